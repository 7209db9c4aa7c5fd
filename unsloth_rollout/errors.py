"""The package's named errors, below every layer: models/ raises them without importing engine/.

Each is re-exported where it was first defined (``unsloth_rollout.engine``, ``engine.config``, ``engine.attention``,
``models.adapters``), so ``from unsloth_rollout.engine import InvalidRequestError`` keeps working.
"""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request or parameter is invalid; ``field`` names the offending field."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


class RequestRejected(InvalidRequestError):
    """The engine cannot run this request (too long for max_model_len or the KV budget)."""


class AdapterNotFoundError(InvalidRequestError):
    """No adapter at ``lora_path`` (the server answers 404, as vLLM does)."""


class EngineStopped(RuntimeError):
    """The engine was shut down: it takes no more requests."""


class ModelNotServableError(RuntimeError):
    """The engine cannot run this model exactly; it stops serving it rather than return wrong tokens."""


class CacheBypassError(ModelNotServableError):
    """The model's attention did not read and write the engine's KV cache: its output would be wrong."""


class BitwiseModeError(ModelNotServableError):
    """The bitwise on-policy mode cannot make this computation batch-invariant (an op, a device, a dtype or a decode
    setting it does not cover): refused by name rather than run with logprobs that would differ from the trainer's."""


class UnsupportedAttentionError(ModelNotServableError):
    """The model's attention computes something the engine cannot reproduce exactly."""
