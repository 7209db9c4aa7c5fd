"""Pictures of recorded figures (the JSON next to them is the record; a picture is a convenience)."""

from __future__ import annotations


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
