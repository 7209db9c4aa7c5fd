"""ModelRunner: one batched forward of the policy with the engine-owned KV cache.

The model is only asked for ``forward()``. Positions are given explicitly per row (M-RoPE
positions for Qwen-VL: text position + the row's rope delta in all three sections), and the
attention mask is passed as a ready ``{"full_attention": mask}`` mapping, which HF decoders use
as is. ``decode_forward`` has fixed-rank inputs so a compiled variant can replace it.
"""

from __future__ import annotations

import inspect

import numpy as np
import torch

from .kv_cache import CacheView, KVCache

ATTN_NAME = "unsloth_rollout_sdpa"


def engine_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                     **kwargs):
    """SDPA with native grouped-query attention: HF's sdpa path repeats K/V per head whenever a mask is
    given (a full copy of the gathered cache every layer and step); ``enable_gqa`` reads them as they are."""
    causal = attention_mask is None and query.shape[2] > 1
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=0.0, scale=scaling, is_causal=causal,
        enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2).contiguous(), None


def _register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, engine_attention)


def _text_dims(cfg) -> tuple[int, int, int]:
    layers = cfg.num_hidden_layers
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return layers, kv, head_dim


def _bucket(n: int, minimum: int = 1) -> int:
    """Next power of two: a handful of decode shapes, so a compiled step is reused."""
    b = minimum
    while b < n:
        b *= 2
    return b


