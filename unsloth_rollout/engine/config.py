"""EngineConfig and SamplingParams: small dataclasses validated at construction.

Errors name the field, so a front end can hand them to the user as they are::

    SamplingParams(temperature=-1)   # ValueError: temperature must be >= 0, got -1
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import re
import warnings
from dataclasses import dataclass, field, fields
from collections.abc import Mapping
from typing import Any

from ..errors import InvalidRequestError  # noqa: F401  (re-exported: imported from here)

# "raw_logprobs": log_softmax(raw_logits / T), what a trainer recomputes; "processed_logprobs": the log of the
# distribution the token was drawn from (penalties, bans, top-k / top-p / min-p applied, renormalised), as vLLM's.
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")

# Temperatures below this sample greedily (vLLM's _SAMPLING_EPS): logits / T would overflow to inf/NaN.
SAMPLING_EPS = 1e-5


_BYTE_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1 << 10, "m": 1000**2, "mb": 1000**2, "mib": 1 << 20,
               "g": 1000**3, "gb": 1000**3, "gib": 1 << 30, "t": 1000**4, "tb": 1000**4, "tib": 1 << 40}


def parse_bytes(text) -> int:
    """A byte count from an int or a string such as "1073741824", "512MiB", "8GiB" or "1.5GB".

    The one unit of every memory setting (``kv_cache_memory_bytes``) on every front end.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _BYTE_UNITS:
        raise ValueError(f"expected a byte count such as 1073741824, 512MiB or 8GiB; got {text!r}")
    return int(float(m.group(1)) * _BYTE_UNITS[unit])


def _check(cond: bool, name: str, message: str) -> None:
    if not cond:
        raise InvalidRequestError(name, f"{name} {message}")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass
