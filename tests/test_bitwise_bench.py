"""``python -m unsloth_rollout.bench --backends ...,engine-bitwise``: the engine under the bitwise on-policy mode as a
bench backend of its own (opt-in), beside the eager engine, with the trainer's side of the mode measured after the
timed run.

Oracles: the harness's teacher-forced drift check (a plain forward: within float32 rounding, as every backend), the
trainer's recompute under the mode (``bitwise_logprob_diff_max``: exactly 0), and the eager engine's token count.
"""

from __future__ import annotations

import pytest

from unsloth_rollout.kernels import batch_invariant

pytestmark = pytest.mark.skipif(not batch_invariant.available(), reason="no C++ compiler for the mode's kernels")


def test_bitwise_engine_row_holds_its_cost_and_the_trainers_side():
    from unsloth_rollout.bench import run_bench
    from unsloth_rollout.bench.backends import DEFAULT_BACKENDS

    assert "engine-bitwise" not in DEFAULT_BACKENDS
    report = run_bench("tiny-lm", prompts=2, group=3, max_new_tokens=6, backends=["engine-eager", "engine-bitwise"],
                       drift_samples=4, progress=False)
    rows = {r["backend"]: r for r in report["results"]}
    assert set(rows) == {"engine-eager", "engine-bitwise"}, report["skipped"]
    bit = rows["engine-bitwise"]
    assert bit["output_tokens"] == rows["engine-eager"]["output_tokens"]
    assert not any("captured decode" in n for n in bit["notes"])  # the eager step the mode makes invariant
    assert bit["logprob_drift"] <= 1e-5
    assert bit["bitwise_logprob_diff_max"] == 0.0
    assert bit["train_step_s"] > 0 and bit["train_step_plain_s"] > 0
    assert bit["train_step_ratio"] == bit["train_step_s"] / bit["train_step_plain_s"]
