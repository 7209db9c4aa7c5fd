"""Every text family the engine accepts, exact in one mixed-length batch.

Tiny random models from transformers' own config classes (unsloth_rollout.testing.families): 3 layers,
GQA, sliding windows of 8 tokens (prompts run past them), Gemma 2 soft-capping, LoRA r=8 with non-zero
B. Per family, one engine run holds 12 greedy prompts of mixed lengths (half arriving while the other
half decodes), a GRPO group of 4 sampled completions sharing one prompt, and a KV budget small enough
to force preemption. Oracles: HF ``generate()`` one prompt at a time for the greedy tokens, a
teacher-forced forward over prompt + output for every logprob, held to ``parity_bound`` (1e-5, or 1.5x HF
``generate()``'s own distance from that forward on the same prompts, measured here).
"""

from __future__ import annotations


import pytest
import torch

from unsloth_rollout.testing.oracles import hf_generate_logprobs, parity_bound, perturb_lora, teacher_forced_logprobs
from unsloth_rollout.testing.drive import run_staggered
from unsloth_rollout import EngineConfig, GenerationRequest, RolloutEngine, SamplingParams, load_model
from unsloth_rollout.engine.kv_cache import KVCache
from unsloth_rollout.models.families import text_dims
from unsloth_rollout.testing.families import FAMILIES, family_model_path

WORDS = ("the quick brown fox jumps over a lazy dog while Alice and Bob count 12 + 7 = 19 apples in Paris "
         "and Tokyo before the rain starts").split()
# Gemma 2's attention soft-capping exists only in its eager attention (transformers' sdpa drops it).
ATTN = {"gemma2": "eager"}
MAX_NEW = 16


def prompts(n: int) -> list[str]:
    return [" ".join((WORDS * 3)[i * 2: i * 2 + 2 + 4 * i]) for i in range(n)]


def load_family(family: str):
    policy = load_model(str(family_model_path(family)), backend="transformers", lora={"r": 8, "random_state": 0},
                        attn_implementation=ATTN.get(family, "sdpa"))
    assert perturb_lora(policy.model, std=0.3) > 0
    return policy


def hf_greedy(policy, ids: list[int]) -> tuple[list[int], torch.Tensor]:
    """HF generate()'s greedy tokens for one prompt and the logprobs of its own cached decode."""
    return hf_generate_logprobs(policy.model, {"input_ids": torch.tensor([ids])}, MAX_NEW)


@pytest.mark.parametrize("family", FAMILIES)
def test_family_mixed_batch_exact(family):
    policy = load_family(family)
    tok = policy.tokenizer
    layers, kv_heads, head_dim = text_dims(policy.text_config)
    per_token = KVCache.bytes_per_token(layers, kv_heads, head_dim, torch.float32)
    # 24 blocks of 8 tokens: far less than the 16 sequences need together, so some are preempted.
    engine = RolloutEngine(policy, EngineConfig(kv_cache_memory_bytes=per_token * 8 * 24, block_size=8), seed=0)
    texts = prompts(12)
    greedy = [GenerationRequest(input_ids=tok.encode(t), sampling=SamplingParams(max_new_tokens=MAX_NEW, temperature=0))
              for t in texts]
    group = GenerationRequest(input_ids=tok.encode(texts[5]),
                              sampling=SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, n=4, seed=7))
    lengths = [len(r.input_ids) for r in greedy]
    assert min(lengths) < 8 < max(lengths) and len(set(lengths)) >= 10, lengths

    outs, stats = run_staggered(engine, greedy[:6], greedy[6:] + [group])
    engine.shutdown()
    assert stats["num_preemptions"] > 0, "the KV budget was meant to force preemption"
    assert stats["prefix_cache_hits"] > 0, "the group's samples should share their prompt's prefill"

    with torch.no_grad():
        mismatches = []
        hf_distance = 0.0
        for req, (out,) in zip(greedy, outs[:12]):
            want, hf_lp = hf_greedy(policy, req.input_ids)
            if out.output_ids != want:
                mismatches.append((len(req.input_ids), out.output_ids, want))
                continue
            ref, _ = teacher_forced_logprobs(policy, req.input_ids, want)
            hf_distance = max(hf_distance, (hf_lp - ref).abs().max().item())
        assert not mismatches, f"{family}: {len(mismatches)}/12 greedy outputs differ from HF generate: {mismatches[:2]}"
        samples = outs[12]
        assert len(samples) == 4 and len({tuple(s.output_ids) for s in samples}) > 1
        worst = 0.0
        for req, out in [(r, o[0]) for r, o in zip(greedy, outs[:12])] + [(group, s) for s in samples]:
            temp = req.sampling.temperature or 1.0
            ref, _ = teacher_forced_logprobs(policy, req.input_ids, out.output_ids, temperature=temp)
            got = torch.tensor(out.output_logprobs)
            assert torch.isfinite(got).all()
            worst = max(worst, (got - ref).abs().max().item())
        assert worst <= parity_bound(hf_distance), (f"{family}: logprob drift {worst:.2e} from a teacher-forced "
                                                    f"forward (HF generate()'s own: {hf_distance:.2e})")
