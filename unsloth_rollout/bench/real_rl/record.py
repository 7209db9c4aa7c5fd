"""The record of a real-weights GRPO run: per-path summaries, the issue's criteria, the JSON and the plot."""

from __future__ import annotations

import math
from dataclasses import asdict

from .settings import StepRecord

WINDOW = 5  # steps averaged at the start and at the end


def _mean(xs):
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return sum(xs) / len(xs) if xs else None


def summarize(records: list[StepRecord]) -> dict:
    """First / last WINDOW-step mean reward, total and median times, the worst logprob gaps."""
    rewards = [r.mean_reward for r in records]
    gen = [r.generation_s for r in records]
    train = [r.train_s for r in records]
    diffs = [r.logprob_diff_max for r in records if r.logprob_diff_max is not None]
    oracle = [r.oracle_diff_max for r in records if r.oracle_diff_max is not None]
    w = min(WINDOW, len(records))
    return {
        "steps": len(records),
        "first_mean_reward": _mean(rewards[:w]),
        "last_mean_reward": _mean(rewards[-w:]),
        "generation_s_total": sum(gen), "train_s_total": sum(train),
        "generation_s_median": sorted(gen)[len(gen) // 2] if gen else None,
        "train_s_median": sorted(train)[len(train) // 2] if train else None,
        "logprob_diff_max": max(diffs) if diffs else None, "logprob_checked_steps": len(diffs),
        "oracle_diff_max": max(oracle) if oracle else None, "oracle_checked_steps": len(oracle),
    }


def bounds(distance_start: float, summaries: dict[str, dict]) -> dict:
    """The fp32 bounds, by the rule of tests/test_real_checkpoint.py: max(1e-5, 1.5 x HF generate's own distance
    from the same reference). HF generate's distance is measured in this run: at the start against a teacher-forced
    forward (as the test does), and on TRL's own generate path at every step (against the trainer's recomputed
    logprobs, and against the teacher-forced forward)."""
    from .bound import fp32_bound

    base = summaries.get("trl-generate") or {}
    hf_oracle = max([distance_start] + ([base["oracle_diff_max"]] if base.get("oracle_diff_max") is not None else []))
    hf_trainer = base.get("logprob_diff_max")
    return {"vs_teacher_forced": fp32_bound(hf_oracle), "hf_generate_vs_teacher_forced": hf_oracle,
            "vs_trainer": None if hf_trainer is None else fp32_bound(hf_trainer),
            "hf_generate_vs_trainer": hf_trainer}


def within(records: list[dict], key: str, bound: float | None) -> bool | None:
    """Every step recorded ``key`` and it is <= ``bound`` (None: no bound or nothing recorded)."""
    vals = [r[key] for r in records]
    if bound is None or not vals:
        return None
    return all(v is not None and v <= bound for v in vals)


def criteria(results: dict[str, dict], bnd: dict, reward_noise: float | None) -> dict:
    """The issue's "done when", per engine path, against TRL's own-generation run."""
    base = results.get("trl-generate", {}).get("summary")
    out = {}
    for name in ("trl-engine", "areal-engine"):
        if name not in results:
            continue
        s, steps = results[name]["summary"], results[name]["steps"]
        c = {"reward_gain": s["last_mean_reward"] - s["first_mean_reward"],
             "rises": s["last_mean_reward"] - s["first_mean_reward"] > (reward_noise or 0.0),
             "logprob_vs_trainer_within_bound_every_step": within(steps, "logprob_diff_max", bnd["vs_trainer"]),
             "logprob_vs_teacher_forced_within_bound_every_step": within(steps, "oracle_diff_max",
                                                                         bnd["vs_teacher_forced"])}
        if base is not None:
            c["last_mean_reward_minus_trl_generate"] = s["last_mean_reward"] - base["last_mean_reward"]
            c["within_noise_of_trl_generate"] = (reward_noise is not None
                                                 and abs(c["last_mean_reward_minus_trl_generate"]) <= reward_noise)
            c["generation_time_ratio_trl_generate_over_this"] = base["generation_s_total"] / s["generation_s_total"]
            c["generation_2x_less"] = c["generation_time_ratio_trl_generate_over_this"] >= 2.0
        out[name] = c
    return out


def reward_noise(records: list[StepRecord], group: int, prompts: int) -> float | None:
    """Two standard errors of a WINDOW-step mean reward, from the run's own per-step rewards (binomial)."""
    if not records:
        return None
    p = _mean([r.mean_reward for r in records[-WINDOW:]])
    n = WINDOW * group * prompts
    return 2 * math.sqrt(max(p * (1 - p), 1e-12) / n)


def steps_json(records: list[StepRecord]) -> list[dict]:
    return [asdict(r) for r in records]


def plot(record: dict, path) -> None:
    """Mean reward per step, reward against cumulative generation time, and the logprob gap per step."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    colors = {"trl-generate": "tab:gray", "trl-engine": "tab:blue", "areal-engine": "tab:orange"}
    fig, axes = plt.subplots(1, 3, figsize=(15, 4), dpi=100)
    bound = (record.get("logprob_bounds") or {}).get("vs_trainer")
    for name, run in record["paths"].items():
        steps = [r["step"] for r in run["steps"]]
        rewards = [r["mean_reward"] for r in run["steps"]]
        cum, t = [], 0.0
        for r in run["steps"]:
            t += r["generation_s"]
            cum.append(t)
        label = f"{name} ({run['summary']['generation_s_total']:.0f} s generating)"
        axes[0].plot(steps, rewards, marker="o", ms=3, color=colors.get(name), label=name)
        axes[1].plot(cum, rewards, marker="o", ms=3, color=colors.get(name), label=label)
        diffs = [(r["step"], r["logprob_diff_max"]) for r in run["steps"] if r["logprob_diff_max"] is not None]
        if diffs:
            axes[2].plot(*zip(*diffs), marker="o", ms=3, color=colors.get(name), label=name)
    if bound:
        axes[2].axhline(bound, color="red", ls="--", lw=1, label=f"fp32 bound (1.5x HF generate's) {bound:.1e}")
    axes[0].set(xlabel="GRPO step", ylabel="mean reward", ylim=(0, 1.05), title="reward per step")
    axes[1].set(xlabel="cumulative generation wall time (s)", ylabel="mean reward", ylim=(0, 1.05),
                title="reward against generation time")
    axes[2].set(xlabel="GRPO step", ylabel="max |behaviour - recomputed logprob|", yscale="log",
                title="engine logprobs vs the trainer's")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(record.get("title", ""), fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
