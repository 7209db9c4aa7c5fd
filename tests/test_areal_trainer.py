"""The drop-in backend: ``install()`` makes AReaL's own PPOTrainer accept ``rollout.backend: "unsloth:d1"`` and
build the colocated engines on one shared model; ``patches/areal-1.0.4-unsloth-backend.patch`` does the same in
AReaL's source (applied to a copy of the installed package and exercised in a subprocess)."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("areal")
pytestmark = pytest.mark.areal

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG = ROOT / "unsloth_rollout" / "areal" / "configs" / "tiny_cpu_grpo.yaml"
PATCH = ROOT / "patches" / "areal-1.0.4-unsloth-backend.patch"


def _config(tmp_path, *overrides):
    from areal.api.cli_args import load_expr_config

    from unsloth_rollout.areal.grpo import UnslothGRPOConfig, _resolve_paths

    config, _ = load_expr_config(["--config", str(CONFIG), f"cluster.fileroot={tmp_path}/exp",
                                  f"cluster.name_resolve.nfs_record_root={tmp_path}/nr", *overrides],
                                 UnslothGRPOConfig)
    _resolve_paths(config)
    return config


def _datasets_and_workflow(config, n=8):
    from unsloth_rollout.areal.data import toy_dataset
    from unsloth_rollout.models.processor import load_processor

    processor = load_processor(config.tokenizer_path)
    kwargs = dict(reward_fn=config.reward_fn, gconfig=config.gconfig, tokenizer=processor.tokenizer,
                  processor=processor, enable_thinking=False)
    return toy_dataset(processor.tokenizer, processor, n=n), kwargs


def test_install_ppotrainer_builds_colocated_engines_on_one_model(tmp_path):
    import torch
    from areal.api.cli_args import ValidDatasetConfig
    from areal.trainer.rl_trainer import PPOTrainer

    import unsloth_rollout.areal as ua
    from unsloth_rollout.areal import UnslothInferenceEngine, UnslothPPOActor

    ua.install()
    ua.install()  # idempotent
    assert ua.is_installed()
    config = _config(tmp_path, "total_train_steps=2", "gconfig.n_samples=2", "evaluator.freq_steps=1")
    config.valid_dataset = ValidDatasetConfig(path="toy", batch_size=2, dataset_kwargs={"n": 2})
    train_ds, wkw = _datasets_and_workflow(config)
    valid_ds, _ = _datasets_and_workflow(config, n=2)
    with PPOTrainer(config, train_dataset=train_ds, valid_dataset=valid_ds) as trainer:
        assert trainer.scheduler is None
        assert isinstance(trainer.actor, UnslothPPOActor) and isinstance(trainer.rollout, UnslothInferenceEngine)
        assert trainer.rollout.policy is trainer.actor.policy  # one model
        assert trainer.eval_rollout.rollout_engine is trainer.rollout.rollout_engine  # one KV cache
        assert trainer.actor._colocated
        params = dict(trainer.actor.policy.model.named_parameters())
        ptrs = {n: p.data_ptr() for n, p in params.items()}
        lora = {n: p.detach().clone() for n, p in params.items() if p.requires_grad}
        trainer.train(workflow="areal.workflow.vision_rlvr.VisionRLVRWorkflow", workflow_kwargs=wkw,
                      eval_workflow="areal.workflow.vision_rlvr.VisionRLVRWorkflow", eval_workflow_kwargs=wkw)
        assert trainer.rollout.get_version() == trainer.actor.get_version() == 2
        assert trainer.rollout.rollout_engine.version == 2
        assert trainer.eval_rollout.get_version() == 2
        assert trainer.eval_rollout.staleness_manager.get_stats().accepted == 2 * 2  # eval ran after each step
        assert all(p.data_ptr() == ptrs[n] for n, p in trainer.actor.policy.model.named_parameters())
        assert any(not torch.equal(lora[n], params[n]) for n in lora)


def test_bad_backend_strings_get_areal_errors(tmp_path, monkeypatch):
    from areal.api import alloc_mode
    from areal.trainer.rl_trainer import PPOTrainer

    import unsloth_rollout.areal as ua

    ua.install()
    config = _config(tmp_path)
    config.scheduler.type = "local"  # AReaL builds its scheduler before it parses the backends
    config.rollout.backend = "bogus:d1"
    with pytest.raises(ValueError, match="Parsing error"):  # AReaL's own parser error
        PPOTrainer(config, train_dataset=[{}] * 8)
    config = _config(tmp_path, "actor.backend=megatron:d1")
    with pytest.raises(ValueError, match="actor.backend"):
        PPOTrainer(config, train_dataset=[{}] * 8)
    # AReaL without the backend registered refuses "unsloth:d1" with its own error.
    original = alloc_mode.ALLOCATION_GRAMMAR.replace('| "unsloth"', "")
    monkeypatch.setattr(alloc_mode, "ALLOCATION_GRAMMAR", original)
    with pytest.raises(ValueError, match="Parsing error"):
        alloc_mode.ModelAllocation.from_str("unsloth:d1", name="rollout")
    monkeypatch.undo()
    assert alloc_mode.ModelAllocation.from_str("unsloth:d1", name="rollout").backend == "unsloth"


_PATCHED_RUN = textwrap.dedent("""
    import sys
    import areal
    assert areal.__file__.startswith(sys.argv[1]), areal.__file__
    from areal.api.alloc_mode import ModelAllocation, ALLOCATION_GRAMMAR
    from areal.trainer.rl_trainer import PPOTrainer, UNSLOTH_BACKEND_PATCHED
    assert ModelAllocation.from_str("unsloth:d1", name="rollout").backend == "unsloth"  # no install()
    from areal.api.alloc_mode import _AllocationMode
    assert _AllocationMode.from_str("unsloth:d2").train.world_size == 2  # the SPMD launchers start 2 replicas
    sys.path.insert(0, sys.argv[3])
    from test_areal_trainer import _config, _datasets_and_workflow
    from unsloth_rollout.areal import UnslothInferenceEngine, UnslothPPOActor
    import pathlib
    config = _config(pathlib.Path(sys.argv[2]), "total_train_steps=2", "gconfig.n_samples=2")
    ds, wkw = _datasets_and_workflow(config)
    with PPOTrainer(config, train_dataset=ds) as trainer:
        assert isinstance(trainer.actor, UnslothPPOActor) and isinstance(trainer.rollout, UnslothInferenceEngine)
        assert trainer.rollout.policy is trainer.actor.policy and trainer.scheduler is None
        trainer.train(workflow="areal.workflow.vision_rlvr.VisionRLVRWorkflow", workflow_kwargs=wkw)
        assert trainer.rollout.get_version() == 2
        trainer._ensure_proxy_started()  # agent workflows: no proxy workers (the engine serves them)
        assert trainer._proxy_started
    config.rollout.backend = "bogus:d1"
    config.scheduler.type = "local"
    try:
        PPOTrainer(config, train_dataset=ds)
    except ValueError as e:
        assert "Parsing error" in str(e)
    else:
        raise AssertionError("a bad backend string was accepted")
    # ArealOpenAI's pieces, patched in the source (no install()): tool calls without sglang/vllm ...
    from areal.experimental.openai import tool_call_parser, types
    assert tool_call_parser.UNSLOTH_TOOL_PARSERS and types.UNSLOTH_MULTI_MODAL
    assert not getattr(tool_call_parser.process_tool_calls, "_unsloth_wrapped", False)
    calls, text, finish = tool_call_parser.process_tool_calls(
        '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>',
        [{"type": "function", "function": {"name": "f"}}], "qwen", "qwen3", "stop")
    assert [(c.function.name, c.function.arguments) for c in calls] == [("f", '{"a": 1}')] and finish == "tool_calls"
    # ... and VLM trajectories that carry the engine's pixel values.
    import torch
    from unsloth_rollout.areal.openai_compat import UnslothModelResponse
    pix, grid = torch.rand(16, 12), torch.tensor([[1, 4, 4]])
    inter = types.InteractionWithTokenLogpReward(model_response=UnslothModelResponse(
        input_tokens=[1, 2], output_tokens=[3], output_logprobs=[-0.5], output_versions=[0],
        multi_modal_input={"pixel_values": pix, "image_grid_thw": grid}))
    assert inter.to_tensor_dict()["multi_modal_input"][0]["pixel_values"] is pix
    print("PATCHED-OK")
