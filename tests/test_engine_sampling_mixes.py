"""A seeded sample's tokens depend only on its own (seed, sample index, step), logits and parameters: never on
which other rows, with which parameters (top_p, top_k, min_p, penalties), share its step."""

from __future__ import annotations

import pytest
import torch

from unsloth_rollout import EngineConfig, GenerationRequest, RolloutEngine, SamplingParams, load_model
from unsloth_rollout.engine.inputs import PreparedPrompt
from unsloth_rollout.engine.sampler import Sampler
from unsloth_rollout.engine.sequence import Sequence

# Twelve seeded samples that ask for no top_p: plain, top_k, min_p, penalties, min_new_tokens, and mixes of them.
SEEDED = [dict(), dict(temperature=0.7), dict(top_k=5), dict(top_k=40, temperature=1.3), dict(min_p=0.05),
          dict(min_p=0.2, temperature=1.2), dict(repetition_penalty=1.3), dict(frequency_penalty=0.8),
          dict(presence_penalty=-0.5), dict(min_new_tokens=6), dict(top_k=8, min_p=0.02, repetition_penalty=1.1),
          dict(min_new_tokens=4, presence_penalty=0.4, top_k=20)]
# Rows that share the step: each needs a different part of the sampler (sorting, top-k, min-p, penalties).
NEIGHBOURS = [dict(top_p=0.3), dict(top_p=0.9, top_k=3), dict(top_k=2), dict(min_p=0.5), dict(repetition_penalty=1.8),
              dict(top_p=0.5, frequency_penalty=1.0), dict(temperature=0.0)]


def _seqs(params: list[dict], first_seed: int = 100) -> list[Sequence]:
    return [Sequence(f"r{i}", 0, PreparedPrompt([1, 2, 3, i]), SamplingParams(seed=first_seed + i, **p))
            for i, p in enumerate(params)]


def test_sampler_draws_of_a_row_ignore_the_other_rows():
    """Same logits row, same seed: identical tokens over 30 steps alone and beside top_p / top_k / min_p / penalty
    rows (the oracle is the row sampled on its own)."""
    torch.manual_seed(0)
    vocab = 300
    logits = torch.randn(30, vocab) * 3
    sampler = Sampler(vocab, eos_ids=[0], suppress_ids=[], seed=0)
    alone = []
    for s in _seqs(SEEDED):  # each on its own
        for step in range(30):
            s.append(sampler(logits[step:step + 1], [s]).tokens[0], 0.0, 0, None)
        alone.append(s.output_ids)
    mixed = _seqs(SEEDED)
    others = _seqs(NEIGHBOURS, first_seed=7)
    for step in range(30):
        batch = others[:3] + mixed[:6] + others[3:] + mixed[6:]
        res = sampler(logits[step:step + 1].expand(len(batch), -1).clone(), batch)
        for s, tok in zip(batch, res.tokens):
            s.append(tok, 0.0, 0, None)
    assert [s.output_ids for s in mixed] == alone


@pytest.fixture(scope="module")
def engine(qwen2_dir):
    eng = RolloutEngine(load_model(qwen2_dir, backend="transformers"), EngineConfig(kv_cache_memory_bytes=16 << 20))
    yield eng
    eng.shutdown()


def test_engine_seeded_samples_are_the_same_alone_and_beside_any_parameters(engine):
    tok = engine.tokenizer

    def req(i, p, seed):
        return GenerationRequest(input_ids=tok.encode(f"Alice counts {i} apples and Bob"),
                                 sampling=SamplingParams(max_new_tokens=16, seed=seed, **p))

    alone = [engine.generate([req(i, p, 500 + i)])[0].output_ids for i, p in enumerate(SEEDED)]
    crowd = [req(40 + j, p, None if j % 2 else 9 + j) for j, p in enumerate(NEIGHBOURS * 2)]
    batch = crowd[:5] + [req(i, p, 500 + i) for i, p in enumerate(SEEDED)] + crowd[5:]
    outs = engine.generate(batch)
    assert [o.output_ids for o in outs[5:5 + len(SEEDED)]] == alone


@pytest.mark.parametrize("vocab", [7, 256, 300, 2048, 5003])
def test_two_level_inverse_cdf_is_the_float64_cumsum_draw(vocab):
    """The sampler's draw (``inverse_cdf``: chunk sums, then the chunk's running total) against the plain float64
    cumsum over the whole vocabulary, on rows with truncated (zero) tokens, one-token rows and vocabularies that
    are not a multiple of the chunk: the same token for every uniform, up to rounding at a boundary, and never a
    zero-probability token, even at u = 1 and u -> 0."""
    from unsloth_rollout.engine.sampler import inverse_cdf

    g = torch.Generator().manual_seed(vocab)
    rows = 64
    probs = torch.softmax(torch.randn(rows, vocab, generator=g) * 4, dim=-1)
    probs[::3] = probs[::3].masked_fill(torch.rand(rows // 3 + 1, vocab, generator=g)[: probs[::3].shape[0]] < 0.7, 0.0)
    probs[1, :] = 0.0
    probs[1, vocab // 2] = 1.0  # a one-token row
    probs[2::5, : vocab // 2] = 0.0  # zeros over whole chunks
    probs[probs.sum(-1) == 0, -1] = 1.0
    mismatches = 0
    for trial in range(40):
        u = torch.rand(rows, generator=g, dtype=torch.float64).clamp(min=1e-12)
        if trial == 0:
            u[:] = 1.0
        if trial == 1:
            u[:] = 1e-300
        got = inverse_cdf(probs, u)
        assert bool((probs.gather(1, got.unsqueeze(1)) > 0).all()), "a zero-probability token was drawn"
        cdf = probs.double().cumsum(-1)
        ref = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1)).squeeze(1).clamp(max=vocab - 1)
        mismatches += int((got != ref).sum())
    assert mismatches <= 2, mismatches  # each a uniform within a float32 rounding of a boundary
