"""Your task: the prompts and the reward. Edit this file; both trainers read it.

- ``rows(tokenizer, processor, **kwargs)``: the dataset, a list of ``{"messages": [chat], **your columns}``
  (AReaL's ``train_dataset.path: my_task:rows``; the TRL script turns it into a ``datasets.Dataset``).
- ``reward(text, row) -> float``: your exact check of one completion (the decoded text) against its row.

As shipped: SmolLM2-135M-Instruct names capitals inside <answer></answer> (unsloth_rollout/bench/real_rl/task.py).
"""

from __future__ import annotations

from unsloth_rollout.bench.real_rl.task import capital_reward_text, capital_rows


def rows(tokenizer=None, processor=None, n: int | None = None, seed: int = 0) -> list[dict]:
    return capital_rows(n, seed)  # [{"messages": [...], "answer": "Berlin"}, ...]


def reward(text: str, row: dict) -> float:
    return capital_reward_text(text, row["answer"])


# ---------------------------------------------------------------- the two trainers' signatures (no need to edit)
def trl_reward(completions, **columns) -> list[float]:
    """TRL: one float per completion; dataset columns arrive as lists."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    keys = [k for k, v in columns.items() if k not in ("prompts", "completion_ids") and isinstance(v, list)
            and len(v) == len(texts)]
    return [reward(t, {k: columns[k][i] for k in keys}) for i, t in enumerate(texts)]


def areal_reward(prompt, completions, prompt_ids, completion_ids, **row) -> float:
    """AReaL (RLVRWorkflow): one completion, the row's columns as keyword arguments."""
    return reward(completions, row)
