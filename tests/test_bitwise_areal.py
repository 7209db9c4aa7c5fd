"""The bitwise on-policy mode through AReaL's colocated backend (``unsloth:d1``): the train engine's ``compute_logp``
(the proximal logprobs PPO's decoupled loss uses) equals the behaviour logprobs the rollout engine returned, bit for
bit, before and after a PPO update, for a text model and for Qwen2.5-VL with images and vision LoRA.

Oracle: AReaL's own ``PPOActor.compute_logp`` over the ``RLVRWorkflow`` / ``VisionRLVRWorkflow`` trajectories (its
padded batch forward, which ``ColocatedTrainEngine`` runs under the mode); without the mode on the train engine's
side the two differ.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("areal")
pytestmark = pytest.mark.areal

from areal.api import FinetuneSpec, WeightUpdateMeta  # noqa: E402
from areal.api.cli_args import (GenerationHyperparameters, InferenceEngineConfig, NormConfig,  # noqa: E402
                                OptimizerConfig, PPOActorConfig)
from areal.workflow import RLVRWorkflow  # noqa: E402
from areal.workflow.vision_rlvr import VisionRLVRWorkflow  # noqa: E402

from unsloth_rollout import bitwise, load_model  # noqa: E402
from unsloth_rollout.areal import UnslothInferenceEngine, UnslothPPOActor  # noqa: E402
from unsloth_rollout.kernels import batch_invariant  # noqa: E402
from unsloth_rollout.testing.tiny import tiny_model_path  # noqa: E402

try:
    from tests._areal_helpers import vlm_item  # noqa: E402
except ImportError:
    from _areal_helpers import vlm_item  # noqa: E402

if not batch_invariant.available():
    pytest.skip("no C++ compiler for the mode's kernels", allow_module_level=True)


def length_reward(prompt=None, completions=None, prompt_ids=None, completion_ids=None, **kw):
    return float(len(completion_ids or []) % 3) / 2.0


def _setup(arch):
    policy = load_model(str(tiny_model_path(arch)), backend="transformers",
                        lora={"r": 8, "random_state": 0, "finetune_vision_layers": arch != "qwen2"})
    bitwise.enable(policy)
    rollout = UnslothInferenceEngine(InferenceEngineConfig(backend="unsloth:d1", consumer_batch_size=4,
                                                           max_head_offpolicyness=int(1e10)),
                                     policy, kv_cache_memory_bytes=16 << 20, max_model_len=512, seed=0)
    rollout.initialize()
    config = PPOActorConfig(experiment_name="test", trial_name="t", path="", backend="unsloth:d1", dtype="float32",
                            optimizer=OptimizerConfig(lr=2e-2, weight_decay=0.0, warmup_steps_proportion=0.0),
                            ppo_n_minibatches=2, use_decoupled_loss=True, recompute_logprob=True,
                            reward_norm=NormConfig(mean_level="group", std_level="group", group_size=2),
                            adv_norm=None)
    actor = UnslothPPOActor(config, policy)
    actor.initialize(ft_spec=FinetuneSpec(total_train_epochs=1, dataset_size=8, train_batch_size=4))
    actor.connect_engine(rollout, WeightUpdateMeta(type="disk"))
    g = GenerationHyperparameters(max_new_tokens=10, temperature=1.0)
    if policy.is_vlm:
        workflow = VisionRLVRWorkflow(reward_fn=length_reward, gconfig=g, tokenizer=policy.tokenizer,
                                      processor=policy.processor, enable_thinking=False)
        data = [vlm_item(policy, i) for i in range(2)]
    else:
        workflow = RLVRWorkflow(reward_fn=length_reward, gconfig=g, tokenizer=policy.tokenizer, enable_thinking=False)
        data = [{"messages": [{"role": "user", "content": f"Question number {i} is rather {'long ' * i}here"}]}
                for i in range(3)]
    return policy, rollout, actor, workflow, data


def _unequal(batch, logps) -> list[float]:
    out = []
    for traj, lp in zip(batch, logps):
        behave = torch.roll(traj["logprobs"], -1, -1).to(lp.dtype)
        mask = torch.roll(traj["loss_mask"], -1, -1).bool()
        if not torch.equal(lp[mask], behave[mask]):
            out.append((lp - behave)[mask].abs().max().item())
    return out


@pytest.mark.parametrize("arch", ["qwen2", "qwen2_5_vl"])
def test_compute_logp_equals_the_behaviour_logprobs_before_and_after_an_update(arch):
    policy, rollout, actor, workflow, data = _setup(arch)
    try:
        for version in range(2):
            batch = rollout.rollout_batch(data, workflow=workflow, group_size=2)
            assert all(int(t["versions"].max()) == version for t in batch)
            logps = actor.compute_logp(batch)
            assert _unequal(batch, logps) == [], version
            if version == 0:  # the check can fail: the train engine's forward without the mode differs
                bitwise.disable(policy)
                assert _unequal(batch, actor.compute_logp(batch))
                bitwise.enable(policy)
            for traj, lp in zip(batch, logps):
                traj["prox_logp"] = lp
            actor.ppo_update(actor.compute_advantages(batch))
            actor.update_weights(WeightUpdateMeta(type="disk", version=version + 1))
            rollout.set_version(version + 1)
    finally:
        rollout.destroy()
