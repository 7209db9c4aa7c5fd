"""CLI: ``python -m unsloth_rollout.bench.real_rl --steps 30 --out benchmarks/real/``.

Runs the same GRPO run three ways (TRL's own generate, TRL through the engine, AReaL through the engine)
one after another in this process, printing a line per step, then writes ``OUT/grpo_real.json`` and
``OUT/grpo_real.png``. ``--paths`` runs a subset.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import sys
import time

from .settings import PATHS, RunSettings


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m unsloth_rollout.bench.real_rl",
                                description="GRPO on a real checkpoint three ways: TRL generate, TRL + engine, "
                                            "AReaL + engine; per-step reward, times and logprob check.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    doc = RunSettings.__doc__ or ""
    for f in dataclasses.fields(RunSettings):
        line = next((ln.split(":", 1)[1].strip() for ln in doc.splitlines() if ln.strip().startswith(f.name + ":")),
                    "")
        p.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default, help=line)
    p.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated subset of {', '.join(PATHS)}")
    p.add_argument("--out", default=None, help="folder for grpo_real.json and grpo_real.png")
    p.add_argument("--quiet", action="store_true", help="no line per step")
    return p


def _load() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def run(settings: RunSettings, paths: list[str], progress: bool = True) -> dict:
    """Run ``paths`` in order; returns the record (the JSON's content)."""
    import torch
    import transformers
    import trl

    from ..harness import cpu_pressure, machine_info
    from . import record
    from .bound import hf_generate_distance
    from .task import capital_rows
    from .trl_paths import load_policy, progress_line, run_trl

    bad = [p for p in paths if p not in PATHS]
    if bad:
        raise ValueError(f"--paths: unknown {bad}; choose from {list(PATHS)}")
    on_step = (lambda name, rec: progress_line(name, rec, settings.steps)) if progress else None
    if settings.threads:
        torch.set_num_threads(settings.threads)
    # The bound of this checkpoint, measured on the run's own prompts as the real-checkpoint test measures it.
    policy = load_policy(settings)
    distance = hf_generate_distance(policy, [r["messages"] for r in capital_rows(settings.rows, settings.seed)][:4],
                                    settings.max_new_tokens, settings.temperature, n=4, seed=settings.seed)
    device = policy.device
    del policy
    load_start = _load()
    results: dict[str, dict] = {}
    for name in paths:
        if progress:
            print(f"[{name}] {settings.steps} steps ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        if name == "areal-engine":
            from .areal_path import run_areal

            recs = run_areal(settings, on_step=on_step)
        else:
            recs = run_trl(settings, engine_path=name == "trl-engine", on_step=on_step)
        results[name] = {"wall_s": round(time.perf_counter() - t0, 1), "load_average_end": _load(),
                         "cpu_pressure_end_pct": cpu_pressure(), "steps": record.steps_json(recs),
                         "summary": record.summarize(recs)}
    base = results.get("trl-generate")
    noise = None
    if base is not None:
        from .settings import StepRecord

        noise = record.reward_noise([StepRecord(**r) for r in base["steps"]], settings.group,
                                    settings.prompts_per_step)
    bnd = record.bounds(distance, {k: v["summary"] for k, v in results.items()})
    return {
        "command": "python -m unsloth_rollout.bench.real_rl " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in settings.as_dict().items()) + f" --paths {','.join(paths)}",
        "title": f"GRPO on {settings.model} (LoRA r={settings.lora_r}), capitals task, "
                 f"{settings.prompts_per_step} prompts x {settings.group} samples per step, CPU fp32",
        "task": "name the capital inside <answer></answer> (unsloth_rollout/bench/real_rl/task.py); reward 1.0 for "
                "the exact capital in the first answer tag, else 0.0",
        "settings": settings.as_dict(),
        "what": {"generation_s": "wall time of the trainer's generation call per step (TRL: GRPOTrainer._generate; "
                                 "AReaL: timeperf/rollout)",
                 "train_s": "the rest of the step: rewards, logprob recompute, loss, backward, optimizer",
                 "logprob_diff_max": "max |behaviour logprob - trainer recomputed logprob| over the step's sampled "
                                     "tokens. trl-engine: TRL's sampling/sampling_logp_difference/max; areal-engine: "
                                     "logprobs vs compute_logp (prox_logp); trl-generate (TRL returns none there): "
                                     "log_softmax(logits / T) of HF generate's own logits vs the training forward",
                 "oracle_diff_max": f"max |behaviour logprob - teacher-forced fp32 forward of the sample alone| on "
                                    f"{settings.oracle_samples} samples per step (testing.oracles.teacher_forced)"},
        "logprob_bounds": bnd,
        "logprob_bounds_how": "max(1e-5, 1.5 x HF generate's own distance from the same reference), the rule of "
                              "tests/test_real_checkpoint.py; HF generate's distance from a teacher-forced forward: "
                              f"{distance:.2e} at the start (4 prompts x 4 seeded samples, one at a time) or the worst of trl-generate's "
                              "steps; from the trainer: the worst of trl-generate's steps",
        "reward_noise": noise,
        "reward_noise_how": "2 standard errors of a 5-step mean reward (binomial, trl-generate's last 5 steps)",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__,
                     "areal": _areal_version()},
        "machine": {**machine_info(device), "load_average_start": load_start},
        "paths": results,
        "criteria": record.criteria(results, bnd, noise),
    }


def _areal_version():
    try:
        from importlib.metadata import version

        return version("areal")
    except Exception:  # noqa: BLE001 - not installed
        return None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    kw = {f.name: getattr(args, f.name) for f in dataclasses.fields(RunSettings)}
    settings = RunSettings(**kw)
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    rec = run(settings, paths, progress=not args.quiet)
    if args.out:
        from .record import plot

        out = pathlib.Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "grpo_real.json").write_text(json.dumps(rec, indent=2) + "\n")
        plot(rec, out / "grpo_real.png")
    def fmt(x):
        return "-" if x is None else f"{x:.2e}"

    b = rec["logprob_bounds"]
    for name, r in rec["paths"].items():
        s = r["summary"]
        print(f"{name}: reward {s['first_mean_reward']:.3f} -> {s['last_mean_reward']:.3f} (first / last 5 steps), "
              f"generation {s['generation_s_total']:.0f} s, training {s['train_s_total']:.0f} s, max |dlogp| vs "
              f"trainer {fmt(s['logprob_diff_max'])} (bound {fmt(b['vs_trainer'])}), vs teacher-forced "
              f"{fmt(s['oracle_diff_max'])} (bound {fmt(b['vs_teacher_forced'])})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
