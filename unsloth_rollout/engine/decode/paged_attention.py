"""Decode attention that reads the paged KV pool in place at a fixed launch shape: the Triton kernel's binding.

A decode step's attention is one query position per row over that row's cached keys. The gather step copies every
row's history out of the pool first, and the workspace steps keep a second copy; both shapes follow the key
length, so a step recorded as a CUDA graph needs one graph per key-length bucket. This kernel
(``unsloth_rollout/kernels/paged_decode.py``, split-KV "flash decoding" in Triton) reads each row's keys straight
from the pool through its block table, so its launch depends only on the batch, the heads and the block table's
width: one graph per batch bucket serves every context length.

``paged_decode_attention(q, k_pool, v_pool, block_tables, lengths, scale, window=, softcap=, num_splits=)``:

- ``q`` ``[B, H, D]`` (any strides, contiguous head dim); ``k_pool`` / ``v_pool`` one layer's pool tensors as
  ``KVCache`` holds them, ``[slots, KV, D]``, slot ``block * page + offset`` (``page``: the pool's block size);
  ``block_tables`` ``[B, W]`` int32, each row's blocks, padded; ``lengths`` ``[B]`` int32: keys ``0 .. lengths[i]
  - 1`` are row i's (a padded row has length 0: it reads nothing, its output is 0).
- query head ``i`` reads KV head ``i // (H / KV)``, as transformers' ``repeat_kv`` maps them; ``window``: only the
  last ``window`` keys; ``softcap``: Gemma 2's ``softcap * tanh(s / softcap)`` of each scaled score.
- returns the output ``[B, H, D]`` in ``q``'s dtype and the natural log-sum-exp ``[B, H]`` (float32; -inf for a row
  with no key). Scores, softmax and sums in float32.

Refused by name (``UnsupportedAttentionError``): a head dim over 256, more than 64 query heads per KV head, a dtype
other than float32 / float16 / bfloat16 (bfloat16 only on a GPU: the interpreter lacks it), ``num_splits`` not a
power of two, tensors off the kernel's device. With ``check=True`` (the default outside CUDA-graph capture) the
inputs are also checked against each other on the host: a length past the block table or a block outside the
pool raises ``ValueError``; ``check=False`` is for callers whose tables come from the engine's own bookkeeping (no
host sync).

``available()`` says whether it can run here: triton importable and a CUDA device, or Triton's interpreter
(``TRITON_INTERPRET=1`` in the environment before triton is first imported, which torch._dynamo does: how the
tests run it on CPU). Nothing here imports triton
until a kernel is launched. ``reference`` is the same attention in float64 over the gathered keys.

The engine reaches it through ``ForwardContext.paged`` (a ``PagedDecode``: the pool, the step's block tables and key
counts): the engine's attention function then calls ``attend`` and reads no gathered keys.
"""

from __future__ import annotations

import importlib.util
import math
import os
from dataclasses import dataclass

import torch

from ...errors import UnsupportedAttentionError

MAX_HEAD_DIM = 256
MAX_GROUP = 64
DEFAULT_SPLITS = 8
DTYPES = (torch.float32, torch.float16, torch.bfloat16)

_kernels = None
_built_interpreted: bool | None = None  # whether the kernels were decorated under the interpreter


def interpreted() -> bool:
    """Whether Triton's interpreter is asked for (``TRITON_INTERPRET``): kernels then run on CPU tensors, in numpy."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def available() -> bool:
    """Whether the kernel can run here: triton importable, and a CUDA device or the interpreter. Imports nothing."""
    if importlib.util.find_spec("triton") is None:
        return False
    return interpreted() or torch.cuda.is_available()


def kernels():
    """The Triton kernels' module (imports triton on the first call). ``triton.jit`` reads ``TRITON_INTERPRET`` when
    it decorates them, so the interpreter is on for them, or off, for the life of the process."""
    global _kernels, _built_interpreted
    if _kernels is None:
        from ...kernels import paged_decode

        if interpreted() and not paged_decode.interpreted_library():
            _refuse("TRITON_INTERPRET=1 was set after triton was imported (torch._dynamo imports it), so triton's "
                    "own jit functions were built for a GPU; set it in the environment before Python starts")
        _kernels, _built_interpreted = paged_decode, interpreted()
    return _kernels


def built_interpreted() -> bool | None:
    """Whether the kernels were built for the interpreter (None: not built yet in this process)."""
    return _built_interpreted


def splits_for(rows: int, kv_heads: int, programs: int = 264) -> int:
    """A split count for a batch bucket: the smallest power of two that gives ``rows * kv_heads * splits`` at least
    ``programs`` stage-1 programs (two waves of an H100's or H200's 132 SMs), between 1 and 64. A function of the
    bucket's shape only, so one recorded graph keeps it."""
    s = 1
    while s < 64 and rows * kv_heads * s < programs:
        s *= 2
    return s


