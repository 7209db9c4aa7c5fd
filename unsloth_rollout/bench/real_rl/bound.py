"""The fp32 logprob bound of a checkpoint, measured the way ``tests/test_real_checkpoint.py`` measures it.

A teacher-forced fp32 forward is the oracle; HF ``generate()`` (cached decode, one prompt at a time) is
itself some distance from it, because fp32 sums run in another order over the model's layers (~1.2e-5 on
SmolLM2-135M's 30 layers, greedy). The bound is ``max(1e-5, 1.5 x that distance)``: a logprob further from the
oracle than this is not fp32 noise. The test measures HF on greedy tokens; GRPO samples at temperature T, and
an unlikely sampled token (|logprob| ~ 5-10) carries more absolute fp32 error than a greedy one, so here HF
generate samples too (seeded, ``n`` per prompt) and is scored at T, as the run's tokens are.
"""

from __future__ import annotations

from ...testing.oracles import parity_bound


def hf_generate_distance(policy, prompts: list[list[dict]], max_new_tokens: int = 16, temperature: float = 1.0,
                         n: int = 4, seed: int = 0) -> float:
    """max |HF generate() logprob - teacher-forced logprob| over ``n`` seeded samples of each of ``prompts`` (chat
    messages), one prompt (``n`` rows) per generate call, scored as ``log_softmax(logits / temperature)``."""
    import torch

    from ...testing.oracles import teacher_forced

    tok = policy.tokenizer
    worst = 0.0
    with policy.inference():
        for messages in prompts:
            ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
            ids = torch.tensor([list(ids["input_ids"])], device=policy.device)
            torch.manual_seed(seed)
            with policy.lock, torch.no_grad():  # n samples of one prompt: equal lengths, no padding
                gen = policy.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                            max_new_tokens=max_new_tokens, do_sample=True, temperature=temperature,
                                            top_k=0, top_p=1.0, num_return_sequences=n, output_logits=True,
                                            return_dict_in_generate=True, pad_token_id=tok.pad_token_id)
            logits = torch.stack(list(gen.logits), 1).float() / temperature  # [n, N, V]
            new = gen.sequences[:, ids.shape[1]:]
            hf = torch.log_softmax(logits, -1).gather(-1, new.unsqueeze(-1)).squeeze(-1)
            for k in range(n):
                out = new[k].tolist()
                if tok.pad_token_id in out:  # a sample that ended early is padded after its EOS
                    out = out[: out.index(tok.pad_token_id) + 1]
                ref, _ = teacher_forced(policy, ids[0].tolist(), out, temperature)
                worst = max(worst, (hf[k, : len(out)].cpu() - ref.cpu()).abs().max().item())
    return worst


def fp32_bound(distance: float) -> float:
    """The bound for a checkpoint whose HF generate() is ``distance`` from a teacher-forced forward (the tests' rule,
    ``unsloth_rollout.testing.oracles.parity_bound``)."""
    return parity_bound(distance)
