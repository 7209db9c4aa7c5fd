"""The engine's attention: masks from the engine's own bookkeeping, arithmetic from the model's.

transformers builds attention masks inside each decoder, and for an attention name it does not know
it builds none at all (``masking_utils._preprocess_mask_arguments``: "we don't need a mask"); only
some decoders accept a ready mask mapping. So the engine never trusts the mask a model passes. For
every engine forward the runner describes the batch in a ``ForwardContext`` (query and key positions
per row, which keys are real, image blocks that attend bidirectionally), and the engine's attention
function builds each layer's mask from it and from the layer's ``sliding_window`` (the argument every
transformers decoder passes to its attention function). The arithmetic itself (scaling, logit
soft-capping, grouped-query heads) is the model's configured implementation: SDPA, or the modeling
file's own ``eager_attention_forward`` — what the trainer's forward runs.

Every forward also proves the model used the engine's cache: each decoder layer must write through
the ``CacheView`` exactly once and attend over exactly the keys the view returned. A model that
bypasses it (a patched fast path such as Unsloth's text ``CausalLM_fast_forward`` on CUDA, or remote
code with its own attention) raises ``CacheBypassError`` at its first forward; nothing it produced is
returned.
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass, field

import torch

from .. import bitwise
from . import internals
from .decode import cpu_kernel, paged_attention
from ..errors import CacheBypassError, ModelNotServableError, UnsupportedAttentionError  # noqa: F401  (re-exported)

ATTN_NAME = "unsloth_rollout_attention"
CTX_KWARG = "unsloth_rollout_ctx"

# What a user does about a model whose forward bypasses the engine's cache.
BYPASS_REMEDY = ("Load the model with load_model(..., backend='transformers') (load_model(backend='auto') does so "
                 "for Unsloth's text fast-path families on CUDA) or without trust_remote_code.")

# Attention-function arguments that change the arithmetic in ways the engine does not reproduce.
_UNSUPPORTED_KWARGS = ("s_aux", "sinks", "attention_chunk_size", "position_bias")


@dataclass
class ForwardContext:
    """What the attention function needs to know about one engine forward.

    ``q_pos``: [B, Q] position of each query token. ``k_pos``: [B or 1, K] position of each key the
    cache view returns; ``k_valid``: [B, K] whether that key is real (padded rows attend to nothing
    past their length). ``block``: optional [B, K] image-block id per key position (-1: text) for
    families whose image tokens attend bidirectionally within one image (Gemma 3); in prefill the
    queries are the keys, so the same ids serve both. ``spans``: the ``(start, end)`` of each prompt of a packed
    prefill (several prompts in one row): each prompt attends only to its own positions, in an attention of its
    own (``parts``), so a pack costs the sum of its prompts' squares, not the square of their sum.
    """

    kind: str
    q_pos: torch.Tensor
    k_pos: torch.Tensor
    k_valid: torch.Tensor | None
    block: torch.Tensor | None = None
    causal_fast_path: bool = False  # prefill of one unpadded row without blocks: is_causal=True
    check: bool = True  # count cache use (off inside a compiled region)
    spans: list | None = None
    inner: str = "sdpa"  # the model's own attention arithmetic: "sdpa" | "eager" | "fused" (flash/flex)
    # decode over rows that hold only their own positions: the shared prompts they attend to as well
    # (decode/shared_prompts.py; attention reads each once for all its rows, ``shared_prompt_attention``)
    shared: object | None = None
    # the compiled step: this layer's shared-prompt store tensors (pk, pv), so one graph serves every layer
    shared_kv: tuple | None = None
    # decode: each row's query position, which is also its count of cached keys (keys 0..lengths[i] are real);
    # with ``kernel`` the attention reads exactly those keys through decode/cpu_kernel.py instead of a mask
    lengths: torch.Tensor | None = None
    kernel: bool = False
    # the bitwise on-policy mode (unsloth_rollout/bitwise.py): attention through its one batch-invariant function
    bitwise: bool = False
    # decode that reads the paged pool in place (decode/paged_attention.py's ``PagedDecode``: the pool, each row's
    # blocks and key count): the cache view returns only this step's keys, and the attention reads the rest itself
    paged: object | None = None
    # what the layers asked of their attention in this forward (checked forwards): (sliding window, softcap?)
    seen: set = field(default_factory=set)
    writes: dict = field(default_factory=dict)
    reads: dict = field(default_factory=dict)
    returned: dict = field(default_factory=dict)
    _masks: dict = field(default_factory=dict)
    _parts: list | None = None

    @classmethod
    def prefill(cls, length: int, device, block: torch.Tensor | None = None) -> "ForwardContext":
        pos = torch.arange(length, device=device).unsqueeze(0)
        return cls("prefill", pos, pos, None, block, causal_fast_path=block is None)

    @classmethod
    def paged_decode(cls, lengths: torch.Tensor, paged, check: bool = True) -> "ForwardContext":
        """One query per row at position ``lengths[i]``, attending to keys 0 .. lengths[i] read from the pool through
        ``paged`` (a ``PagedDecode``); the keys the cache view returns are this step's only (``k_pos``)."""
        pos = lengths.view(-1, 1)
        return cls("decode", pos, pos, None, check=check, lengths=lengths, paged=paged)

    @classmethod
    def decode(cls, lengths: torch.Tensor, key_len: int, check: bool = True) -> "ForwardContext":
        """One query per row at position ``lengths[i]``; keys 0..key_len-1, real up to ``lengths[i]``."""
        k_pos = torch.arange(key_len, device=lengths.device).unsqueeze(0)
        return cls("decode", lengths.view(-1, 1), k_pos, k_pos <= lengths.view(-1, 1), check=check, lengths=lengths)

    def key_range(self, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode: each row's attended keys ``lo .. hi - 1`` under this sliding window (``mask(window)``'s True
        span), built once per forward."""
        r = self._masks.get(("range", window))
        if r is None:
            r = self._masks[("range", window)] = cpu_kernel.key_range(self.lengths, window)
        return r

    def mask(self, window: int | None) -> torch.Tensor:
        """[B, 1, Q, K] boolean mask (True: attend) for a layer with this sliding window."""
        m = self._masks.get(window)
        if m is None:
            q = self.q_pos.unsqueeze(-1)  # [B, Q, 1]
            k = self.k_pos.unsqueeze(1)  # [B|1, 1, K]
            m = k <= q
            if self.block is not None:  # OR(causal, same image block), as transformers composes it
                qb = self.block.unsqueeze(-1)
                m = m | ((qb >= 0) & (qb == self.block.unsqueeze(1)))
            if window is not None:
                m = m & (k > q - window)
            if self.k_valid is not None:
                m = m & self.k_valid.unsqueeze(1)
            m = m.unsqueeze(1)
            self._masks[window] = m
        return m

    def additive_mask(self, window: int | None, dtype: torch.dtype) -> torch.Tensor:
        """``mask(window)`` as SDPA turns a boolean mask into a float one (0 where True, -inf where False), made
        once per forward instead of in every layer's attention call (where SDPA on CPU converts it twice)."""
        m = self._masks.get((window, dtype))
        if m is None:
            b = self.mask(window)
            m = torch.zeros(b.shape, dtype=dtype, device=b.device).masked_fill_(~b, float("-inf"))
            self._masks[(window, dtype)] = m
        return m

    def parts(self) -> list["ForwardContext"]:
        """One prefill context per span (its positions, its image blocks; unchecked: the pack is checked once)."""
        if self._parts is None:
            self._parts = [ForwardContext("prefill", self.q_pos[:, s:e], self.k_pos[:, s:e], None,
                                          None if self.block is None else self.block[:, s:e],
                                          causal_fast_path=self.block is None, check=False, inner=self.inner,
                                          bitwise=self.bitwise)
                           for s, e in self.spans]
        return self._parts

    # ------------------------------------------------------------------ the cache-use guard
    def record_write(self, layer_idx: int, keys: torch.Tensor) -> None:
        if self.check:
            self.writes[layer_idx] = self.writes.get(layer_idx, 0) + 1
            self.returned[layer_idx] = keys

    def record_read(self, module, key: torch.Tensor) -> None:
        if not self.check:
            return
        idx = getattr(module, "layer_idx", None)
        ret = self.returned.get(idx)
        if ret is None or ret.data_ptr() != key.data_ptr() or ret.shape != key.shape:
            raise CacheBypassError(
                f"{type(module).__name__} (layer {idx}) attended over keys that did not come from the engine's "
                "KV cache view: the model's forward keeps a cache of its own (a patched fast path such as Unsloth's "
                f"text-model forward on CUDA, or remote code), so its tokens and logprobs would be wrong. "
                f"{BYPASS_REMEDY}")
        self.reads[idx] = self.reads.get(idx, 0) + 1

    def verify(self, model, num_layers: int) -> None:
        """Every decoder layer wrote once and read once through the engine's cache in this forward."""
        if not self.check:
            return
        want = {i: 1 for i in range(num_layers)}
        if self.writes == want and self.reads == want:
            return
        missing_w = sorted(set(range(num_layers)) - set(self.writes))
        missing_r = sorted(set(range(num_layers)) - set(self.reads))
        raise CacheBypassError(
            f"{type(model).__name__}: in this {self.kind} forward, layers {missing_w or '-'} did not write and "
            f"layers {missing_r or '-'} did not attend through the engine's KV cache (writes {self.writes}, "
            f"reads {self.reads}, expected one each for {num_layers} layers). The model's forward bypasses the "
            "cache the engine passes as past_key_values (a patched fast path such as Unsloth's text-model "
            "CausalLM_fast_forward on CUDA, or remote code with its own attention), so its tokens and logprobs "
            f"would be wrong. {BYPASS_REMEDY}")


