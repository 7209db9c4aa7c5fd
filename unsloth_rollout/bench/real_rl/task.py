"""The verifiable task of the real-weights GRPO run: name a country's capital inside ``<answer></answer>``.

Generated offline (a fixed table, no download). Each prompt is a chat with one worked example (France ->
``<answer>Paris</answer>``) and then the question; the reward is 1.0 when the completion's first
``<answer>...</answer>`` holds exactly the capital (surrounding whitespace ignored, case kept), else 0.0.

Why this task: SmolLM2-135M-Instruct (the checkpoint ``unsloth_rollout.testing.real`` ships) copies the
answer format from the example almost always, but often answers with the country instead of its capital
(``<answer>Germany</answer>``) or with the example's city: a base-model mean reward of about 0.3 at
temperature 1, so GRPO groups mix right and wrong answers from the first step. Single-digit addition, the
other candidate probed, starts at ~0.1 with a worked example and 0.0 without (this 135M model's arithmetic
is weak), and the tag format alone, with no example, is never followed: no signal.

Example::

    >>> capital_reward("<answer> Berlin</answer><|im_end|>", "Berlin")
    1.0
    >>> capital_reward("<answer>Germany</answer>", "Berlin")
    0.0
"""

from __future__ import annotations

import random
import re
from typing import Any

# (country, capital): one-word capitals this checkpoint names at least now and then (probed at temperature 1 with
# this prompt: 0-7 right of 8 per country), so that most GRPO groups mix right and wrong answers.
CAPITALS: tuple[tuple[str, str], ...] = (
    ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Japan", "Tokyo"), ("China", "Beijing"),
    ("Russia", "Moscow"), ("Austria", "Vienna"), ("Sweden", "Stockholm"), ("Denmark", "Copenhagen"),
    ("Hungary", "Budapest"), ("Belgium", "Brussels"), ("Thailand", "Bangkok"), ("Netherlands", "Amsterdam"),
    ("Ukraine", "Kyiv"), ("Egypt", "Cairo"), ("Portugal", "Lisbon"),
)
EXAMPLE = ("France", "Paris")
SYSTEM = "Answer inside <answer></answer> tags."
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)


def question(country: str) -> str:
    return f"What is the capital of {country}?"


def capital_messages(country: str) -> list[dict[str, str]]:
    """The chat prompt: the format as the system message, one worked example, then the question."""
    ex_country, ex_capital = EXAMPLE
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": question(ex_country)},
            {"role": "assistant", "content": f"<answer>{ex_capital}</answer>"},
            {"role": "user", "content": question(country)}]


def capital_rows(n: int | None = None, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` (default all) rows ``{"messages", "answer"}`` in a seeded order; the same list feeds every trainer."""
    pairs = list(CAPITALS)
    random.Random(seed).shuffle(pairs)
    if n is not None:
        if not 1 <= n <= len(pairs):
            raise ValueError(f"n must be in 1..{len(pairs)}, got {n}")
        pairs = pairs[:n]
    return [{"messages": capital_messages(c), "answer": a} for c, a in pairs]


def capital_reward_text(text: str, answer: str) -> float:
    m = _ANSWER.search(text or "")
    return float(m is not None and m.group(1).strip() == answer)


def capital_reward(completions=None, answer=None, *args, **kwargs) -> float:
    """1.0 when the first ``<answer>...</answer>`` of ``completions`` (a string) is exactly ``answer``."""
    return capital_reward_text(completions, answer) if answer is not None else 0.0


def areal_capital_reward(prompt=None, completions=None, prompt_ids=None, completion_ids=None, answer=None,
                         **data) -> float:
    """AReaL's reward signature (RLVRWorkflow: ``reward(prompt, completions, prompt_ids, completion_ids, **row)``)."""
    return capital_reward(completions, answer)


def trl_capital_reward(completions, answer, **kwargs) -> list[float]:
    """TRL's reward signature: one float per completion (chat completions are ``[{"role", "content"}]``)."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [capital_reward_text(t, a) for t, a in zip(texts, answer)]


def trl_dataset(rows: list[dict[str, Any]]):
    """The rows as a ``datasets.Dataset`` with TRL's ``prompt`` column (chat messages) and ``answer``."""
    from datasets import Dataset

    return Dataset.from_dict({"prompt": [r["messages"] for r in rows], "answer": [r["answer"] for r in rows]})


def areal_dataset(tokenizer=None, processor=None, n: int | None = None, seed: int = 0) -> list[dict[str, Any]]:
    """AReaL's dataset builder signature (``train_dataset.path: unsloth_rollout.bench.real_rl.task:areal_dataset``)."""
    return capital_rows(n, seed)
