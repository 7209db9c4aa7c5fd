"""The rollout engine: scheduler, runner, sampler and per-sequence state over one PolicyModel."""

from .config import EngineConfig, InvalidRequestError, SamplingParams
from .engine import EngineStopped, RequestRejected, RolloutEngine
from .request import GenerationOutput, GenerationRequest, StreamDelta

__all__ = [
    "EngineConfig", "EngineStopped", "GenerationOutput", "GenerationRequest", "InvalidRequestError",
    "RequestRejected", "RolloutEngine", "SamplingParams", "StreamDelta",
]