""")


def test_source_patch_applies_to_areal_1_0_4_and_runs(tmp_path):
    import areal

    if shutil.which("patch") is None or shutil.which("git") is None:
        pytest.skip("needs the patch and git commands")

    src = pathlib.Path(areal.__file__).parent
    tree = tmp_path / "site"
    shutil.copytree(src, tree / "areal", ignore=shutil.ignore_patterns("__pycache__"))
    check = subprocess.run(["git", "apply", "--check", "-p1", str(PATCH)], cwd=tree, capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    applied = subprocess.run(["patch", "-p1", "-i", str(PATCH)], cwd=tree, capture_output=True, text=True)
    assert applied.returncode == 0, applied.stdout + applied.stderr
    assert '"unsloth"' in (tree / "areal" / "api" / "alloc_mode.py").read_text()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), str(ROOT)]), HF_HUB_OFFLINE="1")
    run = subprocess.run([sys.executable, "-c", _PATCHED_RUN, str(tree), str(tmp_path), str(ROOT / "tests")],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert "PATCHED-OK" in run.stdout, run.stdout[-3000:] + run.stderr[-5000:]


def test_example_qwen2_5_vl_3b_config_parses(tmp_path):
    from areal.api.alloc_mode import ModelAllocation
    from areal.api.cli_args import load_expr_config

    import unsloth_rollout.areal as ua
    from unsloth_rollout.areal.grpo import UnslothGRPOConfig

    ua.install()
    path = ROOT / "unsloth_rollout" / "areal" / "configs" / "qwen2_5_vl_3b_geometry3k_grpo.yaml"
    config, _ = load_expr_config(["--config", str(path), f"cluster.fileroot={tmp_path}",
                                  f"cluster.name_resolve.nfs_record_root={tmp_path}/nr"], UnslothGRPOConfig)
    assert config.unsloth.load_in_4bit and config.unsloth.finetune_vision_layers and config.actor.use_lora
    assert ModelAllocation.from_str(config.rollout.backend).backend == "unsloth"
    assert ModelAllocation.from_str(config.actor.backend).backend == "unsloth"
    assert config.unsloth.load_options()["lora"]["finetune_vision_layers"] is True
