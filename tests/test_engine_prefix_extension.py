"""A prompt that extends a cached prompt (a conversation's next turn) prefills only its new tokens.

The first turn's KV stays in the prefix cache; the second turn's prompt is the first turn's prompt + its output +
new text (token for token, images included), so the engine shares the first prompt's full blocks and prefills the
rest with the new tokens attending to the cached ones. Oracles, per family (text with a sliding window, Qwen-VL
with M-RoPE and an image, Gemma 3 with a bidirectional image block): a teacher-forced forward over the whole
second prompt + output, whose argmax every greedy token must be and whose log_softmax every logprob must match
(<= 1e-5), and, for the text families, HF generate() on the second prompt.
"""

from __future__ import annotations

import pytest
import torch

from unsloth_rollout.testing.oracles import hf_greedy_ignoring_eos, teacher_forced_logprobs
from unsloth_rollout.engine.config import PrefillConfig
from unsloth_rollout.testing.toy import random_images
from unsloth_rollout import EngineConfig, GenerationRequest, RolloutEngine, SamplingParams, load_model
from unsloth_rollout.engine.inputs import PreparedPrompt
from unsloth_rollout.testing.families import family_model_path
from unsloth_rollout.testing.tiny import tiny_model_path
from unsloth_rollout.testing.vlm_families import vlm_family_path

MAX_NEW = 10
TEXT = "the quick brown fox jumps over a lazy dog while Alice and Bob count twelve red apples in Paris"


def _policy(name: str):
    torch.manual_seed(0)
    path = {"qwen2": lambda: tiny_model_path("qwen2"), "qwen2_5_vl": lambda: tiny_model_path("qwen2_5_vl"),
            "mistral": lambda: family_model_path("mistral"), "gemma3": lambda: vlm_family_path("gemma3")}[name]()
    return load_model(str(path), backend="transformers")


@pytest.fixture
def continue_calls(monkeypatch) -> list[tuple[int, int]]:
    """(prompt length, start) of every ModelRunner.prefill_continue call (the chunks after a cached part)."""
    from unsloth_rollout.engine.runner import ModelRunner

    calls = []
    real = ModelRunner.prefill_continue
    monkeypatch.setattr(ModelRunner, "prefill_continue", lambda self, ids, start, *a, **k: calls.append(
        (len(ids), start)) or real(self, ids, start, *a, **k))
    return calls


def _vision(policy, prompt: PreparedPrompt, ids: list[int]) -> dict:
    """The teacher-forced oracle's vision inputs for ``ids`` (which hold the prompt's images)."""
    if prompt.pixel_values is None:
        return {}
    mm = {"pixel_values": prompt.pixel_values, **prompt.extra}
    if prompt.image_grid_thw is not None:
        mm["image_grid_thw"] = prompt.image_grid_thw
    image_token = getattr(policy.config, "image_token_id", None)
    if getattr(policy.config, "model_type", "") == "gemma3":  # the processor marks image tokens for the mask
        mm["token_type_ids"] = (torch.tensor([ids]) == image_token).long()
    return mm


