"""PolicyModel: one model object shared by the rollout engine and the optimizer.

The engine samples from ``policy.model`` in inference mode; the trainer updates the very same
parameters in training mode. ``inference()`` / ``training()`` do what Unsloth's
``for_inference`` / ``for_training`` do, for any backend, and work both as plain calls and as
context managers (leaving the block restores the previous mode)::

    policy = load_model("tiny-dir", lora={"r": 8})
    with policy.inference():
        ...  # engine steps
    # back in the mode the policy had before
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from ..logs import get_logger
from .families import check_supported, is_vlm_config

logger = get_logger("unsloth_rollout")


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model below PEFT wrappers (PeftModel -> LoraModel -> *ForCausalLM)."""
    m = model
    while True:
        if hasattr(m, "get_base_model") and callable(m.get_base_model):
            nxt = m.get_base_model()
        else:
            break
        if nxt is m:
            break
        m = nxt
    return m


@dataclass
class _ModeState:
    training: bool
    gradient_checkpointing: bool


class _ModeSwitch:
    """Applied on construction; as a context manager it restores the previous mode on exit."""

    def __init__(self, policy: "PolicyModel", previous: _ModeState):
        self._policy = policy
        self._previous = previous

    def __enter__(self) -> "PolicyModel":
        return self._policy

    def __exit__(self, *exc) -> None:
        if self._previous.training:
            self._policy.training(gradient_checkpointing=self._previous.gradient_checkpointing)
        else:
            self._policy.inference()


