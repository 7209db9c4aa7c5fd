"""A decode attention kernel for CPU: each row's history read once, in place, near the machine's memory bandwidth.

A decode step's attention is one query position per row against that row's whole history. On CPU, SDPA's flash
kernel spends 1.6x a plain read of that history on it on the 36-layer bench's shape (36 layers x 64 rows, head dim
16) and 2.6x on the long workload's (32 rows x 2k keys, 4 query heads per KV head, head dim 64); this kernel 1.06x
and 1.13x (2 AMD EPYC cores: ``benchmarks/cpu_attention_kernel.py``), and on deep small-hidden models attention
is the largest part of a step. ``kernels/csrc/decode_attention.cpp`` is the same arithmetic written for this shape:
the G query heads that share a KV head are computed together, so each key and value row is loaded once; scores
for W keys at a time (W = 16 floats with AVX-512, else 8) summed across lanes in registers, an online softmax in
blocks of W keys (flash attention's rescaling), the rows ahead prefetched into L2, rows split across torch's
threads. It reads only each row's real keys (``lo`` .. ``hi``), so no mask is built or read.

It is built once per machine with the system C++ compiler (``kernels/build.py``: ``g++ -O3 -march=native -fopenmp``,
about 10 s), cached under ``~/.cache/unsloth_rollout/kernels`` (``UNSLOTH_ROLLOUT_KERNEL_DIR``) by a hash of the
source, the compiler and the CPU, and linked to the OpenMP runtime torch loaded (one thread team, torch's thread
count). Where it cannot be built (no compiler, no GNU OpenMP in the process) or a shape is outside it (not float32,
head dimension not one of 16 32 48 64 80 96 128 256, more than 8 query heads per KV head), attention is SDPA's, as
before: ``available()`` and ``supported()`` say which, ``build_error()`` why not. Callers reach it as the torch op
``unsloth_rollout::decode_attention``, registered in C++ (``csrc/decode_attention_op.cpp``, built against the
running torch, ~6 s once) so that neither an eager call nor a compiled graph's call passes through Python; where
that library does not build, the op is a Python custom op over ctypes (same kernel; ``op_registration()`` says
which).

Rows of a GRPO group that hold only their own positions (the decode workspace's shared prompts) reach it as
``decode_attention_prefixed`` (op ``unsloth_rollout::decode_attention_prefixed``): each row's shared-prompt entry,
then its own keys, under one softmax; the group's rows are neighbours, so the entry is read from memory about once.

Arithmetic: the softmax of ``scale * q . k`` over the row's keys, ``exp`` by Cephes' single-precision polynomial (~1
ulp), sums in a different order than SDPA's: outputs agree with SDPA's within a few float32 ulps
(tests/engine/decode/test_cpu_kernel.py checks them against SDPA and a float64 reference).
``UNSLOTH_ROLLOUT_CPU_KERNEL=0`` or ``DecodeConfig(cpu_kernel=False)`` keeps SDPA.
"""

from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path

import torch

from ...kernels.build import LazyLibrary, build_library

log = logging.getLogger(__name__)

_HEAD_DIMS = (16, 32, 48, 64, 80, 96, 128, 256)
_MAX_GROUP = 8

_CODES = {1: "unsupported head size or query heads per KV head", 3: "a row's key range is outside the keys",
          4: "a row's prefix entry or its length is outside the prefix keys"}

_op = None  # the registered op (C++ or Python), set when the library loads
_op_prefixed = None  # unsloth_rollout::decode_attention_prefixed, registered with _op
_op_error: str | None = None  # why the op is the Python one


def enabled_by_env() -> bool:
    return os.environ.get("UNSLOTH_ROLLOUT_CPU_KERNEL", "1").strip().lower() not in ("0", "false", "no", "off")


def _load() -> ctypes.CDLL:
    global _op, _op_error, _op_prefixed
    path = build_library("decode_attention")
    lib = ctypes.CDLL(str(path))
    p, i = ctypes.c_void_p, ctypes.c_int64
    lib.decode_attention_f32.argtypes = [p] * 7 + [i] * 11 + [ctypes.c_float, ctypes.c_int]
    lib.decode_attention_f32.restype = ctypes.c_int
    lib.decode_attention_prefixed_f32.argtypes = [p] * 11 + [i] * 19 + [ctypes.c_float, ctypes.c_int]
    lib.decode_attention_prefixed_f32.restype = ctypes.c_int
    _op, _op_error = _define_op(path)
    return lib