class SamplingParams:
    """How to sample one request.

    ``temperature=0`` is greedy, and so is any temperature below ``SAMPLING_EPS`` (1e-5, as in vLLM): such a
    request is sampled and scored as greedy (logprobs at T = 1), never as ``logits / 1e-39``. ``seed`` makes a
    request reproducible whatever else shares its batch; sample i draws from a stream seeded by a hash of
    (seed, i), so requests seeded s and s + 1 share none. ``logprobs`` is the number of top logprobs to
    return per token (the sampled token's own logprob is always returned). Logprobs follow AReaL's convention:
    ``log_softmax(raw_logits / temperature)[token]`` (temperature 1 when greedy), before top-k/p,
    penalties and masks (``logprobs_mode="raw_logprobs"``, the default); ``"processed_logprobs"`` returns, as
    vLLM's mode of that name, the log of the distribution the token was drawn from (after penalties, bans and
    top-k / min-p / top-p, renormalised; a greedy row's: penalised logits at T = 1). ``prompt_logprobs=k``
    scores the prompt: each prompt token's ``log_softmax(raw_logits)`` given the tokens before it, plus the top k
    (vLLM's shape); with it ``max_new_tokens`` may be 0 (score only, no token sampled).
    ``structured_outputs`` (a ``StructuredOutputs`` or its dict; engine/constraints.py) constrains every sample's
    output to a JSON schema, a regex, a choice of strings or a grammar.
    """

    max_new_tokens: int = 256
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int = 0
    n: int = 1
    skip_special_tokens: bool = True
    logprobs_mode: str = "raw_logprobs"
    prompt_logprobs: int | None = None
    structured_outputs: Any = None

    def __post_init__(self):
        _check(self.logprobs_mode in LOGPROBS_MODES, "logprobs_mode",
               f"must be one of {', '.join(LOGPROBS_MODES)}, got {self.logprobs_mode!r}")
        _check(self.prompt_logprobs is None or (_is_int(self.prompt_logprobs) and self.prompt_logprobs >= 0),
               "prompt_logprobs", f"must be None or an integer >= 0, got {self.prompt_logprobs!r}")
        # A scoring request (prompt logprobs) may ask for no new token at all.
        least = 0 if self.prompt_logprobs is not None else 1
        _check(_is_int(self.max_new_tokens) and self.max_new_tokens >= least, "max_new_tokens",
               f"must be an integer >= {least}, got {self.max_new_tokens!r}"
               + ("" if least == 0 else " (0 is allowed only with prompt_logprobs)"))
        _check(_is_int(self.min_new_tokens) and 0 <= self.min_new_tokens <= self.max_new_tokens, "min_new_tokens",
               f"must be an integer in [0, max_new_tokens={self.max_new_tokens}], got {self.min_new_tokens!r}")
        _check(_is_num(self.temperature) and math.isfinite(self.temperature) and self.temperature >= 0,
               "temperature", f"must be a finite number >= 0, got {self.temperature!r}")
        _check(_is_num(self.top_p) and 0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p!r}")
        _check(_is_int(self.top_k) and (self.top_k == -1 or self.top_k >= 1), "top_k",
               f"must be -1 (off) or >= 1, got {self.top_k!r}")
        _check(_is_num(self.min_p) and 0 <= self.min_p <= 1, "min_p", f"must be in [0, 1], got {self.min_p!r}")
        _check(_is_num(self.repetition_penalty) and math.isfinite(self.repetition_penalty)
               and self.repetition_penalty > 0, "repetition_penalty",
               f"must be a finite number > 0, got {self.repetition_penalty!r}")
        _check(_is_num(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2, "frequency_penalty",
               f"must be in [-2, 2], got {self.frequency_penalty!r}")
        _check(_is_num(self.presence_penalty) and -2 <= self.presence_penalty <= 2, "presence_penalty",
               f"must be in [-2, 2], got {self.presence_penalty!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _check(isinstance(self.stop, (list, tuple)) and all(isinstance(s, str) and s for s in self.stop), "stop",
               f"must be a list of non-empty strings, got {self.stop!r}")
        self.stop = list(self.stop)
        _check(isinstance(self.stop_token_ids, (list, tuple)) and all(_is_int(t) and t >= 0
                                                                     for t in self.stop_token_ids),
               "stop_token_ids", f"must be a list of non-negative integers, got {self.stop_token_ids!r}")
        self.stop_token_ids = list(self.stop_token_ids)
        _check(self.seed is None or _is_int(self.seed), "seed", f"must be an integer or None, got {self.seed!r}")
        _check(_is_int(self.logprobs) and 0 <= self.logprobs <= 20, "logprobs",
               f"must be an integer in [0, 20], got {self.logprobs!r}")
        _check(_is_int(self.n) and 1 <= self.n <= 256, "n", f"must be an integer in [1, 256], got {self.n!r}")
        if self.structured_outputs is not None:
            from .constraints import StructuredOutputs

            self.structured_outputs = StructuredOutputs.from_dict(self.structured_outputs)
            # A complete grammar allows only EOS: ignoring it would leave a sample nothing to sample.
            _check(not self.ignore_eos, "ignore_eos", "cannot be combined with structured_outputs")

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def logprob_temperature(self) -> float:
        return 1.0 if self.greedy else float(self.temperature)

    @classmethod
    def from_dict(cls, d: dict) -> "SamplingParams":
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            name = sorted(unknown)[0]
            raise InvalidRequestError(name, f"{name} is not a sampling parameter")
        return cls(**d)


def _check_bool(value, name: str) -> None:
    _check(isinstance(value, bool), name, f"must be True or False, got {value!r}")


def _check_count(value, name: str, least: int, none: bool = True) -> None:
    _check((none and value is None) or (_is_int(value) and value >= least), name,
           f"must be an integer >= {least}{' or None' if none else ''}, got {value!r}")


# The decode variants a config may name (decode/choose.py's BACKENDS, and "auto": its table).
DECODE_BACKENDS = ("auto", "compiled", "graph", "workspace", "gather", "paged")


@dataclass
class DecodeConfig:
    """How decode steps run: one module per variant in engine/decode/, ``auto`` chosen by decode/choose.py.

    Args:
        backend: "auto" (decode/choose.py's table), "compiled", "graph" (CUDA only), "workspace", "gather" or
            "paged" (attention reads the pool in place with a Triton kernel: CUDA, or Triton's interpreter).
        compile_mode: the torch.compile mode of the compiled step (None: inductor's default).
        layers_per_call: decoder layers of one kind per compiled call (None: 4 for served families, else 1).
        shared_prompt: rows of one prompt hold its positions once and read them once per step (CPU, SDPA).
        shared_prompt_min_tokens: fewest shared positions that make a shared prompt (None: decode/choose.py's).
        cpu_kernel: CPU decode attention on the engine's kernel (decode/cpu_kernel.py; SDPA where it cannot).
        workspace_bytes: most bytes the decode rows may hold beside the pool (None: the pool's size; 0: none).
    """

    backend: str = "auto"
    compile_mode: str | None = None
    layers_per_call: int | None = None
    shared_prompt: bool = True
    shared_prompt_min_tokens: int | None = None
    cpu_kernel: bool = True
    workspace_bytes: int | None = None

    def __post_init__(self):
        if self.backend == "static":
            _deprecated("decode backend 'static'", "'compiled'")
            self.backend = "compiled"
        if self.compile_mode == "cuda-graphs":
            _deprecated("compile_mode='cuda-graphs'", "DecodeConfig(backend='graph')")
            self.backend, self.compile_mode = "graph", None
        _check(self.backend in DECODE_BACKENDS, "decode.backend",
               f"must be one of {', '.join(map(repr, DECODE_BACKENDS))}, got {self.backend!r}")
        _check(self.compile_mode is None or isinstance(self.compile_mode, str), "decode.compile_mode",
               f"must be a torch.compile mode or None, got {self.compile_mode!r}")
        _check_count(self.layers_per_call, "decode.layers_per_call", 1)
        _check_bool(self.shared_prompt, "decode.shared_prompt")
        _check_count(self.shared_prompt_min_tokens, "decode.shared_prompt_min_tokens", 1)
        _check_bool(self.cpu_kernel, "decode.cpu_kernel")
        _check_count(self.workspace_bytes, "decode.workspace_bytes", 0)


@dataclass
class PrefillConfig:
    """How prompts are prefilled.

    Args:
        max_tokens: prompt tokens prefilled in one step (others wait for the next step).
        chunk_tokens: most tokens in one prefill forward (a prompt's first runs through its last image placeholder).
    """

    max_tokens: int = 4096
    chunk_tokens: int = 8192

    def __post_init__(self):
        _check_count(self.max_tokens, "prefill.max_tokens", 1, none=False)
        _check_count(self.chunk_tokens, "prefill.chunk_tokens", 1, none=False)


@dataclass
class LoRAConfig:
    """Adapters loaded by name (``load_lora_adapter``), bounded as vLLM's LoRAConfig bounds them.

    Args:
        max_lora_rank: adapters of a higher LoRA rank are refused (the policy's own adapter is not bound by it).
        max_loras: most adapters loaded by name at once (None: no limit); a load beyond it is refused.
    """

    max_lora_rank: int = 256
    max_loras: int | None = None

    def __post_init__(self):
        _check_count(self.max_lora_rank, "lora.max_lora_rank", 1, none=False)
        _check_count(self.max_loras, "lora.max_loras", 1)


@dataclass
class MultiModalConfig:
    """Images and vision tokens.

    Args:
        mm_processor_cache_bytes: image-processor outputs kept for images seen recently (engine/mm_cache.py); 0: off.
        suppress_vision_tokens: never sample image/video pad or vision start/end tokens (logprobs are unaffected).
    """

    mm_processor_cache_bytes: int = 256 << 20
    suppress_vision_tokens: bool = True

    def __post_init__(self):
        _check_count(self.mm_processor_cache_bytes, "multimodal.mm_processor_cache_bytes", 0, none=False)
        _check_bool(self.suppress_vision_tokens, "multimodal.suppress_vision_tokens")


@dataclass
class EngineConfig:
    """Engine settings: sizing at the top, one nested config per part, each handed whole to what it configures.

    Args:
        kv_cache_memory_bytes: KV cache budget (None: a fraction of free memory, at most 1 GiB on CPU).
        kv_cache_memory_fraction: that fraction, when no budget is given.
        block_size: tokens per KV block (paged cache).
        max_num_seqs: most sequences decoding in one step.
        max_model_len: longest prompt + output (None: the model's max_position_embeddings, capped by the budget).
        prefix_cache: share the KV of identical prompts (GRPO groups, n > 1) instead of prefilling again.
        recompute_on_weight_change: recompute in-flight sequences' KV after a weight change (False: keep it, stale).
        cpu_retain_freed_memory: on CPU, glibc's malloc keeps freed memory for reuse (engine/malloc.py).
        prefill: ``PrefillConfig``.
        lora: ``LoRAConfig``.
        multimodal: ``MultiModalConfig``.
        decode: ``DecodeConfig``.

    The flat settings these nested configs replaced are accepted by their old names, with a DeprecationWarning
    (``DEPRECATED_SETTINGS``; docs/config.md).
    """

    kv_cache_memory_bytes: int | None = None
    kv_cache_memory_fraction: float = 0.3
    block_size: int = 16
    max_num_seqs: int = 256
    max_model_len: int | None = None
    prefix_cache: bool = True
    recompute_on_weight_change: bool = True
    cpu_retain_freed_memory: bool = True
    prefill: PrefillConfig = field(default_factory=PrefillConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    multimodal: MultiModalConfig = field(default_factory=MultiModalConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)

    def __post_init__(self):
        _check(self.kv_cache_memory_bytes is None or (_is_int(self.kv_cache_memory_bytes)
                                                       and self.kv_cache_memory_bytes > 0),
               "kv_cache_memory_bytes", f"must be a positive integer or None, got {self.kv_cache_memory_bytes!r}")
        _check(_is_num(self.kv_cache_memory_fraction) and 0 < self.kv_cache_memory_fraction <= 1,
               "kv_cache_memory_fraction", f"must be in (0, 1], got {self.kv_cache_memory_fraction!r}")
        _check_count(self.block_size, "block_size", 1, none=False)
        _check_count(self.max_num_seqs, "max_num_seqs", 1, none=False)
        _check_count(self.max_model_len, "max_model_len", 2)
        _check_bool(self.prefix_cache, "prefix_cache")
        _check_bool(self.recompute_on_weight_change, "recompute_on_weight_change")
        _check_bool(self.cpu_retain_freed_memory, "cpu_retain_freed_memory")
        for name, cls in _NESTED.items():  # a dict (YAML, JSON) becomes the nested config
            value = getattr(self, name)
            if isinstance(value, Mapping):
                setattr(self, name, value := cls(**value))
            _check(isinstance(value, cls), name, f"must be a {cls.__name__}, got {value!r}")

    def __getattr__(self, name: str):
        """An old flat name read (``config.decode_backend``): its nested value, with a DeprecationWarning."""
        where = DEPRECATED_NAMES.get(name)
        if where is None or name.startswith("__"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        part, key = where
        _deprecated(f"EngineConfig.{name}", f"EngineConfig.{part}.{key}")
        return getattr(getattr(self, part), key)


_NESTED = {"prefill": PrefillConfig, "lora": LoRAConfig, "multimodal": MultiModalConfig, "decode": DecodeConfig}

# The flat settings the nested configs replaced: old name -> (nested config, its field).
DEPRECATED_NAMES = {
    "max_prefill_tokens": ("prefill", "max_tokens"), "prefill_chunk_tokens": ("prefill", "chunk_tokens"),
    "max_lora_rank": ("lora", "max_lora_rank"), "max_loras": ("lora", "max_loras"),
    "mm_processor_cache_bytes": ("multimodal", "mm_processor_cache_bytes"),
    "suppress_vision_tokens": ("multimodal", "suppress_vision_tokens"),
    "decode_backend": ("decode", "backend"), "compile_mode": ("decode", "compile_mode"),
    "decode_layers_per_call": ("decode", "layers_per_call"), "shared_prefix_decode": ("decode", "shared_prompt"),
    "shared_prefix_min_tokens": ("decode", "shared_prompt_min_tokens"),
    "cpu_attention_kernel": ("decode", "cpu_kernel"), "decode_workspace_bytes": ("decode", "workspace_bytes"),
}
# Every old name ``EngineConfig()`` accepts: those, and ``decode_compile=True`` (backend "compiled").
DEPRECATED_SETTINGS = frozenset(DEPRECATED_NAMES) | {"decode_compile"}


def _deprecated(old: str, new: str) -> None:
    warnings.warn(f"{old} is deprecated; use {new}", DeprecationWarning, stacklevel=4)


_dataclass_init = EngineConfig.__init__


def _init(self, *args, **kwargs):
    """The dataclass's ``__init__``, with the old flat names moved into their nested configs (and a warning)."""
    if "decode_compile" in kwargs:  # the compiled step's old switch: the same as backend "compiled"
        _deprecated("EngineConfig(decode_compile=True)", "EngineConfig(decode=DecodeConfig(backend='compiled'))")
        if kwargs.pop("decode_compile"):
            kwargs["decode_backend"] = "compiled"
    moved: dict[str, dict] = {}
    for name in [k for k in kwargs if k in DEPRECATED_NAMES]:
        part, key = DEPRECATED_NAMES[name]
        _deprecated(f"EngineConfig({name}=...)", f"EngineConfig({part}={_NESTED[part].__name__}({key}=...))")
        moved.setdefault(part, {})[key] = kwargs.pop(name)
    for part, values in moved.items():
        given = kwargs.get(part)
        base = given if isinstance(given, _NESTED[part]) else _NESTED[part](**(given or {}))
        kwargs[part] = dataclasses.replace(base, **values)
    _dataclass_init(self, *args, **kwargs)


_init.__signature__ = inspect.signature(_dataclass_init)
EngineConfig.__init__ = _init
