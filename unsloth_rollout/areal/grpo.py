"""Colocated GRPO with AReaL's PPOTrainer on the ``unsloth`` backend.

One model per process: the rollout engine samples from the PolicyModel the optimizer trains (LoRA,
vision tower included), and a weight update is a version bump. ``unsloth:dN`` runs N such processes
as data-parallel replicas (see ``distributed.py``).

CLI (AReaL's config system: YAML plus ``key=value`` overrides)::

    python -m unsloth_rollout.areal.grpo --config unsloth_rollout/areal/configs/qwen2_5_vl_3b_geometry3k_grpo.yaml
    python -m unsloth_rollout.areal.grpo --config unsloth_rollout/areal/configs/tiny_cpu_grpo.yaml \\
        actor.path=/path/to/tiny-model total_train_steps=20
    # N replicas (one per GPU, or N CPU processes): torchrun in AReaL's SPMD mode (set here when WORLD_SIZE > 1)
    torchrun --nproc-per-node 2 -m unsloth_rollout.areal.grpo --config ... rollout.backend=unsloth:d2 \\
        actor.backend=unsloth:d2

``train_dataset.path: toy`` builds an offline toy dataset (random images for VLMs); ``module:function`` calls
that builder (``function(tokenizer, processor, **dataset_kwargs)`` -> list of items, e.g.
``unsloth_rollout.bench.real_rl.task:areal_dataset``); any other path is loaded as geometry3k-style data
(``problem`` with ``<image>``, ``images``, ``answer``). A model path ``tiny:<arch>`` (e.g. ``tiny:qwen2_5_vl``)
names an offline tiny random model, ``real:<name>`` (e.g. ``real:smollm2-135m-instruct``) a real checkpoint of
``unsloth_rollout.testing.real``.
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # started as a file (AReaL's launchers run <script>.py)
    import os as _os
    import sys as _sys

    _here = _os.path.dirname(_os.path.abspath(__file__))  # its siblings must not shadow top-level modules
    _sys.path[:] = [p for p in _sys.path if _os.path.abspath(p or _os.curdir) != _here]

import os
import sys
from dataclasses import dataclass, field
from typing import Any

from areal.api.cli_args import load_expr_config

from unsloth_rollout.areal.config import UnslothPPOConfig
from unsloth_rollout.areal.data import geometry3k_rl_dataset, toy_dataset

VISION_WORKFLOW = "areal.workflow.vision_rlvr.VisionRLVRWorkflow"
TEXT_WORKFLOW = "areal.workflow.rlvr.RLVRWorkflow"


@dataclass
class UnslothGRPOConfig(UnslothPPOConfig):
    """The PPO config plus what this script needs: the reward and the workflow."""

    reward_fn: str = field(default="unsloth_rollout.areal.rewards.geometry3k_reward",
                           metadata={"help": "import path of a module-level reward function"})
    workflow: str | None = field(default=None, metadata={
        "help": "RolloutWorkflow import path; default VisionRLVRWorkflow for VLMs, RLVRWorkflow otherwise"})
    enable_thinking: bool = False


def resolve_model_path(path: str) -> str:
    """``tiny:<arch>[:<size>]`` -> the cached offline tiny model folder (see ``unsloth_rollout.testing.tiny``);
    ``real:<name>`` -> the converted real checkpoint (see ``unsloth_rollout.testing.real``)."""
    if isinstance(path, str) and path.startswith("tiny:"):
        from unsloth_rollout.testing.tiny import tiny_model_path

        arch, _, size = path[len("tiny:"):].partition(":")
        return str(tiny_model_path(arch, size or "tiny"))
    if isinstance(path, str) and path.startswith("real:"):
        from unsloth_rollout.testing.real import real_checkpoint_path

        return str(real_checkpoint_path(path[len("real:"):]))
    return path


def _resolve_paths(config) -> None:
    config.actor.path = resolve_model_path(config.actor.path)
    config.tokenizer_path = resolve_model_path(config.tokenizer_path)
    if config.ref is not None:
        config.ref.path = resolve_model_path(config.ref.path)
    config.rollout.tokenizer_path = resolve_model_path(config.rollout.tokenizer_path)


def _tokenizer_and_processor(path: str):
    from transformers import AutoTokenizer

    from unsloth_rollout.models.processor import load_processor

    processor = load_processor(path)
    tokenizer = processor.tokenizer if processor is not None else AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer, processor


def build_dataset(dataset_config, split: str, tokenizer, processor) -> list[dict[str, Any]]:
    """``path: toy`` -> the offline toy set (``dataset_kwargs``: n, image_size, seed); ``module:function`` -> that
    builder's items; else geometry3k-style."""
    kwargs = dict(getattr(dataset_config, "dataset_kwargs", None) or {})
    if dataset_config.path == "toy":
        return toy_dataset(tokenizer, processor, **kwargs)
    module, sep, name = str(dataset_config.path).partition(":")
    if sep and module and name and "/" not in module and not os.path.exists(dataset_config.path):
        import importlib

        return list(getattr(importlib.import_module(module), name)(tokenizer, processor, **kwargs))
    if processor is None:
        raise ValueError(f"train_dataset.path: {dataset_config.path!r} is geometry3k-style image data; "
                         "it needs a vision-language model")
    return geometry3k_rl_dataset(dataset_config.path, split, processor, max_length=dataset_config.max_length,
                                 **kwargs)


