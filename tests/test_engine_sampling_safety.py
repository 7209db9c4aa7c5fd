"""Sampling parameters that cannot misbehave: independent random streams per (seed, sample index), tiny
temperatures (greedy below 1e-5, as vLLM; never NaN, also through the server), non-finite logprobs fail the
sample by name instead of being returned, and stop strings count only where they end after min_new_tokens.
Oracles: HF generate() and a teacher-forced forward of the same model."""

from __future__ import annotations

import math
import re

import pytest
import torch

from unsloth_rollout.testing.oracles import perturb_lora, teacher_forced_logprobs
from unsloth_rollout import (EngineConfig, GenerationRequest, InvalidRequestError, RolloutEngine, SamplingParams,
                             load_model)

PROMPT = "Alice and Bob count the red apples"


@pytest.fixture(scope="module")
def policy(qwen2_dir):
    return load_model(qwen2_dir, backend="transformers")


@pytest.fixture(scope="module")
def engine(policy):
    eng = RolloutEngine(policy, EngineConfig(kv_cache_memory_bytes=16 << 20))
    yield eng
    eng.shutdown()


def req(policy, prompt=PROMPT, **sp):
    return GenerationRequest(input_ids=policy.tokenizer.encode(prompt), sampling=SamplingParams(**sp))


def hf_greedy(policy, ids, n):
    with torch.no_grad():
        out = policy.model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                                    attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    return out[0, len(ids):].tolist()


# ====================================================================== seeds
def test_seeds_s_and_s_plus_1_share_no_streams(policy, engine):
    """With Random(seed + index), sample i+1 of seed 100 was sample i of seed 101 (7 of 7 pairs)."""
    sp = dict(max_new_tokens=8, temperature=1.0, n=8, ignore_eos=True)
    outs = engine.generate([req(policy, seed=100, **sp), req(policy, seed=101, **sp)])
    a, b = outs[:8], outs[8:]
    assert all(a[i + 1].output_ids != b[i].output_ids for i in range(7))
    assert len({tuple(o.output_ids) for o in outs}) == 16, "16 samples of 8 tokens over 768 tokens must differ"
    # Still reproducible, whatever else is in the batch.
    crowd = [req(policy, f"noise {i} and more", max_new_tokens=3 + i, temperature=0.9) for i in range(4)]
    mixed = engine.generate(crowd[:2] + [req(policy, seed=101, **sp)] + crowd[2:])
    assert [o.output_ids for o in mixed[2:10]] == [o.output_ids for o in b]
    assert [o.output_ids for o in engine.generate([req(policy, seed=100, **sp)])] == [o.output_ids for o in a]


# ====================================================================== temperatures
@pytest.mark.parametrize("temperature", [1e-3, 1e-20, 1e-39])
def test_tiny_temperatures_never_give_nan(policy, engine, temperature):
    out = engine.generate([req(policy, max_new_tokens=12, temperature=temperature, logprobs=3)])[0]
    assert out.error is None and len(out.output_ids) >= 1
    assert all(math.isfinite(x) and x <= 0 for x in out.output_logprobs)
    assert all(math.isfinite(v) for top in out.top_logprobs for v in top.values())
    if temperature < 1e-5:  # greedy, as vLLM: HF's greedy tokens, scored at T = 1
        assert out.output_ids == hf_greedy(policy, out.prompt_ids, 12)[:len(out.output_ids)]
        oracle = teacher_forced_logprobs(policy, out.prompt_ids, out.output_ids)[0]
        assert torch.allclose(torch.tensor(out.output_logprobs), oracle, atol=1e-5, rtol=0)


@pytest.mark.parametrize("bad", [float("inf"), float("nan"), -1e-39])
def test_non_finite_or_negative_temperature_is_refused_by_name(bad):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(temperature=bad)
    assert e.value.field == "temperature"


