"""ColocatedTrainEngine / UnslothPPOActor with AReaL's PPOActor: logprob parity with the rollout engine,
LoRA-only optimization (vision LoRA included), and zero-transfer weight updates on one shared model."""

from __future__ import annotations

import dataclasses
import gc
import os

import pytest
import torch

pytest.importorskip("areal")
pytestmark = pytest.mark.areal

from areal.api import FinetuneSpec, SaveLoadMeta, WeightUpdateMeta  # noqa: E402
from areal.api.cli_args import (GenerationHyperparameters, InferenceEngineConfig, NormConfig,  # noqa: E402
                                OptimizerConfig, PPOActorConfig)
from areal.workflow import RLVRWorkflow  # noqa: E402
from areal.workflow.vision_rlvr import VisionRLVRWorkflow  # noqa: E402

from unsloth_rollout import load_model  # noqa: E402
from unsloth_rollout.testing.oracles import perturb_lora  # noqa: E402
from unsloth_rollout.areal import ColocatedTrainEngine, UnslothInferenceEngine, UnslothPPOActor  # noqa: E402
from unsloth_rollout.testing.tiny import tiny_model_path  # noqa: E402

try:
    from tests._areal_helpers import teacher_forced_logprobs, vlm_item  # noqa: E402
except ImportError:
    from _areal_helpers import teacher_forced_logprobs, vlm_item  # noqa: E402


def length_reward(prompt=None, completions=None, prompt_ids=None, completion_ids=None, **kw):
    return float(len(completion_ids or []) % 3) / 2.0


def _actor_config(**kw) -> PPOActorConfig:
    base = dict(experiment_name="test", trial_name="t", path="", backend="unsloth:d1", dtype="float32",
                optimizer=OptimizerConfig(lr=2e-2, weight_decay=0.0, warmup_steps_proportion=0.0),
                ppo_n_minibatches=2, use_decoupled_loss=True, recompute_logprob=True,
                reward_norm=NormConfig(mean_level="group", std_level="group", group_size=2), adv_norm=None)
    base.update(kw)
    return PPOActorConfig(**base)


def _setup(arch: str, **actor_kw):
    policy = load_model(str(tiny_model_path(arch)), backend="transformers", lora={"r": 8, "random_state": 0})
    rollout = UnslothInferenceEngine(InferenceEngineConfig(backend="unsloth:d1", consumer_batch_size=4,
                                                           max_head_offpolicyness=int(1e10)),
                                     policy, kv_cache_memory_bytes=16 << 20, max_model_len=512, seed=0)
    rollout.initialize()
    actor = UnslothPPOActor(_actor_config(**actor_kw), policy)
    actor.initialize(ft_spec=FinetuneSpec(total_train_epochs=1, dataset_size=8, train_batch_size=4))
    actor.connect_engine(rollout, WeightUpdateMeta(type="disk"))
    return policy, rollout, actor


def _workflow(policy, max_new_tokens=10):
    g = GenerationHyperparameters(max_new_tokens=max_new_tokens, temperature=1.0)
    if policy.is_vlm:
        return VisionRLVRWorkflow(reward_fn=length_reward, gconfig=g, tokenizer=policy.tokenizer,
                                  processor=policy.processor, enable_thinking=False)
    return RLVRWorkflow(reward_fn=length_reward, gconfig=g, tokenizer=policy.tokenizer, enable_thinking=False)


def _data(policy, n=2):
    if policy.is_vlm:
        return [vlm_item(policy, i) for i in range(n)]
    return [{"messages": [{"role": "user", "content": f"Question number {i} is rather {'long ' * i}here"}]}
            for i in range(n)]


def _logprob_gaps(batch, logps) -> torch.Tensor:
    """|trainer recompute - behaviour logprob| of every generated token."""
    gaps = []
    for traj, lp in zip(batch, logps):
        behave = torch.roll(traj["logprobs"], -1, -1)
        mask = torch.roll(traj["loss_mask"], -1, -1).bool()
        assert lp.shape == traj["input_ids"].shape
        gaps.append((lp - behave)[mask].abs().float())
    return torch.cat(gaps)


def _max_logprob_gap(batch, logps) -> float:
    return _logprob_gaps(batch, logps).max().item()


@pytest.fixture(scope="module")
def vlm():
    policy, rollout, actor = _setup("qwen2_5_vl")
    yield policy, rollout, actor
    rollout.destroy()