def legacy_cache_read(kind: str) -> CacheBypassError:
    """The refusal for a forward that reads ``past_key_values`` as a legacy per-layer tuple.

    Unsloth's text fast path (``LlamaModel_fast_forward`` / ``CausalLM_fast_forward``, what
    ``FastLanguageModel`` installs for llama, mistral, gemma, gemma2, qwen2 and qwen3 on CUDA) reads
    ``past_key_values[0][0]`` and attends over KV buffers of its own, so the engine's cache would not be used."""
    return CacheBypassError(
        f"the model's {kind} forward reads past_key_values as a legacy tuple of per-layer (key, value) tensors "
        "(past_key_values[layer][0]) instead of writing and reading through the engine's KV cache view, as "
        "Unsloth's text-model fast path (FastLanguageModel on CUDA: LlamaModel_fast_forward) does; it keeps KV "
        f"buffers of its own, so its tokens and logprobs would not be the engine's. {BYPASS_REMEDY}")


_local = threading.local()


def set_current(ctx: ForwardContext | None) -> None:
    """Fallback for decoders that do not pass extra forward kwargs down to their attention."""
    _local.ctx = ctx


def _eager_for(module):
    fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if fn is None:
        from transformers.models.llama.modeling_llama import eager_attention_forward as fn
    return fn


