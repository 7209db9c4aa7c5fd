"""The randomized differential test (unsloth_rollout.testing.differential): mixes of features against oracles.

CI runs a short seeded sample on a few families; ``-m slow`` runs 1,000+ mixes over every family
(``DIFFERENTIAL_MIXES``, ``DIFFERENTIAL_SEED`` change the count and the first seed). Draws that hit a defect
named in ``differential.KNOWN`` are skipped by name (``DIFFERENTIAL_ALL=1`` runs them too). A failure prints
the mix's seed and the smallest mix that still fails; rerun one with ``run_mix(draw_mix(seed, [family]))``.
"""

from __future__ import annotations

import os

import pytest

from unsloth_rollout.testing import differential as diff
from unsloth_rollout.testing.differential_models import ALL_FAMILIES

CI_FAMILIES = ("qwen2", "gemma2", "qwen2_5_vl", "gemma3")
CI_MIXES = 12
CI_SEED = 2200


def _run(families, count: int, first_seed: int, run_known: bool = False, shrink_budget: int = 25,
         progress: bool = False):
    """Run ``count`` mixes; returns (report lines of what failed, names of skipped known defects)."""
    report, skipped = [], {}
    seed = first_seed
    ran = 0
    while ran < count:
        # Each family in turn, so every one gets draws; the seed alone reproduces the mix.
        mix = diff.draw_mix(seed, [families[seed % len(families)]])
        seed += 1
        known = diff.known_defects(mix)
        if known and not run_known:
            for k in known:
                skipped[k] = skipped.get(k, 0) + 1
            continue
        ran += 1
        failures = [(c, m) for c, m in diff.run_mix(mix) if run_known or c not in diff.KNOWN]
        if progress:  # one line per mix under `pytest -s`: a long run shows where it is
            print(f"mix {ran}/{count} seed {seed - 1} {mix.family}: {'ok' if not failures else failures[0][0]}",
                  flush=True)
        if not failures:
            continue
        checks = {c for c, _ in failures}
        small = diff.shrink(mix, checks, budget=shrink_budget)
        report.append(diff.describe(mix, failures) + "\nshrunk to:\n" + diff.describe(small, diff.run_mix(small)))
    return report, skipped


def test_differential_seeded_mixes():
    report, skipped = _run(CI_FAMILIES, CI_MIXES, CI_SEED)
    print(f"skipped draws by known defect: {skipped}")
    assert not report, "\n\n".join(report)


@pytest.mark.slow
def test_differential_long_run():
    count = int(os.environ.get("DIFFERENTIAL_MIXES", "1000"))
    first = int(os.environ.get("DIFFERENTIAL_SEED", "100000"))
    report, skipped = _run(ALL_FAMILIES, count, first, run_known=os.environ.get("DIFFERENTIAL_ALL") == "1",
                           progress=True)
    print(f"skipped draws by known defect: {skipped}")
    assert not report, f"{len(report)} of {count} mixes failed:\n\n" + "\n\n".join(report)


def test_differential_catches_and_shrinks_a_planted_defect(monkeypatch):
    """The oracles can fail: named rows silently served by the policy's own adapter (a defect of the kind the
    mixes exist to find) fail the greedy and logprob checks, and the shrinker keeps one named row."""
    from unsloth_rollout.engine.runner import ModelRunner

    monkeypatch.setattr(ModelRunner, "adapter_names", lambda self, names: None)
    mix = diff.Mix(seed=-1, family="qwen2", policy_lora=True, chunk=8192, block_size=8, small_kv=False, events=[
        "pause"], rows=[diff.Row("greedy", 9, adapter="a1", sampling={"max_new_tokens": 5, "temperature": 0.0}),
                        diff.Row("greedy", 16, sampling={"max_new_tokens": 4, "temperature": 0.0}, seed=3),
                        diff.Row("sampled", 7, adapter="a2", sampling={"max_new_tokens": 4, "temperature": 1.0},
                                 wave=1, seed=5)])
    checks = {c for c, _ in diff.run_mix(mix)}
    assert {"greedy", "logprobs"} <= checks, checks
    small = diff.shrink(mix, {"greedy"})
    assert small.events == [] and len(small.rows) == 1 and small.rows[0].adapter == "a1", diff.describe(small, [])
