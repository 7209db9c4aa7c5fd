"""Benchmark building blocks: seeded workloads (checked against the HF processor's own image expansion),
per-row budgets in a padded generate(), EOS cutting, and that the drift check detects a wrong logprob."""

from __future__ import annotations

import re

import pytest
import torch

from unsloth_rollout import load_model
from unsloth_rollout.bench.backends import (
    BenchContext,
    SampleResult,
    cut_at_eos,
    hf_generate,
    spread,
)
from unsloth_rollout.bench.harness import logprob_drift, teacher_forced_logprobs
from unsloth_rollout.bench.workloads import build_workload


@pytest.fixture(scope="module")
def vlm(qwen2_5_vl_dir):
    return load_model(qwen2_5_vl_dir, backend="transformers")


@pytest.fixture(scope="module")
def lm(qwen2_dir):
    return load_model(qwen2_dir, backend="transformers")


def test_workload_is_seeded_and_varied(vlm):
    a = build_workload(vlm, "grpo", prompts=5, group=3, max_new_tokens=40, seed=3)
    b = build_workload(vlm, "grpo", prompts=5, group=3, max_new_tokens=40, seed=3)
    c = build_workload(vlm, "grpo", prompts=5, group=3, max_new_tokens=40, seed=4)
    key = lambda wl: [(r.prompt_ids, r.max_new_tokens, r.seed, r.image.size) for r in wl.requests]
    assert key(a) == key(b)
    assert key(a) != key(c)
    assert len(a.requests) == 15
    assert len({len(g[0].prompt_ids) for g in a.groups()}) > 1  # prompt lengths drawn
    assert len({g[0].image.size for g in a.groups()}) > 1  # image sizes drawn
    assert all(1 <= r.max_new_tokens <= 40 for r in a.requests)
    assert len({r.max_new_tokens for r in a.requests}) > 1  # output lengths drawn per sample
    for g in a.groups():  # a GRPO group: one prompt and image, distinct seeds
        assert len({tuple(r.prompt_ids) for r in g}) == 1 and len({id(r.image) for r in g}) == 1
        assert len({r.seed for r in g}) == len(g)


def test_expanded_prompt_matches_the_processor(vlm):
    """Oracle: the HF processor expands <|image_pad|> itself from the text with one placeholder per image."""
    wl = build_workload(vlm, "grpo", prompts=3, group=1, max_new_tokens=8, seed=1)
    for r in wl.requests:
        text = re.sub(r"(<\|image_pad\|>)+", "<|image_pad|>", vlm.tokenizer.decode(r.prompt_ids))
        enc = vlm.processor(text=[text], images=[r.image], return_tensors="pt")
        assert enc["input_ids"][0].tolist() == r.prompt_ids


def test_text_workload_has_no_images(lm):
    wl = build_workload(lm, "chat", prompts=4, max_new_tokens=8, seed=0)
    assert wl.group == 1 and len(wl.requests) == 4
    assert all(r.image is None for r in wl.requests)
    with pytest.raises(ValueError, match="--workload"):
        build_workload(lm, "nope")
    with pytest.raises(ValueError, match="--prompts"):
        build_workload(lm, "grpo", prompts=0)


def test_cut_at_eos_and_spread():
    assert cut_at_eos([5, 6, 2, 7], [2], False, 10) == [5, 6, 2]
    assert cut_at_eos([5, 6, 2, 7], [2], True, 10) == [5, 6, 2, 7]
    assert cut_at_eos([5, 6, 2, 7], [2], False, 2) == [5, 6]
    assert spread(10, 3) == [0, 4, 9] or spread(10, 3) == [0, 5, 9]
    assert spread(3, 8) == [0, 1, 2]


def test_padded_generate_honours_row_budgets(vlm):
    """hf-batched's padded generate(): each row stops at its own budget; its logprobs match a teacher-forced
    forward of the same model on prompt + output (with pixel_values)."""
    wl = build_workload(vlm, "grpo", prompts=2, group=2, max_new_tokens=7, seed=2, ignore_eos=True)
    rows = wl.requests
    for r, budget in zip(rows, (2, 7, 4, 5)):
        r.max_new_tokens = budget
    ctx = BenchContext(vlm, wl, lora_rank=0)
    torch.manual_seed(0)
    samples, first = hf_generate(ctx, rows)  # two prompts of different lengths: left padding
    assert [len(s.output_ids) for s in samples] == [2, 7, 4, 5]
    assert first is not None
    for s, r in zip(samples, rows):
        ref = teacher_forced_logprobs(vlm, wl, r, s.output_ids)
        assert max(abs(a - b) for a, b in zip(s.logprobs, ref)) <= 1e-4


def test_padded_generate_never_samples_vision_tokens(vlm):
    """hf-batched suppresses the ids the engine suppresses (image pads, vision markers): with the image pad
    made the likeliest token, it is still never sampled, the logprobs stay the raw distribution's, and the
    trainer's forward over prompt + output still runs (a sampled pad would not match the image features)."""
    from unsloth_rollout.engine.inputs import InputPreparer

    pad = vlm.config.image_token_id
    wl = build_workload(vlm, "grpo", prompts=1, group=2, max_new_tokens=6, seed=5, ignore_eos=True)
    hook = vlm.base_model.lm_head.register_forward_hook(lambda m, i, out: out.index_add(
        -1, torch.tensor([pad]), torch.full((*out.shape[:-1], 1), 30.0)))
    try:
        torch.manual_seed(0)
        samples, _ = hf_generate(BenchContext(vlm, wl, lora_rank=0), wl.requests)
        suppressed = set(InputPreparer(vlm).vision_token_ids())
        assert pad in suppressed
        for s, r in zip(samples, wl.requests):
            assert len(s.output_ids) == r.max_new_tokens and not suppressed & set(s.output_ids), s.output_ids
            assert max(s.logprobs) < -20  # raw logprobs: the pad took nearly all the mass
            ref = teacher_forced_logprobs(vlm, wl, r, s.output_ids)
            assert max(abs(a - b) for a, b in zip(s.logprobs, ref)) <= 1e-4
    finally:
        hook.remove()


def test_drift_check_detects_a_wrong_logprob(lm):
    wl = build_workload(lm, "grpo", prompts=1, group=2, max_new_tokens=4, seed=0)
    r = wl.requests[0]
    out = [11, 12, 13]
    ref = teacher_forced_logprobs(lm, wl, r, out)
    exact = [SampleResult(r.index, out, list(ref), None)]
    assert logprob_drift(lm, wl, exact, 4) == (0.0, 1)
    wrong = [SampleResult(r.index, out, [ref[0], ref[1] + 1e-3, ref[2]], None)]
    drift, checked = logprob_drift(lm, wl, wrong, 4)
    assert checked == 1 and drift == pytest.approx(1e-3, rel=1e-3)
    assert logprob_drift(lm, wl, [SampleResult(r.index, out, None, None)], 4) == (None, 0)