@pytest.mark.parametrize("family", ["qwen2", "mistral", "qwen2_5_vl", "gemma3"])
def test_next_turn_prefills_only_its_new_tokens(family):
    policy = _policy(family)
    tok = policy.tokenizer
    engine = RolloutEngine(policy, EngineConfig(kv_cache_memory_bytes=64 << 20, block_size=16), seed=0)
    try:
        if policy.is_vlm:
            msgs = [{"role": "user", "content": [{"type": "text", "text": "look:"}, {"type": "image"},
                                                 {"type": "text", "text": TEXT}]}]
            first = GenerationRequest(messages=msgs, images=random_images(1, seed=1))
        else:
            first = GenerationRequest(messages=[{"role": "user", "content": TEXT}])
        first.sampling = SamplingParams(max_new_tokens=MAX_NEW, temperature=0, ignore_eos=True)
        p1 = engine.prepare(first)
        [out1] = engine.generate(GenerationRequest(prepared=p1, sampling=first.sampling))
        # The next turn, token for token: the first prompt, its answer, and a new user message (long enough to
        # run past Mistral's sliding window from the cached part).
        more = tok.encode(" and then " + TEXT + " again", add_special_tokens=False)
        ids2 = list(p1.prompt_ids) + list(out1.output_ids) + more
        p2 = PreparedPrompt(ids2, p1.pixel_values, p1.image_grid_thw, p1.image_hashes, dict(p1.extra))
        before = engine.stats()
        [out2] = engine.generate(GenerationRequest(prepared=p2, sampling=SamplingParams(
            max_new_tokens=MAX_NEW, temperature=0, ignore_eos=True, logprobs=0)))
        after = engine.stats()
    finally:
        engine.shutdown()

    start = len(p1.prompt_ids) // 16 * 16
    assert start >= 16, "the first prompt must span a full block for this test"
    assert after["prefix_cache_extensions"] - before["prefix_cache_extensions"] == 1
    assert after["prefix_cache_reused_tokens"] - before["prefix_cache_reused_tokens"] == start
    assert after["prefill_tokens"] - before["prefill_tokens"] == len(ids2) - start

    mm = _vision(policy, p2, ids2)
    lp, logits = teacher_forced_logprobs(policy, ids2, out2.output_ids, mm=mm)
    assert out2.output_ids == logits.argmax(-1).tolist(), "greedy tokens must be the teacher-forced argmax"
    assert (lp - torch.tensor(out2.output_logprobs)).abs().max() <= 1e-5
    if not policy.is_vlm:
        ref = hf_greedy_ignoring_eos(policy.model, ids2, MAX_NEW)
        assert out2.output_ids == ref


