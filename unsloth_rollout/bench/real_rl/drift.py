"""Where the trainer's recomputed logprobs differ from the engine's: ``python -m unsloth_rollout.bench.real_rl.drift``.

On one batch of engine samples (base weights, 4 prompts x 8 samples at T=1) it prints the max distance from a
teacher-forced fp32 forward of each sample alone (the oracle) of: the engine's logprobs; a batched forward
built as TRL's recompute is (prompts left-padded, completions right-padded, one forward of every row) in train
and eval mode, with and without position ids from the attention mask; the 8 rows of each prompt batched with no
left padding; and HF ``generate()``'s own logits for the very same tokens (forced, one left-padded batch, as TRL's
own generate path batches).
"""

from __future__ import annotations

import argparse
import os


def _lp(logits, tokens):
    import torch

    return torch.log_softmax(logits.float(), -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def batched(policy, outs, train: bool, positions: bool, rows=None):
    """Logprobs of each output from one forward of ``outs`` (left-padded prompts, right-padded outputs)."""
    import torch

    pad = policy.tokenizer.pad_token_id
    P, C = max(len(o.prompt_ids) for o in outs), max(len(o.output_ids) for o in outs)
    ids, am = torch.full((len(outs), P + C), pad), torch.zeros(len(outs), P + C, dtype=torch.long)
    for i, o in enumerate(outs):
        p, c = list(o.prompt_ids), list(o.output_ids)
        ids[i, P - len(p):P], ids[i, P:P + len(c)] = torch.tensor(p), torch.tensor(c)
        am[i, P - len(p):P + len(c)] = 1
    kw = {"position_ids": (am.cumsum(-1) - 1).clamp(min=0)} if positions else {}
    was = policy.model.training
    policy.model.train(train)
    try:
        with policy.lock, torch.no_grad():
            logits = policy.model(input_ids=ids, attention_mask=am, use_cache=False, **kw).logits[:, P - 1:-1]
    finally:
        policy.model.train(was)
    lp = _lp(logits, ids[:, P:])
    return [lp[i, :len(o.output_ids)] for i, o in enumerate(outs)]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from ...engine import EngineConfig, GenerationRequest, RolloutEngine, SamplingParams
    from ...testing.oracles import teacher_forced
    from .checks import hf_generate_forced_rows
    from .settings import RunSettings
    from .task import capital_rows
    from .trl_paths import load_policy

    torch.set_num_threads(args.threads)
    policy = load_policy(RunSettings(seed=0))
    engine = RolloutEngine(policy, EngineConfig(kv_cache_memory_bytes=256 << 20, max_model_len=512), seed=0)
    rows = capital_rows(16, 0)[4 * (args.seed % 4):4 * (args.seed % 4) + 4]
    sp = SamplingParams(n=8, max_new_tokens=16, temperature=1.0, seed=args.seed)
    outs = engine.generate([GenerationRequest(messages=r["messages"], sampling=sp) for r in rows])
    engine.shutdown()
    oracle = [teacher_forced(policy, o.prompt_ids, o.output_ids, 1.0)[0] for o in outs]

    def dist(lps):
        return max((a - b).abs().max().item() for a, b in zip(lps, oracle))

    print(f"{len(outs)} engine samples; max |logprob - teacher-forced alone|:")
    print(f"  engine                                        {dist([torch.tensor(o.output_logprobs) for o in outs]):.2e}")
    for train in (True, False):
        for pos in (False, True):
            print(f"  batched as TRL's recompute, {'train' if train else 'eval '} mode, position ids "
                  f"{'from the mask' if pos else '0..L-1     '} {dist(batched(policy, outs, train, pos)):.2e}")
    groups = [batched(policy, outs[g:g + 8], False, False) for g in range(0, len(outs), 8)]
    print(f"  each prompt's 8 rows batched, no left pad   {dist([x for g in groups for x in g]):.2e}")
    forced = hf_generate_forced_rows(policy, [(o.prompt_ids, o.output_ids) for o in outs], 1.0)
    print(f"  HF generate()'s own logits, tokens forced     {dist(forced):.2e}")


if __name__ == "__main__":
    main()
