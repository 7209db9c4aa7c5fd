"""The bitwise on-policy mode through the Python API (unsloth_rollout/bitwise.py), on the tiny Qwen2 with LoRA.

Oracle: the trainer's own recompute, one padded batch forward of ``policy.model`` over prompt + output under
``bitwise.mode`` and ``log_softmax(logits / T)[token]`` (``testing.bitwise.trainer_logprobs``): the engine's
logprobs must equal it bit for bit (``torch.equal``) over mixed lengths and temperatures, a GRPO group sharing a
prompt, a preemption and a weight update mid-generation. The same recompute without the mode differs in the last
bits (the test's own check that it can fail).
"""

from __future__ import annotations

import time

import pytest
import torch

from unsloth_rollout import (DecodeConfig, EngineConfig, GenerationRequest, RolloutEngine, SamplingParams, bitwise,
                             load_model)
from unsloth_rollout.errors import BitwiseModeError
from unsloth_rollout.kernels import batch_invariant
from unsloth_rollout.testing.bitwise import trainer_logprobs, unequal
from unsloth_rollout.testing.drive import run_staggered
from unsloth_rollout.testing.oracles import perturb_lora
from unsloth_rollout.testing.tiny import tiny_model_path

pytestmark = pytest.mark.skipif(not batch_invariant.available(), reason="no C++ compiler for the mode's kernels")


@pytest.fixture(scope="module")
def policy():
    torch.manual_seed(0)  # LoRA A's init
    p = load_model(str(tiny_model_path("qwen2")), backend="transformers", lora={"r": 4})
    perturb_lora(p.model, std=0.3)
    bitwise.enable(p)
    return p


@pytest.fixture(scope="module")
def engine(policy):
    eng = RolloutEngine(policy, EngineConfig(kv_cache_memory_bytes=8 << 20, max_model_len=256), seed=0)
    yield eng
    eng.shutdown()


def _requests(spec, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [GenerationRequest(input_ids=torch.randint(0, 700, (n,), generator=g).tolist(),
                              sampling=SamplingParams(max_new_tokens=m, temperature=t, n=k, seed=i, ignore_eos=True))
            for i, (n, m, t, k) in enumerate(spec)]


def _temps(reqs):
    return [r.sampling.temperature for r in reqs for _ in range(r.sampling.n)]


def test_engine_logprobs_equal_the_trainers_recompute(policy, engine):
    reqs = _requests([(5, 9, 1.0, 1), (17, 4, 0.7, 1), (11, 12, 1.3, 3), (3, 7, 1.0, 1)])
    outs = engine.generate(reqs)
    assert engine.stats()["decode_backend"] == "workspace"  # the eager step the mode makes invariant
    assert "bitwise" in engine.stats()["decode_backend_reason"]
    assert len({len(o.prompt_ids) + len(o.output_ids) for o in outs}) >= 4  # mixed lengths: padding in the batch
    for padding in ("right", "left"):
        assert unequal(outs, trainer_logprobs(policy, outs, _temps(reqs), padding=padding)) == [], padding
    # the same recompute without the mode is not bit-identical: the comparison can fail
    assert unequal(outs, trainer_logprobs(policy, outs, _temps(reqs), on=False))


def test_preempted_and_recomputed_samples_stay_equal(policy, engine):
    early = _requests([(6, 14, 1.0, 2), (21, 14, 0.8, 1)], seed=1)
    late = _requests([(9, 10, 1.0, 1)], seed=2)
    before = engine.stats()["num_preemptions"]
    outs, stats = run_staggered(engine, early, late)
    assert stats["num_preemptions"] > before
    flat = [o for group in outs for o in group]
    assert unequal(flat, trainer_logprobs(policy, flat, _temps(early + late))) == []


def test_a_weight_update_mid_generation_each_token_equals_its_versions_recompute(policy, engine):
    reqs = _requests([(7, 24, 1.0, 2), (13, 24, 1.0, 1)], seed=3)
    lora = [p for n, p in policy.model.named_parameters() if "lora_B" in n]
    before = [p.detach().clone() for p in lora]
    futs = [engine.submit(r) for r in reqs]
    start = engine.stats()["decode_tokens"]
    deadline = time.time() + 60
    while engine.stats()["decode_tokens"] < start + 6 and time.time() < deadline:
        time.sleep(0.001)
    engine.pause()
    with torch.no_grad():  # an optimizer step in place: same tensors, new values
        for p in lora:
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(9)) * 0.2)
    after = [p.detach().clone() for p in lora]
    engine.set_version(1)
    engine.resume()
    outs = [o for f in futs for o in f.result(timeout=120)]
    assert all(o.output_versions[0] == 0 and o.output_versions[-1] == 1 for o in outs)
    new = trainer_logprobs(policy, outs, _temps(reqs))
    with torch.no_grad():
        for p, b in zip(lora, before):
            p.copy_(b)
    old = trainer_logprobs(policy, outs, _temps(reqs))
    with torch.no_grad():
        for p, a in zip(lora, after):
            p.copy_(a)
    engine.weights_changed()
    for o, lp_new, lp_old in zip(outs, new, old):
        v = torch.tensor(o.output_versions)
        got = torch.tensor(o.output_logprobs, dtype=torch.float32)
        assert torch.equal(got[v == 1], lp_new[v == 1]) and torch.equal(got[v == 0], lp_old[v == 0])
        assert not torch.equal(lp_new, lp_old)  # the update matters


