"""The record of a real-weights GRPO run: per-path summaries, the criteria each engine path is held to, the JSON
and the plot."""

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
    drift = [r.trainer_drift_max for r in records if r.trainer_drift_max is not None]
    forced = [r.hf_forced_diff_max for r in records if r.hf_forced_diff_max is not None]
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
        "trainer_drift_max": max(drift) if drift else None,
        "hf_forced_diff_max": max(forced) if forced else None,
        "oracle_checked_rows": sum(r.checked_rows for r in records),
    }


def bounds(distance_start: float, summaries: dict[str, dict]) -> dict:
    """The fp32 bound against the teacher-forced forward, by the rule of tests/test_real_checkpoint.py:
    max(1e-5, 1.5 x HF generate's own distance from it), HF's distance measured in this run: at the start on the
    base weights, on every checked row of TRL's own generate path at every step, and, at every step of every
    path, on exactly the tokens that path checked (HF generate's own logits, every token forced:
    ``hf_forced_diff_max``). Maxima over as many rows as the engine paths check, on the same weights. Against the
    trainer's recompute the bound is per step (``trainer_bound``)."""
    from .bound import fp32_bound

    base = summaries.get("trl-generate") or {}
    own = [base["oracle_diff_max"]] if base.get("oracle_diff_max") is not None else []
    forced = {k: v["hf_forced_diff_max"] for k, v in summaries.items() if v.get("hf_forced_diff_max") is not None}
    hf_oracle = max([distance_start] + own + list(forced.values()))
    return {"vs_teacher_forced": fp32_bound(hf_oracle), "hf_generate_vs_teacher_forced": hf_oracle,
            "hf_generate_vs_teacher_forced_start": distance_start,
            "hf_generate_checked_rows": base.get("oracle_checked_rows", 0),
            "hf_generate_forced_on_each_paths_rows": forced,
            "vs_trainer": "per step: vs_teacher_forced + that step's trainer_drift_max (the trainer's own distance "
                          "from the teacher-forced forward on the same rows)"}


def trainer_bound(step: dict, bound_vs_teacher_forced: float | None) -> float | None:
    """A step's bound on |behaviour - trainer|: the behaviour side may be ``bound_vs_teacher_forced`` from the
    oracle, the trainer's recompute is ``trainer_drift_max`` from it (measured on the same rows): |a - b| is at
    most their sum."""
    drift = step.get("trainer_drift_max")
    return None if drift is None or bound_vs_teacher_forced is None else bound_vs_teacher_forced + drift


def within(records: list[dict], key: str, bound) -> bool | None:
    """Every step recorded ``key`` and it is <= ``bound`` (a number, or a function of the step; None: no bound or
    nothing recorded)."""
    if bound is None or not records:
        return None
    limit = bound if callable(bound) else (lambda _r: bound)
    return all(r.get(key) is not None and limit(r) is not None and r[key] <= limit(r) for r in records)


def _same(a, b) -> bool:
    """Two maxima of one set of gaps, computed apart (ours from lists, TRL's from its tensors)."""
    return a is not None and b is not None and abs(a - b) <= 1e-4 * max(abs(b), 1e-12)


def two_se_of_difference(p1: float, p2: float, n: int) -> float:
    """Two standard errors of the difference of two mean rewards over ``n`` 0/1 samples each (binomial; samples of
    one GRPO group are correlated, so the true noise is somewhat larger)."""
    return 2 * math.sqrt((p1 * (1 - p1) + p2 * (1 - p2)) / n)


