"""The shapes agent (examples/shapes_agent: plain ``openai`` SDK, multi-turn, tools, images) trained by AReaL's
PPOTrainer on the unsloth backend, tiny random Qwen2.5-VL, CPU: its episodes train (every step's samples come
from the previous step's weights) and, over a short run, its mean reward rises.

The committed curve (benchmarks/shapes_agent_reward_curve.{json,png}) comes from
``python examples/shapes_agent/train.py --config examples/shapes_agent/tiny_cpu.yaml
--curve benchmarks/shapes_agent_reward_curve``, not from this test (which writes nothing into the tree)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("areal")
pytest.importorskip("fastapi")
pytestmark = pytest.mark.areal

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "shapes_agent" / "tiny_cpu.yaml"


def _run(tmp_path, *overrides):
    """The training run's per-step stats, from a fresh Python process, as a user's training job runs: a trainer
    run earlier in the same process (another AReaL test on this pytest worker) must not share its state."""
    args = ["--config", str(CONFIG), f"cluster.fileroot={tmp_path}/exp",
            f"cluster.name_resolve.nfs_record_root={tmp_path}/nr", *overrides]
    out = tmp_path / "history.json"
    code = ("import json, sys\n"
            f"sys.path.insert(0, {str(ROOT / 'examples' / 'shapes_agent')!r})\n"
            "from train import main\n"
            f"history = main({args!r})\n"
            f"open({str(out)!r}, 'w').write(json.dumps(history))\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=1500,
                          check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(out.read_text())


def test_openai_sdk_agent_trains_under_ppotrainer(tmp_path):
    history = _run(tmp_path, "total_train_steps=2", "train_dataset.batch_size=2", "gconfig.n_samples=4")
    assert len(history) == 2
    assert [int(h["unsloth_rollout/version"]) for h in history] == [1, 2]  # rollouts of version k train at step k
    for h in history:
        assert h["ppo_actor/task_reward/min"] >= 0.0 and h["ppo_actor/task_reward/max"] <= 1.0
        assert h["ppo_actor/update/update_successful"] == 1.0
        assert h["ppo_actor/prompt_len/min"] > 100  # the tools block and the picture reached the model


@pytest.mark.slow
def test_openai_sdk_agent_reward_rises_on_cpu(tmp_path):
    history = _run(tmp_path, "total_train_steps=30")
    rewards = [h["ppo_actor/task_reward/avg"] for h in history]
    assert len(rewards) == 30
    start, end = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert end >= start + 0.1 and end >= 3 * start, f"mean reward {start:.3f} -> {end:.3f}: {rewards}"