def test_gradients_under_the_mode_match_the_plain_forwards(policy):
    ids = torch.randint(0, 700, (3, 12), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    lora = [p for p in policy.model.parameters() if p.requires_grad]

    def grads(on):
        policy.model.zero_grad(set_to_none=True)
        with policy.training(), (bitwise.mode(policy) if on else torch.enable_grad()):
            logits = policy.model(input_ids=ids, attention_mask=mask).logits[:, :-1]
            lp = torch.log_softmax(logits.float() / 0.7, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
            loss = -(lp * mask[:, 1:]).sum()
        loss.backward()
        return [p.grad.clone() for p in lora], loss.detach()

    (g_bit, loss_bit), (g_plain, loss_plain) = grads(True), grads(False)
    policy.model.zero_grad(set_to_none=True)
    assert (loss_bit - loss_plain).abs() < 1e-4
    for a, b in zip(g_bit, g_plain):
        assert (a - b).abs().max() <= 1e-4 * max(1.0, b.abs().max().item())


def test_compiled_decode_and_other_devices_or_dtypes_are_refused_by_name(policy):
    for backend in ("compiled", "graph"):
        with pytest.raises(BitwiseModeError, match=f"decode.backend='{backend}'"):
            RolloutEngine(policy, EngineConfig(kv_cache_memory_bytes=4 << 20, decode=DecodeConfig(backend=backend)))
    with pytest.raises(BitwiseModeError, match="compile_mode"):
        RolloutEngine(policy, EngineConfig(kv_cache_memory_bytes=4 << 20,
                                           decode=DecodeConfig(backend="workspace", compile_mode="max-autotune")))
    half = load_model(str(tiny_model_path("qwen2")), backend="transformers", dtype=torch.bfloat16)
    with pytest.raises(BitwiseModeError, match="float32"):
        bitwise.enable(half)
    with bitwise.mode(policy), pytest.raises(BitwiseModeError, match="cumsum"):
        torch.cumsum(torch.randn(4), 0)  # an op the mode has no invariant version of: named, never approximated


def test_an_engine_refuses_to_run_once_the_mode_changed_under_it(policy):
    eng = RolloutEngine(policy, EngineConfig(kv_cache_memory_bytes=4 << 20, max_model_len=64), seed=0)
    try:
        bitwise.disable(policy)
        with pytest.raises(BitwiseModeError, match="turned off after this engine was built"):
            eng.generate(_requests([(4, 3, 1.0, 1)]), timeout=60)
    finally:
        bitwise.enable(policy)
        eng.shutdown()
