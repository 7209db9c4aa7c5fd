"""Model layer: load_model() over Unsloth and transformers + PEFT, PolicyModel, offline tiny models."""

from .families import UnsupportedModelError, supported_families
from .loader import BackendUnavailableError, load_model, lora_config_from, resolve_backend
from .policy import PolicyModel

__all__ = ["BackendUnavailableError", "PolicyModel", "UnsupportedModelError", "supported_families", "load_model", "lora_config_from", "resolve_backend"]
