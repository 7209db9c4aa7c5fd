"""Per-layer ``[rows, H, capacity, D]`` tensors beside the pool (the workspace's rows, the shared-prompt store's
entries): grown in one regrow, filled from the pool."""

from __future__ import annotations

import torch


def regrow(cache, store: list[torch.Tensor], first: int, cap: int, n: int, keep: int) -> None:
    """Replace each layer's tensor of ``store`` with a ``[first, H, cap, D]`` one holding the first ``n`` rows' first
    ``keep`` positions. Zeros, not empty: masked keys past a row's length are multiplied by a zero weight, never
    NaN. One layer at a time: the old is freed as the new replaces it."""
    for i in range(cache.num_layers):
        t = torch.zeros((first, cache.num_kv_heads, cap, cache.head_dim), dtype=cache.dtype, device=cache.device)
        if i < len(store):
            if n:
                t[:n, :, :keep].copy_(store[i][:n, :, :keep])
            store[i] = t
        else:
            store.append(t)


def copy_from_pool(cache, k: list[torch.Tensor], v: list[torch.Tensor], index: int, slots: list[int]) -> None:
    """Copy the pool's keys and values at ``slots`` into ``k[layer][index, :, :len(slots)]`` (and ``v``)."""
    idx = torch.tensor(slots, device=cache.device)
    n = len(slots)
    for i in range(cache.num_layers):
        k[i][index, :, :n].copy_(cache.k[i].index_select(0, idx).transpose(0, 1))
        v[i][index, :, :n].copy_(cache.v[i].index_select(0, idx).transpose(0, 1))
