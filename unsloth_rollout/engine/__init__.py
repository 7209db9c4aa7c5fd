"""The rollout engine: scheduler, runner, sampler and per-sequence state over one PolicyModel."""

from ..errors import (CacheBypassError, EngineStopped, InvalidRequestError, ModelNotServableError, RequestRejected,
                      UnsupportedAttentionError)
from .config import DecodeConfig, EngineConfig, LoRAConfig, MultiModalConfig, PrefillConfig, SamplingParams
from .constraints import StructuredOutputs
from .engine import RolloutEngine
from .request import GenerationOutput, GenerationRequest, StreamDelta

__all__ = [
    "CacheBypassError", "ModelNotServableError", "UnsupportedAttentionError", "EngineConfig", "EngineStopped", "GenerationOutput", "GenerationRequest", "InvalidRequestError",
    "RequestRejected", "RolloutEngine", "SamplingParams", "StreamDelta", "StructuredOutputs",
    "DecodeConfig", "PrefillConfig", "LoRAConfig", "MultiModalConfig",
]
