"""EngineConfig and SamplingParams: small dataclasses validated at construction.

Errors name the field, so a front end can hand them to the user as they are::

    SamplingParams(temperature=-1)   # ValueError: temperature must be >= 0, got -1
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, fields
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


@dataclass
class EngineConfig:
    """Engine sizing.

    Args:
        kv_cache_memory_bytes: KV cache budget. ``None``: a fraction of free memory
            (``kv_cache_memory_fraction`` of free CUDA memory, or of available RAM capped at 1 GiB on CPU).
        block_size: tokens per KV block (paged cache).
        max_num_seqs: most sequences decoding in one step.
        max_model_len: longest prompt + output; default the model's max_position_embeddings (capped by the budget).
        max_prefill_tokens: prompt tokens prefilled in one step (others wait for the next step).
        prefill_chunk_tokens: most tokens in one prefill forward: packs of prompts stay within it, and a longer
            prompt (a recompute after preemption or a weight change, a next turn's new tokens) is prefilled in
            forwards of at most this many tokens, each attending to the KV of the ones before: activation memory
            stays bounded by the chunk, not the prompt. The one exception: a prompt's first forward runs through
            its last image placeholder (an image's tokens and pixels enter in one forward), however long.
        suppress_vision_tokens: never sample image/video pad or vision start/end tokens (they would break
            the trainer's forward); logprobs are unaffected.
        prefix_cache: share the KV of identical prompts (GRPO groups, n > 1) instead of prefilling again.
        recompute_on_weight_change: when the weights change under sequences in flight (``set_version``,
            ``weights_changed``, adapter or checkpoint loads), recompute their cached positions with the new
            weights before their next token, so every token stamped v is sampled from and scored by weights v
            (the default). False keeps the stale cache (faster, inexact): each output then says, per token,
            the oldest weight version among the positions it attended to (``output_kv_versions``).
        decode_compile: the compiled decode step: the same as ``decode_backend="static"`` (below), kept as a
            switch of its own for existing configs.
        decode_backend: how decode steps run (engine/decode_backend.py). "auto" (the default): "static" on a CPU
            device with a C++ compiler for torch.compile and on CUDA for transformers + PEFT models in full or
            half precision (measured faster there, benchmarks/gpu/README.md); "workspace" for 4-bit weights and
            Unsloth-loaded models on CUDA (not yet measured compiled on a GPU), on other devices, and when the
            static step cannot be compiled (the reason is in ``stats()["decode_backend_fallback"]``);
            ``stats()["decode_backend"]`` says which runs.
            "workspace": each running sequence owns a persistent row, filled once when it joins; no per-step copy
            of the history; each step eager. "gather": every row's history gathered from the paged pool each step.
            Memory: the workspace holds the running rows' history a second
            time beside the pool, each row padded to the longest, within ``decode_workspace_bytes``. Rows that
            share a prompt's KV blocks (the samples of one GRPO prompt) hold the shared positions once, and
            attention reads them once per step for all of them (CPU, full-attention SDPA models: the eager
            workspace, and the compiled step with the CPU kernel, see ``shared_prefix``; ``stats()["decode_shared_prefix"]``, ``["decode_prefix_entries"]``,
            ``["decode_prefix_steps"]``; a sample that decoded alone before its group's others arrived is moved to
            the shared layout when they join: ``["decode_prefix_rehomed"]``).
            "static" (engine/decode_static.py): the workspace rows read by one compiled decode step (dynamic
            batch and context: no recompiles as sequences grow), compiled at engine start
            (``stats()["decode_warmup_s"]``: one unit of decoder layers compiled per kind of layer,
            ``decode_layers_per_call`` below; 19 s for units of 4 on a 2-core CPU whatever the depth, ~8 s when
            inductor's on-disk cache holds it, benchmarks/cpu/captured.md); ``compile_mode`` is its
            torch.compile mode, or "cuda-graphs": the step replayed whole as one CUDA graph per (batch bucket,
            128-token key bucket), each graph's first replays checked against the unrecorded step
            (engine/decode_graphs.py; CUDA only, off by default: not yet measured on a GPU). Steps it cannot serve (rows naming different adapters, a batch past the
            workspace budget) run eager through the same rows (``stats()["decode_eager_steps"]``).
        decode_layers_per_call: with the "static" step, how many consecutive decoder layers of one kind run as
            one compiled call (engine/decode_units.py; ``stats()["decode_layers_per_call"]``). None (the default):
            4 for the families whose transformers decoder loop passes each layer its predecessor's output and
            the same arguments (the served ones), 1 for others. Fewer calls cost less Python per step (36 layers
            x LoRA at batch 64 on a 2-core CPU: ~0.85x the step of one layer per call) and more compile time at
            engine start (~2-3x). Each step checks that the model's loop passed every layer its predecessor's
            output and the same arguments (where not, the engine runs one layer per call from then on), and
            that no decoder layer itself has a hook (one per call while one is left, units again after); logged,
            the step runs again, exactly.
        decode_workspace_bytes: most bytes the decode workspace may hold (``None``: the KV pool's own size, so KV
            takes at most twice ``kv_cache_memory_bytes`` in all; 0: never use it). A step whose batch would need
            more (rows x its longest row, e.g. one long conversation beside many short rows) decodes through the
            gather path instead: same tokens, memory bounded, never a preemption. ``stats()``:
            ``decode_workspace_bytes`` (held now), ``decode_workspace_peak_bytes``, ``decode_workspace_fallbacks``.
        shared_prefix_decode: with the workspace backend, rows that share a prompt's full KV blocks (the samples
            of one GRPO prompt, through the prefix cache) hold those positions once, and each decode step reads
            them once for all of those rows, merging the two attentions exactly by their log-sum-exps
            (``attention.shared_prefix_decode``; with the CPU kernel, one softmax over each row's entry and then
            its own keys: ``cpu_attention.decode_attention_prefixed``). Served on CPU for models whose every layer
            attends with SDPA arithmetic over its whole history; elsewhere (and when False) every row holds its
            whole history. With the CPU kernel the compiled step serves these steps too (the prefix store is a
            graph input; ``stats()["decode_prefix_compiled"]``); without it they run eager.
        shared_prefix_min_tokens: fewest shared positions for which rows share them (None: 32; 640 when the
            compiled "static" step runs without the CPU kernel, whose steps reading shared prefixes then run eager:
            compiled whole rows were faster there up to ~650-token prompts). With the kernel, on the bench's model
            (GRPO groups of 8), compiled steps over prefix entries are faster than compiled whole rows from 128
            shared tokens on (benchmarks/cpu/shared-prefix-crossover.md). Shorter shared prompts are held by every
            row.
        cpu_attention_kernel: on a CPU device, decode attention (one new token per row over its history) runs on
            the engine's own kernel (engine/cpu_attention.py: each row's keys and values read once, in place, no
            mask; SDPA's arithmetic within float32 rounding), built once per machine with the system C++ compiler
            and cached. Where it cannot be built, or for shapes outside it (not float32, unusual head sizes), SDPA
            runs as before; ``stats()["cpu_attention_kernel"]`` says which. ``UNSLOTH_ROLLOUT_CPU_KERNEL=0`` turns
            it off process-wide.
        cpu_retain_freed_memory: on a CPU device, the first engine sets glibc's malloc to keep freed memory for
            reuse instead of handing it back to the kernel (``engine/malloc.py``; process-wide): activations
            stop faulting their pages in again at every prefill layer. Resident memory then stays near its peak.
        max_lora_rank: adapters loaded by name (``load_lora_adapter``) with a higher LoRA rank are refused, as
            vLLM's ``--max-lora-rank`` refuses them (vLLM's default is 16, sized for its kernels' buffers; here a
            rank costs only its memory, so the default is 256). The policy's own adapter is not bound by it.
        max_loras: most adapters loaded by name at once (None: no limit); a load beyond it is refused.
        mm_processor_cache_bytes: most bytes of image-processor outputs kept for images seen recently
            (engine/mm_cache.py; vLLM's ``mm_processor_cache_gb``), so the n requests of a GRPO group that carry
            one image run the image processor once. Keyed by the images' content and the processed text: a hit
            is what the processor returns. Encoded images (bytes, data URLs, base64 strings) are decoded once
            as well, keyed by their bytes (file paths are read every time). 0 turns it off. ``stats()``:
            ``mm_processor_cache_hits`` / ``_misses`` / ``_bytes`` (decodes and processor outputs together).
    """

    kv_cache_memory_bytes: int | None = None
    kv_cache_memory_fraction: float = 0.3
    block_size: int = 16
    max_num_seqs: int = 256
    max_model_len: int | None = None
    max_prefill_tokens: int = 4096
    prefill_chunk_tokens: int = 8192
    suppress_vision_tokens: bool = True
    prefix_cache: bool = True
    recompute_on_weight_change: bool = True
    decode_compile: bool = False
    compile_mode: str | None = None
    decode_backend: str = "auto"
    decode_workspace_bytes: int | None = None
    shared_prefix_decode: bool = True
    shared_prefix_min_tokens: int | None = None
    decode_layers_per_call: int | None = None
    cpu_attention_kernel: bool = True
    cpu_retain_freed_memory: bool = True
    max_lora_rank: int = 256
    max_loras: int | None = None
    mm_processor_cache_bytes: int = 256 << 20

    def __post_init__(self):
        _check(self.kv_cache_memory_bytes is None or (_is_int(self.kv_cache_memory_bytes)
                                                       and self.kv_cache_memory_bytes > 0),
               "kv_cache_memory_bytes", f"must be a positive integer or None, got {self.kv_cache_memory_bytes!r}")
        _check(0 < self.kv_cache_memory_fraction <= 1, "kv_cache_memory_fraction",
               f"must be in (0, 1], got {self.kv_cache_memory_fraction!r}")
        _check(_is_int(self.block_size) and self.block_size >= 1, "block_size", f"must be >= 1, got {self.block_size}")
        _check(_is_int(self.max_num_seqs) and self.max_num_seqs >= 1, "max_num_seqs",
               f"must be >= 1, got {self.max_num_seqs}")
        _check(self.max_model_len is None or (_is_int(self.max_model_len) and self.max_model_len >= 2),
               "max_model_len", f"must be >= 2 or None, got {self.max_model_len!r}")
        _check(_is_int(self.max_prefill_tokens) and self.max_prefill_tokens >= 1, "max_prefill_tokens",
               f"must be >= 1, got {self.max_prefill_tokens}")
        _check(_is_int(self.prefill_chunk_tokens) and self.prefill_chunk_tokens >= 1, "prefill_chunk_tokens",
               f"must be >= 1, got {self.prefill_chunk_tokens}")
        _check(self.decode_workspace_bytes is None or (_is_int(self.decode_workspace_bytes)
                                                        and self.decode_workspace_bytes >= 0),
               "decode_workspace_bytes", f"must be an integer >= 0 or None, got {self.decode_workspace_bytes!r}")
        _check(isinstance(self.shared_prefix_decode, bool), "shared_prefix_decode",
               f"must be True or False, got {self.shared_prefix_decode!r}")
        _check(self.shared_prefix_min_tokens is None or (_is_int(self.shared_prefix_min_tokens)
                                                          and self.shared_prefix_min_tokens >= 1),
               "shared_prefix_min_tokens", f"must be an integer >= 1 or None, got {self.shared_prefix_min_tokens!r}")
        _check(self.decode_layers_per_call is None or (_is_int(self.decode_layers_per_call)
                                                        and self.decode_layers_per_call >= 1),
               "decode_layers_per_call", f"must be an integer >= 1 or None, got {self.decode_layers_per_call!r}")
        _check(isinstance(self.cpu_attention_kernel, bool), "cpu_attention_kernel",
               f"must be True or False, got {self.cpu_attention_kernel!r}")
        _check(isinstance(self.cpu_retain_freed_memory, bool), "cpu_retain_freed_memory",
               f"must be True or False, got {self.cpu_retain_freed_memory!r}")
        _check(self.decode_backend in ("auto", "gather", "workspace", "static"), "decode_backend",
               f"must be 'auto', 'gather', 'workspace' or 'static', got {self.decode_backend!r}")
        _check(_is_int(self.max_lora_rank) and self.max_lora_rank >= 1, "max_lora_rank",
               f"must be an integer >= 1, got {self.max_lora_rank!r}")
        _check(_is_int(self.mm_processor_cache_bytes) and self.mm_processor_cache_bytes >= 0,
               "mm_processor_cache_bytes", f"must be an integer >= 0, got {self.mm_processor_cache_bytes!r}")
        _check(self.max_loras is None or (_is_int(self.max_loras) and self.max_loras >= 1), "max_loras",
               f"must be an integer >= 1 or None, got {self.max_loras!r}")
