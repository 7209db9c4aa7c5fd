"""Pictures of recorded figures (the JSON next to them is the record; a picture is a convenience)."""

from __future__ import annotations

import os
import pathlib


def figures_root() -> pathlib.Path:
    """Where tests write measured figures: $UNSLOTH_ROLLOUT_FIGURES, else the ignored .figures/ folder.
    ``scripts/record_figures.sh`` points it at benchmarks/ to refresh the recorded ones."""
    root = pathlib.Path(__file__).resolve().parents[2]  # the repository (unsloth_rollout/testing/figures.py)
    return pathlib.Path(os.environ.get("UNSLOTH_ROLLOUT_FIGURES") or root / ".figures")


def plot_reward_curve(rewards: list[float], path, title: str) -> None:
    """Mean reward per GRPO step as a PNG; silently skipped without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    ax.plot(range(1, len(rewards) + 1), rewards, marker="o", ms=3)
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("mean reward (batch)")
    ax.set_ylim(0, 1.05)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
