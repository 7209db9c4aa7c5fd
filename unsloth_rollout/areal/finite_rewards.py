"""Rewards from user code are finite: NaN or +-inf becomes 0.0, with a warning naming where it came from.

One non-finite reward would otherwise reach every advantage of its group (GRPO normalizes over the group) and, for
an agent, every completion of its episode (the turn discount spreads the last reward backwards). Two places take
rewards from user code on the AReaL side: an agent's ``run()`` return value (``agent_server``, before the discount)
and any workflow's trajectories (``FiniteRewardWorkflow``, which wraps every workflow the inference engine resolves:
RLVRWorkflow / VisionRLVRWorkflow reward functions, custom workflows, agent workflows).
"""

from __future__ import annotations

from typing import Any

import torch
from areal.api.workflow_api import RolloutWorkflow
from areal.experimental.openai.types import InteractionWithTokenLogpReward

from ..logs import get_logger
from ..rewards import finite_reward as _finite_reward

logger = get_logger("unsloth_rollout.areal.finite_rewards")


def finite_reward(value: float, where: str) -> float:
    """``value`` as a float, or 0.0 (logged on the project's logger) when it is NaN or infinite."""
    return _finite_reward(value, where, logger)


def finite_trajectory(traj, where: str):
    """A workflow's result with non-finite rewards set to 0.0: a tensor dict's ``rewards``, or each interaction's
    ``reward`` of an ``{id: InteractionWithTokenLogpReward}`` dict; anything else as it is."""
    if not isinstance(traj, dict) or not traj:
        return traj
    if all(isinstance(v, InteractionWithTokenLogpReward) for v in traj.values()):
        for cid, v in traj.items():
            if v.reward is not None:
                v.reward = finite_reward(v.reward, f"{where} (completion {cid})")
        return traj
    rewards = traj.get("rewards")
    if isinstance(rewards, torch.Tensor) and rewards.is_floating_point():
        bad = ~torch.isfinite(rewards)
        if bool(bad.any()):
            logger.warning("unsloth_rollout: %d non-finite reward(s) %s from %s replaced by 0.0", int(bad.sum()),
                           rewards[bad].tolist()[:4], where)
            traj["rewards"] = rewards.masked_fill(bad, 0.0)
    return traj


class FiniteRewardWorkflow(RolloutWorkflow):
    """``workflow`` whose episodes never return a non-finite reward (see the module docstring)."""

    def __init__(self, workflow: RolloutWorkflow):
        self.workflow = workflow

    async def arun_episode(self, engine, data: dict[str, Any]):
        return finite_trajectory(await self.workflow.arun_episode(engine, data), type(self.workflow).__name__)
