"""Sampling: seeded reproducibility, truncation never leaks excluded tokens, and the empirical distribution
matches the analytically computed one."""

from __future__ import annotations

import math

import pytest
import torch

from unsloth_rollout.testing.oracles import teacher_forced_logprobs
from unsloth_rollout import EngineConfig, GenerationRequest, InvalidRequestError, RolloutEngine, SamplingParams
from unsloth_rollout import load_model
from unsloth_rollout.engine.inputs import PreparedPrompt
from unsloth_rollout.engine.sampler import Sampler
from unsloth_rollout.engine.sequence import Sequence


@pytest.fixture(scope="module")
def engine(qwen2_dir):
    eng = RolloutEngine(load_model(qwen2_dir, backend="transformers"), EngineConfig(kv_cache_memory_bytes=16 << 20))
    yield eng
    eng.shutdown()


def req(engine, text, **sp):
    return GenerationRequest(input_ids=engine.tokenizer.encode(text), sampling=SamplingParams(**sp))


def test_seeded_sampling_is_reproducible_whatever_the_batch(engine):
    target = dict(max_new_tokens=20, temperature=1.0, seed=1234)
    alone = engine.generate([req(engine, "Alice counts apples", **target)])[0]
    crowd = [req(engine, f"noise {i} and more words", max_new_tokens=5 + i, temperature=0.9) for i in range(10)]
    mixed = engine.generate(crowd[:5] + [req(engine, "Alice counts apples", **target)] + crowd[5:])
    assert mixed[5].output_ids == alone.output_ids
    other_seed = engine.generate([req(engine, "Alice counts apples", **{**target, "seed": 99})])[0]
    assert other_seed.output_ids != alone.output_ids


@pytest.mark.parametrize("params", [dict(top_k=3), dict(top_p=0.3), dict(min_p=0.2), dict(top_k=5, top_p=0.5)])
def test_truncation_never_emits_excluded_tokens(engine, params):
    temperature = 1.3
    outs = engine.generate([req(engine, f"Bob has {i} red apples", max_new_tokens=24, temperature=temperature,
                                seed=i, **params) for i in range(6)])
    for o in outs:
        _, logits = teacher_forced_logprobs(engine.policy, o.prompt_ids, o.output_ids)
        probs = torch.softmax(logits / temperature, dim=-1)
        for pos, tok in enumerate(o.output_ids):
            p = probs[pos]
            order = p.argsort(descending=True)
            rank = (order == tok).nonzero().item()
            if "top_k" in params:
                assert rank < params["top_k"]
            if "top_p" in params:
                mass_before = p[order[:rank]].sum().item()
                assert mass_before < params["top_p"] + 1e-6
            if "min_p" in params:
                assert p[tok] >= params["min_p"] * p.max() - 1e-7


def _fake_seqs(n, **sp):
    return [Sequence("r", i, PreparedPrompt([1, 2, 3]), SamplingParams(**sp)) for i in range(n)]


@pytest.mark.parametrize("params", [dict(temperature=0.7), dict(temperature=1.0, top_k=3),
                                    dict(temperature=1.0, top_p=0.75), dict(temperature=1.5, min_p=0.1)])
def test_empirical_distribution_matches_requested(params):
    """Chi-square goodness of fit of 20k draws against the distribution computed independently by hand."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    t = params["temperature"]
    p = torch.softmax(logits / t, dim=-1)
    if "top_k" in params:
        p[params["top_k"]:] = 0
    if "top_p" in params:  # logits are sorted, so the nucleus is a prefix
        keep = (torch.cumsum(p, 0) - p) < params["top_p"]
        p = p * keep
    if "min_p" in params:
        p = p * (p >= params["min_p"] * p.max())
    p = p / p.sum()
    sampler = Sampler(len(logits), eos_ids=[], suppress_ids=[], seed=0)
    draws = 20000
    counts = torch.zeros(len(logits))
    for _ in range(draws // 1000):
        res = sampler(logits.expand(1000, -1).clone(), _fake_seqs(1000, **params))
        counts += torch.bincount(torch.tensor(res.tokens), minlength=len(logits)).float()
    assert counts[p == 0].sum() == 0, "excluded tokens were drawn"
    expected = p * draws
    mask = expected > 0
    chi2 = (((counts - expected) ** 2)[mask] / expected[mask]).sum().item()
    dof = int(mask.sum()) - 1
    # 99.9% quantile of chi-square via the Wilson-Hilferty approximation.
    z = 3.09
    crit = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    assert chi2 < crit, f"chi2 {chi2:.1f} >= {crit:.1f} for {params}"


def test_logprobs_ignore_truncation_and_penalties(engine):
    """Logprobs follow AReaL's convention: log_softmax(raw_logits / T), not the truncated distribution."""
    o = engine.generate([req(engine, "the lazy dog", max_new_tokens=16, temperature=0.8, top_k=2, seed=3,
                             repetition_penalty=1.3, presence_penalty=0.5)])[0]
    ref, _ = teacher_forced_logprobs(engine.policy, o.prompt_ids, o.output_ids, 0.8)
    assert (torch.tensor(o.output_logprobs) - ref).abs().max() <= 1e-5


def test_penalties_change_greedy_choice(engine):
    base = engine.generate([req(engine, "the the the the", max_new_tokens=24, temperature=0)])[0]
    pen = engine.generate([req(engine, "the the the the", max_new_tokens=24, temperature=0,
                               frequency_penalty=2.0)])[0]
    # With a strong frequency penalty no token may repeat more often than the free-running greedy output.
    assert max(pen.output_ids.count(t) for t in set(pen.output_ids)) <= max(
        base.output_ids.count(t) for t in set(base.output_ids))
    assert pen.output_ids != base.output_ids


@pytest.mark.parametrize("field,value", [("temperature", -1), ("top_p", 0), ("top_k", 0), ("min_p", 2),
                                         ("max_new_tokens", 0), ("n", 0), ("logprobs", -1), ("seed", "x"),
                                         ("stop", [""]), ("repetition_penalty", 0), ("min_new_tokens", 10**9)])
def test_invalid_sampling_params_name_the_field(field, value):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**{field: value})
    assert e.value.field == field and field in str(e.value)