def _define_op(kernel: Path):
    """The op ``unsloth_rollout::decode_attention``: registered in C++ (``csrc/decode_attention_op.cpp``, built
    against this torch: a call reaches the kernel without a Python frame, ~25-45 us less a call) where that
    builds, else a Python custom op over ctypes. The same kernel either way: the same results. The same for
    ``unsloth_rollout::decode_attention_prefixed`` (set in ``_op_prefixed``)."""
    global _op_prefixed
    try:
        torch.ops.load_library(str(build_library("decode_attention_op", torch_headers=True, link=(kernel,))))
        torch.library.register_fake("unsloth_rollout::decode_attention")(_fake)
        torch.library.register_fake("unsloth_rollout::decode_attention_prefixed")(_fake_prefixed)
        _op_prefixed = torch.ops.unsloth_rollout.decode_attention_prefixed.default
        return torch.ops.unsloth_rollout.decode_attention.default, None
    except Exception as e:  # noqa: BLE001 - no torch headers, a failed build: the Python op, same kernel
        error = f"{type(e).__name__}: {e}"
        log.info("decode attention op registered in Python (C++ registration unavailable: %s)", error[:500])
    op = torch.library.custom_op("unsloth_rollout::decode_attention", mutates_args=())(_run)
    op.register_fake(_fake)
    _op_prefixed = torch.library.custom_op("unsloth_rollout::decode_attention_prefixed", mutates_args=())(_run_prefixed)
    _op_prefixed.register_fake(_fake_prefixed)
    return op, error


_kernel = LazyLibrary(_load, "CPU decode attention kernel", "decode attention uses SDPA")


def available() -> bool:
    """Whether the kernel is built and loaded (builds it on the first call)."""
    return enabled_by_env() and _kernel.get() is not None


def build_error() -> str | None:
    """Why the kernel could not be built (None: it was, or was not tried yet)."""
    return _kernel.error


def op_registration() -> str | None:
    """How the op ``unsloth_rollout::decode_attention`` is registered once the kernel is loaded: "c++", or
    "python: <why not C++>" (None: the kernel is not loaded)."""
    if _op is None:
        return None
    return "c++" if _op_error is None else f"python: {_op_error}"


