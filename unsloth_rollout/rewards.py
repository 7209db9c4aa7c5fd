"""Rewards from user code are finite before a trainer sees them: one NaN or infinite reward would otherwise reach
every advantage of its group (GRPO normalizes over the group). Shared by the AReaL (``areal/finite_rewards.py``)
and TRL (``trl/rollout.py``) front ends; no optional dependency."""

from __future__ import annotations

import logging
import math

from .logs import get_logger

logger = get_logger("unsloth_rollout")


def finite_reward(value: float, where: str, log: logging.Logger | None = None) -> float:
    """``value`` as a float, or 0.0 (with a warning naming ``where``, on ``log``) when it is NaN or infinite.

    Example::

        finite_reward(float("nan"), "my_reward")  # 0.0, and a warning
    """
    value = float(value)
    if math.isfinite(value):
        return value
    (log or logger).warning("unsloth_rollout: non-finite reward %s from %s replaced by 0.0", value, where)
    return 0.0
