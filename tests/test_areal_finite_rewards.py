"""A non-finite reward from user code (an agent's run(), a workflow's reward function) becomes 0.0 with a warning,
before AReaL's turn discount and group normalization could spread it: exported rewards are finite, and so are the
group-normalized advantages AReaL's PPO actor computes from them (AReaL's own ``Normalization``)."""

from __future__ import annotations

import logging
import math

import pytest
import torch

pytest.importorskip("areal")
pytest.importorskip("fastapi")
pytestmark = pytest.mark.areal

from areal.api.cli_args import GenerationHyperparameters, InferenceEngineConfig, NormConfig  # noqa: E402
from areal.utils.data import Normalization  # noqa: E402
from areal.workflow import RLVRWorkflow  # noqa: E402

from unsloth_rollout import EngineConfig, RolloutEngine, load_model  # noqa: E402
from unsloth_rollout.areal import finite_rewards  # noqa: E402
from unsloth_rollout.areal.agent_server import UnslothAgentWorkflow  # noqa: E402
from unsloth_rollout.areal.inference_engine import UnslothInferenceEngine  # noqa: E402
from unsloth_rollout.testing.logs import captured  # noqa: E402


def nan_reward_fn(*args, **kwargs):  # module level: AReaL runs reward functions in a process pool
    return float("nan")


def inf_reward_fn(*args, **kwargs):
    return float("-inf")


def one_reward_fn(*args, **kwargs):
    return 1.0


class _Agent:
    """Two chat completions, then ``reward`` (a float, or a builder of {completion id: reward})."""

    def __init__(self, reward):
        self.reward = reward

    async def run(self, data, **kw):
        from openai import AsyncOpenAI

        client = AsyncOpenAI(base_url=kw["base_url"], api_key=kw["api_key"], http_client=kw.get("http_client"))
        ids = []
        for turn in range(2):
            r = await client.chat.completions.create(model="any", max_tokens=3, temperature=0,
                                                     messages=[{"role": "user", "content": f"turn {turn}"}])
            ids.append(r.id)
        return self.reward(ids) if callable(self.reward) else self.reward


@pytest.fixture(scope="module")
def engine(qwen2_dir):
    policy = load_model(qwen2_dir, backend="transformers")
    rollout = RolloutEngine(policy, EngineConfig(kv_cache_memory_bytes=16 << 20, max_model_len=512), seed=0)
    e = UnslothInferenceEngine(InferenceEngineConfig(backend="unsloth:d1", consumer_batch_size=2,
                                                     max_head_offpolicyness=int(1e10)), rollout_engine=rollout)
    e.initialize()
    yield e
    e.destroy()
    rollout.shutdown()


def _advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    norm = Normalization(NormConfig(mean_level="group", std_level="group", group_size=group_size))
    return norm(rewards.float())


@pytest.mark.parametrize("reward", [float("nan"), float("inf"), lambda ids: {ids[0]: 1.0, ids[1]: float("nan")}],
                         ids=["nan", "inf", "dict-nan"])
def test_an_agent_returning_a_non_finite_reward_exports_zero(engine, reward):
    good = UnslothAgentWorkflow(_Agent(1.0), lambda: engine.agent_server, discount=0.9)
    bad = UnslothAgentWorkflow(_Agent(reward), lambda: engine.agent_server, discount=0.9)
    with captured(finite_rewards.logger, logging.WARNING) as seen:
        [t_bad] = engine.rollout_batch([{"i": 0}], workflow=bad)
    [t_good] = engine.rollout_batch([{"i": 1}], workflow=good)
    rewards = t_bad["rewards"]
    assert rewards.shape[0] == 2 and torch.isfinite(rewards).all()
    # The discount spreads the last reward backwards: 0 (replaced) everywhere, or the dict's 1.0 on turn 0 alone.
    assert rewards.tolist() == ([1.0, 0.0] if callable(reward) else [0.0, 0.0])
    assert any("non-finite reward" in m for m in seen), seen
    adv = _advantages(torch.cat([rewards, t_good["rewards"]]), group_size=4)
    assert torch.isfinite(adv).all()


@pytest.mark.parametrize("fn", [nan_reward_fn, inf_reward_fn])
def test_a_workflow_reward_fn_returning_a_non_finite_reward_exports_zero(engine, fn):
    tok = engine.rollout_engine.tokenizer
    gconfig = GenerationHyperparameters(max_new_tokens=4, greedy=False)
    data = {"messages": [{"role": "user", "content": "Hi"}]}
    with captured(finite_rewards.logger, logging.WARNING) as seen:
        [t] = engine.rollout_batch([data], workflow=RLVRWorkflow(reward_fn=fn, gconfig=gconfig, tokenizer=tok,
                                                                  enable_thinking=False), group_size=2)
    assert t["rewards"].tolist() == [0.0, 0.0]
    assert any("non-finite reward" in m for m in seen), seen
    [ok] = engine.rollout_batch([data], workflow=RLVRWorkflow(reward_fn=one_reward_fn, gconfig=gconfig,
                                                               tokenizer=tok, enable_thinking=False), group_size=2)
    assert ok["rewards"].tolist() == [1.0, 1.0]
    adv = _advantages(torch.cat([t["rewards"], ok["rewards"]]), group_size=2)
    assert torch.isfinite(adv).all() and not math.isnan(float(adv.sum()))