def supported(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether the kernel computes a decode attention of these tensors (once ``available()``): CPU float32, one
    query position, ``[B, H, 1, D]`` queries over ``[B, KV, L, D]`` keys and values, contiguous head dimension."""
    if not (query.device.type == "cpu" and query.dtype == key.dtype == value.dtype == torch.float32):
        return False
    b, h, q, d = query.shape
    kvh = key.shape[1]
    return (q == 1 and d in _HEAD_DIMS and h % kvh == 0 and h // kvh <= _MAX_GROUP and key.shape[-1] == d
            and value.shape[-1] == d and key.stride(-1) == 1 and value.stride(-1) == 1)


def _run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
         scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    q = q.contiguous()
    lo, hi = lo.to(torch.int64).contiguous(), hi.to(torch.int64).contiguous()
    b, kvh, g, d = q.shape
    out = torch.empty_like(q)
    lse = torch.empty((b, kvh, g), dtype=torch.float32)
    rc = _kernel.lib.decode_attention_f32(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(),
                                   lo.data_ptr(), hi.data_ptr(), b, kvh, g, d, min(k.shape[2], v.shape[2]),
                                   *k.stride()[:3], *v.stride()[:3], float(scale), torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"decode attention kernel: {_CODES.get(rc, rc)} (q {tuple(q.shape)}, k {tuple(k.shape)})")
    return out, lse


def _fake(q, k, v, lo, hi, scale):
    return q.new_empty(q.shape).contiguous(), q.new_empty(q.shape[:3]).contiguous()


def _run_prefixed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                  pk: torch.Tensor, pv: torch.Tensor, pe: torch.Tensor, plen: torch.Tensor,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    q = q.contiguous()
    lo, hi = lo.to(torch.int64).contiguous(), hi.to(torch.int64).contiguous()
    pe, plen = pe.to(torch.int64).contiguous(), plen.to(torch.int64).contiguous()
    b, kvh, g, d = q.shape
    if pk.shape[1] != kvh or pk.shape[3] != d or pv.shape != pk.shape or plen.numel() < pk.shape[0]:
        raise RuntimeError(f"decode attention kernel: pk {tuple(pk.shape)} / pv {tuple(pv.shape)} / plen "
                           f"{tuple(plen.shape)} do not match q {tuple(q.shape)}")
    out = torch.empty_like(q)
    lse = torch.empty((b, kvh, g), dtype=torch.float32)
    rc = _kernel.lib.decode_attention_prefixed_f32(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(), lo.data_ptr(), hi.data_ptr(),
        pk.data_ptr(), pv.data_ptr(), pe.data_ptr(), plen.data_ptr(), b, kvh, g, d, min(k.shape[2], v.shape[2]),
        pk.shape[0], min(pk.shape[2], pv.shape[2]), *k.stride()[:3], *v.stride()[:3], *pk.stride()[:3],
        *pv.stride()[:3], float(scale), torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"decode attention kernel: {_CODES.get(rc, rc)} (q {tuple(q.shape)}, k {tuple(k.shape)}, "
                           f"pk {tuple(pk.shape)})")
    return out, lse


def _fake_prefixed(q, k, v, lo, hi, pk, pv, pe, plen, scale):
    return _fake(q, k, v, lo, hi, scale)


def key_range(lengths: torch.Tensor, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's keys ``lo .. hi - 1``: positions 0 .. lengths[i] (the new token's own), or the last ``window``."""
    hi = lengths + 1
    lo = (hi - window).clamp(min=0) if window else torch.zeros_like(hi)
    return lo, hi


def decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, lo: torch.Tensor,
                     hi: torch.Tensor, scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``query`` ``[B, H, 1, D]`` over ``key`` / ``value`` ``[B, KV, L, D]`` (row i: keys lo[i] .. hi[i] - 1):
    the output ``[B, KV, G, D]`` (query head ``kv * G + g``, as transformers' ``repeat_kv`` maps them) and its
    log-sum-exp ``[B, KV, G]``. It is the op ``unsloth_rollout::decode_attention`` (a compiled graph calls it)."""
    qg, scale, direct = _prepare(query, key, scale)
    if direct:
        return _run(qg, key, value, lo, hi, scale)  # the Python op's own body, without its dispatch
    return _op(qg, key, value, lo, hi, scale)


def _prepare(query: torch.Tensor, key: torch.Tensor, scale: float | None) -> tuple[torch.Tensor, float, bool]:
    """(the queries grouped by KV head ``[B, KV, G, D]``, the scale, whether to call the Python op's body directly:
    the op is the Python one and no graph is being traced)."""
    if _kernel.get() is None:
        raise RuntimeError(f"CPU decode attention kernel unavailable: {_kernel.error or 'disabled'}")
    b, h, _, d = query.shape
    kvh = key.shape[1]
    scale = d ** -0.5 if scale is None else float(scale)
    return query.reshape(b, kvh, h // kvh, d), scale, _op_error is not None and not torch.compiler.is_compiling()


def decode_attention_prefixed(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, lo: torch.Tensor,
                              hi: torch.Tensor, pk: torch.Tensor, pv: torch.Tensor, row_entry: torch.Tensor,
                              plen: torch.Tensor, scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``decode_attention`` where row i also attends to the keys ``0 .. plen[e] - 1`` of shared-prompt
    entry ``e = row_entry[i]`` of ``pk`` / ``pv`` ``[E, KV, P, D]`` (e < 0: none), before its own keys ``lo[i] ..
    hi[i] - 1``, under one softmax: a GRPO group's samples read their shared prompt from one entry (rows of a group
    are neighbours, so after the first the entry comes from cache). The op
    ``unsloth_rollout::decode_attention_prefixed``; the compiled step calls it too."""
    qg, scale, direct = _prepare(query, key, scale)
    if direct:
        return _run_prefixed(qg, key, value, lo, hi, pk, pv, row_entry, plen, scale)
    return _op_prefixed(qg, key, value, lo, hi, pk, pv, row_entry, plen, scale)