@pytest.mark.parametrize("arch", ["qwen2"])
def test_logprob_parity_text(arch):
    policy, rollout, actor = _setup(arch)
    try:
        batch = rollout.rollout_batch(_data(policy, 3), workflow=_workflow(policy), group_size=2)
        assert _max_logprob_gap(batch, actor.compute_logp(batch)) < 1e-5
    finally:
        rollout.destroy()


def test_logprob_parity_vlm_and_ppo_update_zero_transfer(vlm):
    policy, rollout, actor = vlm
    batch = rollout.rollout_batch(_data(policy), workflow=_workflow(policy), group_size=2)
    logps = actor.compute_logp(batch)
    assert _max_logprob_gap(batch, logps) < 1e-5  # fp32: trainer recomputation == behaviour logprobs
    for traj, lp in zip(batch, logps):
        traj["prox_logp"] = lp

    # LoRA only in the optimizer, the vision tower's included.
    opt_params = {id(p) for g in actor.optimizer.param_groups for p in g["params"]}
    named = dict(policy.model.named_parameters())
    assert opt_params == {id(p) for p in named.values() if p.requires_grad}
    assert all("lora_" in n for n, p in named.items() if id(p) in opt_params)
    assert any("visual" in n for n, p in named.items() if id(p) in opt_params)

    assert rollout.update_weights_from_disk(WeightUpdateMeta(type="disk")).done()  # colocated: nothing to load
    ptrs = {n: p.data_ptr() for n, p in named.items()}
    before = {n: p.detach().clone() for n, p in named.items()}
    numel_before = _live_tensor_numel()

    actor.ppo_update(actor.compute_advantages(batch))
    actor.step_lr_scheduler()
    assert rollout.rollout_engine.is_paused, "generation is held from the first optimizer step to update_weights"
    actor.update_weights(WeightUpdateMeta(type="disk", version=1))
    actor.set_version(1)
    rollout.set_version(1)
    assert not rollout.rollout_engine.is_paused
    assert rollout.rollout_engine.stats()["prefix_cache_entries"] == 0  # KV of the old weights dropped

    changed = [n for n, p in named.items() if not torch.equal(before[n], p.detach())]
    assert changed and all("lora_" in n for n in changed)
    assert any("visual" in n for n in changed)
    assert all(ptrs[n] == p.data_ptr() for n, p in policy.model.named_parameters()), "no parameter was replaced"
    model_numel = sum(p.numel() for p in named.values())
    grown = _live_tensor_numel() - numel_before
    assert grown < model_numel // 2, f"live tensors grew by {grown} elements (model: {model_numel})"

    # The next rollout samples from the updated weights, vision LoRA included.
    batch2 = rollout.rollout_batch(_data(policy), workflow=_workflow(policy), group_size=2)
    assert all(int(t["versions"].max()) == 1 for t in batch2)
    traj = batch2[0]
    row = traj["input_ids"][0][traj["attention_mask"][0]].tolist()
    n_prompt = int((traj["loss_mask"][0] == 0).sum())
    out = row[n_prompt:]
    mm = traj["multi_modal_input"][0]
    behave = traj["logprobs"][0][n_prompt:len(row)]
    now = teacher_forced_logprobs(policy, row[:n_prompt], out, 1.0, mm["pixel_values"], mm["image_grid_thw"])
    assert torch.allclose(behave, now, atol=1e-5, rtol=0)
    vision_lora = [n for n in changed if "visual" in n]
    with torch.no_grad():
        current = {n: named[n].detach().clone() for n in vision_lora}
        for n in vision_lora:
            named[n].copy_(before[n])
        old_vision = teacher_forced_logprobs(policy, row[:n_prompt], out, 1.0, mm["pixel_values"],
                                             mm["image_grid_thw"])
        for n in vision_lora:
            named[n].copy_(current[n])
    assert (behave - old_vision).abs().max() > 1e-4, "the rollout used the updated vision LoRA"


def _live_tensor_numel() -> int:
    gc.collect()
    seen, total = set(), 0
    for obj in gc.get_objects():
        try:
            if torch.is_tensor(obj) and obj.device.type == "cpu":
                key = (obj.untyped_storage().data_ptr(), obj.untyped_storage().nbytes())
                if key not in seen:
                    seen.add(key)
                    total += obj.untyped_storage().nbytes() // max(obj.element_size(), 1)
        except Exception:  # noqa: BLE001 - exotic tensor subclasses
            continue
    return total


