"""The bitwise on-policy mode on the tiny Qwen2.5-VL with LoRA on the vision tower and the language model, images
in the prompts (unsloth_rollout/bitwise.py).

Oracle: the trainer's recompute, one padded batch forward of ``policy.model`` with every sample's pixels under
``bitwise.mode`` (``testing.bitwise.trainer_logprobs``), right- and left-padded: the engine's logprobs equal it bit
for bit over a GRPO group sharing an image prompt, samples with other images, a text-only prompt and a preemption;
without the mode the same recompute differs.
"""

from __future__ import annotations

import pytest
import torch

from unsloth_rollout import EngineConfig, GenerationRequest, RolloutEngine, SamplingParams, bitwise
from unsloth_rollout.kernels import batch_invariant
from unsloth_rollout.testing.adapters import images, lora_policy
from unsloth_rollout.testing.bitwise import trainer_logprobs, unequal
from unsloth_rollout.testing.drive import run_staggered
from unsloth_rollout.testing.tiny import tiny_model_path

pytestmark = pytest.mark.skipif(not batch_invariant.available(), reason="no C++ compiler for the mode's kernels")


@pytest.fixture(scope="module")
def policy():
    p = lora_policy(str(tiny_model_path("qwen2_5_vl")), r=4, finetune_vision_layers=True)
    assert any("visual" in n and "lora_B" in n for n, _ in p.model.named_parameters())
    bitwise.enable(p)
    return p


def _request(img, text, n=1, temperature=1.0, max_new=6):
    content = ([{"type": "image", "image": img}] if img is not None else []) + [{"type": "text", "text": text}]
    return GenerationRequest(messages=[{"role": "user", "content": content}],
                             sampling=SamplingParams(max_new_tokens=max_new, temperature=temperature, n=n, seed=1,
                                                     ignore_eos=True))


def _vision(policy, reqs):
    out = []
    for r in reqs:
        img = r.messages[0]["content"][0].get("image")
        v = None
        if img is not None:
            enc = policy.processor.image_processor(images=[img], return_tensors="pt")
            v = {"pixel_values": enc["pixel_values"], "image_grid_thw": enc["image_grid_thw"]}
        out += [v] * r.sampling.n
    return out


def test_vision_lora_and_images_equal_the_trainers_recompute(policy):
    imgs = images(3, seed=1)
    early = [_request(imgs[0], "Describe it.", n=3), _request(imgs[1], "What is this?", temperature=0.8, max_new=9)]
    late = [_request(None, "hello there", max_new=5), _request(imgs[2], "Hi", max_new=4)]
    engine = RolloutEngine(policy, EngineConfig(kv_cache_memory_bytes=8 << 20, max_model_len=512), seed=0)
    try:
        outs, stats = run_staggered(engine, early, late)
    finally:
        engine.shutdown()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    reqs = early + late
    flat = [o for group in outs for o in group]
    temps = [r.sampling.temperature for r in reqs for _ in range(r.sampling.n)]
    vision = _vision(policy, reqs)
    for padding in ("right", "left"):
        assert unequal(flat, trainer_logprobs(policy, flat, temps, vision, padding=padding)) == [], padding
    assert unequal(flat, trainer_logprobs(policy, flat, temps, vision, on=False))
