"""Every served family under the bitwise on-policy mode: the engine's logprobs equal the trainer's recompute bit for
bit (an op the mode has no invariant version of would refuse the model by name: test_bitwise_engine.py; no served
family needs one). Qwen2, Qwen2.5-VL and the real Llama checkpoint have files of their own: test_bitwise_engine.py,
test_bitwise_vlm.py, test_bitwise_real.py.

Oracle: ``testing.bitwise.trainer_logprobs`` under ``bitwise.mode``: text families in one padded batch forward, Qwen-VL
families in one batch with every sample's pixels, the other VLMs one sample per forward with their processor's own
outputs. Each family's tiny model has its distinguishing features on (sliding windows, soft-capping, experts,
bidirectional image blocks, deepstack features, pixel-shuffle connectors: testing/families.py,
testing/vlm_families.py) and LoRA on its language and vision layers.
"""

from __future__ import annotations

import pytest
import torch

from unsloth_rollout import EngineConfig, GenerationRequest, RolloutEngine, SamplingParams, bitwise, load_model
from unsloth_rollout.kernels import batch_invariant
from unsloth_rollout.models.families import family_of, served_families
from unsloth_rollout.testing.bitwise import trainer_logprobs, unequal
from unsloth_rollout.testing.families import family_path
from unsloth_rollout.testing.oracles import perturb_lora
from unsloth_rollout.testing.toy import random_images

pytestmark = pytest.mark.skipif(not batch_invariant.available(), reason="no C++ compiler for the mode's kernels")

OWN_FILES = ("qwen2", "qwen2_5_vl")


def _requests(policy):
    def sp(max_new, n=1, temperature=1.0):
        return SamplingParams(max_new_tokens=max_new, n=n, temperature=temperature, seed=1, ignore_eos=True)

    if not policy.is_vlm:
        return [GenerationRequest(messages=[{"role": "user", "content": t}], sampling=sp(m, n, temp))
                for t, m, n, temp in [("the quick brown fox jumps over the lazy dog twice", 6, 2, 1.0),
                                      ("hi", 9, 1, 0.7), ("count to ten", 4, 1, 1.3)]]
    imgs = random_images(2, seed=3)

    def msgs(text, k):
        return [{"role": "user", "content": [{"type": "image"}] * k + [{"type": "text", "text": text}]}]

    return [GenerationRequest(messages=msgs("look at this picture please", 1), images=imgs[:1], sampling=sp(6, 2)),
            GenerationRequest(messages=msgs("and what about this one then, friend", 1), images=imgs[1:],
                              sampling=sp(5, 1, 0.7)),
            GenerationRequest(messages=msgs("hello", 0), sampling=sp(7))]


def _vision(policy, reqs):
    out = []
    for r in reqs:
        v = None
        if r.images:
            if family_of(policy.config).grid_images:
                enc = policy.processor.image_processor(images=r.images, return_tensors="pt")
                v = {"pixel_values": enc["pixel_values"], "image_grid_thw": enc["image_grid_thw"]}
            else:
                text = policy.processor.apply_chat_template(r.messages, add_generation_prompt=True, tokenize=False)
                v = dict(policy.processor(text=[text], images=[r.images], return_tensors="pt"))
        out += [v] * r.sampling.n
    return out


@pytest.mark.parametrize("family", [f for f in served_families() if f not in OWN_FILES])
def test_served_family_equals_the_trainers_recompute(family):
    torch.manual_seed(0)
    policy = load_model(family_path(family), backend="transformers", lora={"r": 4})
    perturb_lora(policy.model, std=0.3)
    bitwise.enable(policy)
    reqs = _requests(policy)
    engine = RolloutEngine(policy, EngineConfig(kv_cache_memory_bytes=8 << 20, max_model_len=512), seed=0)
    try:
        outs = engine.generate(reqs)
    finally:
        engine.shutdown()
    assert all(o.error is None for o in outs), [o.error for o in outs]
    temps = [r.sampling.temperature for r in reqs for _ in range(r.sampling.n)]
    vision = _vision(policy, reqs)
    assert unequal(outs, trainer_logprobs(policy, outs, temps, vision)) == []
    assert unequal(outs, trainer_logprobs(policy, outs, temps, vision, on=False))