def test_tiny_temperatures_through_the_server(policy):
    pytest.importorskip("fastapi")
    from starlette.testclient import TestClient

    from unsloth_rollout.serve import create_app

    eng = RolloutEngine(policy, EngineConfig(kv_cache_memory_bytes=16 << 20, max_model_len=256))
    with TestClient(create_app(eng, served_model_name="m", owns_engine=True)) as c:
        ids = policy.tokenizer.encode(PROMPT)
        for t in (1e-3, 1e-20, 1e-39):
            r = c.post("/v1/completions", json={"model": "m", "prompt": ids, "max_tokens": 8, "temperature": t,
                                                "logprobs": 1})
            assert r.status_code == 200, r.text
            lps = r.json()["choices"][0]["logprobs"]["token_logprobs"]
            assert lps and all(isinstance(x, float) and math.isfinite(x) for x in lps)
        r = c.post("/v1/completions", json={"model": "m", "prompt": ids, "max_tokens": 8, "temperature": -1e-39})
        assert r.status_code == 400 and "temperature" in r.text


# ====================================================================== non-finite logprobs
def test_non_finite_logprob_fails_that_sample_by_name(tmp_path, qwen2_dir):
    """A served adapter whose weights went NaN: its requests fail with a named error (no NaN handed back);
    a request on the base model in the same batches is untouched (HF greedy)."""
    torch.manual_seed(0)
    broken = load_model(qwen2_dir, backend="transformers", lora={"r": 8})
    perturb_lora(broken.model, std=0.3)
    with torch.no_grad():
        next(p for n, p in broken.model.named_parameters() if "lora_B" in n).fill_(float("nan"))
    broken.model.save_pretrained(str(tmp_path / "nan-adapter"))
    base = load_model(qwen2_dir, backend="transformers")
    eng = RolloutEngine(base, EngineConfig(kv_cache_memory_bytes=16 << 20))
    eng.load_lora_adapter("nan", str(tmp_path / "nan-adapter"))
    ids = base.tokenizer.encode(PROMPT)
    outs = eng.generate([GenerationRequest(input_ids=ids, lora_name="nan", sampling=SamplingParams(
                             max_new_tokens=8, temperature=1.0, n=2, seed=0)),
                         GenerationRequest(input_ids=ids, sampling=SamplingParams(max_new_tokens=8, temperature=0))])
    eng.shutdown()
    for o in outs[:2]:
        assert o.finish_reason == "abort" and o.error and o.error.startswith("NonFiniteLogprob")
        assert "output_logprobs" in o.error
        assert all(math.isfinite(x) for x in o.output_logprobs)
    assert outs[2].error is None
    with base.model.disable_adapter():
        assert outs[2].output_ids == hf_greedy(base, ids, 8)


# ====================================================================== stop strings and min_new_tokens
def _stop_case(policy, k, want_later: bool):
    """A 3-letter stop string found in the text of the first k greedy tokens, which does (want_later) or does
    not occur again ending after that text."""
    ids = policy.tokenizer.encode(PROMPT)
    ref = hf_greedy(policy, ids, 40)
    protected = policy.tokenizer.decode(ref[:k])
    full = policy.tokenizer.decode(ref)
    assert full.startswith(protected)
    for i in range(len(protected) - 2):
        x = protected[i:i + 3]
        if not x.isalpha():
            continue
        later = [m.start() for m in re.finditer(re.escape(x), full) if m.end() > len(protected)]
        if bool(later) == want_later:
            return ids, ref, protected, full, x, later
    pytest.skip("no suitable stop string in this model's greedy text")


@pytest.mark.parametrize("k", [4, 8])
def test_stop_string_inside_min_new_tokens_does_not_stop(policy, engine, k):
    ids, ref, protected, full, x, _ = _stop_case(policy, k, want_later=False)
    out = engine.generate([GenerationRequest(input_ids=ids, sampling=SamplingParams(
        max_new_tokens=40, min_new_tokens=k, temperature=0, stop=[x], ignore_eos=True))])[0]
    assert out.finish_reason == "length" and out.output_ids == ref and out.text == full


@pytest.mark.parametrize("k", [4, 8])
def test_stop_string_after_min_new_tokens_stops(policy, engine, k):
    ids, ref, protected, full, x, later = _stop_case(policy, k, want_later=True)
    out = engine.generate([GenerationRequest(input_ids=ids, sampling=SamplingParams(
        max_new_tokens=40, min_new_tokens=k, temperature=0, stop=[x], ignore_eos=True))])[0]
    assert out.finish_reason == "stop" and out.stop_reason == x
    assert out.text == full[:later[0]]
    # It stops at the first token whose text completes that match.
    t = next(t for t in range(k, 41) if len(policy.tokenizer.decode(ref[:t])) >= later[0] + len(x))
    assert out.output_ids == ref[:t]
