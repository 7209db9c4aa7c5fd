"""TRL's GRPOTrainer through ``rollout_func``: a reward function returning +-inf gets 0.0 for it, with a warning,
so the group's advantages and the logged reward stay finite; None / NaN keep TRL's meaning ("no reward from this
function", dropped in TRL's nansum over functions)."""

from __future__ import annotations

import asyncio
import logging
import math
import os

import pytest

pytest.importorskip("trl")
pytestmark = pytest.mark.trl
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from unsloth_rollout import EngineConfig, RolloutEngine, load_model, rewards  # noqa: E402
from unsloth_rollout.trl import rollout_func  # noqa: E402
from unsloth_rollout.trl.rollout import finite_reward_func  # noqa: E402
from unsloth_rollout.testing.logs import captured  # noqa: E402
from unsloth_rollout.testing.trl_toy import grpo_config, toy_dataset  # noqa: E402


def test_wrapped_reward_functions_replace_only_infinities():
    def sync_fn(completions, **kw):
        return [1.0, float("inf"), None, float("nan"), -float("inf")]

    async def async_fn(completions, **kw):
        return [float("inf"), 2.0]

    with captured(rewards.logger, logging.WARNING) as seen:
        out = finite_reward_func(sync_fn)(completions=[])
        out_async = asyncio.run(finite_reward_func(async_fn)(completions=[]))
    assert out[:3] == [1.0, 0.0, None] and math.isnan(out[3]) and out[4] == 0.0
    assert out_async == [0.0, 2.0]
    assert finite_reward_func(sync_fn).__name__ == "sync_fn"
    assert sum("non-finite reward" in m for m in seen) == 3


def test_grpo_step_with_an_infinite_reward_stays_finite(qwen2_dir, tmp_path):
    from trl import GRPOTrainer

    def inf_reward(completions, **kw):  # the first completion of each call: +inf; the others a real reward
        return [float("inf")] + [float(len(c)) / 10 for c in completions[1:]]

    policy = load_model(qwen2_dir, backend="transformers", lora={"r": 4, "random_state": 0})
    engine = RolloutEngine(policy, EngineConfig(kv_cache_memory_bytes=8 << 20), seed=0)
    try:
        tr = GRPOTrainer(model=policy.model, processing_class=policy.tokenizer, reward_funcs=inf_reward,
                         args=grpo_config(str(tmp_path), 1, num_generations=2, prompts_per_step=2),
                         train_dataset=toy_dataset(2, None), rollout_func=rollout_func(engine))
        with captured(rewards.logger, logging.WARNING) as seen:
            tr.train()
    finally:
        engine.shutdown()
    logged = [h for h in tr.state.log_history if "reward" in h]
    assert logged and all(math.isfinite(h["reward"]) and math.isfinite(h.get("loss", 0.0)) for h in logged), logged
    assert any("non-finite reward inf from inf_reward" in m for m in seen), seen
