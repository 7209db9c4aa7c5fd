"""Long run: colocated GRPO (AReaL's PPOTrainer on the unsloth backend, the same entry point and config as
tests/test_areal_grpo_learning.py) on the tiny VLM, with the process's RSS and CPU time taken at every step.
No memory growth: the median RSS over the last quarter within RSS_MARGIN of the median over the first
quarter after warm-up (medians: RSS swings ~50 MiB step to step as the trainer's buffers come and go).
No slowdown: the fastest step's CPU time over the last quarter at most 1.5x the fastest over the first quarter
after warm-up (CPU time, not wall time, and the fastest step: a shared machine's neighbours only add time, while a
per-step cost that grows raises every step; medians and wall times are recorded too). Every step trains
on samples of the step before (version).

Figures go to <figures>/reliability/ (.figures/, or benchmarks/ via scripts/record_figures.sh): grpo_<variant>.json. CI: 20 steps; ``-m slow``: 200 steps.
"""

from __future__ import annotations

import statistics
import time

import pytest

pytest.importorskip("areal")
psutil = pytest.importorskip("psutil")
pytestmark = pytest.mark.areal

from _reliability_helpers import ROOT, MiB, one_thread, write_figures  # noqa: E402

CONFIG = ROOT / "unsloth_rollout" / "areal" / "configs" / "tiny_cpu_grpo.yaml"
RSS_MARGIN_ABS = 64 * MiB
RSS_MARGIN_REL = 0.05
SLOWDOWN = 1.5


@pytest.mark.parametrize("steps", [pytest.param(20, id="ci"), pytest.param(200, marks=pytest.mark.slow, id="full")])
def test_grpo_long_run_no_growth_no_slowdown(tmp_path, monkeypatch, steps, request):
    from areal.utils.stats_logger import StatsLogger

    from unsloth_rollout.areal.grpo import main

    proc = psutil.Process()
    marks: list[tuple[float, float, int]] = []  # (wall, cpu, rss) when each step's stats are committed
    commit = StatsLogger.commit

    def timed_commit(self, epoch, step, global_step, data):
        t = proc.cpu_times()
        marks.append((time.perf_counter(), t.user + t.system, proc.memory_info().rss))
        return commit(self, epoch, step, global_step, data)

    monkeypatch.setattr(StatsLogger, "commit", timed_commit)
    t = proc.cpu_times()
    start = (time.perf_counter(), t.user + t.system, proc.memory_info().rss)
    with one_thread():
        history = main(["--config", str(CONFIG), f"total_train_steps={steps}", f"cluster.fileroot={tmp_path}/exp",
                        f"cluster.name_resolve.nfs_record_root={tmp_path}/nr"])
    assert len(history) == steps and len(marks) == steps
    assert [int(h["unsloth_rollout/version"]) for h in history] == list(range(1, steps + 1))

    points = [start] + marks
    wall = [b[0] - a[0] for a, b in zip(points, points[1:])]
    cpu = [b[1] - a[1] for a, b in zip(points, points[1:])]
    rss = [m[2] for m in marks]
    warmup = max(2, steps // 10)
    q = max(5, (steps - warmup) // 4)  # at least 5 steps per quarter: medians over a swinging RSS
    first, last = cpu[warmup:warmup + q], cpu[-q:]
    ratio = min(last) / min(first)
    baseline, final = statistics.median(rss[warmup:warmup + q]), statistics.median(rss[-q:])
    margin = max(RSS_MARGIN_ABS, RSS_MARGIN_REL * baseline)
    rewards = [h["ppo_actor/task_reward/avg"] for h in history]
    stride = max(1, steps // 20)
    record = {
        "test": f"tests/test_reliability_grpo.py::{request.node.name}", "config": str(CONFIG.relative_to(ROOT)),
        "run": "areal 1.0.4 PPOTrainer, rollout.backend unsloth:d1 (colocated, one process, CPU, torch 1 thread), "
               "tiny random Qwen2.5-VL with vision LoRA, 4 prompts x 8 samples x 8 new tokens per step",
        "steps": steps, "warmup_steps": warmup, "quarter_steps": q,
        "cpu_s_per_step_median_first_quarter": round(statistics.median(first), 4),
        "cpu_s_per_step_median_last_quarter": round(statistics.median(last), 4),
        "cpu_s_per_step_min_first_quarter": round(min(first), 4),
        "cpu_s_per_step_min_last_quarter": round(min(last), 4),
        "cpu_slowdown_ratio": round(ratio, 3), "slowdown_limit": SLOWDOWN,
        "wall_s_per_step_median_first_quarter": round(statistics.median(wall[warmup:warmup + q]), 4),
        "wall_s_per_step_median_last_quarter": round(statistics.median(wall[-q:]), 4),
        "rss_before_run_mib": round(start[2] / MiB, 1), "rss_after_warmup_mib": round(rss[warmup - 1] / MiB, 1),
        "rss_end_mib": round(rss[-1] / MiB, 1),
        "rss_median_first_quarter_mib": round(baseline / MiB, 1), "rss_median_last_quarter_mib": round(final / MiB, 1),
        "rss_growth_mib": round((final - baseline) / MiB, 1),
        "rss_margin_mib": round(margin / MiB, 1), "rss_max_mib": round(max(rss) / MiB, 1),
        "rss_every_k_steps_mib": {"k": stride, "values": [round(v / MiB, 1) for v in rss[stride - 1::stride]]},
        "cpu_s_every_k_steps": {"k": stride, "values": [round(v, 3) for v in cpu[stride - 1::stride]]},
        "mean_reward_first_5": round(sum(rewards[:5]) / 5, 4), "mean_reward_last_5": round(sum(rewards[-5:]) / 5, 4),
        "wall_s": round(marks[-1][0] - start[0], 1),
    }
    write_figures(f"grpo_{request.node.callspec.id}", record)
    assert final - baseline <= margin, f"median RSS grew {(final - baseline) / MiB:.1f} MiB over {steps} steps"
    assert ratio <= SLOWDOWN, f"CPU time per step grew {ratio:.2f}x ({record})"
