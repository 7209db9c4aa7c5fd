"""Prompt scoring (``prompt_logprobs``, ``max_new_tokens=0``) and ``logprobs_mode="processed_logprobs"``.

Oracles: a teacher-forced forward of the same weights (``unsloth_rollout.testing.oracles.teacher_forced``) for
prompt logprobs, and the processed distribution computed from its definition (``testing.oracles
.processed_distribution``: penalties, then T, top-k, min-p, top-p over the sorted probabilities, renormalised)
for processed logprobs.
"""

import pytest
import torch

from unsloth_rollout import EngineConfig, GenerationRequest, RolloutEngine, SamplingParams, load_model
from unsloth_rollout.engine.config import PrefillConfig
from unsloth_rollout.engine import InvalidRequestError
from unsloth_rollout.testing.oracles import processed_distribution, teacher_forced

TOL = 1e-5


@pytest.fixture(scope="module")
def policy(qwen2_dir):
    return load_model(qwen2_dir, backend="transformers")


@pytest.fixture(scope="module")
def engine(policy):
    eng = RolloutEngine(policy, EngineConfig(kv_cache_memory_bytes=32 << 20, max_model_len=256,
                                             prefill=PrefillConfig(chunk_tokens=16)), seed=0)
    yield eng
    eng.shutdown()


def _prompt_oracle(policy, ids):
    """log p(ids[j] | ids[:j]) for j >= 1 and the full log-softmax rows, from one teacher-forced forward."""
    lp, logits = teacher_forced(policy, ids[:1], ids[1:], temperature=1.0)
    return lp, torch.log_softmax(logits, dim=-1)


@pytest.mark.parametrize("lengths", [(3, 11, 40), (45,)])  # packed together; alone, chunked (> 16 tokens)
def test_prompt_logprobs_match_teacher_forced_packed_and_chunked(engine, policy, lengths, monkeypatch):
    prompts = [list(range(5 + n, 5 + 2 * n)) for n in lengths]
    reqs = [GenerationRequest(input_ids=p, sampling=SamplingParams(max_new_tokens=0, prompt_logprobs=3))
            for p in prompts]
    runner, calls = engine.core.runner, []
    monkeypatch.setattr(runner, "prefill_continue", lambda *a, _f=runner.prefill_continue, **k: calls.append(1)
                        or _f(*a, **k))
    outs = engine.generate(reqs)
    if len(lengths) == 1:
        assert len(calls) == 2  # 45 tokens in chunks of 16: two continuations
    for p, out in zip(prompts, outs):
        assert out.output_ids == [] and out.finish_reason == "length"
        assert len(out.prompt_logprobs) == len(p) and out.prompt_logprobs[0] is None
        want, rows = _prompt_oracle(policy, p)
        got = torch.tensor([next(iter(d.values())) for d in out.prompt_logprobs[1:]])
        assert [next(iter(d)) for d in out.prompt_logprobs[1:]] == p[1:]  # the prompt's own token first
        assert (got - want).abs().max() <= TOL
        for j, d in enumerate(out.prompt_logprobs[1:]):
            top = rows[j].topk(3)
            for t, v in zip(top.indices.tolist(), top.values.tolist()):
                assert abs(d[t] - v) <= TOL
            assert out.prompt_logprob_ranks[j + 1] == int((rows[j] > rows[j][p[j + 1]]).sum()) + 1


def test_scored_prompt_is_cached_and_then_generates(engine, policy):
    p = list(range(30, 52))
    before = engine.stats()["prefix_cache_hits"]
    first = engine.generate([GenerationRequest(input_ids=p, sampling=SamplingParams(
        max_new_tokens=0, prompt_logprobs=0))])[0]
    again = engine.generate([GenerationRequest(input_ids=p, sampling=SamplingParams(
        max_new_tokens=2, temperature=0, prompt_logprobs=0))])[0]
    assert engine.stats()["prefix_cache_hits"] > before
    assert again.prompt_logprobs == first.prompt_logprobs
    assert all(len(d) == 1 for d in first.prompt_logprobs[1:])  # prompt_logprobs=0: the prompt token only
    lp, _ = teacher_forced(policy, p, again.output_ids)
    assert (lp - torch.tensor(again.output_logprobs)).abs().max() <= TOL


