"""Adapters served by name, with LoRA on the vision tower, on every served VLM family; and the shared model is
never left different by a forward that fails.

Per family: the policy has its own LoRA (language + vision, non-zero B) and serves a second adapter ``a1``
(another seed and rank, vision LoRA included) loaded from disk. One engine step takes a1 and unnamed prompts
with 0, 1 and 2 images together: one packed prefill per adapter, then decode steps mixing both. Oracles: HF
``generate()`` on the processor's own encoding, with a fresh model running only a1 for a1's rows (and the policy
for unnamed rows), and a teacher-forced forward of the same model for every logprob.
"""

from __future__ import annotations

import pytest
import torch

from unsloth_rollout import EngineConfig, GenerationRequest, RolloutEngine, SamplingParams
from unsloth_rollout.testing.adapters import (VLM_SERVED, adapter_oracle, hf_greedy, images, lora_policy,
                                              processor_inputs, save_adapter)
from unsloth_rollout.testing.families import family_path
from unsloth_rollout.testing.oracles import teacher_forced

MAX_NEW = 6
WORDS = "the quick brown fox jumps over a lazy dog while Alice and Bob count apples in Paris".split()


def messages(i: int, n_images: int) -> list[dict]:
    parts = [{"type": "image"} for _ in range(n_images)]
    return [{"role": "user", "content": parts + [{"type": "text", "text": " ".join(WORDS[i: i + 3 + i])}]}]


def one_step(engine, reqs: list[GenerationRequest]) -> list:
    """Submit every request while paused, so the engine takes them all in its first step."""
    engine.pause("keep", holder="test")
    futs = [engine.submit(r) for r in reqs]
    engine.resume(holder="test")
    return [f.result(timeout=300)[0] for f in futs]


def vision_of(enc: dict) -> dict:
    return {k: v for k, v in enc.items() if k not in ("input_ids", "attention_mask")}


def pre_hooks(model) -> int:
    return sum(len(m._forward_pre_hooks) for m in model.modules())


def check_exact(policy, out, enc, suppress, what: str) -> None:
    assert out.error is None, f"{what}: {out.error}"
    assert out.prompt_ids == enc["input_ids"][0].tolist(), f"{what}: the prompt differs from the processor's"
    assert out.output_ids == hf_greedy(policy, enc, MAX_NEW, suppress), f"{what}: greedy tokens differ from HF"
    ref, _ = teacher_forced(policy, out.prompt_ids, out.output_ids, 1.0, **vision_of(enc))
    drift = (torch.tensor(out.output_logprobs) - ref).abs().max().item()
    assert drift <= 1e-5, f"{what}: logprob drift {drift:.2e} from a teacher-forced forward"


@pytest.mark.parametrize("family", VLM_SERVED)
def test_named_vision_lora_adapter_exact_in_mixed_packs(family, tmp_path):
    path = family_path(family)
    a1 = save_adapter(path, tmp_path / "a1", seed=1, r=4)
    policy = lora_policy(path, seed=0, r=8)
    engine = RolloutEngine(policy, EngineConfig(kv_cache_memory_bytes=16 << 20), seed=0)
    engine.load_lora_adapter("a1", a1)
    imgs = images(6, seed=3)
    rows = [("a1", 0, imgs[0:1]), ("a1", 1, imgs[1:3]), (None, 2, imgs[3:4]), (None, 3, imgs[4:6]),
            ("a1", 4, []), (None, 5, [])]
    sp = SamplingParams(max_new_tokens=MAX_NEW, temperature=0, ignore_eos=True)
    outs = one_step(engine, [GenerationRequest(messages=messages(i, len(im)), images=im or None, lora_name=name,
                                               sampling=sp) for name, i, im in rows])
    stats, suppress = engine.stats(), engine.core.sampler.suppress_ids
    rows.append(("a1", 6, imgs[2:4]))  # and alone in its step
    outs += one_step(engine, [GenerationRequest(messages=messages(6, 2), images=imgs[2:4], lora_name="a1",
                                                sampling=sp)])
    engine.shutdown()
    assert stats["errors"] == 0, [o.error for o in outs]
    # One packed forward per adapter: a pack that raised would have been retried prompt by prompt (more forwards).
    assert stats["prefill_forwards"] == 2, stats["prefill_forwards"]
    assert pre_hooks(policy.model) == 0

    oracle = adapter_oracle(path, a1)
    enc0 = processor_inputs(oracle, messages(0, 1), imgs[0:1])
    theirs, _ = teacher_forced(oracle, enc0["input_ids"][0].tolist(), outs[0].output_ids, **vision_of(enc0))
    ours, _ = teacher_forced(policy, enc0["input_ids"][0].tolist(), outs[0].output_ids, **vision_of(enc0))
    assert (theirs - ours).abs().max() > 1e-3, "a1 must differ from the policy's adapter for the test to mean much"
    for (name, i, im), out in zip(rows, outs):
        model = oracle if name else policy
        check_exact(model, out, processor_inputs(model, messages(i, len(im)), im or None), suppress,
                    f"{family} {name or 'unnamed'} with {len(im)} image(s)")


