"""Split-KV ("flash-decoding") decode attention over the paged KV pool, in Triton.

Imported only by ``unsloth_rollout/engine/decode/paged_attention.py`` (the binding: argument checks, launch, the
float64 reference), and only when asked: importing this module imports triton.

One query position per row over that row's keys, read in place from the pool through its block table:

- stage 1 (``split_kernel``), one program per (row, KV head, split): the G query heads that share the KV head are one
  tile of queries (GQA: query head ``kv * G + g`` reads KV head ``kv``, as transformers' ``repeat_kv`` maps them),
  so every key and value row is loaded once for all of them. The row's attended keys ``lo .. n - 1`` (``n`` its
  length; ``lo = n - window`` under a sliding window) are cut into ``NUM_SPLITS`` equal spans, one per program;
  each walks its span in tiles of ``BLOCK_N`` keys (each key's slot: ``block_table[pos // PAGE] * PAGE + pos %
  PAGE``) with an online softmax (flash attention's rescaling), fp32 throughout, and writes its normalized partial
  output and log-sum-exp.
- stage 2 (``merge_kernel``), one program per (row, query head): the splits merged by their log-sum-exps.

The grid is (rows, KV heads, NUM_SPLITS) and (rows, query heads): fixed by the tensors' shapes, never by their
values, and nothing is read back to the host, so a launch can be recorded in a CUDA graph and replayed as rows
grow. Work per program follows the row's length (the tile loop runs while keys are left: a ``while`` loop, since
Triton's interpreter runs no ``range`` over loaded bounds), so a wide block table costs nothing for short rows.

A row of length 0 reads nothing: its output is 0 and its log-sum-exp -inf. Dot products run on ``tl.dot`` (IEEE
float32 for float32 inputs; half inputs at their precision with float32 accumulation, and the softmax weights cast
to the value dtype before the weighted sum, as flash attention does).
"""

from __future__ import annotations

import triton
import triton.language as tl


def interpreted_library() -> bool:
    """Whether triton.language's own jit functions (``tl.max``, ``tl.sum``, ...) run under the interpreter: triton
    decorates them when it is imported (torch._dynamo imports it), so ``TRITON_INTERPRET=1`` must be set before."""
    return type(tl.max).__name__ == "InterpretedFunction"


@triton.jit
def _tanh(x):
    """tanh in float32 from ``exp`` (the interpreter runs no libdevice): an odd Taylor series below |x| = 0.5 (no
    cancellation near 0; the first omitted term < 1e-8 relative), ``(1 - e^-2|x|) / (1 + e^-2|x|)`` above."""
    a = tl.abs(x)
    e = tl.exp(-2.0 * a)
    big = (1.0 - e) / (1.0 + e)
    x2 = x * x
    p = 6404582.0 / 10854718875.0
    p = p * x2 - 929569.0 / 638512875.0
    p = p * x2 + 21844.0 / 6081075.0
    p = p * x2 - 1382.0 / 155925.0
    p = p * x2 + 62.0 / 2835.0
    p = p * x2 - 17.0 / 315.0
    p = p * x2 + 2.0 / 15.0
    p = p * x2 - 1.0 / 3.0
    small = a + a * x2 * p
    t = tl.where(a < 0.5, small, big)
    return tl.where(x < 0, -t, t)


@triton.jit
def split_kernel(Q, K, V, BT, LENS, O_PART, LSE_PART,
           scale, softcap, window, max_keys, max_block,
           stride_qb, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_bt,
           G: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, NUM_SPLITS: tl.constexpr,
           BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
           SOFTCAP: tl.constexpr, WINDOW: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)

    n = tl.load(LENS + b)
    n = tl.minimum(tl.maximum(n, 0), max_keys)  # never past the block table (the binding refuses it when checking)
    lo = n * 0
    if WINDOW:
        lo = tl.maximum(n - window, 0)
    per = tl.cdiv(n - lo, NUM_SPLITS)
    start = lo + sp * per
    end = tl.minimum(start + per, n)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    h_ok = offs_h < G
    d_ok = offs_d < HEAD_DIM
    heads = kvh * G + offs_h
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=h_ok[:, None] & d_ok[None, :], other=0.0)

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    t = start
    while t < end:  # every tile holds at least one of this split's keys: m is finite after the first
        pos = t + offs_n
        ok = pos < end
        blk = tl.load(BT + b * stride_bt + pos // PAGE, mask=ok, other=0)
        blk = tl.minimum(tl.maximum(blk, 0), max_block)
        slot = blk.to(tl.int64) * PAGE + (pos % PAGE)
        k = tl.load(K + slot[:, None] * stride_ks + kvh * stride_kh + offs_d[None, :],
                    mask=ok[:, None] & d_ok[None, :], other=0.0).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [BLOCK_H, BLOCK_N], fp32
        if SOFTCAP:
            s = softcap * _tanh(s / softcap)
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(V + slot[:, None] * stride_vs + kvh * stride_vh + offs_d[None, :],
                    mask=ok[:, None] & d_ok[None, :], other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m = m_new
        t += BLOCK_N

    seen = l > 0.0  # false for an empty split (a short row, a padded row): output 0, log-sum-exp -inf
    out = acc / tl.where(seen, l, 1.0)[:, None]
    lse = tl.where(seen, m + tl.log(tl.where(seen, l, 1.0)), float("-inf"))
    row = (b * (tl.num_programs(1) * G) + heads) * NUM_SPLITS + sp  # O_PART [B, H, NUM_SPLITS, HEAD_DIM]
    tl.store(O_PART + row[:, None] * HEAD_DIM + offs_d[None, :], out, mask=h_ok[:, None] & d_ok[None, :])
    tl.store(LSE_PART + row, lse, mask=h_ok)


@triton.jit
def merge_kernel(O_PART, LSE_PART, OUT, LSE, stride_ob, stride_oh,
           HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_D: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    row = b * tl.num_programs(1) + h
    lse = tl.load(LSE_PART + row * NUM_SPLITS + offs_s)
    top = tl.max(lse, 0)
    live = lse > float("-inf")
    w = tl.where(live, tl.exp(lse - tl.where(live, top, 0.0)), 0.0)
    total = tl.sum(w, 0)
    o = tl.load(O_PART + (row * NUM_SPLITS + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
                mask=d_ok[None, :], other=0.0)
    any_key = total > 0.0
    out = tl.sum(w[:, None] * o, 0) / tl.where(any_key, total, 1.0)
    tl.store(OUT + b * stride_ob + h * stride_oh + offs_d, out.to(OUT.dtype.element_ty), mask=d_ok)
    tl.store(LSE + row, tl.where(any_key, top + tl.log(tl.where(any_key, total, 1.0)), float("-inf")))