@dataclass(eq=False)
class PolicyModel:
    """A (PEFT-wrapped) causal LM or VLM with its tokenizer and processor.

    Attributes:
        model: the ``torch.nn.Module`` the optimizer updates (a ``PeftModel`` when LoRA is on).
        tokenizer: the text tokenizer (``processor.tokenizer`` for VLMs).
        processor: the multimodal processor, or ``None`` for text models.
        backend: ``"unsloth"`` or ``"transformers"``.
        is_vlm: whether the model takes images.
    """

    model: torch.nn.Module
    tokenizer: Any
    processor: Any = None
    backend: str = "transformers"
    is_vlm: bool = False
    # Gradient checkpointing wanted in training mode; recorded from the model at wrap time.
    gradient_checkpointing: bool = False
    max_seq_length: int | None = None
    name_or_path: str | None = None
    # Serve a model family the engine has not verified (models/families.py); the cache-use guard still applies.
    allow_unverified_family: bool = False
    # True when ``model`` is a PEFT wrapper made only to serve named adapters (models/adapters.py): the policy has
    # no LoRA of its own, so unnamed requests and the trainer's forward run the plain model.
    serving_wrapper: bool = False
    # Adapters loaded to serve by name: request name -> the adapter's name inside PEFT (models/adapters.py).
    served_adapters: dict = field(default_factory=dict)
    # The same adapters: request name -> the folder it was loaded from (models/weights.py keeps both).
    adapter_paths: dict = field(default_factory=dict)
    # The bitwise on-policy mode (unsloth_rollout/bitwise.py: enable / disable): engines built on this policy and the
    # trainer doors run batch-invariant ops, so the engine's logprobs equal the trainer's recompute bit for bit.
    bitwise: bool = False
    lock: threading.RLock = field(default_factory=threading.RLock, repr=False)

    @classmethod
    def wrap(cls, model, tokenizer, processor=None, backend: str | None = None,
             allow_unverified_family: bool = False) -> "PolicyModel":
        """Wrap a model a user already built (with Unsloth or transformers + PEFT).

        Example::

            model, tok = FastLanguageModel.from_pretrained(...)
            policy = PolicyModel.wrap(model, tok)
        """
        if tokenizer is None and processor is not None:
            tokenizer = getattr(processor, "tokenizer", None)
        if tokenizer is None:
            raise ValueError("PolicyModel.wrap: tokenizer is required (or a processor with .tokenizer)")
        if backend is None:
            mod = type(model).__module__ + " " + type(_unwrap(model)).__module__
            backend = "unsloth" if "unsloth" in mod or getattr(model, "_unsloth_policy", False) else "transformers"
        config = _unwrap(model).config
        is_vlm = is_vlm_config(config)
        gc = bool(getattr(_unwrap(model), "is_gradient_checkpointing", False))
        check_supported(config, allow_unverified_family)
        return cls(model=model, tokenizer=tokenizer, processor=processor, backend=backend, is_vlm=is_vlm,
                   gradient_checkpointing=gc, allow_unverified_family=allow_unverified_family)

    # ----------------------------------------------------------------------------- properties
    @property
    def base_model(self) -> torch.nn.Module:
        return _unwrap(self.model)

    @property
    def config(self):
        return self.base_model.config

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        for p in self.model.parameters():
            if p.is_floating_point():
                return p.dtype
        return torch.float32

    @property
    def text_config(self):
        cfg = self.config
        return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg

    @property
    def is_training(self) -> bool:
        return self.model.training

    def _state(self) -> _ModeState:
        return _ModeState(self.model.training, bool(getattr(self.base_model, "is_gradient_checkpointing", False)))

    # ----------------------------------------------------------------------------- mode switch
    def _set_use_cache(self, value: bool) -> None:
        for m in self.model.modules():
            cfg = getattr(m, "config", None)
            if cfg is not None and hasattr(cfg, "use_cache"):
                cfg.use_cache = value
                if hasattr(cfg, "get_text_config"):
                    tc = cfg.get_text_config()
                    if tc is not cfg and hasattr(tc, "use_cache"):
                        tc.use_cache = value

    def clear_rope_deltas(self) -> None:
        """Qwen-VL models cache M-RoPE deltas between calls; a stale value corrupts the next forward."""
        for m in self.model.modules():
            if hasattr(m, "rope_deltas"):
                m.rope_deltas = None

    def _set_padding_side(self, side: str) -> None:
        for tok in (self.tokenizer, getattr(self.processor, "tokenizer", None)):
            if tok is not None:
                tok.padding_side = side

    def inference(self) -> _ModeSwitch:
        """Switch to inference mode: eval(), no gradient checkpointing, use_cache, left padding."""
        with self.lock:
            prev = self._state()
            if prev.training and prev.gradient_checkpointing:  # remember it for the way back
                self.gradient_checkpointing = True
            if self.backend == "unsloth":
                _unsloth_cls(self).for_inference(self.model)
            base = self.base_model
            if getattr(base, "is_gradient_checkpointing", False):
                base.gradient_checkpointing_disable()
            self.model.eval()
            self._set_use_cache(True)
            self._set_padding_side("left")
            self.clear_rope_deltas()
            return _ModeSwitch(self, prev)

    def training(self, gradient_checkpointing: bool | None = None) -> _ModeSwitch:
        """Switch to training mode: train(), gradient checkpointing as recorded, no use_cache, right padding."""
        with self.lock:
            prev = self._state()
            gc = self.gradient_checkpointing if gradient_checkpointing is None else gradient_checkpointing
            if self.backend == "unsloth":
                _unsloth_cls(self).for_training(self.model, use_gradient_checkpointing=gc)
            self.model.train()
            base = self.base_model
            if gc and not getattr(base, "is_gradient_checkpointing", False):
                base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
                if hasattr(self.model, "enable_input_require_grads"):
                    self.model.enable_input_require_grads()
            elif not gc and getattr(base, "is_gradient_checkpointing", False):
                base.gradient_checkpointing_disable()
            self.gradient_checkpointing = gc
            self._set_use_cache(False)
            self._set_padding_side("right")
            self.clear_rope_deltas()
            return _ModeSwitch(self, prev)

    # ----------------------------------------------------------------------------- helpers
    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def num_parameters(self, trainable_only: bool = False) -> int:
        return sum(p.numel() for p in self.model.parameters() if p.requires_grad or not trainable_only)


def _unsloth_cls(policy: PolicyModel):
    import unsloth  # noqa: F401  (only reached on the unsloth backend)

    if policy.is_vlm:
        from unsloth import FastVisionModel

        return FastVisionModel
    from unsloth import FastLanguageModel

    return FastLanguageModel