def test_gradient_checkpointing_and_modes(vlm):
    policy, rollout, actor = vlm
    actor.config.gradient_checkpointing = True
    try:
        actor.train()
        assert policy.model.training and policy.base_model.is_gradient_checkpointing
        batch = rollout.rollout_batch(_data(policy, 1), workflow=_workflow(policy, 4), group_size=2)
        for traj, lp in zip(batch, actor.compute_logp(batch)):
            traj["prox_logp"] = lp
        assert not policy.model.training  # compute_logp runs in inference mode
        actor.ppo_update(actor.compute_advantages(batch))
        assert policy.base_model.is_gradient_checkpointing
        actor.update_weights(WeightUpdateMeta(type="disk", version=rollout.get_version()))
        assert not policy.model.training and not policy.base_model.is_gradient_checkpointing
    finally:
        actor.config.gradient_checkpointing = False


def test_save_load_in_place_and_reference_engine(tmp_path, vlm):
    policy, rollout, actor = vlm
    named = dict(policy.model.named_parameters())
    lora = [n for n in named if "lora_B" in n]
    saved = {n: named[n].detach().clone() for n in lora}
    ptrs = {n: named[n].data_ptr() for n in lora}
    actor.save(SaveLoadMeta(path=str(tmp_path / "ckpt"), weight_format="hf", with_optim=True))
    assert os.path.isfile(tmp_path / "ckpt" / "adapter_model.safetensors")
    with torch.no_grad():
        for n in lora:
            named[n].add_(1.0)
    actor.load(SaveLoadMeta(path=str(tmp_path / "ckpt"), weight_format="hf", with_optim=True))
    assert all(torch.equal(named[n], saved[n]) and named[n].data_ptr() == ptrs[n] for n in lora)

    ref = UnslothPPOActor(_actor_config(optimizer=None), reference=True, share_with=actor)
    ref.initialize()
    assert ref.policy is policy
    batch = rollout.rollout_batch(_data(policy, 1), workflow=_workflow(policy, 4))
    ref_lp = ref.compute_logp(batch)[0]
    traj = batch[0]
    row = traj["input_ids"][0].tolist()
    n_prompt = int((traj["loss_mask"][0] == 0).sum())
    mm = traj["multi_modal_input"][0]
    with policy.model.disable_adapter():
        base = teacher_forced_logprobs(policy, row[:n_prompt], row[n_prompt:], 1.0, mm["pixel_values"],
                                       mm["image_grid_thw"])
    assert torch.allclose(ref_lp[0, n_prompt - 1:len(row) - 1], base, atol=1e-5, rtol=0)
    with pytest.raises(RuntimeError, match="no optimizer"):
        ref.train_batch(batch, loss_fn=None, loss_weight_fn=None)


def test_train_engine_without_rollout_and_optimizer_errors():
    policy = load_model(str(tiny_model_path("qwen2")), backend="transformers")  # no LoRA: full fine-tuning
    eng = ColocatedTrainEngine(_actor_config(), policy)
    eng.initialize()
    assert sum(len(g["params"]) for g in eng.optimizer.param_groups) == len(list(policy.model.parameters()))
    for p in policy.model.parameters():
        p.requires_grad_(False)
    with pytest.raises(ValueError, match="use_lora"):
        ColocatedTrainEngine(_actor_config(), policy).initialize()
    eng = ColocatedTrainEngine(_actor_config(optimizer=None), policy)
    eng.initialize()
    with pytest.raises(RuntimeError, match="connect_engine"):
        eng.update_weights(WeightUpdateMeta(type="disk"))


