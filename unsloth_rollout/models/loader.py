"""load_model(): one entry point over Unsloth and transformers + PEFT.

``backend="unsloth"`` goes through ``FastVisionModel`` / ``FastLanguageModel`` and their
``get_peft_model``; ``"transformers"`` through the Auto classes and PEFT (bitsandbytes 4-bit where
it runs); ``"auto"`` takes Unsloth where it is importable and the engine can serve what it loads
(its CPU backend loads text models only; on CUDA its text fast path is refused by the engine, see
UNSLOTH_FAST_PATH_TYPES) and logs one line saying which and why.
"""

from __future__ import annotations

import importlib.util
import os
import re
from typing import Any

import torch

from ..logs import get_logger
from .families import check_supported, is_vlm_config
from .policy import PolicyModel
from .processor import load_processor

logger = get_logger("unsloth_rollout")

BACKENDS = ("auto", "unsloth", "transformers")

# model_types FastLanguageModel loads through its patched text fast path (unsloth/models/loader.py, checked
# against unsloth 2026.10.9): on CUDA its inference forward reads past_key_values as a legacy tuple and keeps
# KV buffers of its own, so RolloutEngine refuses it (CacheBypassError). Other text types go through
# Unsloth's FastModel path, which runs transformers' attention through the engine's cache.
UNSLOTH_FAST_PATH_TYPES = frozenset({"llama", "mistral", "gemma", "gemma2", "qwen2", "qwen3"})

# Unsloth's get_peft_model vocabulary: which projection names count as attention or MLP.
_ATTN_NAMES = {"q_proj", "k_proj", "v_proj", "o_proj", "qkv", "proj", "out_proj", "qkv_proj"}
_MLP_NAMES = {"gate_proj", "up_proj", "down_proj", "gate_up_proj", "fc1", "fc2", "linear_fc1", "linear_fc2", "w1", "w2",
              "w3"}
_VISION_MARKERS = ("visual", "vision_tower", "vision_model", "image_encoder")
_LORA_KEYS = {
    "r", "lora_alpha", "lora_dropout", "target_modules", "finetune_vision_layers", "finetune_language_layers",
    "finetune_attention_modules", "finetune_mlp_modules", "bias", "random_state", "use_rslora",
    "modules_to_save", "init_lora_weights", "use_gradient_checkpointing",
}


class BackendUnavailableError(RuntimeError):
    """The requested backend cannot serve this model here; the message says why."""


def _unsloth_importable() -> bool:
    return importlib.util.find_spec("unsloth") is not None


def _cuda() -> bool:
    return torch.cuda.is_available()


def resolve_backend(backend: str, is_vlm: bool, model_type: str | None = None) -> tuple[str, str]:
    """Return (backend, reason)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(map(repr, BACKENDS))}; got {backend!r}")
    if backend == "transformers":
        return "transformers", "requested"
    if not _unsloth_importable():
        if backend == "unsloth":
            raise BackendUnavailableError(
                "backend='unsloth': the unsloth package is not installed (pip install 'unsloth_rollout[unsloth]')")
        return "transformers", "unsloth is not installed"
    if is_vlm and not _cuda():
        if backend == "unsloth":
            raise BackendUnavailableError(
                "backend='unsloth': Unsloth's CPU backend loads only text models, and this is a vision-language "
                "model with no GPU present; use backend='transformers' (or 'auto')")
        return "transformers", "Unsloth's CPU backend does not load vision-language models"
    if backend == "auto" and not is_vlm and model_type in UNSLOTH_FAST_PATH_TYPES and _cuda():
        return "transformers", (f"Unsloth's text fast path for {model_type} on CUDA keeps its own KV cache, which "
                                "the rollout engine cannot serve exactly (backend='unsloth' loads it anyway, for "
                                "training without the engine)")
    return "unsloth", "requested" if backend == "unsloth" else "unsloth is installed and supports this model here"


def _default_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    if dtype is not None:
        return dtype
    if _cuda():
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def _lora_target_names(model: torch.nn.Module, opts: dict) -> list[str]:
    """Full names of the Linear layers Unsloth's finetune_* flags select."""
    vision = opts.get("finetune_vision_layers", True)
    language = opts.get("finetune_language_layers", True)
    attention = opts.get("finetune_attention_modules", True)
    mlp = opts.get("finetune_mlp_modules", True)
    names = []
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        leaf = name.rsplit(".", 1)[-1]
        parts = name.split(".")
        in_vision = any(m in parts for m in _VISION_MARKERS)
        if "lm_head" in parts or "merger" in parts:
            continue
        if in_vision and not vision or not in_vision and not language:
            continue
        is_attn = leaf in _ATTN_NAMES and any(p in ("attn", "self_attn", "attention") for p in parts)
        is_mlp = leaf in _MLP_NAMES and any(p in ("mlp", "feed_forward", "ffn") for p in parts)
        if is_attn and attention or is_mlp and mlp:
            names.append(name)
    if not names:
        raise ValueError("lora: the finetune_* flags select no Linear layer of this model")
    return names


