"""Prefill packing: distinct prompts in one forward, each attending only to itself, and sequences recomputed
together; the sampler's batched penalties and bans.

Oracles: one prompt at a time through the same runner (logits, rope deltas), the count of prefill forwards, and a
per-row reference of the penalties and bans (the logits as HF's processors would change them).
"""

from __future__ import annotations

import pytest
import torch

from unsloth_rollout import SamplingParams, load_model
from unsloth_rollout.engine.config import DecodeConfig
from unsloth_rollout.engine.core import EngineCore
from unsloth_rollout.engine.inputs import PreparedPrompt
from unsloth_rollout.engine.sequence import Sequence
from unsloth_rollout.testing.drive import add_sequences, engine_core, step_until_idle
from unsloth_rollout.testing.oracles import hf_greedy_ignoring_eos, teacher_forced_logprobs


def _core(policy, backend: str) -> EngineCore:
    return engine_core(policy, decode=DecodeConfig(backend=backend))


@pytest.mark.parametrize("arch", ["qwen2", "qwen2_5_vl", "gemma3", "llava", "mistral3", "idefics3", "qwen3_vl"])
def test_packed_prefill_equals_one_prompt_at_a_time(model_dirs, arch):
    """Distinct prompts of different lengths (images of different sizes, M-RoPE rows; Gemma 3's bidirectional
    image blocks) prefilled in one packed forward give the logits, rope deltas and cached keys/values of
    prefilling each alone."""
    from unsloth_rollout.testing.toy import random_images
    from unsloth_rollout import GenerationRequest
    from unsloth_rollout.testing.vlm_families import vlm_family_path

    path = model_dirs[arch] if arch in ("qwen2", "qwen2_5_vl") else vlm_family_path(arch)
    policy = load_model(path, backend="transformers")
    core = _core(policy, "workspace")
    words = "alice bob counts twelve red apples at the market".split()
    prompts = []
    for i, k in enumerate([1, 0, 2, 1]):
        text = " ".join(words[: 2 + 2 * i])
        if policy.is_vlm:
            msgs = [{"role": "user", "content": [{"type": "image"}] * k + [{"type": "text", "text": text}]}]
            req = GenerationRequest(messages=msgs, images=random_images(k, seed=i))
        else:
            req = GenerationRequest(input_ids=policy.tokenizer.encode(text * (i + 1)))
        prompts.append(core.inputs.prepare(req))
    assert all(core.runner.can_pack(p) for p in prompts)
    runner, kv = core.runner, core.kv
    tables = [kv.allocate(-(-len(p.prompt_ids) // kv.block_size)) for p in prompts]
    items = [(p.prompt_ids, kv.slots(t, 0, len(p.prompt_ids)), p) for p, t in zip(prompts, tables)]
    with torch.inference_mode(), policy.inference():
        packed = runner.prefill_packed(items)
        pack_ctx = runner._last_ctx  # each prompt attended alone: no mask over the whole pack was built
        assert [e - s for s, e in pack_ctx.spans] == [len(p.prompt_ids) for p in prompts] and not pack_ctx._masks
        packed_kv = [[(kv.k[i][torch.tensor(s)].clone(), kv.v[i][torch.tensor(s)].clone())
                      for i in range(kv.num_layers)] for _, s, _ in items]
        for (ids, slots, p), (logits, delta), cached in zip(items, packed, packed_kv):
            policy.clear_rope_deltas() if hasattr(policy, "clear_rope_deltas") else None
            alone, alone_delta = runner.prefill(ids, slots, p)
            assert alone_delta == delta
            assert (alone - logits).abs().max() <= 1e-5
            for i in range(kv.num_layers):
                assert (kv.k[i][torch.tensor(slots)] - cached[i][0]).abs().max() <= 1e-5
                assert (kv.v[i][torch.tensor(slots)] - cached[i][1]).abs().max() <= 1e-5
    if arch in ("qwen2_5_vl", "qwen3_vl"):
        assert any(d != 0 for _, d in packed), "M-RoPE rows with images have a non-zero rope delta"


def test_distinct_prompts_admitted_together_share_one_prefill_forward(qwen2_dir):
    policy = load_model(qwen2_dir, backend="transformers")
    core = _core(policy, "workspace")
    prompts = [policy.tokenizer.encode("alice counts apples " * (1 + i)) for i in range(5)]
    seqs = add_sequences(core, prompts, [6] * 5, n=2, seed_by_prompt=True, temperature=0.0)
    step_until_idle(core, max_steps=2000)
    assert core.stats["prefills"] == 5 and core.stats["prefill_forwards"] == 1
    for s in seqs:
        ref = hf_greedy_ignoring_eos(policy.model, s.prompt_ids, 6)
        assert s.output_ids == ref


def test_batched_penalties_and_bans_equal_a_per_row_reference():
    """The sampler's batched penalties and min-token bans, against the per-row arithmetic written out by hand."""
    from unsloth_rollout.engine.sampler import Sampler

    torch.manual_seed(0)
    vocab, eos = 50, 7
    params = [dict(repetition_penalty=1.7), dict(frequency_penalty=0.9, presence_penalty=0.4), dict(),
              dict(repetition_penalty=0.6, frequency_penalty=1.5, min_new_tokens=5, stop_token_ids=[3, 11]),
              dict(min_new_tokens=9), dict(presence_penalty=2.0, ignore_eos=True, min_new_tokens=4)]
    seqs = []
    for i, p in enumerate(params):
        s = Sequence("r", i, PreparedPrompt([int(x) for x in torch.randint(0, vocab, (6,))]),
                     SamplingParams(temperature=0, **p))
        s.output_ids = [int(x) for x in torch.randint(0, vocab, (i + 2,))]
        seqs.append(s)
    logits = torch.randn(len(seqs), vocab + 3) * 3  # padded vocabulary columns, as lm heads have
    logits[:, [eos, 3, 11]] += 20  # banned tokens would win without the bans
    want = []
    for i, s in enumerate(seqs):
        sp, row = s.sampling, logits[i].clone()
        for t in set(s.all_ids):
            row[t] = row[t] / sp.repetition_penalty if row[t] > 0 else row[t] * sp.repetition_penalty
        for t in set(s.output_ids):
            row[t] -= sp.frequency_penalty * s.output_ids.count(t) + sp.presence_penalty
        if len(s.output_ids) < sp.min_new_tokens:
            for t in list(sp.stop_token_ids) + ([] if sp.ignore_eos else [eos]):
                row[t] = float("-inf")
        want.append(int(row.argmax()))
    res = Sampler(vocab, [eos], [], seed=0)(logits, seqs)
    assert res.tokens == want
    assert res.tokens[5] == eos or res.tokens[5] in (3, 11)  # ignore_eos and no stop ids: nothing banned


def test_sequences_recomputed_after_a_weight_change_share_one_forward(qwen2_dir):
    """A weight change mid-generation puts every running sequence back to be recomputed (prompt + output so far);
    the resumed sequences run in one packed forward, and what they decode next is what HF greedy generate()
    continues with from the same tokens under the new weights."""
    policy = load_model(qwen2_dir, backend="transformers")
    core = _core(policy, "workspace")
    tok = policy.tokenizer
    prompts = [tok.encode("alice counts apples " * (1 + i)) for i in range(4)]
    seqs = []
    for i, ids in enumerate(prompts):
        sp = SamplingParams(max_new_tokens=14, temperature=0.0, ignore_eos=True)
        seqs.append(Sequence(f"r{i}", 0, PreparedPrompt(ids), sp))
        core.add(seqs[-1])
    while min(len(s.output_ids) for s in seqs) < 5:
        core.step()
    before = [list(s.output_ids) for s in seqs]
    with torch.no_grad():  # new weights: every layer's o_proj scaled (greedy continuations change)
        for name, p in policy.model.named_parameters():
            if name.endswith("o_proj.weight"):
                p.mul_(1.5)
    core.weights.bump(1, None)
    forwards, recomputes = core.stats["prefill_forwards"], core.stats["weight_recomputes"]
    core.step()
    assert core.stats["weight_recomputes"] - recomputes == 4
    assert core.stats["prefill_forwards"] - forwards == 1, "the four recomputes must share one forward"
    while core.scheduler.has_work():
        core.step()
    for s, done in zip(seqs, before):
        assert s.output_ids[: len(done)] == done
        ref = hf_greedy_ignoring_eos(policy.model, s.prompt_ids + done, 14 - len(done))
        assert s.output_ids[len(done):] == ref
        lp, _ = teacher_forced_logprobs(policy, s.prompt_ids + done, s.output_ids[len(done):])
        assert (lp - torch.tensor(s.output_logprobs[len(done):])).abs().max() <= 1e-5
