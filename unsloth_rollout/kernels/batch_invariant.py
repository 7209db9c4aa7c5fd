"""Batch-invariant float32 ops on CPU, and the dispatch mode that runs a forward on them.

A float32 forward's value for one token depends on more than its inputs: a matmul over 1 row and over 300 rows sums
K in different orders (the BLAS picks its blocking by shape), a reduction splits differently by size, a vectorized
``exp`` gives another last bit in a batch's scalar tail, and attention over a cache sums its keys in another order
than attention over the same forward's keys. So the engine's decode step (one row over a KV cache), its prefill (a
packed row) and a trainer's padded batch forward agree only to ~1e-5. Here every op whose per-element result could
depend on those things is replaced by one whose result depends only on that element's own inputs
(``csrc/batch_invariant.cpp``):

- ``matmul`` (``mm``, ``addmm``, ``bmm``, ``baddbmm``, ``mv``, ``dot``, and a stride-equals-kernel ``convolution`` as
  a matmul over patches): each output a dot product over K in 16 lanes in order of k, fused multiply-adds, one
  fixed tree over the lanes; independent of M, N, tiling and threads.
- row reductions (``sum``, ``mean``, ``var_mean``, ``linalg_vector_norm``, ``native_layer_norm``, RMS norms): the same
  16-lane order over the reduced elements.
- ``softmax`` / ``log_softmax`` / ``logsumexp``: max, a 16-lane sum of ``exp(x - max)``; ``log_softmax(x) = x -
  logsumexp(x)``.
- transcendental elementwise functions (``exp``, ``log``, ``tanh``, ``silu``, ``gelu``, ``rsqrt``, ``pow``, ...): the C
  library's scalar function per element.
- ``attention(q, k, v, mask, scale, softcap)``: each query's attended keys one at a time in position order, so the
  same attended keys give the same bits whether they come from a cache, the same forward, a padded or a packed
  row; SDPA's CPU kernel (``_scaled_dot_product_flash_attention_for_cpu``) is replaced by it too.

``InvariantOps`` is a ``TorchDispatchMode`` (thread-local, below autograd): inside it those aten ops run the
kernels above, ops that are exact whatever the layout (views, copies, indexing, IEEE ``+ - * /``, comparisons, max)
run as they are, backward ops run as they are (gradients may use any correct formula), and any other op on floating
tensors raises ``BitwiseModeError`` naming it: a forward is invariant or refused, never silently approximate.
float32 on CPU only; the GPU version of the same contract (Triton kernels with fixed tiling) needs a device.
"""

from __future__ import annotations

import ctypes
import logging
import math

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..errors import BitwiseModeError
from .build import LazyLibrary, build_library

log = logging.getLogger(__name__)

aten = torch.ops.aten

# bi_unary_f32's functions, by the index the C source gives them
_UNARY = {name: i for i, name in enumerate((
    "exp", "log", "sin", "cos", "tanh", "sigmoid", "silu", "gelu", "gelu_tanh", "rsqrt", "erf", "pow", "expm1",
    "log1p", "softplus", "exp2", "log2", "erfc", "tan", "atan"))}


def _load() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(build_library("batch_invariant", flags=("-ffp-contract=off",))))
    p, i, f, n = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
    lib.bi_matmul_f32.argtypes = [p, p, p] + [i] * 10 + [n]
    lib.bi_rowsum_f32.argtypes = [p, p, i, i, i, n]
    lib.bi_softmax_f32.argtypes = [p, p, i, i, i, i, n, n]
    lib.bi_unary_f32.argtypes = [n, p, p, i, f, f, n]
    lib.bi_attention_f32.argtypes = [p] * 6 + [i] * 22 + [n, f, f, n]
    for fn in (lib.bi_matmul_f32, lib.bi_rowsum_f32, lib.bi_softmax_f32, lib.bi_unary_f32, lib.bi_attention_f32):
        fn.restype = ctypes.c_int
    return lib


_kernels = LazyLibrary(_load, "batch-invariant kernels", "the bitwise mode is refused by name")


def available() -> bool:
    """Whether the kernels are built and loaded (builds them on the first call, ~5 s)."""
    return _kernels.get() is not None


