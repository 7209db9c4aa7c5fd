"""Train the shapes agent (``agent.py``, plain ``openai`` SDK) with AReaL's PPOTrainer on the unsloth backend.

The agent runs unchanged: ``PPOTrainer.train(workflow=ShapesAgent(...))``; with ``rollout.backend:
"unsloth:d1"`` the engine serves it on loopback from the model being trained, records every completion
(token ids, logprobs, weight versions, pixel values) and turns each episode into trajectories with the
agent's reward (GRPO over ``gconfig.n_samples`` episodes per scene).

    # tiny random VLM on CPU (a few minutes); writes the mean-reward curve
    python examples/shapes_agent/train.py --config examples/shapes_agent/tiny_cpu.yaml --curve OUT_PREFIX
    # Qwen2.5-VL-3B, 4-bit base, LoRA incl. the vision tower, one GPU
    python examples/shapes_agent/train.py --config examples/shapes_agent/qwen2_5_vl_3b.yaml
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time
from dataclasses import dataclass, field

HERE = pathlib.Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:
    sys.path.insert(0, str(HERE.parent))

from areal.api.cli_args import load_expr_config  # noqa: E402

from shapes_agent.agent import ShapesAgent  # noqa: E402
from shapes_agent.env import dataset  # noqa: E402
from unsloth_rollout.areal.config import UnslothPPOConfig  # noqa: E402
from unsloth_rollout.areal.grpo import record_history  # noqa: E402


@dataclass
class ShapesAgentConfig(UnslothPPOConfig):
    """AReaL's GRPO config (+ ``unsloth:``) plus the agent's and the data's settings."""

    agent_max_turns: int = field(default=3, metadata={"help": "model calls per episode"})
    agent_max_tokens: int = field(default=48, metadata={"help": "tokens per model reply"})
    image_size: int = field(default=112, metadata={"help": "scene side in pixels"})
    train_size: int = field(default=64, metadata={"help": "scenes in the training set"})
    data_seed: int = 0


def main(argv: list[str] | None = None) -> list[dict[str, float]]:
    """Train; returns PPOTrainer's per-step statistics (``ppo_actor/task_reward/avg`` is the mean reward)."""
    from unsloth_rollout.areal import install
    from unsloth_rollout.areal.grpo import _resolve_paths

    config, _ = load_expr_config(list(sys.argv[1:] if argv is None else argv), ShapesAgentConfig)
    install()
    _resolve_paths(config)
    from areal.trainer.rl_trainer import PPOTrainer

    agent = ShapesAgent(max_turns=config.agent_max_turns, max_tokens=config.agent_max_tokens,
                        image_size=config.image_size, temperature=config.gconfig.temperature)
    with PPOTrainer(config, train_dataset=dataset(config.train_size, config.data_seed)) as trainer:
        history = record_history(trainer)
        trainer.train(workflow=agent, workflow_kwargs=None)
    return history


def write_curve(history: list[dict[str, float]], prefix: str, command: str, wall_s: float) -> dict:
    """``<prefix>.json`` (the per-step mean reward) and ``<prefix>.png`` (its plot, when matplotlib is there)."""
    rewards = [h["ppo_actor/task_reward/avg"] for h in history]
    k = max(1, min(5, len(rewards) // 4))
    record = {"command": command, "steps": list(range(1, len(rewards) + 1)), "mean_reward": rewards,
              f"first_{k}_steps_mean": sum(rewards[:k]) / k, f"last_{k}_steps_mean": sum(rewards[-k:]) / k,
              "wall_s": round(wall_s, 1)}
    out = pathlib.Path(prefix)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return record
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    ax.plot(record["steps"], rewards, marker="o", ms=3)
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("mean episode reward")
    ax.set_title("shapes agent (openai SDK) on PPOTrainer + unsloth backend")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"))
    plt.close(fig)
    return record


if __name__ == "__main__":
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--curve", default=None, help="write the reward curve to CURVE.json / CURVE.png")
    args, rest = parser.parse_known_args()
    t0 = time.perf_counter()
    hist = main(rest)
    if args.curve:
        print(json.dumps(write_curve(hist, args.curve, "python " + " ".join(sys.argv), time.perf_counter() - t0)))