def record_history(trainer) -> list[dict[str, float]]:
    """The stats of every step ``trainer`` commits, collected into the returned list as they are logged."""
    history: list[dict[str, float]] = []
    commit = trainer.stats_logger.commit

    def record(epoch, step, global_step, data):
        for d in (data if isinstance(data, list) else [data]):
            history.append({"global_step": global_step, **d})
        return commit(epoch, step, global_step, data)

    trainer.stats_logger.commit = record
    return history


def main(argv: list[str] | None = None, setup=None) -> list[dict[str, float]]:
    """Train; returns the per-step statistics PPOTrainer logged (rewards, losses, timings; with dN
    averaged over the replicas, the same on every rank). ``setup(trainer, history)``, when given, runs
    before training (instrumentation: ``unsloth_rollout.bench.real_rl`` records its logprob check there)."""
    from unsloth_rollout.areal import install

    if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        os.environ.setdefault("AREAL_SPMD_MODE", "1")  # N replicas = AReaL's SPMD mode (as its launchers set)

    config, _ = load_expr_config(list(sys.argv[1:] if argv is None else argv), UnslothGRPOConfig)
    install()
    _resolve_paths(config)
    from areal.trainer.rl_trainer import PPOTrainer

    tokenizer, processor = _tokenizer_and_processor(config.tokenizer_path)
    train_ds = build_dataset(config.train_dataset, "train", tokenizer, processor)
    valid_ds = (build_dataset(config.valid_dataset, "test", tokenizer, processor)
                if config.valid_dataset is not None else None)
    workflow = config.workflow or (VISION_WORKFLOW if processor is not None else TEXT_WORKFLOW)
    workflow_kwargs: dict[str, Any] = dict(reward_fn=config.reward_fn, gconfig=config.gconfig, tokenizer=tokenizer,
                                           enable_thinking=config.enable_thinking)
    if workflow == VISION_WORKFLOW:
        workflow_kwargs["processor"] = processor
    eval_kwargs = {**workflow_kwargs, "gconfig": config.eval_gconfig}

    with PPOTrainer(config, train_dataset=train_ds, valid_dataset=valid_ds) as trainer:
        history = record_history(trainer)
        if setup is not None:
            setup(trainer, history)
        trainer.train(workflow=workflow, workflow_kwargs=workflow_kwargs,
                      eval_workflow=workflow if valid_ds is not None else None, eval_workflow_kwargs=eval_kwargs)
    return history


if __name__ == "__main__":
    main()
