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
    p.add_argument("--parallel", action="store_true",
                   help="run the paths side by side, each in its own process (one torch thread each by default)")
    p.add_argument("--part-out", default=None, help=argparse.SUPPRESS)  # one path's result (--parallel's children)
    p.add_argument("--assemble", default=None, metavar="FOLDER",
                   help="make the record from a stopped run's parts folder (marked partial) instead of running")
    p.add_argument("--quiet", action="store_true", help="no line per step")
    return p


def _load() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def run_path(settings: RunSettings, name: str, progress: bool = True, part_out: str | None = None) -> dict:
    """One path's result: its steps, summary, wall time and the load at its end (also written to ``part_out``
    after every step, so an interrupted run leaves its steps so far)."""
    import torch

    from ..harness import cpu_pressure
    from . import record
    from .trl_paths import progress_line, run_trl

    if settings.threads:
        torch.set_num_threads(settings.threads)
    t0 = time.perf_counter()
    done = []

    def result(recs) -> dict:
        return {"wall_s": round(time.perf_counter() - t0, 1), "load_average_end": _load(),
                "cpu_pressure_end_pct": cpu_pressure(), "steps": record.steps_json(recs),
                "summary": record.summarize(recs)}

    def on_step(n, rec):
        done.append(rec)
        if progress:
            progress_line(n, rec, settings.steps)
        if part_out:
            pathlib.Path(part_out).write_text(json.dumps(result(done)) + "\n")

    if progress:
        print(f"[{name}] {settings.steps} steps ...", file=sys.stderr, flush=True)
    if name == "areal-engine":
        from .areal_path import run_areal

        recs = run_areal(settings, on_step=on_step)
    else:
        recs = run_trl(settings, engine_path=name == "trl-engine", on_step=on_step)
    out = result(recs)
    if part_out:
        pathlib.Path(part_out).write_text(json.dumps(out) + "\n")
    return out


def _run_parallel(settings: RunSettings, paths: list[str], progress: bool, folder: pathlib.Path) -> dict[str, dict]:
    """Each path in its own process, side by side (one torch thread each unless --threads says otherwise)."""
    import subprocess

    s = dataclasses.replace(settings, threads=settings.threads or 1)
    args = [f"--{k.replace('_', '-')}={v}" for k, v in s.as_dict().items()]
    procs = {name: subprocess.Popen([sys.executable, "-m", "unsloth_rollout.bench.real_rl", *args, "--paths", name,
                                     "--part-out", str(folder / f"{name}.json"), *([] if progress else ["--quiet"])],
                                    stdout=subprocess.DEVNULL)
             for name in paths}
    failed = [name for name, p in procs.items() if p.wait() != 0]
    if failed:
        raise RuntimeError(f"--parallel: path(s) {failed} failed (their output is above)")
    return {name: json.loads((folder / f"{name}.json").read_text()) for name in paths}


def run(settings: RunSettings, paths: list[str], progress: bool = True, parallel: bool = False) -> dict:
    """Run ``paths`` (in order, or side by side in processes of their own); returns the record (the JSON).

    Each path's steps so far are kept in a parts folder (printed); ``--assemble FOLDER`` makes the record from
    it, marked partial, if the run is stopped."""
    import tempfile

    import torch

    from ..harness import machine_info
    from .bound import hf_generate_distance
    from .task import capital_rows
    from .trl_paths import load_policy

    bad = [p for p in paths if p not in PATHS]
    if bad:
        raise ValueError(f"--paths: unknown {bad}; choose from {list(PATHS)}")
    if settings.threads or parallel:  # one thread beside the paths' processes: oversubscribed OpenMP teams crawl
        torch.set_num_threads(settings.threads or 1)
    # The bound of this checkpoint, measured on the run's own prompts as the real-checkpoint test measures it.
    policy = load_policy(settings)
    distance = hf_generate_distance(policy, [r["messages"] for r in capital_rows(settings.rows, settings.seed)][:4],
                                    settings.max_new_tokens, settings.temperature, n=4, seed=settings.seed)
    folder = pathlib.Path(tempfile.mkdtemp(prefix="unsloth_rollout_real_parts_"))
    meta = {"settings": settings.as_dict(), "paths": paths, "parallel": parallel, "distance": distance,
            "machine": {**machine_info(policy.device), "load_average_start": _load()}}
    del policy
    (folder / "meta.json").write_text(json.dumps(meta) + "\n")
    if progress:
        print(f"parts folder: {folder} (python -m unsloth_rollout.bench.real_rl --assemble {folder} --out DIR "
              "makes a partial record from it if this run is stopped)", file=sys.stderr, flush=True)
    if parallel:
        results = _run_parallel(settings, paths, progress, folder)
    else:
        results = {name: run_path(settings, name, progress, str(folder / f"{name}.json")) for name in paths}
    return assemble(meta, results)