def lora_config_from(model: torch.nn.Module, lora: Any):
    """Build a PEFT LoraConfig from Unsloth-style keyword names (or pass a LoraConfig through)."""
    from peft import LoraConfig

    if isinstance(lora, LoraConfig):
        return lora
    if not isinstance(lora, dict):
        raise TypeError(f"lora must be a dict of get_peft_model options or a peft.LoraConfig; got {type(lora).__name__}")
    unknown = set(lora) - _LORA_KEYS
    if unknown:
        raise ValueError(f"lora: unknown option(s) {sorted(unknown)}; known: {sorted(_LORA_KEYS)}")
    r = int(lora.get("r", 16))
    if r <= 0:
        raise ValueError(f"lora.r must be > 0; got {r}")
    targets = lora.get("target_modules")
    if targets is None:
        targets = _lora_target_names(model, lora)
    return LoraConfig(
        r=r,
        lora_alpha=lora.get("lora_alpha", r),
        lora_dropout=lora.get("lora_dropout", 0.0),
        target_modules=targets,
        bias=lora.get("bias", "none"),
        use_rslora=lora.get("use_rslora", False),
        modules_to_save=lora.get("modules_to_save"),
        init_lora_weights=lora.get("init_lora_weights", True),
        task_type="CAUSAL_LM",
    )


def _check_path(path: str) -> None:
    if os.path.isdir(path):
        return
    offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")
    looks_like_repo = re.fullmatch(r"[\w.-]+/[\w.-]+", path) is not None and not os.path.exists(path)
    if offline or not looks_like_repo:
        raise FileNotFoundError(
            f"model path {path!r} is not a local model folder"
            + (" (HF_HUB_OFFLINE=1, so hub names cannot be resolved)" if offline else "")
            + "; build a tiny one with: python -m unsloth_rollout.testing.tiny --out DIR")


def load_model(
    path_or_model,
    *,
    backend: str = "auto",
    dtype=None,
    load_in_4bit: bool = False,
    max_seq_length: int | None = None,
    lora: Any = None,
    tokenizer=None,
    processor=None,
    gradient_checkpointing: bool = False,
    device: str | torch.device | None = None,
    attn_implementation: str = "sdpa",
    allow_unverified_family: bool = False,
) -> PolicyModel:
    """Load a policy for rollout and training.

    Example::

        policy = load_model("qwen-tiny", lora={"r": 8, "finetune_vision_layers": True})
        print(policy.backend, policy.is_vlm)

    Args:
        path_or_model: a local model folder (or hub name when online), an ``nn.Module`` (wrapped with
            ``tokenizer`` / ``processor``), or a ``PolicyModel`` (returned as is).
        backend: "auto" | "unsloth" | "transformers".
        dtype: torch dtype (or its name); default fp32 on CPU, bf16 on GPUs that have it.
        load_in_4bit: bitsandbytes NF4 weights (LoRA stays in ``dtype``).
        max_seq_length: Unsloth's max_seq_length (also the engine's default max_model_len).
        lora: Unsloth ``get_peft_model`` options (r, lora_alpha, lora_dropout, target_modules,
            finetune_vision_layers, finetune_language_layers, finetune_attention_modules,
            finetune_mlp_modules) or a ``peft.LoraConfig``. Vision-tower LoRA is on by default for VLMs.
        attn_implementation: the model's attention ("sdpa" or "eager"); the engine reproduces its arithmetic.
        allow_unverified_family: load a family the engine has not verified (see ``models/families.py``)
            instead of raising ``UnsupportedModelError``.
    """
    if isinstance(path_or_model, PolicyModel):
        return path_or_model
    if isinstance(path_or_model, torch.nn.Module):
        policy = PolicyModel.wrap(path_or_model, tokenizer, processor,
                                  allow_unverified_family=allow_unverified_family)
        if lora is not None:
            policy.model = _apply_peft(policy.model, lora)
        return policy
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(map(repr, BACKENDS))}; got {backend!r}")
    path = os.fspath(path_or_model)
    _check_path(path)

    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    check_supported(config, allow_unverified_family)
    is_vlm = is_vlm_config(config)
    chosen, reason = resolve_backend(backend, is_vlm, getattr(config, "model_type", None))
    logger.info("unsloth_rollout: backend=%s (%s)", chosen, reason)
    dtype = _default_dtype(dtype)
    if chosen == "unsloth":
        policy = _load_unsloth(path, is_vlm, dtype, load_in_4bit, max_seq_length, lora, gradient_checkpointing,
                               device)
    else:
        policy = _load_transformers(path, config, is_vlm, dtype, load_in_4bit, lora, gradient_checkpointing,
                                    device, attn_implementation)
    policy.max_seq_length = max_seq_length
    policy.name_or_path = path
    policy.allow_unverified_family = allow_unverified_family
    policy.inference()
    return policy


