"""End-to-end GRPO with AReaL's PPOTrainer on the unsloth backend: a tiny random Qwen2.5-VL (vision LoRA)
learns a toy reward on CPU. Saves the reward curve to <figures>/areal_grpo_reward_curve.{json,png}
(.figures/ by default; scripts/record_figures.sh writes benchmarks/).

The curve has a knee: flat near 0.1 for a while, then up to ~0.9 within ten steps. Where the knee falls moves with
the seed and with the machine (fp32 sums in another order sample other tokens): measured at steps ~12-28 over
seeds and two machines, 45 steps leave the plateau room on every one. A run that does not learn stays near its
start whatever the step count."""

from __future__ import annotations

import json
import pathlib
import time

import pytest
from unsloth_rollout.testing.figures import figures_root

from unsloth_rollout.testing.figures import plot_reward_curve

pytest.importorskip("areal")
pytestmark = pytest.mark.areal

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG = ROOT / "unsloth_rollout" / "areal" / "configs" / "tiny_cpu_grpo.yaml"
OUT = figures_root() / "areal_grpo_reward_curve"
STEPS = 45


def test_grpo_learns_toy_reward_on_cpu(tmp_path):
    from unsloth_rollout.areal.grpo import main
    from unsloth_rollout.testing.toy import TOY_TARGET_IDS

    t0 = time.perf_counter()
    history = main(["--config", str(CONFIG), f"total_train_steps={STEPS}", f"cluster.fileroot={tmp_path}/exp",
                    f"cluster.name_resolve.nfs_record_root={tmp_path}/nr"])
    wall = time.perf_counter() - t0
    rewards = [h["ppo_actor/task_reward/avg"] for h in history]
    assert len(rewards) == STEPS
    # Every step used the weights of the step before it: version k samples are trained at step k.
    assert [int(h["unsloth_rollout/version"]) for h in history] == list(range(1, STEPS + 1))

    start = sum(rewards[:3]) / 3
    end = sum(rewards[-5:]) / 5
    OUT.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "test": "tests/test_areal_grpo_learning.py", "config": str(CONFIG.relative_to(ROOT)),
        "model": "tiny random Qwen2.5-VL (unsloth_rollout.testing.tiny), LoRA r=8 incl. vision tower",
        "reward": f"fraction of completion tokens in a fixed set of {len(TOY_TARGET_IDS)} token ids (max 1.0)",
        "trainer": "areal 1.0.4 PPOTrainer, rollout.backend unsloth:d1 (colocated, one process, CPU)",
        "steps": list(range(1, STEPS + 1)), "mean_reward": rewards, "start_mean_reward": start,
        "end_mean_reward": end, "wall_s": round(wall, 1),
    }
    OUT.with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n")
    plot_reward_curve(rewards, OUT.with_suffix(".png"), "AReaL PPOTrainer + unsloth backend, tiny VLM on CPU")
    assert end >= 3 * start or end >= 0.8, f"reward {start:.3f} -> {end:.3f}: {rewards}"