def assemble_folder(folder: str) -> dict:
    """The record from a parts folder (every path's steps so far)."""
    f = pathlib.Path(folder)
    meta = json.loads((f / "meta.json").read_text())
    results = {name: json.loads((f / f"{name}.json").read_text()) for name in meta["paths"]
               if (f / f"{name}.json").exists()}
    return assemble(meta, results)


def assemble(meta: dict, results: dict[str, dict]) -> dict:
    import torch
    import transformers
    import trl

    from . import record

    settings = RunSettings(**meta["settings"])
    paths, parallel, distance = meta["paths"], meta["parallel"], meta["distance"]
    bnd = record.bounds(distance, {k: v["summary"] for k, v in results.items()})
    partial = {k: len(v["steps"]) for k, v in results.items() if len(v["steps"]) < settings.steps}
    partial.update({k: 0 for k in paths if k not in results})
    return {
        "partial": bool(partial),
        "partial_steps_done": partial or None,
        "command": "python -m unsloth_rollout.bench.real_rl " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in settings.as_dict().items()) + f" --paths {','.join(paths)}"
            + (" --parallel" if parallel else ""),
        "parallel": parallel,
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
                 "oracle_diff_max": f"max |behaviour logprob - teacher-forced fp32 forward of the sample alone (the "
                                    f"weights that sampled it)| on {settings.oracle_samples} samples per step "
                                    "(testing.oracles.teacher_forced)",
                 "trainer_drift_max": "max |trainer recomputed logprob - teacher-forced| on the same samples: the "
                                      "trainer's own fp32 distance from the oracle (its batched forward)",
                 "checked_diff_max": "max |behaviour - trainer recomputed| on the checked samples",
                 "hf_forced_diff_max": "max |HF generate's own log_softmax(logits / T) of the same checked tokens "
                                       "(every token forced, one left-padded batch) - teacher-forced|: HF's fp32 "
                                       "noise on exactly the rows and weights the behaviour logprobs came from (trl-generate: "
                                       "its behaviour logprobs, HF generate's own)"},
        "logprob_bounds": bnd,
        "logprob_bounds_how": "vs teacher-forced: max(1e-5, 1.5 x HF generate's own distance from it), the rule of "
                              "tests/test_real_checkpoint.py, HF generate's distance measured in this run "
                              f"({distance:.2e} at the start on the base weights, 4 prompts x 4 seeded samples, one "
                              "prompt at a time; on trl-generate's checked samples at every step; and at every step of "
                              "every path on exactly its checked tokens and weights, every token forced through HF "
                              "generate: hf_forced_diff_max). vs trainer, per "
                              "step: the bound vs teacher-forced plus that step's trainer_drift_max; |behaviour - "
                              "trainer| <= |behaviour - oracle| + |oracle - trainer|, and the second term is the "
                              "trainer's, measured on the same rows with the same weights",
        "noise_how": "reward_gain_noise / difference_noise: 2 standard errors of the difference of two 5-step mean "
                     "rewards (binomial over their 5 x prompts_per_step x group samples)",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__,
                     "areal": _areal_version()},
        "machine": meta["machine"],
        "paths": results,
        "criteria": record.criteria(results, bnd, settings.prompts_per_step * settings.group),
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
    if args.part_out:
        (name,) = paths
        run_path(settings, name, not args.quiet, args.part_out)
        return 0
    if args.assemble:
        rec = assemble_folder(args.assemble)
    else:
        rec = run(settings, paths, progress=not args.quiet, parallel=args.parallel)
    if args.out:
        from .record import plot

        out = pathlib.Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "grpo_real.json").write_text(json.dumps(rec, indent=2) + "\n")
        plot(rec, out / "grpo_real.png")

    from .record import markdown

    print(markdown(rec))
    return 0


if __name__ == "__main__":
    sys.exit(main())