def _decoder_layer(model) -> torch.nn.Module:
    layers = [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
    return layers[len(layers) // 2]


@pytest.mark.parametrize("family", ["qwen2_5_vl", "gemma3"])
def test_failed_forward_leaves_the_shared_model_as_fresh(family, tmp_path):
    """A forward that raises mid-model (in a named prefill with images, then in a decode step mixing adapters)
    fails only its rows; afterwards the trainer's forward (eval and train mode) and unnamed requests equal a fresh
    model's, and named requests are still exact."""
    path = family_path(family)
    a1 = save_adapter(path, tmp_path / "a1", seed=1, r=4)
    policy, fresh = lora_policy(path, seed=0), lora_policy(path, seed=0)
    engine = RolloutEngine(policy, EngineConfig(kv_cache_memory_bytes=16 << 20), seed=0)
    engine.load_lora_adapter("a1", a1)
    hooks_before = pre_hooks(policy.model)
    layers = [m for m in policy.model.modules() if hasattr(m, "_active_adapter")]
    selection = [(m._active_adapter, m._disable_adapters) for m in layers]

    calls = {"n": 0, "fail_at": set()}

    def boom(module, args):
        calls["n"] += 1
        if calls["n"] in calls["fail_at"]:
            raise RuntimeError("injected failure")

    handle = _decoder_layer(policy.model).register_forward_pre_hook(boom)
    imgs = images(4, seed=5)
    sp = SamplingParams(max_new_tokens=MAX_NEW, temperature=0, ignore_eos=True)
    try:
        calls["fail_at"] = {1}  # the named prefill with an image
        out = one_step(engine, [GenerationRequest(messages=messages(0, 1), images=imgs[:1], lora_name="a1",
                                                  sampling=sp)])[0]
        assert out.error is not None and "injected" in out.error
        calls["n"], calls["fail_at"] = 0, {3}  # two prefills (one per adapter), then the mixed decode step
        outs = one_step(engine, [GenerationRequest(messages=messages(1, 0), lora_name="a1", sampling=sp),
                                 GenerationRequest(messages=messages(2, 0), sampling=sp)])
        assert all(o.error is not None and "injected" in o.error for o in outs), [o.error for o in outs]
    finally:
        handle.remove()
    assert pre_hooks(policy.model) == hooks_before, "a failed forward left hooks on the shared model"
    assert [(m._active_adapter, m._disable_adapters) for m in layers] == selection

    enc = processor_inputs(fresh, messages(3, 2), imgs[1:3])
    for mode in ("inference", "training"):  # the trainer's own forward, in both modes
        getattr(policy, mode)(), getattr(fresh, mode)()
        with torch.no_grad():
            got, want = policy.model(**enc).logits, fresh.model(**enc).logits
        assert (got - want).abs().max() <= 1e-5, f"{mode}: the trainer's forward differs from a fresh model's"
    policy.inference(), fresh.inference()

    reqs = [GenerationRequest(messages=messages(3, 2), images=imgs[1:3], sampling=sp),
            GenerationRequest(messages=messages(4, 0), sampling=sp),
            GenerationRequest(messages=messages(5, 1), images=imgs[3:4], lora_name="a1", sampling=sp)]
    outs = one_step(engine, reqs)
    suppress = engine.core.sampler.suppress_ids
    engine.shutdown()
    check_exact(fresh, outs[0], enc, suppress, "unnamed with 2 images after the failures")
    check_exact(fresh, outs[1], processor_inputs(fresh, messages(4, 0), None), suppress, "unnamed text")
    oracle = adapter_oracle(path, a1)
    check_exact(oracle, outs[2], processor_inputs(oracle, messages(5, 1), imgs[3:4]), suppress, "a1 after failures")


@pytest.mark.parametrize("family", ["gemma3", "qwen2_5_vl"])
def test_unloading_a_vision_lora_adapter_beside_a_language_only_one_keeps_serving(family, tmp_path):
    """Found by the differential run (seed 100120): on a policy without LoRA serving a1 (vision + language LoRA)
    and a2 (language only), unloading a1 left PEFT's model-level active adapter naming the deleted a1 (PEFT takes
    the new one from the first LoRA layer, a vision layer that held only a1), so the next load raised KeyError.
    After unload + reload both adapters serve exactly what they served before, and unnamed rows stay the base's."""
    from unsloth_rollout.models import load_model

    path = family_path(family)
    a1 = save_adapter(path, tmp_path / "a1", seed=1)
    lang_only = lora_policy(path, seed=2, r=4, lora_alpha=8, finetune_vision_layers=False)
    assert not any("visual" in n or "vision" in n for n, _ in lang_only.model.named_parameters() if "lora_B" in n)
    a2 = str(tmp_path / "a2")
    lang_only.model.save_pretrained(a2)
    policy = load_model(path, backend="transformers")
    engine = RolloutEngine(policy, EngineConfig(kv_cache_memory_bytes=32 << 20))
    try:
        engine.load_lora_adapter("a1", a1)
        engine.load_lora_adapter("a2", a2)
        imgs = images(1, seed=3)

        def run():
            reqs = [GenerationRequest(messages=messages(i, 1), images=imgs, lora_name=name, request_id=f"{name}{i}",
                                      sampling=SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0,
                                                              ignore_eos=True))
                    for i, name in enumerate(["a1", "a2", None])]
            return [(o.output_ids, o.output_logprobs) for o in one_step(engine, reqs)]

        before = run()
        engine.unload_lora_adapter("a1")
        assert sorted(engine.lora_adapters) == ["a2"]
        engine.load_lora_adapter("a1", a1)
        after = run()
        for (ids0, lp0), (ids1, lp1), what in zip(before, after, ["a1", "a2", "unnamed"]):
            assert ids1 == ids0, f"{what}: other tokens after unload + reload"
            assert max(abs(x - y) for x, y in zip(lp0, lp1)) <= 1e-5, f"{what}: other logprobs after unload + reload"
        for name in ("a1", "a2"):
            engine.unload_lora_adapter(name)
        assert not engine.lora_adapters
    finally:
        engine.shutdown()
