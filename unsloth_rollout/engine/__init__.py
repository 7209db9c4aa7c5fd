"""The rollout engine: scheduler, runner, sampler and per-sequence state over one PolicyModel."""

from .attention import CacheBypassError, ModelNotServableError, UnsupportedAttentionError
from .config import EngineConfig, InvalidRequestError, SamplingParams
from .constraints import StructuredOutputs
from .engine import EngineStopped, RequestRejected, RolloutEngine
from .request import GenerationOutput, GenerationRequest, StreamDelta

__all__ = [
    "CacheBypassError", "ModelNotServableError", "UnsupportedAttentionError", "EngineConfig", "EngineStopped", "GenerationOutput", "GenerationRequest", "InvalidRequestError",
    "RequestRejected", "RolloutEngine", "SamplingParams", "StreamDelta", "StructuredOutputs",
]