def test_process_memory_does_not_grow_by_a_model_copy():
    """A ~30M-parameter VLM: a weight update (ppo_update, update_weights, set_version, next rollout) must
    not grow the process by anything near a copy of the model."""
    psutil = pytest.importorskip("psutil")
    policy = load_model(str(tiny_model_path("qwen2_5_vl", "small")), backend="transformers",
                        lora={"r": 8, "random_state": 0})
    rollout = UnslothInferenceEngine(InferenceEngineConfig(backend="unsloth:d1", consumer_batch_size=2,
                                                           max_head_offpolicyness=int(1e10)),
                                     policy, kv_cache_memory_bytes=32 << 20, max_model_len=512, seed=0)
    rollout.initialize()
    actor = UnslothPPOActor(_actor_config(ppo_n_minibatches=1), policy)
    actor.initialize()
    actor.connect_engine(rollout, WeightUpdateMeta(type="disk"))
    model_bytes = sum(p.numel() * p.element_size() for p in policy.model.parameters())
    proc = psutil.Process()

    def cycle(version):
        batch = rollout.rollout_batch(_data(policy, 1), workflow=_workflow(policy, 6), group_size=2)
        for traj, lp in zip(batch, actor.compute_logp(batch)):
            traj["prox_logp"] = lp
        actor.ppo_update(actor.compute_advantages(batch))
        actor.update_weights(WeightUpdateMeta(type="disk", version=version))
        actor.set_version(version)
        rollout.set_version(version)

    try:
        cycle(1)  # warm-up: optimizer state, allocator pools
        gc.collect()
        rss = proc.memory_info().rss
        ptrs = [p.data_ptr() for p in policy.model.parameters()]
        for v in (2, 3):
            cycle(v)
        gc.collect()
        grown = proc.memory_info().rss - rss
        assert ptrs == [p.data_ptr() for p in policy.model.parameters()]
        assert grown < model_bytes // 2, (f"RSS grew by {grown / 2**20:.1f} MiB; "
                                          f"the model is {model_bytes / 2**20:.1f} MiB")
    finally:
        rollout.destroy()


# bf16 keeps 8 bits of mantissa: the engine's kernels and the trainer's plain forward round differently (the bounds
# tests/test_gpu.py holds bf16 to, and why).
BF16_TOL, BF16_MEAN_TOL = 0.1, 0.02


def test_colocated_path_under_areals_default_precision():
    """AReaL's TrainEngineConfig computes in bf16 by default (``dtype="bfloat16"``): the actor loads the model in
    bf16 (LoRA weights stay float32, as PEFT keeps them) and the colocated engine samples from that same model, with
    no autocast anywhere. Behaviour logprobs equal the trainer's recompute within bf16 rounding, a PPO step's weights
    reach the next rollout, and a model with another adapter is far outside that tolerance."""
    default = {f.name: f.default for f in dataclasses.fields(PPOActorConfig)}["dtype"]
    assert default == "bfloat16"
    actor = UnslothPPOActor(_actor_config(dtype=default, path=str(tiny_model_path("qwen2")), use_lora=True,
                                          lora_rank=8, lora_alpha=16), load_options={"backend": "transformers"})
    actor.initialize(ft_spec=FinetuneSpec(total_train_epochs=1, dataset_size=8, train_batch_size=4))
    policy = actor.policy
    assert policy.dtype == torch.bfloat16
    rollout = UnslothInferenceEngine(InferenceEngineConfig(backend="unsloth:d1", consumer_batch_size=4,
                                                           max_head_offpolicyness=int(1e10)),
                                     policy, kv_cache_memory_bytes=16 << 20, max_model_len=512, seed=0)
    rollout.initialize()
    actor.connect_engine(rollout, WeightUpdateMeta(type="disk"))
    try:
        batch = rollout.rollout_batch(_data(policy, 3), workflow=_workflow(policy), group_size=2)
        logps = actor.compute_logp(batch)
        gaps = _logprob_gaps(batch, logps)
        assert gaps.max() <= BF16_TOL and gaps.mean() <= BF16_MEAN_TOL, (gaps.max(), gaps.mean())
        for traj, lp in zip(batch, logps):
            traj["prox_logp"] = lp
        actor.ppo_update(actor.compute_advantages(batch))
        actor.step_lr_scheduler()
        actor.update_weights(WeightUpdateMeta(type="disk", version=1))
        actor.set_version(1)
        rollout.set_version(1)
        batch2 = rollout.rollout_batch(_data(policy, 3), workflow=_workflow(policy), group_size=2)
        assert all(int(t["versions"].max()) == 1 for t in batch2)
        gaps = _logprob_gaps(batch2, actor.compute_logp(batch2))
        assert gaps.max() <= BF16_TOL and gaps.mean() <= BF16_MEAN_TOL, (gaps.max(), gaps.mean())
        perturb_lora(policy.model, std=0.2, seed=1)
        assert _logprob_gaps(batch2, actor.compute_logp(batch2)).mean() > 5 * BF16_MEAN_TOL
    finally:
        rollout.destroy()