def build_error() -> str | None:
    """Why the kernels could not be built (None: they were, or were not tried yet)."""
    return _kernels.error


def _lib_or_raise():
    lib = _kernels.get()
    if lib is None:
        raise BitwiseModeError(f"the bitwise on-policy mode's CPU kernels could not be built: {_kernels.error}")
    return lib


def _check(x: torch.Tensor, what: str) -> None:
    if x.dtype != torch.float32 or x.device.type != "cpu":
        raise BitwiseModeError(f"the bitwise on-policy mode computes {what} in float32 on CPU only, got {x.dtype} on "
                               f"{x.device} (the GPU version needs a device)")


def _ptr(x: torch.Tensor) -> int:
    return x.data_ptr()


def _threads() -> int:
    return torch.get_num_threads()


def _rc(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"batch-invariant {what} kernel: error {rc}")


# ================================================================== matmul
def _batched(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``[batch, rows, K]`` with a contiguous last dimension and one batch stride (a copy if needed)."""
    x = x.reshape(-1, x.shape[-2], x.shape[-1])
    if x.stride(-1) != 1 or (x.shape[0] > 1 and x.stride(0) < x.shape[1] * x.stride(1) and x.shape[1] > 1):
        x = x.contiguous()
    return x


def matmul_nt(a: torch.Tensor, bt: torch.Tensor) -> torch.Tensor:
    """``a @ bt^T`` for ``a`` ``[*, M, K]`` and ``bt`` ``[*, N, K]`` of the same batch shape: ``[*, M, N]``, every
    element a fixed-order dot product over K."""
    _check(a, "a matmul")
    _check(bt, "a matmul")
    lib = _lib_or_raise()
    batch_shape = a.shape[:-2]
    M, K, N = a.shape[-2], a.shape[-1], bt.shape[-2]
    if bt.shape[-1] != K or bt.shape[:-2] != batch_shape:
        raise RuntimeError(f"matmul_nt: shapes {tuple(a.shape)} and {tuple(bt.shape)} do not match")
    a3, b3 = _batched(a), _batched(bt)
    out = torch.empty((a3.shape[0], M, N), dtype=torch.float32)
    if out.numel():
        _rc(lib.bi_matmul_f32(_ptr(a3), _ptr(b3), _ptr(out), a3.shape[0], M, N, K, a3.stride(0), a3.stride(1),
                              b3.stride(0), b3.stride(1), out.stride(0), out.stride(1), _threads()), "matmul")
    return out.view(*batch_shape, M, N)


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` (``[*, M, K] @ [*, K, N]``, batch dimensions broadcast), batch-invariant."""
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    a = a.expand(*batch, *a.shape[-2:])
    bt = b.transpose(-1, -2).expand(*batch, b.shape[-1], b.shape[-2])
    return matmul_nt(a, bt)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight^T + bias`` over the last dimension of ``x``; each output row depends only on its input row."""
    out = matmul_nt(x.reshape(1, -1, x.shape[-1]), weight.unsqueeze(0)).view(*x.shape[:-1], weight.shape[0])
    return out if bias is None else out + bias


# ================================================================== reductions
def _to_rows(x: torch.Tensor, dims) -> tuple[torch.Tensor, list[int], list[int]]:
    """(``x`` with ``dims`` moved last and flattened into rows ``[rows, n]``, the kept dims, the reduced dims)."""
    nd = x.dim()
    red = sorted({d % nd for d in dims}) if dims else list(range(nd))
    kept = [d for d in range(nd) if d not in red]
    n = 1
    for d in red:
        n *= x.shape[d]
    rows = x.permute(*kept, *red).reshape(-1, n)
    if rows.stride(-1) != 1 or (rows.shape[0] > 1 and rows.stride(0) != n):
        rows = rows.contiguous()
    return rows, kept, red


def _reduced_shape(x: torch.Tensor, kept: list[int], red: list[int], keepdim: bool) -> list[int]:
    return [1 if d in red else x.shape[d] for d in range(x.dim())] if keepdim else [x.shape[d] for d in kept]


def row_sum(x: torch.Tensor, dims=None, keepdim: bool = False) -> torch.Tensor:
    """The sum over ``dims`` (None or empty: all) in a fixed 16-lane order."""
    _check(x, "a sum")
    lib = _lib_or_raise()
    rows, kept, red = _to_rows(x, dims)
    out = torch.empty(rows.shape[0], dtype=torch.float32)
    if rows.shape[0]:
        _rc(lib.bi_rowsum_f32(_ptr(rows), _ptr(out), rows.shape[0], rows.shape[1], max(rows.stride(0), 1),
                              _threads()), "row sum")
    return out.view(_reduced_shape(x, kept, red, keepdim))


def row_mean(x: torch.Tensor, dims=None, keepdim: bool = False) -> torch.Tensor:
    n = 1
    for d in (dims if dims else range(x.dim())):
        n *= x.shape[d]
    return row_sum(x, dims, keepdim) / n


def _softmax_rows(x: torch.Tensor, dim: int, mode: int) -> torch.Tensor:
    _check(x, "a softmax")
    lib = _lib_or_raise()
    moved = x.movedim(dim, -1)
    rows = moved.reshape(-1, moved.shape[-1])
    if rows.stride(-1) != 1 or (rows.shape[0] > 1 and rows.stride(0) != rows.shape[1]):
        rows = rows.contiguous()
    n = rows.shape[1]
    out = torch.empty((rows.shape[0],) if mode == 2 else rows.shape, dtype=torch.float32)
    if rows.shape[0]:
        _rc(lib.bi_softmax_f32(_ptr(rows), _ptr(out), rows.shape[0], n, max(rows.stride(0), 1), max(n, 1), mode,
                               _threads()), "softmax")
    if mode == 2:
        return out.view(moved.shape[:-1])
    return out.view(moved.shape).movedim(-1, dim)


def softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``exp(x - max) / sum``, the sum in a fixed 16-lane order."""
    return _softmax_rows(x, dim, 0)


def log_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``x - logsumexp(x)`` with this module's ``logsumexp``: the engine's sampler and the trainer's recompute run
    this same function under the mode."""
    return _softmax_rows(x, dim, 1)


def logsumexp(x: torch.Tensor, dims, keepdim: bool = False) -> torch.Tensor:
    dims = [dims] if isinstance(dims, int) else list(dims)
    rows, kept, red = _to_rows(x, dims)
    out = _softmax_rows(rows, -1, 2)
    return out.view(_reduced_shape(x, kept, red, keepdim))


# ================================================================== elementwise
def unary(name: str, x: torch.Tensor, p0: float = 0.0, p1: float = 0.0) -> torch.Tensor:
    """``name`` (one of ``_UNARY``) of every element, the C library's scalar function each time."""
    _check(x, name)
    lib = _lib_or_raise()
    src = x.contiguous()
    out = torch.empty(x.shape, dtype=torch.float32)
    if out.numel():
        _rc(lib.bi_unary_f32(_UNARY[name], _ptr(src), _ptr(out), out.numel(), float(p0), float(p1), _threads()),
            name)
    return out


# ================================================================== attention
def attended(mask: torch.Tensor | None, dtype=torch.float32) -> torch.Tensor | None:
    """A mask as booleans (True: attend). A float mask may hold only 0 (attend) and -inf or the dtype's minimum (do
    not): any other value is a bias the kernel does not add, refused by name."""
    if mask is None or mask.dtype == torch.bool:
        return mask
    keep = mask == 0
    if bool(((~keep) & (mask > torch.finfo(mask.dtype).min / 2)).any()):
        raise BitwiseModeError("the bitwise on-policy mode's attention takes masks of 0 and -inf only; this one adds "
                               "a bias to the scores (ALiBi, relative positions)")
    return keep


def _attention_forward(q, k, v, mask, scale: float, softcap: float, causal: bool):
    for t, name in ((q, "queries"), (k, "keys"), (v, "values")):
        _check(t, f"attention {name}")
    lib = _lib_or_raise()
    b, h, nq, d = q.shape
    kvh, lk = k.shape[1], k.shape[2]
    if h % kvh or k.shape[0] != b or v.shape[:3] != k.shape[:3] or k.shape[-1] != d or v.shape[-1] != d:
        raise RuntimeError(f"attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not match")
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    out = torch.empty((b, h, nq, d), dtype=torch.float32)
    lse = torch.empty((b, h, nq), dtype=torch.float32)
    if mask is not None:
        m = mask.expand(b, h, nq, lk).view(torch.uint8)
        ms, mp = m.stride(), _ptr(m)
    else:
        ms, mp = (0, 0, 0, 0), None
    if out.numel():
        _rc(lib.bi_attention_f32(_ptr(q), _ptr(k), _ptr(v), mp, _ptr(out), _ptr(lse), b, h, kvh, nq, lk, d,
                                 q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                                 v.stride(0), v.stride(1), v.stride(2), *ms, out.stride(0), out.stride(1),
                                 out.stride(2), int(causal), float(scale), float(softcap or 0.0), _threads()),
            "attention")
    return out, lse


def _attention_scores_mask(q, k, mask, causal):
    b, h, nq, _ = q.shape
    lk = k.shape[2]
    if mask is not None:
        return mask.expand(b, h, nq, lk)
    if causal:
        return torch.ones(nq, lk, dtype=torch.bool).tril().expand(b, h, nq, lk)
    return torch.ones(b, h, nq, lk, dtype=torch.bool)


class _Attention(torch.autograd.Function):
    """The kernel's forward; the backward is plain attention's gradient in torch ops (any correct formula)."""

    @staticmethod
    def forward(ctx, q, k, v, mask, scale, softcap, causal):
        out, lse = _attention_forward(q.detach(), k.detach(), v.detach(), mask, scale, softcap, causal)
        ctx.save_for_backward(q, k, v, mask if mask is not None else torch.empty(0))
        ctx.has_mask, ctx.scale, ctx.softcap, ctx.causal = mask is not None, scale, softcap, causal
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, mask = ctx.saved_tensors
        mask = mask if ctx.has_mask else None
        g = q.shape[1] // k.shape[1]
        kx, vx = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        s = (q @ kx.transpose(-1, -2)) * ctx.scale
        t = None
        if ctx.softcap:
            t = torch.tanh(s / ctx.softcap)
            s = t * ctx.softcap
        s = s.masked_fill(~_attention_scores_mask(q, k, mask, ctx.causal), float("-inf"))
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)
        dv = p.transpose(-1, -2) @ dout
        dp = dout @ vx.transpose(-1, -2)
        ds = p * (dp - (dp * p).sum(-1, keepdim=True))
        if t is not None:
            ds = ds * (1 - t * t)
        dq = (ds @ kx) * ctx.scale
        dk = (ds.transpose(-1, -2) @ q) * ctx.scale

        def grouped(x):
            return x.view(x.shape[0], k.shape[1], g, *x.shape[2:]).sum(2)

        return dq, grouped(dk), grouped(dv), None, None, None, None


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
              softcap: float | None = None, causal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention ``[B, H, Q, D]`` (and its log-sum-exp ``[B, H, Q]``) of queries ``[B, H, Q, D]`` over keys and values
    ``[B, KV, L, D]`` (query head h reads KV head ``h // (H / KV)``): per query, its attended keys (``mask``
    broadcastable to ``[B, H, Q, L]``, True: attend; or, without one, ``j <= i`` when ``causal``, else all) one at a
    time in key order. Differentiable (the backward is plain attention's)."""
    mask = attended(mask)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        return _Attention.apply(q, k, v, mask, float(scale), float(softcap or 0.0), bool(causal))
    return _attention_forward(q, k, v, mask, float(scale), float(softcap or 0.0), bool(causal))


# ================================================================== the dispatch mode
def _float_tensors(args, kwargs) -> bool:
    def floating(x):
        if isinstance(x, torch.Tensor):
            return x.is_floating_point() or x.is_complex()
        if isinstance(x, (list, tuple)):
            return any(floating(y) for y in x)
        return False

    return any(floating(a) for a in args) or any(floating(a) for a in kwargs.values())


def _mm(a, b):
    return matmul(a, b)


def _addmm(bias, a, b, *, beta=1, alpha=1):
    out = matmul(a, b)
    if alpha != 1:
        out = out * alpha
    if beta == 0:
        return out
    return out + (bias if beta == 1 else bias * beta)


def _mv(a, v):
    return matmul(a, v.unsqueeze(-1)).squeeze(-1)


def _addmv(bias, a, v, *, beta=1, alpha=1):
    return _addmm(bias.unsqueeze(-1), a, v.unsqueeze(-1), beta=beta, alpha=alpha).squeeze(-1)


def _dot(a, b):
    return matmul(a.view(1, -1), b.view(-1, 1)).view(())


def _sum(x, dim=None, keepdim=False, *, dtype=None):
    if dtype not in (None, torch.float32):
        return _refuse(aten.sum.dim_IntList, f"a sum in {dtype or x.dtype}")
    return row_sum(x, dim, keepdim)


def _grouped_mm(a, b, offs=None, bias=None, out_dtype=None):
    """Mixture-of-Experts' grouped matmul, ``a`` ``[M, K]`` rows grouped by ``offs`` (cumulative ends) against ``b``
    ``[G, K, N]``: each group's rows through ``matmul``, so a token's result does not depend on its group's size."""
    if a.dim() != 2 or b.dim() != 3 or offs is None or bias is not None or out_dtype not in (None, torch.float32):
        return _refuse(aten._grouped_mm.default, "a grouped matmul other than [M, K] rows grouped against [G, K, N]")
    out = a.new_empty((a.shape[0], b.shape[-1]))
    start = 0
    for g, end in enumerate(offs.tolist()):
        if end > start:
            out[start:end] = matmul(a[start:end], b[g])
        start = end
    return out


def _mean(x, dim=None, keepdim=False, *, dtype=None):
    if dtype not in (None, torch.float32):
        return _refuse(aten.mean.dim, f"a mean in {dtype}")
    return row_mean(x, dim, keepdim)


def _var_mean(x, dim=None, *, correction=None, keepdim=False):
    mean = row_mean(x, dim, True)
    n = x.numel() // max(mean.numel(), 1)
    c = 1 if correction is None else correction
    centered = x - mean
    var = row_sum(centered * centered, dim, keepdim) / max(n - c, 0)
    return var, (mean if keepdim else mean.view(var.shape))


def _vector_norm(x, ord=2, dim=None, keepdim=False, *, dtype=None):
    if ord != 2 or dtype not in (None, torch.float32):
        return _refuse(aten.linalg_vector_norm.default, f"a vector norm of order {ord}")
    return torch.sqrt(row_sum(x * x, dim, keepdim))


def _layer_norm(x, shape, weight, bias, eps):
    axis = x.dim() - len(shape)
    n = math.prod(shape)
    rows = x.reshape(-1, n)
    mean = row_mean(rows, [1], True)
    centered = rows - mean
    rstd = unary("rsqrt", row_mean(centered * centered, [1], True) + eps)
    out = centered * rstd
    if weight is not None:
        out = out * weight.reshape(-1)
    if bias is not None:
        out = out + bias.reshape(-1)
    stat = list(x.shape[:axis]) + [1] * len(shape)
    return out.view(x.shape), mean.view(stat), rstd.view(stat)


def _rms_norm(x, shape, weight, eps):
    n = math.prod(shape)
    rows = x.reshape(-1, n)
    eps = torch.finfo(torch.float32).eps if eps is None else eps
    rstd = unary("rsqrt", row_mean(rows * rows, [1], True) + eps)
    out = rows * rstd
    if weight is not None:
        out = out * weight.reshape(-1)
    return out.view(x.shape), rstd.view(list(x.shape[:x.dim() - len(shape)]) + [1] * len(shape))


def _softmax(x, dim, half_to_float):
    return softmax(x, dim)


def _log_softmax(x, dim, half_to_float):
    return log_softmax(x, dim)


def _logsumexp(x, dim, keepdim=False):
    return logsumexp(x, dim, keepdim)


def _unary(name):
    def run(x, *rest, **kw):
        return unary(name, x)

    return run


def _gelu(x, *, approximate="none"):
    return unary("gelu_tanh" if approximate == "tanh" else "gelu", x)


def _pow(x, exponent):
    if isinstance(exponent, torch.Tensor) or not isinstance(x, torch.Tensor):
        return _refuse(aten.pow.Tensor_Tensor, "pow with a tensor exponent")
    return unary("pow", x, float(exponent))


def _softplus(x, beta=1, threshold=20):
    return unary("softplus", x, float(beta), float(threshold))


def _convolution(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    """A convolution whose stride equals its kernel (no padding, dilation or groups): a matmul over patches (the
    patch embeddings of vision towers); any other convolution is refused by name."""
    ks = list(weight.shape[2:])
    spatial = list(x.shape[2:])
    if (transposed or groups != 1 or any(p != 0 for p in padding) or any(d != 1 for d in dilation)
            or list(stride) != ks or any(s % k for s, k in zip(spatial, ks))):
        return _refuse(aten.convolution.default, "a convolution other than non-overlapping patches")
    n, c = x.shape[:2]
    patches = x
    for i, k in enumerate(ks):  # [N, C, S1/k1, ..., k1, ...]
        patches = patches.unfold(2 + i, k, k)
    nd = len(ks)
    grid = list(patches.shape[2:2 + nd])
    patches = patches.permute(0, *range(2, 2 + nd), 1, *range(2 + nd, 2 + 2 * nd)).reshape(-1, c * math.prod(ks))
    out = linear(patches, weight.reshape(weight.shape[0], -1), bias)  # [N * P, E]
    return out.view(n, *grid, -1).permute(0, nd + 1, *range(1, nd + 1)).contiguous()


def _sdpa_cpu(q, k, v, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    if dropout_p:
        return _refuse(aten._scaled_dot_product_flash_attention_for_cpu.default, "attention dropout")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out, lse = attention(q, k, v, attn_mask, scale, None, is_causal)
    # the layout SDPA's CPU kernel returns (its backward reads it): [B, Q, H, D] memory, viewed as [B, H, Q, D]
    return out.transpose(1, 2).contiguous().transpose(1, 2), lse


def _with_alpha(func, args, kwargs):
    """``add`` / ``sub`` / ``rsub`` (any overload: in place, out=): exact with ``alpha`` 1; otherwise the scaled operand
    is multiplied first (ATen's vector path fuses ``other * alpha + self`` into one FMA, its scalar tail does not)."""
    alpha = kwargs.get("alpha", args[2] if len(args) > 2 else 1)
    if alpha == 1:
        return func(*args, **kwargs)
    kwargs = {**kwargs, "alpha": 1} if "alpha" in kwargs or len(args) < 3 else kwargs
    args = list(args[:2]) + ([1] if len(args) > 2 else [])
    scaled = 0 if func.overloadpacket is aten.rsub else 1
    args[scaled] = torch.mul(args[scaled], alpha)
    return func(*args, **kwargs)


def _dropout(x, p, train):
    if train and p > 0:
        return _refuse(aten.native_dropout.default, f"dropout (p={p}) in training mode: the trainer's forward would be "
                                                    "random; set lora_dropout / attention_dropout to 0")
    return x.clone(), torch.ones_like(x, dtype=torch.bool)


def _no_duplicates(func, index: torch.Tensor, what: str):
    if index.numel() != torch.unique(index).numel():
        _refuse(func, f"{what} with repeated indices (the order of their sums depends on the batch)")


def _index_add(x, dim, index, source, *, alpha=1):
    _no_duplicates(aten.index_add.default, index, "index_add")
    return aten.index_add.default(x, dim, index, source, alpha=alpha)


def _index_put(x, indices, values, accumulate=False):
    if accumulate:
        _refuse(aten.index_put.default, "index_put with accumulate=True")
    return aten.index_put.default(x, indices, values, False)


def _arange(func, args, kwargs):
    """A floating ``arange`` as ``start + step * i`` per element in float64, then rounded: ATen's vector lanes and
    scalar tail round it differently, so an element's value would depend on the length asked for."""
    dtype = kwargs.get("dtype")
    if dtype is None or not dtype.is_floating_point:
        return func(*args, **kwargs)
    start, end, step = (0, args[0], 1) if len(args) == 1 else (args[0], args[1], args[2] if len(args) > 2 else 1)
    n = max(0, math.ceil((float(end) - float(start)) / float(step)))
    i = torch.arange(n, dtype=torch.int64, device=kwargs.get("device")).to(torch.float64)
    return (i * float(step) + float(start)).to(dtype)


def _cumsum(x, dim, *, dtype=None):
    """A floating cumulative sum is exact, whatever its order, only over integer values below 2^24 (counts, as
    Mixture-of-Experts routing builds them); any other is refused by name."""
    if not (torch.equal(x, x.round()) and float(x.abs().sum()) < 2 ** 24):
        return _refuse(aten.cumsum.default, "a cumulative sum of non-integer floats")
    return aten.cumsum.default(x, dim, dtype=dtype)


def _avg_pool2d(x, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True,
                divisor_override=None):
    """Average pooling over non-overlapping windows (stride = kernel, no padding): each window's fixed-order sum over
    its size; any other pooling is refused by name."""
    ks = list(kernel_size) * (2 if len(kernel_size) == 1 else 1)
    st = list(stride or ks) * (2 if len(stride or ks) == 1 else 1)
    pad = [padding] * 2 if isinstance(padding, int) else list(padding) * (2 if len(padding) == 1 else 1)
    h, w = x.shape[-2:]
    if st != ks or any(pad) or h % ks[0] or w % ks[1]:
        return _refuse(aten.avg_pool2d.default, "an average pooling other than over non-overlapping windows")
    win = x.unfold(-2, ks[0], ks[0]).unfold(-2, ks[1], ks[1])  # [..., H/k, W/k, k0, k1]
    return row_sum(win, [-2, -1]) / (divisor_override or ks[0] * ks[1])


def _refuse(func, what: str):
    raise BitwiseModeError(f"the bitwise on-policy mode has no batch-invariant version of {what} ({func}); the "
                           "forward cannot be made to equal the trainer's bit for bit, so it is refused")


# Replaced ops, by overload: the kernels above.
_REPLACED = {
    aten.mm.default: _mm, aten.bmm.default: _mm, aten.addmm.default: _addmm, aten.baddbmm.default: _addmm,
    aten.mv.default: _mv, aten.addmv.default: _addmv, aten.dot.default: _dot,
    aten.sum.dim_IntList: _sum, aten.sum.default: _sum, aten.mean.dim: _mean, aten.mean.default: _mean,
    aten.var_mean.correction: _var_mean, aten.linalg_vector_norm.default: _vector_norm,
    aten.native_layer_norm.default: _layer_norm, aten._fused_rms_norm.default: _rms_norm,
    aten._softmax.default: _softmax, aten._log_softmax.default: _log_softmax, aten.logsumexp.default: _logsumexp,
    aten.gelu.default: _gelu, aten.pow.Tensor_Scalar: _pow, aten.pow.Tensor_Tensor: _pow,
    aten.softplus.default: _softplus, aten.convolution.default: _convolution,
    aten._scaled_dot_product_flash_attention_for_cpu.default: _sdpa_cpu,
    aten.native_dropout.default: _dropout,
    aten.index_add.default: _index_add, aten.index_put.default: _index_put, aten.avg_pool2d.default: _avg_pool2d,
    aten.cumsum.default: _cumsum, aten._grouped_mm.default: _grouped_mm,
    **{getattr(aten, name).default: _unary(name) for name in (
        "exp", "log", "sin", "cos", "tanh", "sigmoid", "silu", "rsqrt", "erf", "expm1", "log1p", "exp2", "log2",
        "erfc", "tan", "atan")},
}

# Ops whose result is exact whatever the layout, batch or thread count: data movement, indexing, IEEE + - * / and
# sqrt (correctly rounded), comparisons, max / min / sort (order-free), creation.
_EXACT = {getattr(aten, name) for name in (
    "view", "_unsafe_view", "reshape", "t", "transpose", "permute", "expand", "unsqueeze", "squeeze", "slice",
    "select", "alias", "detach", "unbind", "split", "split_with_sizes", "chunk", "narrow", "as_strided", "unfold",
    "clone", "_to_copy", "to", "copy_", "contiguous", "cat", "stack", "index", "index_select", "gather",
    "masked_scatter",
    "masked_fill", "masked_fill_", "where", "embedding", "constant_pad_nd", "repeat", "repeat_interleave", "flip",
    "roll", "tril", "triu", "zeros", "zeros_like", "ones", "ones_like", "full", "full_like", "empty", "empty_like",
    "empty_strided", "new_empty", "new_zeros", "new_ones", "new_full", "new_empty_strided", "scalar_tensor",
    "lift_fresh", "lift_fresh_copy", "_local_scalar_dense", "fill_", "fill", "zero_", "mul", "mul_", "div", "div_",
    "neg", "abs", "reciprocal", "sqrt", "maximum", "minimum", "clamp", "clamp_", "clamp_min", "clamp_max", "sign",
    "floor", "ceil", "round", "trunc", "remainder", "fmod", "floor_divide", "relu", "relu_", "hardtanh", "threshold",
    "eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or", "logical_not", "logical_xor", "bitwise_and",
    "bitwise_or", "bitwise_not", "bitwise_xor", "isnan", "isinf", "isfinite", "nan_to_num", "max", "min", "amax",
    "amin", "argmax", "argmin", "sort", "topk", "_is_all_true", "all", "any", "nonzero", "unique_consecutive",
    "_unique2", "scatter", "scatter_", "index_put_", "index_copy", "index_copy_", "masked_select", "bucketize",
    "searchsorted", "square", "_assert_tensor_metadata", "_assert_async", "resize_", "set_",
    "_has_compatible_shallow_copy_type", "is_same_size", "squeeze_", "unsqueeze_", "view_as_real", "diagonal",
    "expand_as", "movedim", "_reshape_alias", "sym_size", "sym_stride", "sym_numel",
    "sym_storage_offset", "randperm", "histc", "im2col", "one_hot", "bincount", "equal")}

# In-place and out= variants of replaced ops: computed out of place, then copied.
_INPLACE = {getattr(aten, f"{name}_"): getattr(aten, name) for name in (
    "exp", "log", "sin", "cos", "tanh", "sigmoid", "silu", "rsqrt", "erf", "expm1", "log1p", "exp2", "log2", "erfc",
    "tan", "atan", "pow", "addmm", "baddbmm", "index_add")}


class InvariantOps(TorchDispatchMode):
    """Runs the forward ops of the calling thread on this module's batch-invariant kernels (see the module
    docstring); an op on floating tensors it cannot vouch for raises ``BitwiseModeError`` naming it."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if packet is aten.arange:
            return _arange(func, args, kwargs)
        if not _float_tensors(args, kwargs) or "backward" in packet.__name__:  # integers; gradients: any formula
            return func(*args, **kwargs)
        impl = _REPLACED.get(func)
        if impl is not None:
            return impl(*args, **kwargs)
        if packet in (aten.add, aten.add_, aten.sub, aten.sub_, aten.rsub):
            return _with_alpha(func, args, kwargs)
        if packet in _EXACT:
            return func(*args, **kwargs)
        if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd"):
            with self:  # its parts through this mode again (composite ops reach a dispatch mode in inference mode)
                return func.decompose(*args, **kwargs)
        base = _INPLACE.get(packet)
        if base is not None:  # x.op_(...): computed out of place, written back
            res = self.__torch_dispatch__(getattr(base, func._overloadname), types, args, kwargs)
            return args[0].copy_(res)
        default = getattr(packet, "default", None) if "out" in func._overloadname else None
        if default is not None and default in _REPLACED and "out" in kwargs:  # torch.mm(a, b, out=t)
            out = kwargs.pop("out")
            res = _REPLACED[default](*args, **kwargs)
            out.resize_(res.shape)
            return out.copy_(res)
        return _refuse(func, str(func))