def _pow2(n: int, least: int = 16) -> int:
    return max(least, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


def _refuse(why: str) -> None:
    raise UnsupportedAttentionError(f"paged decode attention: {why}")


def _check_shapes(q, k_pool, v_pool, block_tables, lengths, page, num_splits, block_n, window, softcap) -> None:
    if q.dim() != 3 or k_pool.dim() != 3 or v_pool.shape != k_pool.shape:
        _refuse(f"expects q [B, H, D] and pool tensors [slots, KV, D] of one shape (q {tuple(q.shape)}, k "
                f"{tuple(k_pool.shape)}, v {tuple(v_pool.shape)})")
    b, h, d = q.shape
    kvh = k_pool.shape[1]
    if k_pool.shape[2] != d:
        _refuse(f"query head dim {d} != pool head dim {k_pool.shape[2]}")
    if d > MAX_HEAD_DIM:
        _refuse(f"head dim {d} is over {MAX_HEAD_DIM}")
    if h % kvh:
        _refuse(f"{h} query heads are not a multiple of {kvh} KV heads")
    if h // kvh > MAX_GROUP:
        _refuse(f"{h // kvh} query heads per KV head is over {MAX_GROUP}")
    for name, t in (("q", q), ("k_pool", k_pool), ("v_pool", v_pool)):
        if t.dtype not in DTYPES:
            _refuse(f"{name} is {t.dtype}; float32, float16 or bfloat16 only")
        if t.stride(-1) != 1:
            _refuse(f"{name}'s head dimension is not contiguous (strides {t.stride()})")
    if interpreted() and torch.bfloat16 in (q.dtype, k_pool.dtype):
        _refuse("bfloat16 under Triton's interpreter (numpy has no bfloat16); run it on a GPU")
    if block_tables.dim() != 2 or block_tables.shape[0] != b or block_tables.dtype != torch.int32:
        _refuse(f"block_tables must be int32 [B={b}, W] (got {block_tables.dtype} {tuple(block_tables.shape)})")
    if lengths.shape != (b,) or lengths.dtype != torch.int32:
        _refuse(f"lengths must be int32 [B={b}] (got {lengths.dtype} {tuple(lengths.shape)})")
    if num_splits < 1 or num_splits & (num_splits - 1) or num_splits > 256:
        _refuse(f"num_splits={num_splits} is not a power of two in 1 .. 256")
    if block_n < 16 or block_n & (block_n - 1):
        _refuse(f"block_n={block_n} is not a power of two >= 16")
    if page < 1 or k_pool.shape[0] % page:
        _refuse(f"the pool's {k_pool.shape[0]} slots are not whole pages of {page}")
    if window is not None and window < 1:
        _refuse(f"sliding window {window} < 1")
    if softcap is not None and not softcap > 0:
        _refuse(f"softcap {softcap} is not positive")
    devices = {t.device for t in (q, k_pool, v_pool, block_tables, lengths)}
    if len(devices) != 1:
        _refuse(f"tensors on several devices: {sorted(map(str, devices))}")
    dev = devices.pop()
    if dev.type == "cuda" and interpreted():
        _refuse("CUDA tensors under Triton's interpreter")
    if dev.type != "cuda" and not interpreted():
        _refuse(f"tensors on {dev}: the kernel runs on CUDA (or on CPU under TRITON_INTERPRET=1)")


def _check_values(k_pool, block_tables, lengths, page) -> None:
    """The host-side contract (one sync): every length fits the block table, every block it reaches is in the pool."""
    width = block_tables.shape[1]
    lens = lengths.to("cpu", torch.int64)
    if bool((lens < 0).any()) or bool((lens > width * page).any()):
        raise ValueError(f"paged decode attention: lengths {lens.tolist()} outside 0 .. {width * page} (a block table "
                         f"of {width} blocks of {page})")
    used = torch.arange(width).unsqueeze(0) < ((lens + page - 1) // page).unsqueeze(1)
    blocks = block_tables.to("cpu", torch.int64)[used]
    if blocks.numel() and (int(blocks.min()) < 0 or int(blocks.max()) >= k_pool.shape[0] // page):
        raise ValueError(f"paged decode attention: a row's block is outside the pool's {k_pool.shape[0] // page} "
                         "blocks")


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                           lengths: torch.Tensor, scale: float | None = None, *, page: int, window: int | None = None,
                           softcap: float | None = None, num_splits: int = DEFAULT_SPLITS, block_n: int = 64,
                           check: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention of ``q`` ``[B, H, D]`` over each row's ``lengths[i]`` keys of the pool (module docstring):
    ``(out [B, H, D] in q's dtype, lse [B, H] float32)``. ``check=None``: check the values unless a CUDA graph is
    being recorded."""
    _check_shapes(q, k_pool, v_pool, block_tables, lengths, page, num_splits, block_n, window, softcap)
    if check is None:
        check = not (q.device.type == "cuda" and torch.cuda.is_current_stream_capturing())
    if check:
        _check_values(k_pool, block_tables, lengths, page)
    b, h, d = q.shape
    kvh = k_pool.shape[1]
    g = h // kvh
    scale = d ** -0.5 if scale is None else float(scale)
    k = kernels()
    if _built_interpreted != interpreted():
        _refuse(f"TRITON_INTERPRET is {'on' if interpreted() else 'off'} but the kernels were built with it "
                f"{'on' if _built_interpreted else 'off'} in this process")
    out = torch.empty((b, h, d), dtype=q.dtype, device=q.device)
    lse = torch.empty((b, h), dtype=torch.float32, device=q.device)
    o_part = torch.empty((b, h, num_splits, d), dtype=torch.float32, device=q.device)
    lse_part = torch.empty((b, h, num_splits), dtype=torch.float32, device=q.device)
    if b == 0:
        return out, lse
    block_d = _pow2(d)
    k.split_kernel[(b, kvh, num_splits)](
        q, k_pool, v_pool, block_tables, lengths, o_part, lse_part,
        scale, float(softcap or 1.0), int(window or 0), block_tables.shape[1] * page, k_pool.shape[0] // page - 1,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1),
        block_tables.stride(0),
        G=g, HEAD_DIM=d, PAGE=page, NUM_SPLITS=num_splits, BLOCK_H=_pow2(g), BLOCK_D=block_d, BLOCK_N=block_n,
        SOFTCAP=softcap is not None, WINDOW=window is not None, num_warps=4, num_stages=1)
    k.merge_kernel[(b, h)](o_part, lse_part, out, lse, out.stride(0), out.stride(1),
                     HEAD_DIM=d, NUM_SPLITS=num_splits, BLOCK_D=block_d, num_warps=4)
    return out, lse


def reference(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
              lengths: torch.Tensor, scale: float | None = None, *, page: int, window: int | None = None,
              softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The same attention in float64, row by row over the keys gathered through the block table: ``(out [B, H, D]
    float64, lse [B, H] float64)``; a row with no key: 0 and -inf."""
    b, h, d = q.shape
    kvh = k_pool.shape[1]
    g = h // kvh
    scale = d ** -0.5 if scale is None else float(scale)
    out = torch.zeros((b, h, d), dtype=torch.float64)
    lse = torch.full((b, h), float("-inf"), dtype=torch.float64)
    for i in range(b):
        n = int(lengths[i])
        lo = max(0, n - window) if window is not None else 0
        if n <= lo:
            continue
        pos = torch.arange(lo, n)
        slots = block_tables[i].long().cpu()[pos // page] * page + pos % page
        keys = k_pool.cpu()[slots].double().transpose(0, 1)  # [KV, L, D]
        values = v_pool.cpu()[slots].double().transpose(0, 1)
        qi = q[i].cpu().double().view(kvh, g, d)
        s = torch.einsum("hgd,hld->hgl", qi, keys) * scale
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        row_lse = torch.logsumexp(s, -1)
        # exp(s - lse), not torch.softmax: the softmax kernel's vectorised exp differs between CPUs (AVX2, AVX-512)
        # by ~1e-10, more than a float64 reference should carry
        lse[i] = row_lse.reshape(h)
        out[i] = torch.einsum("hgl,hld->hgd", torch.exp(s - row_lse.unsqueeze(-1)), values).reshape(h, d)
    return out, lse


# ------------------------------------------------------------------ the engine's attention
@dataclass
class PagedDecode:
    """What a decode forward's attention reads the pool through (``ForwardContext.paged``): the pool's per-layer
    tensors and page size, each row's blocks (``block_tables`` ``[B, W]`` int32) and key count (``key_counts``
    ``[B]`` int32: the row's cached positions and this step's token), and the split count."""

    pool_k: list
    pool_v: list
    page: int
    block_tables: torch.Tensor
    key_counts: torch.Tensor
    num_splits: int = DEFAULT_SPLITS
    check: bool = False  # the tables come from the engine's bookkeeping: no host sync per layer


def attend(query: torch.Tensor, layer: int, paged: PagedDecode, window: int | None, scale: float | None,
           softcap: float | None) -> torch.Tensor:
    """The engine's decode attention over the pool in place: ``query`` ``[B, H, 1, D]`` (this step's token, whose
    key and value the cache view already wrote) -> ``[B, 1, H, D]``, as ``engine_attention`` returns it."""
    b, h, q, d = query.shape
    if q != 1:
        _refuse(f"one query position per row, got {q}")
    out, _ = paged_decode_attention(query.reshape(b, h, d), paged.pool_k[layer], paged.pool_v[layer],
                                    paged.block_tables, paged.key_counts, scale, page=paged.page, window=window,
                                    softcap=softcap, num_splits=paged.num_splits, check=paged.check)
    return out.view(b, 1, h, d)