def test_max_new_tokens_zero_needs_prompt_logprobs():
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(max_new_tokens=0)
    assert e.value.field == "max_new_tokens"
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(logprobs_mode="processed_logits")
    assert e.value.field == "logprobs_mode"


def _processed_oracle(logits, seen_all, seen_out, sp):
    """The log of the distribution a token is drawn from, from the definition (vLLM's processed_logprobs)."""
    return processed_distribution(logits, seen_all, seen_out, temperature=sp.temperature, top_k=sp.top_k,
                                  top_p=sp.top_p, min_p=sp.min_p, repetition_penalty=sp.repetition_penalty,
                                  frequency_penalty=sp.frequency_penalty, presence_penalty=sp.presence_penalty)


@pytest.mark.parametrize("knobs", [dict(temperature=0.7, top_p=0.9, repetition_penalty=1.05),
                                   dict(temperature=1.3, top_k=7, min_p=0.02, presence_penalty=0.3)])
def test_processed_logprobs_match_an_independent_oracle(engine, policy, knobs):
    prompt = list(range(40, 52))
    sp = SamplingParams(max_new_tokens=12, seed=3, logprobs=2, logprobs_mode="processed_logprobs", **knobs)
    raw_sp = SamplingParams(max_new_tokens=12, seed=3, **knobs)
    out, raw = engine.generate([GenerationRequest(input_ids=prompt, sampling=sp),
                                GenerationRequest(input_ids=prompt, sampling=raw_sp)])
    assert out.output_ids == raw.output_ids  # the mode changes what is reported, never what is drawn
    _, logits = teacher_forced(policy, prompt, out.output_ids)
    for i, tok in enumerate(out.output_ids):
        want = _processed_oracle(logits[i], prompt + out.output_ids[:i], out.output_ids[:i], sp)
        assert abs(out.output_logprobs[i] - float(want[tok])) <= TOL
        for t, v in out.top_logprobs[i].items():
            assert abs(v - float(want[t])) <= TOL
        assert abs(raw.output_logprobs[i] - float(torch.log_softmax(logits[i] / sp.temperature, -1)[tok])) <= TOL
    diff = max(abs(a - b) for a, b in zip(out.output_logprobs, raw.output_logprobs))
    assert diff > 1e-3  # the two modes do differ here (a test that could not fail otherwise)


def test_processed_logprobs_rows_with_different_settings_in_one_batch(engine, policy):
    """Rows of one sampler call with different T / top-k / top-p / min-p, and a greedy row (its processed
    logprobs: the penalised logits at T = 1, unfiltered), each equal to the oracle of its own settings."""
    prompt = list(range(60, 70))
    settings = [dict(temperature=0.7, top_p=0.8, seed=1), dict(temperature=1.2, top_k=5, min_p=0.05, seed=2),
                dict(temperature=0.0, repetition_penalty=1.2)]
    sps = [SamplingParams(max_new_tokens=6, logprobs_mode="processed_logprobs", **k) for k in settings]
    outs = engine.generate([GenerationRequest(input_ids=prompt, sampling=sp) for sp in sps])
    for sp, out in zip(sps, outs):
        _, logits = teacher_forced(policy, prompt, out.output_ids)
        for i, tok in enumerate(out.output_ids):
            if sp.greedy:
                x = logits[i].double().clone()
                seen = torch.tensor(sorted(set(prompt + out.output_ids[:i])))
                v = x[seen]
                x[seen] = torch.where(v > 0, v / sp.repetition_penalty, v * sp.repetition_penalty)
                want = torch.log_softmax(x, -1)
                assert tok == int(want.argmax())
            else:
                want = _processed_oracle(logits[i], prompt + out.output_ids[:i], out.output_ids[:i], sp)
            assert abs(out.output_logprobs[i] - float(want[tok])) <= TOL
