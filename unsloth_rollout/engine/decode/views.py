"""The cache views of the compiled step (decode/compiled.py), and what a trace of it keeps dynamic."""

from __future__ import annotations

import torch

from .. import internals
from ..kv_cache import CacheView


class CompiledView(CacheView):
    """One decode step's cache: each layer's new token goes into the pool (``write_slots``) and into its
    workspace row at ``lengths[i]``; attention reads ``ws[:B, :, :L]`` in place. All tensors are passed in, so
    a compiled step holds no reference to storage that may move."""

    def __init__(self, cache, pool_k, pool_v, ws_k, ws_v, write_slots, lengths, key_len, ctx):
        super().__init__(cache, write_slots, None, key_len, ctx)
        self.pool_k, self.pool_v, self.ws_k, self.ws_v = pool_k, pool_v, ws_k, ws_v
        self.rows = torch.arange(lengths.shape[0], device=lengths.device)
        self.lengths = lengths

    def _update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int):
        b = key_states.shape[0]
        pk, pv = self.pool_k[layer_idx], self.pool_v[layer_idx]
        k_new, v_new = key_states[:, :, 0, :], value_states[:, :, 0, :]  # [B, H, D]
        pk.index_copy_(0, self.write_slots, k_new.to(pk.dtype))
        pv.index_copy_(0, self.write_slots, v_new.to(pv.dtype))
        wk, wv = self.ws_k[layer_idx], self.ws_v[layer_idx]
        wk[self.rows, :, self.lengths] = k_new.to(wk.dtype)
        wv[self.rows, :, self.lengths] = v_new.to(wv.dtype)
        n = self._seq_length
        return wk[:b, :, :n].to(key_states.dtype), wv[:b, :, :n].to(value_states.dtype)


class LayerView(CacheView):
    """One decoder layer's slice of a step's cache, handed to the compiled layer: its own pool and workspace
    tensors, so the shared graph never indexes a per-layer list (an int guard would compile one graph per
    layer). ``k_pos`` carries the key length as a tensor shape (dynamic), not a Python int (specialized)."""

    def __init__(self, pk, pv, wk, wv, write_slots, rows, lengths, k_pos, ctx):
        self.cache, self.ctx, self.gather_index = None, ctx, None
        self.pk, self.pv, self.wk, self.wv = pk, pv, wk, wv
        self.write_slots, self.rows, self.lengths, self.k_pos = write_slots, rows, lengths, k_pos

    def _update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int):
        b, n = key_states.shape[0], self.k_pos.shape[0]
        k_new, v_new = key_states[:, :, 0, :], value_states[:, :, 0, :]  # [B, H, D]
        self.pk.index_copy_(0, self.write_slots, k_new.to(self.pk.dtype))
        self.pv.index_copy_(0, self.write_slots, v_new.to(self.pv.dtype))
        self.wk[self.rows, :, self.lengths] = k_new.to(self.wk.dtype)
        self.wv[self.rows, :, self.lengths] = v_new.to(self.wv.dtype)
        return self.wk[:b, :, :n].to(key_states.dtype), self.wv[:b, :, :n].to(value_states.dtype)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.k_pos.shape[0] - 1


def mark_step(args) -> None:
    """Mark what a trace of the step keeps dynamic (one graph for every batch, context, workspace size)."""
    input_ids, pos, lens_t, write_t, k_pos, _, _, ws_k, ws_v, shared = args
    for t, d in ((input_ids, 0), (lens_t, 0), (write_t, 0), (pos, pos.dim() - 2)):
        internals.mark_dynamic(t, d)  # one graph; the graph step records one per bucket
    internals.mark_dynamic(k_pos, 0)
    stores = list(ws_k) + list(ws_v) + (list(shared.pk) + list(shared.pv) if shared is not None else [])
    for t in stores:  # rows / entries and capacity grow with the batch, the context, the prompts
        internals.mark_dynamic(t, 0)
        internals.mark_dynamic(t, 2)
    if shared is not None:
        internals.mark_dynamic(shared.pe, 0)
        internals.mark_dynamic(shared.plen, 0)