def criteria(results: dict[str, dict], bnd: dict, samples_per_step: int) -> dict:
    """Per engine path, against TRL's own-generation run, at the step count every path reached (all of them,
    unless the run was stopped): the reward rises beyond noise and ends within noise of TRL's own run, logprobs
    stay within their bounds every step, and generation takes at most half TRL's time."""
    common = min((len(r["steps"]) for r in results.values()), default=0)
    cut = {k: {"steps": r["steps"][:common],
               "summary": summarize([StepRecord(**x) for x in r["steps"][:common]])} for k, r in results.items()}
    base = cut.get("trl-generate", {}).get("summary")
    out = {"at_step": common}
    if not common:
        return out
    for name in ("trl-engine", "areal-engine"):
        if name not in cut:
            continue
        s, steps = cut[name]["summary"], cut[name]["steps"]
        n = min(WINDOW, len(steps)) * samples_per_step
        first, last = s["first_mean_reward"], s["last_mean_reward"]
        b_tf = bnd["vs_teacher_forced"]
        c = {"reward_gain": last - first, "reward_gain_noise": two_se_of_difference(first, last, n),
             "logprob_vs_trainer_within_bound_every_step": within(steps, "logprob_diff_max",
                                                                  lambda r: trainer_bound(r, b_tf)),
             "logprob_vs_teacher_forced_within_bound_every_step": within(steps, "oracle_diff_max", b_tf),
             "trainer_bound_per_step": [trainer_bound(r, b_tf) for r in steps],
             "widest_gap_checked_every_step": all(_same(r.get("checked_diff_max"), r.get("logprob_diff_max"))
                                                  for r in steps)}
        c["rises"] = c["reward_gain"] > c["reward_gain_noise"]
        if base is not None:
            c["last_mean_reward_minus_trl_generate"] = last - base["last_mean_reward"]
            c["difference_noise"] = two_se_of_difference(last, base["last_mean_reward"], n)
            c["within_noise_of_trl_generate"] = abs(c["last_mean_reward_minus_trl_generate"]) <= c["difference_noise"]
            c["generation_time_ratio_trl_generate_over_this"] = base["generation_s_total"] / s["generation_s_total"]
            c["generation_2x_less"] = c["generation_time_ratio_trl_generate_over_this"] >= 2.0
        out[name] = c
    return out


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
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5), dpi=100)
    bnd = record.get("logprob_bounds") or {}
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
        for key, ls, what in (("logprob_diff_max", "-", "vs trainer"), ("oracle_diff_max", ":", "vs teacher-forced")):
            pts = [(r["step"], r[key]) for r in run["steps"] if r.get(key) is not None]
            if pts:
                axes[2].plot(*zip(*pts), marker="o", ms=3, ls=ls, color=colors.get(name), label=f"{name} {what}")
        b_tf = bnd.get("vs_teacher_forced")
        pts = [(r["step"], trainer_bound(r, b_tf)) for r in run["steps"] if b_tf and trainer_bound(r, b_tf)]
        if pts and name != "trl-generate":
            axes[2].plot(*zip(*pts), ls="--", lw=1, color=colors.get(name), label=f"{name} bound vs trainer")
    if bnd.get("vs_teacher_forced"):
        axes[2].axhline(bnd["vs_teacher_forced"], color="red", ls="-.", lw=1,
                        label=f"fp32 bound vs teacher-forced {bnd['vs_teacher_forced']:.1e}")
    axes[0].set(xlabel="GRPO step", ylabel="mean reward", ylim=(0, 1.05), title="reward per step")
    axes[1].set(xlabel="cumulative generation wall time (s)", ylabel="mean reward", ylim=(0, 1.05),
                title="reward against generation time")
    axes[2].set(xlabel="GRPO step", ylabel="max |behaviour logprob - reference|", yscale="log",
                title="behaviour logprobs vs the trainer's and a teacher-forced forward")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(record.get("title", ""), fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def markdown(rec: dict) -> str:
    """The record's table: per path, reward first / last 5 steps, times, logprob gaps (what the READMEs quote)."""
    def f(x, spec):
        return "-" if x is None else format(x, spec)

    b = rec["logprob_bounds"]
    crit = rec.get("criteria", {})
    common = crit.get("at_step") or min(len(r["steps"]) for r in rec["paths"].values())
    lines = [f"{rec['title']}{' (PARTIAL: ' + str(rec['partial_steps_done']) + ')' if rec.get('partial') else ''}",
             "", "| path | mean reward, first 5 -> last 5 steps | generation (s) | training (s) | "
             "max \\|logprob - trainer's\\| | max \\|logprob - teacher-forced\\| | trainer drift | rows checked |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for name, r in rec["paths"].items():
        s = summarize([StepRecord(**x) for x in r["steps"][:common]])  # every path at the same step count
        lines.append(f"| {name} | {f(s['first_mean_reward'], '.3f')} -> {f(s['last_mean_reward'], '.3f')} "
                     f"({s['steps']} steps) | {s['generation_s_total']:.0f} | {s['train_s_total']:.0f} | "
                     f"{f(s['logprob_diff_max'], '.1e')} | {f(s['oracle_diff_max'], '.1e')} | "
                     f"{f(s['trainer_drift_max'], '.1e')} | {s['oracle_checked_rows']} |")
    m = rec.get("machine", {})
    ends = ", ".join(f"{k} {v.get('load_average_end')}" for k, v in rec["paths"].items())
    lines += ["", f"Load average (1, 5, 15 min) at the start {m.get('load_average_start')}, at each path's end: {ends}."]
    lines += ["", f"fp32 bound vs teacher-forced: {f(b['vs_teacher_forced'], '.1e')} (1.5x HF generate's own "
                  f"{f(b['hf_generate_vs_teacher_forced'], '.1e')}, its largest distance in the run: at the start, on "
                  "trl-generate's checked rows, and on every path's checked tokens forced through it); vs trainer, "
                  "per step: that plus the trainer's own "
                  "distance from the teacher-forced forward on the same rows (the trainer drift column).", ""]
    for name, c in crit.items():
        if not isinstance(c, dict):
            continue
        parts = [f"gain {c['reward_gain']:+.3f} (noise {c['reward_gain_noise']:.3f})"]
        if "last_mean_reward_minus_trl_generate" in c:
            parts.append(f"last 5 vs trl-generate {c['last_mean_reward_minus_trl_generate']:+.3f} "
                         f"(noise {c['difference_noise']:.3f})")
            parts.append(f"generation {c['generation_time_ratio_trl_generate_over_this']:.2f}x less")
        parts.append(f"logprobs within bound every step: vs trainer {c['logprob_vs_trainer_within_bound_every_step']}, "
                     f"vs teacher-forced {c['logprob_vs_teacher_forced_within_bound_every_step']}; the step's "
                     f"largest gap among the rows checked every step: {c.get('widest_gap_checked_every_step')}")
        lines.append(f"- {name} (at step {crit.get('at_step')}): " + "; ".join(parts))
    return "\n".join(lines) + "\n"