def _apply_peft(model, lora):
    from peft import get_peft_model

    cfg = lora_config_from(model, lora)
    seed = lora.get("random_state") if isinstance(lora, dict) else None
    if seed is not None:
        torch.manual_seed(int(seed))
    return get_peft_model(model, cfg)


# Kept out of 4-bit: lm_head and the vision tower with its projector. transformers 5 matches these from the
# start of the module path (re.match) or as its end, so a bare "visual" would not match "model.visual.blocks...".
_FULL_PRECISION_MODULES = ["lm_head", r".*\.visual\b", r".*\.vision_tower\b", r".*\.multi_modal_projector\b"]


def _load_transformers(path, config, is_vlm, dtype, load_in_4bit, lora, gradient_checkpointing, device,
                       attn_implementation) -> PolicyModel:
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

    kwargs: dict[str, Any] = {"dtype": dtype, "attn_implementation": attn_implementation}
    if load_in_4bit:
        if importlib.util.find_spec("bitsandbytes") is None:
            raise BackendUnavailableError("load_in_4bit=True needs bitsandbytes (pip install bitsandbytes)")
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype,
            bnb_4bit_use_double_quant=True, llm_int8_skip_modules=_FULL_PRECISION_MODULES)
    if device is not None:
        kwargs["device_map"] = {"": str(device)}
    elif _cuda():
        kwargs["device_map"] = {"": "cuda:0"}
    cls = AutoModelForImageTextToText if is_vlm else AutoModelForCausalLM
    model = cls.from_pretrained(path, **kwargs)
    processor = load_processor(path, config) if is_vlm else None
    tokenizer = processor.tokenizer if processor is not None else AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if lora is not None:
        model = _apply_peft(model, lora)
    policy = PolicyModel(model=model, tokenizer=tokenizer, processor=processor, backend="transformers",
                         is_vlm=is_vlm, gradient_checkpointing=gradient_checkpointing)
    return policy


def _load_unsloth(path, is_vlm, dtype, load_in_4bit, max_seq_length, lora, gradient_checkpointing,
                  device=None) -> PolicyModel:
    import unsloth  # noqa: F401  (must come before transformers' models are built)
    from unsloth import FastLanguageModel, FastVisionModel

    cls = FastVisionModel if is_vlm else FastLanguageModel
    kwargs: dict[str, Any] = {"model_name": path, "dtype": dtype, "load_in_4bit": load_in_4bit}
    if max_seq_length is not None:
        kwargs["max_seq_length"] = max_seq_length
    if device is not None:  # e.g. one replica per GPU (unsloth:dN): cuda:LOCAL_RANK, not Unsloth's "sequential"
        kwargs["device_map"] = {"": str(device)}
    try:
        model, tok = cls.from_pretrained(**kwargs)
    except NotImplementedError as e:
        raise BackendUnavailableError(f"backend='unsloth' cannot load {path!r} here: {e}") from e
    processor = tok if is_vlm else None
    tokenizer = getattr(tok, "tokenizer", tok)
    if lora is not None:
        from peft import LoraConfig

        if isinstance(lora, LoraConfig):
            raise ValueError("backend='unsloth' takes lora as a dict of get_peft_model options, not a LoraConfig")
        opts = {k: v for k, v in lora.items() if k in _LORA_KEYS}
        opts.setdefault("r", 16)
        opts.setdefault("lora_alpha", opts["r"])
        opts.setdefault("use_gradient_checkpointing", "unsloth" if gradient_checkpointing else False)
        if not is_vlm:
            for k in ("finetune_vision_layers", "finetune_language_layers", "finetune_attention_modules",
                      "finetune_mlp_modules"):
                opts.pop(k, None)
        model = cls.get_peft_model(model, **opts)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return PolicyModel(model=model, tokenizer=tokenizer, processor=processor, backend="unsloth", is_vlm=is_vlm,
                       gradient_checkpointing=gradient_checkpointing)