def test_new_tokens_with_an_image_are_prefilled_whole(qwen2_5_vl_dir):
    """A next turn that adds an image (other images than the cached prompt's) is prefilled whole."""
    policy = load_model(qwen2_5_vl_dir, backend="transformers")
    engine = RolloutEngine(policy, EngineConfig(kv_cache_memory_bytes=64 << 20, block_size=16), seed=0)
    try:
        sp = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)
        one = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": TEXT}]}]
        imgs = random_images(2, seed=2)
        [out1] = engine.generate(GenerationRequest(messages=one, images=imgs[:1], sampling=sp))
        two = one + [{"role": "assistant", "content": "ok"},
                     {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and this?"}]}]
        before = engine.stats()
        [out2] = engine.generate(GenerationRequest(messages=two, images=imgs, sampling=sp))
        after = engine.stats()
    finally:
        engine.shutdown()
    assert after["prefix_cache_extensions"] == before["prefix_cache_extensions"]
    assert after["prefill_tokens"] - before["prefill_tokens"] == len(out2.prompt_ids)


def test_a_chat_conversation_next_turn_extends_the_cached_turn(qwen2_dir):
    """Through the chat template, as an agent's client sends it: turn 2 (turn 1's messages, the assistant's
    answer as text, a new user message) renders to turn 1's prompt tokens and more, so it extends turn 1's KV;
    its greedy output is HF generate()'s on turn 2's prompt."""
    policy = load_model(qwen2_dir, backend="transformers")
    engine = RolloutEngine(policy, EngineConfig(kv_cache_memory_bytes=64 << 20, block_size=16), seed=0)
    try:
        sp = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
        msgs = [{"role": "system", "content": "You count things."}, {"role": "user", "content": TEXT}]
        [out1] = engine.generate(GenerationRequest(messages=msgs, sampling=sp))
        msgs2 = msgs + [{"role": "assistant", "content": out1.text}, {"role": "user", "content": "Say it again."}]
        before = engine.stats()
        [out2] = engine.generate(GenerationRequest(messages=msgs2, sampling=sp))
        after = engine.stats()
    finally:
        engine.shutdown()
    assert out2.prompt_ids[: len(out1.prompt_ids)] == out1.prompt_ids
    assert after["prefix_cache_extensions"] - before["prefix_cache_extensions"] == 1
    ref = hf_greedy_ignoring_eos(policy.model, out2.prompt_ids, 8)
    assert out2.output_ids == ref


@pytest.mark.parametrize("family", ["qwen2", "mistral", "qwen2_5_vl", "gemma3"])
def test_a_long_prompt_is_prefilled_in_chunks(family, continue_calls):
    """prefill_chunk_tokens=32: a prompt of ~100+ tokens (an image near its start) is prefilled in a first forward
    through the image and chunks of 32 that attend to the cached ones; greedy tokens and logprobs are the
    teacher-forced forward's (and HF generate()'s for the text families)."""
    policy = _policy(family)
    calls = continue_calls
    engine = RolloutEngine(policy, EngineConfig(kv_cache_memory_bytes=64 << 20, block_size=16,
                                                prefill=PrefillConfig(chunk_tokens=32)), seed=0)
    try:
        text = f"{TEXT}, {TEXT} and {TEXT}"
        if policy.is_vlm:
            msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
            req = GenerationRequest(messages=msgs, images=random_images(1, seed=4))
        else:
            req = GenerationRequest(messages=[{"role": "user", "content": text}])
        req.sampling = SamplingParams(max_new_tokens=MAX_NEW, temperature=0, ignore_eos=True, logprobs=0)
        prompt = engine.prepare(req)
        [out] = engine.generate(GenerationRequest(prepared=prompt, sampling=req.sampling))
    finally:
        engine.shutdown()
    ids = list(prompt.prompt_ids)
    assert len(ids) > 96
    assert len(calls) >= 2 and calls[-1][0] == len(ids), calls
    assert all(end - start <= 32 for end, start in calls)
    lp, logits = teacher_forced_logprobs(policy, ids, out.output_ids, mm=_vision(policy, prompt, ids))
    assert out.output_ids == logits.argmax(-1).tolist()
    assert (lp - torch.tensor(out.output_logprobs)).abs().max() <= 1e-5
    if not policy.is_vlm:
        ref = hf_greedy_ignoring_eos(policy.model, ids, MAX_NEW)
        assert out.output_ids == ref


def test_a_long_next_turn_is_prefilled_in_chunks_too(continue_calls):
    """The new tokens of a next turn are chunked by prefill_chunk_tokens like any prompt's; the output is still
    HF generate()'s on the whole second prompt."""
    policy = _policy("qwen2")
    calls = continue_calls
    engine = RolloutEngine(policy, EngineConfig(kv_cache_memory_bytes=64 << 20, block_size=16,
                                                prefill=PrefillConfig(chunk_tokens=64)), seed=0)
    try:
        sp = SamplingParams(max_new_tokens=MAX_NEW, temperature=0, ignore_eos=True)
        p1 = engine.prepare(GenerationRequest(messages=[{"role": "user", "content": TEXT}]))
        [out1] = engine.generate(GenerationRequest(prepared=p1, sampling=sp))
        ids2 = list(p1.prompt_ids) + list(out1.output_ids) + policy.tokenizer.encode(
            f" and then {TEXT}, {TEXT} and {TEXT} again", add_special_tokens=False)
        calls.clear()
        [out2] = engine.generate(GenerationRequest(prepared=PreparedPrompt(ids2), sampling=sp))
        assert engine.stats()["prefix_cache_extensions"] == 1
    finally:
        engine.shutdown()
    start = len(p1.prompt_ids) // 16 * 16
    assert len(ids2) - start > 64 and len(calls) >= 2 and calls[0][1] == start and calls[-1][0] == len(ids2)
    assert all(end - begin <= 64 for end, begin in calls)
    ref = hf_greedy_ignoring_eos(policy.model, ids2, MAX_NEW)
    assert out2.output_ids == ref
