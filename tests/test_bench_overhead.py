"""`python -m unsloth_rollout.bench --workload overhead` on a tiny config: its JSON record, its table, and that
no engine thread outlives generate() / agenerate() (the mechanism; the ratios themselves are timing, recorded
but not asserted here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _bench(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "unsloth_rollout.bench", "--workload", "overhead", *args,
                           "--no-progress"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
                          check=False)


def test_overhead_workload(tmp_path):
    out = tmp_path / "overhead.json"
    proc = _bench("--layers", "2", "--batch", "3", "--steps", "3", "--train-batch", "2", "--train-tokens", "8",
                  "--repeats", "3", "--json", str(out), "--markdown", str(tmp_path / "overhead.md"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["layers"] == 2 and report["lora_rank"] == 8 and report["rounds"] == 3
    assert "--workload overhead" in report["command"] and "--layers 2" in report["command"]
    for k, v in report["per_round_ms"].items():  # no engine: before it is built and after shutdown; others per round
        assert len(v) == (2 if k == "train_no_engine_ms" else 3) and all(x > 0 for x in v), (k, v)
    med = report["medians_ms"]
    ratios = report["ratios"]
    assert ratios["decode_generate_vs_main"] == med["generate_step_ms"] / med["main_step_ms"]
    assert ratios["train_after_generate_vs_no_engine"] == med["train_after_generate_ms"] / med["train_no_engine_ms"]
    assert set(ratios) == {"decode_generate_vs_main", "decode_worker_vs_main", "train_after_generate_vs_no_engine",
                           "train_after_agenerate_vs_no_engine", "control_train_beside_idle_thread_vs_no_engine"}
    assert report["engine_threads_after_generate"] == [0, 0, 0]  # generate() stepped on the calling thread
    assert report["engine_threads_after_agenerate"] == [0, 0, 0]  # the worker exited once idle
    assert report["engine_workers_started"] == 3  # one per agenerate burst, none for generate()
    md = (tmp_path / "overhead.md").read_text()
    assert (f"| decode step, generate() (steps on the calling thread) | {med['generate_step_ms']:.1f} | "
            f"{ratios['decode_generate_vs_main']:.2f} |") in md, md
    assert (f"| trainer step, engine alive after agenerate() | {med['train_after_agenerate_ms']:.1f} | "
            f"{ratios['train_after_agenerate_vs_no_engine']:.2f} |") in md, md


def test_overhead_workload_rejects_bad_arguments(capsys):
    from unsloth_rollout.bench.__main__ import main

    for args, field in ((["--layers", "0"], "--layers"), (["--steps", "1"], "--steps"),
                        (["--model", "tiny-vlm"], "text model")):
        assert main(["--workload", "overhead", *args, "--no-progress"]) == 2, args
        assert field in capsys.readouterr().err, args