class ModelRunner:
    def __init__(self, policy, kv_cache: KVCache, compile_decode: bool = False, compile_mode: str | None = None):
        self.policy = policy
        self.kv = kv_cache
        self.device = policy.device
        self.mrope = policy.is_vlm
        cfg = policy.config
        self.image_token_id = getattr(cfg, "image_token_id", None)
        self.video_token_id = getattr(cfg, "video_token_id", None)
        self._rope_index = self._find_rope_index() if self.mrope else None
        self.base_default = False  # True when the only adapters are served ones: unnamed rows use the base
        _register_attention()
        # The decoder's config; its attention implementation is switched to the engine's during engine forwards.
        self._text_config = policy.text_config
        self.compile_decode = compile_decode
        self._compiled = None
        if compile_decode:
            # Automatic dynamic shapes on CPU; on CUDA "reduce-overhead" captures CUDA graphs per bucket.
            mode = compile_mode or ("reduce-overhead" if self.device.type == "cuda" else None)
            self._compiled = torch.compile(self._static_decode, mode=mode, dynamic=None)

    def _find_rope_index(self):
        m = self.policy.base_model
        for obj in (getattr(m, "model", None), m):
            fn = getattr(obj, "get_rope_index", None)
            if fn is not None:
                return fn
        raise RuntimeError("vision-language model without get_rope_index: M-RoPE positions unavailable")

    # ------------------------------------------------------------------ positions
    def mrope_positions(self, ids: list[int], grid: torch.Tensor | None) -> tuple[torch.Tensor, int]:
        """[3, 1, L] M-RoPE positions of a prompt and its rope delta."""
        t = torch.tensor([ids], device=self.device)
        if grid is None:
            pos = torch.arange(len(ids), device=self.device).view(1, 1, -1).expand(3, 1, -1)
            return pos, 0
        kwargs = {"image_grid_thw": grid.to(self.device), "attention_mask": torch.ones_like(t)}
        params = inspect.signature(self._rope_index).parameters
        if "mm_token_type_ids" in params:
            tt = torch.zeros_like(t, dtype=torch.int32)
            tt[t == self.image_token_id] = 1
            if self.video_token_id is not None:
                tt[t == self.video_token_id] = 2
            kwargs["mm_token_type_ids"] = tt
        pos, delta = self._rope_index(t, **kwargs)
        return pos, int(delta.view(-1)[0])

    # ------------------------------------------------------------------ forwards
    def _forward(self, input_ids, position_ids, mask, view, adapters=None, **mm):
        mapping = {"full_attention": mask, "sliding_attention": mask}
        if adapters is not None:  # PEFT mixed-adapter batch: one adapter name per row ("__base__" = none)
            mm["adapter_names"] = adapters
        cfg = self._text_config
        saved = cfg._attn_implementation_internal
        cfg._attn_implementation_internal = ATTN_NAME  # the engine holds policy.lock: nothing else runs now
        try:
            out = self.policy.model(input_ids=input_ids, position_ids=position_ids, attention_mask=mapping,
                                    past_key_values=view, use_cache=True, logits_to_keep=1, **mm)
        finally:
            cfg._attn_implementation_internal = saved
        return out.logits[:, -1, :]

    def adapter_names(self, names: list[str | None]) -> list[str] | None:
        """Per-row PEFT adapter names, or None when every row uses the active adapter."""
        if all(n is None for n in names) and not self.base_default:
            return None
        active = "__base__" if self.base_default else getattr(self.policy.model, "active_adapter", "__base__")
        return [active if n is None else n for n in names]

    def prefill(self, ids: list[int], slots: list[int], pixel_values=None, image_grid_thw=None,
                adapter: str | None = None):
        """Run a whole prompt (batch of one), writing its KV into ``slots``. Returns (logits [V], rope_delta)."""
        input_ids = torch.tensor([ids], device=self.device)
        delta = 0
        mm = {}
        if self.mrope:
            position_ids, delta = self.mrope_positions(ids, image_grid_thw)
            if pixel_values is not None:
                mm = {"pixel_values": pixel_values.to(self.device, self.policy.dtype),
                      "image_grid_thw": image_grid_thw.to(self.device)}
        else:
            position_ids = torch.arange(len(ids), device=self.device).unsqueeze(0)
        view = CacheView(self.kv, torch.tensor(slots, device=self.device), None, 0)
        logits = self._forward(input_ids, position_ids, None, view, self.adapter_names([adapter]), **mm)
        return logits[0], delta

    def decode(self, tokens: list[int], lengths: list[int], deltas: list[int], block_tables: list[list[int]],
               adapters: list[str | None] | None = None):
        """One new token per row. ``lengths[i]``: tokens already cached for row i (the new token's position)."""
        bs = self.kv.block_size
        n_rows = len(tokens)
        names = self.adapter_names(adapters or [None] * n_rows)
        static = self._compiled is not None and names is None
        b = _bucket(n_rows) if static else n_rows
        lmax = _bucket(max(lengths) + 1, 64) if static else max(lengths) + 1
        if static and b > n_rows:  # padded rows: one scratch slot, attended to and overwritten
            tokens = list(tokens) + [0] * (b - n_rows)
            deltas = list(deltas) + [0] * (b - n_rows)
        gather = np.full((b, lmax), self.kv.scratch_slot, dtype=np.int64)
        ar = np.arange(lmax)
        for i, (n, table) in enumerate(zip(lengths, block_tables)):
            blocks = np.asarray(table, dtype=np.int64)
            pos = ar[: n + 1]
            gather[i, : n + 1] = blocks[pos // bs] * bs + pos % bs
        lengths = list(lengths) + [0] * (b - n_rows)
        write = gather[np.arange(b), np.asarray(lengths)]
        dev = self.device
        gather_t = torch.from_numpy(gather).to(dev)
        write_t = torch.from_numpy(write).to(dev)
        lens_t = torch.tensor(lengths, device=dev)
        mask = (torch.arange(lmax, device=dev).unsqueeze(0) <= lens_t.unsqueeze(1)).view(b, 1, 1, lmax)
        pos = lens_t.view(b, 1)
        if self.mrope:
            pos = (pos + torch.tensor(deltas, device=dev).view(b, 1)).unsqueeze(0).expand(3, b, 1)
        input_ids = torch.tensor(tokens, device=dev).view(b, 1)
        if static:
            return self._compiled(input_ids, pos, mask, write_t, gather_t)[:n_rows]
        view = CacheView(self.kv, write_t, gather_t, lmax)
        return self._forward(input_ids, pos, mask, view, names)

    def _static_decode(self, input_ids, position_ids, mask, write_slots, gather_index) -> torch.Tensor:
        """The fixed-shape decode step (bucketed batch and length) that torch.compile captures."""
        view = CacheView(self.kv, write_slots, gather_index, gather_index.shape[1])
        return self._forward(input_ids, position_ids, mask, view)