def engine_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                     **kwargs):
    """Attention for engine forwards (registered in transformers' AttentionInterface as ATTN_NAME)."""
    ctx = kwargs.pop(CTX_KWARG, None) or getattr(_local, "ctx", None)
    if ctx is None:
        raise CacheBypassError(f"{type(module).__name__}: engine attention called outside an engine forward")
    for name in _UNSUPPORTED_KWARGS:
        if kwargs.get(name) is not None:
            raise UnsupportedAttentionError(
                f"{type(module).__name__} passes '{name}' to its attention function; the engine cannot reproduce "
                "that arithmetic exactly")
    ctx.record_read(module, key)
    window = kwargs.get("sliding_window")
    window = int(window) if window else None
    if ctx.check:
        ctx.seen.add((window, kwargs.get("softcap") is not None))
    if ctx.spans is not None:  # a packed prefill: each prompt's queries attend to that prompt's keys only
        outs = [_attend(module, query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], part, window, scaling, kwargs)
                for (s, e), part in zip(ctx.spans, ctx.parts())]
        return torch.cat(outs, dim=1), None
    return _attend(module, query, key, value, ctx, window, scaling, kwargs), None


def _attend(module, query, key, value, ctx: ForwardContext, window, scaling, kwargs) -> torch.Tensor:
    """The attention output ``[B, Q, H, D]`` of ``engine_attention``, for one context."""
    if ctx.paged is not None:
        return _paged(module, query, ctx, window, scaling, kwargs)
    if ctx.bitwise:  # bitwise on-policy mode: the one batch-invariant attention the trainer's forward runs too
        return bitwise.attend(query, key, value, ctx.mask(window), scaling, kwargs.get("softcap"))
    inner = ctx.inner
    if inner == "eager" or (kwargs.get("softcap") is not None and inner == "fused"):
        # The modeling file's own eager attention (soft-capping, scaling, GQA as the model defines them),
        # fed the additive mask transformers' eager path uses.
        m = ctx.mask(window)
        add = torch.zeros(m.shape, dtype=query.dtype, device=query.device).masked_fill_(
            ~m, torch.finfo(query.dtype).min)
        return _eager_for(module)(module, query, key, value, add, dropout=0.0, scaling=scaling, **kwargs)[0]
    # SDPA, as transformers' sdpa path computes it (which ignores softcap), reading K/V with native GQA.
    fast = ctx.causal_fast_path and window is None
    b, h, q, d = query.shape
    kvh = key.shape[1]
    kernel = (ctx.kernel and ctx.lengths is not None and ctx.block is None
              and cpu_kernel.supported(query, key, value))
    mask = None if fast or kernel else ctx.additive_mask(window, query.dtype)
    if ctx.shared is not None:
        if q != 1 or window is not None or kwargs.get("softcap") is not None:
            raise UnsupportedAttentionError(f"{type(module).__name__}: a shared-prompt decode step reached a layer "
                                            "with a sliding window or soft-capping")
        if kernel:  # each row's shared prompt, then its own keys, under one softmax (rows of a group: from cache)
            pb = ctx.shared
            pk, pv = ctx.shared_kv if ctx.shared_kv is not None else (pb.pk[module.layer_idx], pb.pv[module.layer_idx])
            out, _ = cpu_kernel.decode_attention_prefixed(query, key, value, *ctx.key_range(None), pk, pv, pb.pe,
                                                          pb.plen, scaling)
            return out.view(b, 1, h, d)
        return shared_prompt_attention(query, key, value, mask, scaling, ctx.shared, module.layer_idx)
    if kernel:  # one query per row over exactly its real keys, read in place (no mask)
        out, _ = cpu_kernel.decode_attention(query, key, value, *ctx.key_range(window), scaling)
        return out.view(b, 1, h, d)
    if q == 1 and kvh != h and mask is not None:
        # One query per row (decode): the G = H / KV query heads that share a KV head become G query rows of
        # that head, so each row's history is read once per KV head, in place. With a mask, SDPA's own GQA
        # on CPU expands K/V per query head (H / KV times the history's bytes per step). Same dot products,
        # same softmax, per query: query head i reads KV head i // G, as transformers' repeat_kv maps them.
        out = torch.nn.functional.scaled_dot_product_attention(
            query.reshape(b, kvh, h // kvh, d), key, value, attn_mask=mask, dropout_p=0.0, scale=scaling)
        return out.reshape(b, 1, h, d)  # CUDA's fp32 kernels return it strided by heads: no view
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, dropout_p=0.0, scale=scaling, is_causal=fast and query.shape[2] > 1,
        enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2).contiguous()


def _paged(module, query, ctx: ForwardContext, window, scaling, kwargs) -> torch.Tensor:
    """Decode attention read from the pool in place (decode/paged_attention.py). The arithmetic ``_attend`` would
    run: soft-capping where the model's eager function computes it (``inner`` "eager", or "fused" with a softcap),
    none under SDPA (transformers' sdpa path drops it); scaling, sliding window and grouped-query heads as the model
    passes them."""
    if ctx.bitwise or ctx.shared is not None or ctx.block is not None or query.shape[2] != 1:
        raise UnsupportedAttentionError(
            f"{type(module).__name__}: paged decode attention serves one query per row without the bitwise mode, "
            "shared prompts or image blocks")
    softcap = kwargs.get("softcap") if ctx.inner in ("eager", "fused") else None
    return paged_attention.attend(query, module.layer_idx, ctx.paged, window, scaling, softcap)


def _flash(q, k, v, mask, scale):
    """CPU flash attention with its log-sum-exp (what SDPA runs on CPU, minus the LSE it drops)."""
    if mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
    return internals.cpu_flash_attention(q, k, v, mask, scale)


def shared_prompt_attention(query, key, value, mask, scaling, pb, layer_idx, own=None):
    """A decode step's attention when rows hold only their own positions and several rows share a prompt.

    Each row attends to its own positions (``key`` / ``value``: the rows' ``[B, KV, L, D]``, ``mask``) and, when
    it has one, to its shared prompt's positions: all the rows of an entry go in as query rows of one attention
    over the entry's keys, so a GRPO group's prompt is read once per step instead of once per sample. The two
    softmaxes are merged exactly by their log-sum-exps (``o = (e^l1 o1 + e^l2 o2) / (e^l1 + e^l2)``, as flash
    attention merges key blocks). Grouped-query heads as in the plain decode: query head i reads KV head i // G.
    ``own``: the rows' own attention and its log-sum-exp when already computed (the CPU kernel's)."""
    b, h, _, d = query.shape
    kvh = key.shape[1]
    g = h // kvh
    qg = query.reshape(b, kvh, g, d)
    o1, l1 = own if own is not None else _flash(qg, key, value, mask, scaling)  # [B, KV, G, D], [B, KV, G]
    pk, pv = pb.pk[layer_idx], pb.pv[layer_idx]
    qp = qg[pb.q_index]  # [n, m, KV, G, D]: each entry's rows
    qp = qp.permute(0, 2, 1, 3, 4).reshape(pb.n, kvh, pb.m * g, d)
    parts = [_flash(qp[a:b], pk[a:b, :, :p].to(query.dtype), pv[a:b, :, :p].to(query.dtype),
                    pb.mask[a:b, :, :, :p].to(query.dtype), scaling) for a, b, p in pb.chunks]
    o2, l2 = parts[0] if len(parts) == 1 else (torch.cat([o for o, _ in parts]), torch.cat([l for _, l in parts]))
    o2 = o2.view(pb.n, kvh, pb.m, g, d).permute(0, 2, 1, 3, 4)[pb.entry, pb.slot]  # back to rows: [B, KV, G, D]
    l2 = l2.view(pb.n, kvh, pb.m, g).permute(0, 2, 1, 3)[pb.entry, pb.slot]
    l2 = l2.masked_fill(pb.alone.view(b, 1, 1), float("-inf"))
    top = torch.maximum(l1, l2)
    w1, w2 = (l1 - top).exp().unsqueeze(-1), (l2 - top).exp().unsqueeze(-1)
    out = (o1 * w1 + torch.where(w2 > 0, o2, 0.0) * w2) / (w1 + w2)
    return out.to(query.dtype).reshape(b, 1, h, d)


def register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, engine_attention)


def inner_implementation(name: str | None) -> str:
    """How the engine reproduces a model's configured attention: "sdpa" (transformers' sdpa path, which
    ignores logit soft-capping), "eager" (the modeling file's own function), or "fused" (flash / flex
    kernels: SDPA arithmetic, soft-capping honoured through the eager function)."""
    name = str(name) if name is not None else "sdpa"
    if "sdpa" in name:
        return "sdpa"
    if name == "eager":
        return "eager"
    if "flash" in name or "flex" in name:
        return "fused"
    raise UnsupportedAttentionError(
        f"attention implementation {name!r} is not one the engine reproduces; load the model with "
        f"attn_implementation='sdpa' or 'eager'")
