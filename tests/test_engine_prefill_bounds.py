"""``prefill_chunk_tokens`` bounds every prefill forward: packs of several prompts, recomputes after preemption and
after a weight change, next-turn extensions. Measured where every token enters the model (a hook on the input
embedding); outputs stay HF ``generate()``'s and logprobs the teacher-forced forward's."""

from __future__ import annotations

import pytest
import torch

from unsloth_rollout import EngineConfig, SamplingParams, load_model
from unsloth_rollout.engine.config import PrefillConfig
from unsloth_rollout.engine.core import EngineCore
from unsloth_rollout.testing.oracles import teacher_forced
from unsloth_rollout.testing.drive import add_sequences, engine_core, step_until_idle

CHUNK = 16


@pytest.fixture(scope="module")
def policy(qwen2_dir):
    return load_model(qwen2_dir, backend="transformers")


@pytest.fixture
def forwards(policy):
    """The input shape of every forward of the policy, as its embedding layer sees it."""
    shapes = []
    hook = policy.model.get_input_embeddings().register_forward_hook(
        lambda mod, args, out: shapes.append(tuple(args[0].shape)))
    yield shapes
    hook.remove()


def _largest_prefill(shapes) -> int:
    """Tokens of the largest prefill forward (one row of L tokens; a decode step is B rows of one token)."""
    assert all(b == 1 or q == 1 for b, q in shapes), shapes
    return max(q for b, q in shapes)


def _core(policy, kv_tokens: int | None = None, **kw) -> EngineCore:
    return engine_core(policy, kv_tokens, budget=16 << 20, prefill=PrefillConfig(chunk_tokens=CHUNK), **kw)


def _add(core, prompts, max_new):
    return add_sequences(core, prompts, max_new, temperature=0)


def _drain(core):
    step_until_idle(core, max_steps=3000)


def _assert_hf(policy, seqs, logprobs: bool = False):
    for s in seqs:
        assert s.finish_reason == "length", s.error
        n = len(s.output_ids)
        ref = policy.model.generate(torch.tensor([s.prompt_ids]), max_new_tokens=n, min_new_tokens=n,
                                    do_sample=False)[0, len(s.prompt_ids):]
        assert s.output_ids == ref.tolist()
        if logprobs:
            lp, _ = teacher_forced(policy, s.prompt_ids, s.output_ids)
            assert (lp - torch.tensor(s.output_logprobs)).abs().max() <= 1e-5


def _prompts(policy, lengths):
    words = ["apple", "bob", "count", "red", "Paris"]
    out = []
    for i, n in enumerate(lengths):
        ids = policy.tokenizer.encode(" ".join(words[(i + j) % 5] for j in range(n)))
        out.append(ids[:n])
    return out


def test_prompts_arriving_together_are_packed_within_the_chunk(policy, forwards):
    """Three 100-token prompts and four short ones, admitted together: each long one is chunked alone, the short
    ones pack up to the chunk (before: one 300+ token forward)."""
    core = _core(policy)
    seqs = _add(core, _prompts(policy, [100, 100, 100, 5, 6, 7, 9]), [8] * 7)
    core.step()
    assert core.stats["prefills"] == 7
    _drain(core)
    assert _largest_prefill(forwards) <= CHUNK
    _assert_hf(policy, seqs, logprobs=True)


def test_recomputes_after_preemption_stay_within_the_chunk(policy, forwards):
    # A pool of 12 blocks for five sequences that grow to 5-7 blocks each: decode growth preempts and recomputes.
    core = _core(policy, kv_tokens=16 * 12)
    seqs = _add(core, _prompts(policy, [40, 50, 30, 45, 20]), [60, 50, 40, 30, 20])
    _drain(core)
    assert core.scheduler.num_preemptions > 0, "the budget was meant to force preemption"
    assert _largest_prefill(forwards) <= CHUNK
    _assert_hf(policy, seqs)


def test_recomputes_after_a_weight_change_stay_within_the_chunk(policy, forwards):
    core = _core(policy)
    seqs = _add(core, _prompts(policy, [30, 12, 44, 8]), [40] * 4)
    while min(len(s.output_ids) for s in seqs) < 30:
        core.step()
    core.weights.bump(1, None)  # same weights, new version: every running sequence is recomputed (prompt + output)
    _drain(core)
    assert core.stats["weight_recomputes"] == 4
    assert _largest_prefill(forwards) <= CHUNK
    _assert_hf(policy, seqs, logprobs=True)


def test_next_turn_extensions_stay_within_the_chunk(policy, forwards):
    core = _core(policy)
    [first] = _add(core, _prompts(policy, [40]), [6])
    _drain(core)
    nxt = [first.prompt_ids + first.output_ids + _prompts(policy, [50])[0],
           first.prompt_ids + first.output_ids + _prompts(policy, [3])[0]]
    seqs = _add(core, nxt, [6, 6])
    _drain(core)
    assert core.scheduler.prefix.extensions == 2
    assert _largest_prefill(forwards) <= CHUNK
    _assert_hf(policy, [first] + seqs)


def test_an_image_span_is_the_one_documented_exception(qwen2_5_vl_dir):
    """A prompt's first forward runs through its last image placeholder (the pixels enter there, in one forward):
    only that forward may exceed the chunk, and only by the image span; the rest is chunked; tokens and logprobs
    are the teacher-forced forward's."""
    from PIL import Image

    from unsloth_rollout import GenerationRequest, RolloutEngine

    vlm = load_model(qwen2_5_vl_dir, backend="transformers")
    shapes = []
    hook = vlm.model.get_input_embeddings().register_forward_hook(
        lambda mod, args, out: shapes.append(tuple(args[0].shape)))
    engine = RolloutEngine(vlm, EngineConfig(kv_cache_memory_bytes=16 << 20,
                                             prefill=PrefillConfig(chunk_tokens=CHUNK)), seed=0)
    try:
        text = " ".join(["apple", "bob", "count"][j % 3] for j in range(60))
        msgs = [{"role": "user", "content": [{"type": "text", "text": "look:"}, {"type": "image"},
                                             {"type": "text", "text": text}]}]
        sp = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
        prompt = engine.prepare(GenerationRequest(messages=msgs, images=[Image.new("RGB", (56, 56), "red")]))
        shapes.clear()
        [out] = engine.generate(GenerationRequest(prepared=prompt, sampling=sp))
    finally:
        engine.shutdown()
        hook.remove()
    ids = list(prompt.prompt_ids)
    vision = engine.core.runner.vision_token_ids
    last_image = max(i for i, t in enumerate(ids) if t in vision)
    assert last_image + 1 > CHUNK and len(ids) > last_image + 2 * CHUNK
    prefill = [q for b, q in shapes if b == 1 and q > 1]
    assert prefill[0] == last_image + 1 and max(prefill[1:]) <= CHUNK
    lp, logits = teacher_forced(vlm, ids, out.output_ids, pixel_values=prompt.pixel_values,
                                image_grid_thw=prompt.image_grid_thw)
    assert out.output_ids == logits.argmax(-1).tolist()
    assert (lp - torch.tensor(out.output_logprobs)).abs().max() <= 1e-5
