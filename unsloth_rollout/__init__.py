"""unsloth_rollout: an in-process rollout engine for RL of LoRA (vision-)language models.

It samples from the same model object the optimizer updates (Unsloth or transformers + PEFT,
4-bit or 16-bit), with continuous batching and logprobs that match the trainer's forward.

    from unsloth_rollout import load_model, RolloutEngine, GenerationRequest, SamplingParams

Importing this package imports neither areal, fastapi nor unsloth.
"""

from . import logs as _logs  # noqa: F401 - first: the project's loggers (silent by default) before any module logs
from .engine import (CacheBypassError, EngineConfig, ModelNotServableError, GenerationOutput, GenerationRequest, InvalidRequestError, RequestRejected,
                     RolloutEngine, SamplingParams, StreamDelta, StructuredOutputs)
from .engine import DecodeConfig, LoRAConfig, MultiModalConfig, PrefillConfig
from .models import PolicyModel, UnsupportedModelError, load_model, supported_families

__version__ = "0.1.0"

__all__ = [
    "CacheBypassError", "ModelNotServableError", "UnsupportedModelError", "supported_families", "EngineConfig", "GenerationOutput", "GenerationRequest", "InvalidRequestError", "PolicyModel",
    "RequestRejected", "RolloutEngine", "SamplingParams", "StreamDelta", "StructuredOutputs", "load_model",
    "DecodeConfig", "PrefillConfig", "LoRAConfig", "MultiModalConfig", "__version__",
]
