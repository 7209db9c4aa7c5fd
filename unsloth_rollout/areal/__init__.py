"""AReaL backend ``unsloth``: rollouts and training on one shared model, in one process.

- ``UnslothInferenceEngine``: AReaL's ``InferenceEngine`` over the RolloutEngine.
- ``ColocatedTrainEngine`` / ``UnslothPPOActor``: a ``TrainEngine`` over the same PolicyModel
  (LoRA-only optimizer, VLM inputs); ``update_weights`` is a version bump, no bytes move.
- ``install()``: makes AReaL accept ``rollout.backend: "unsloth:d1"`` and makes ``PPOTrainer``
  build both engines on one shared model (``patches/areal-1.0.4-unsloth-backend.patch`` is the same
  change as a source patch); ``"unsloth:dN"`` runs N such processes as data-parallel replicas under
  torchrun / AReaL's SPMD launchers (``distributed.py``, ``launch.py``).
- ``AgentServer`` / ``UnslothAgentWorkflow``: agent workflows (``async def run(data, **extra_kwargs)``
  with the plain ``openai`` SDK) run against the engine's in-process OpenAI-compatible server, each
  episode a recorded session; ``PPOTrainer.train(workflow=agent)`` uses them on this backend.
- ``ArealOpenAI`` on this engine needs neither SGLang nor vLLM: tool calls come from the server's
  parsers, VLM trajectories carry the engine's pixel values (``openai_compat``).

Example::

    import unsloth_rollout.areal as ua
    ua.install()
    from areal import PPOTrainer
    with PPOTrainer(config, train_dataset=ds) as trainer:   # config.rollout.backend == "unsloth:d1"
        trainer.train(workflow="areal.workflow.vision_rlvr.VisionRLVRWorkflow", workflow_kwargs=...)

This package imports areal; ``import unsloth_rollout`` alone does not.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import compat  # noqa: F401 - first: AReaL's private names, and the project's loggers kept across its rebuilds

__all__ = ["AgentServer", "ColocatedTrainEngine", "UnslothAgentWorkflow", "UnslothConfig", "UnslothInferenceEngine",
           "UnslothPPOActor", "UnslothPPOConfig", "install", "is_installed"]

if TYPE_CHECKING:  # pragma: no cover
    from .agent_server import AgentServer, UnslothAgentWorkflow
    from .config import UnslothConfig, UnslothPPOConfig
    from .inference_engine import UnslothInferenceEngine
    from .train_engine import ColocatedTrainEngine, UnslothPPOActor

_LAZY = {
    "AgentServer": ".agent_server",
    "UnslothAgentWorkflow": ".agent_server",
    "UnslothInferenceEngine": ".inference_engine",
    "ColocatedTrainEngine": ".train_engine",
    "UnslothPPOActor": ".train_engine",
    "UnslothConfig": ".config",
    "UnslothPPOConfig": ".config",
}


def install() -> None:
    """Register the ``unsloth`` backend with the installed AReaL (idempotent); see ``backend.install``."""
    from .backend import install as _install

    _install()


def is_installed() -> bool:
    from .backend import is_installed as _is_installed

    return _is_installed()


def __getattr__(name: str):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(mod, __name__), name)
