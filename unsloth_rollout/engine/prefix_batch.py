"""One decode step's shared prefixes, as the attention reads them (``attention.shared_prefix_decode``).

The decode workspace (decode_backend.py) holds each shared prefix once, as an entry of its prefix store; a
``PrefixBatch`` says which rows read which entry, and in how many attention calls the entries are read.
"""

from __future__ import annotations

from itertools import accumulate

import torch

# What one more attention call over the prefix entries costs, in entry positions it would have to save (on the
# 2-core CPU: ~20 us a call against ~0.09 us an entry position, measured on the default bench's shapes).
SPLIT_COST = 256


def prefix_chunks(plens: list[int]) -> list[tuple[int, int, int]]:
    """The entries ``[a, b)`` each attention call over the prefix store covers, with its padded length: one call
    over them all (every entry padded to the longest), or two over contiguous ranges when that reads fewer padded
    positions by more than SPLIT_COST. Entries join in order of length (``arrange``), so one split point separates
    short prompts from long ones."""
    n = len(plens)
    pre = list(accumulate(plens, max))  # pre[k]: the longest of entries 0..k
    suf = list(accumulate(reversed(plens), max))[::-1]  # suf[k]: the longest of entries k..n-1
    best, k_best = n * pre[-1], 0
    for k in range(1, n):
        cost = k * pre[k - 1] + (n - k) * suf[k] + SPLIT_COST
        if cost < best:
            best, k_best = cost, k
    return [(0, n, pre[-1])] if not k_best else [(0, k_best, pre[k_best - 1]), (k_best, n, suf[k_best])]


class PrefixBatch:
    """One decode step's shared prefixes: ``pk[layer][:n, :, :pmax]`` hold entry e's ``plens[e]`` positions
    (``mask``: additive [n, 1, 1, pmax]); ``q_index`` [n, m]: the rows reading each entry (padded); per row,
    ``entry`` / ``slot``: where it sits in ``q_index``, ``alone``: True for rows without a prefix entry.
    ``chunks``: ``(a, b, p)`` per attention call, over entries a..b-1 padded to p positions (``prefix_chunks``).
    ``pe`` [B]: each row's entry (-1: none) and ``plen`` [entries of the store]: each entry's positions, as the CPU
    kernel reads them (``cpu_attention.decode_attention_prefixed``: no padding, no mask)."""

    def __init__(self, pk, pv, n, pmax, m, mask, q_index, entry, slot, alone, chunks=None, pe=None, plen=None):
        self.pk, self.pv, self.n, self.pmax, self.m = pk, pv, n, pmax, m
        self.mask, self.q_index, self.entry, self.slot, self.alone = mask, q_index, entry, slot, alone
        self.chunks = chunks or [(0, n, pmax)]
        self.pe, self.plen = pe, plen

    @classmethod
    def of(cls, pk, pv, plens: list[int], row_entry: list[int], dtype, device) -> "PrefixBatch | None":
        """The batch of a workspace's prefix store (``pk`` / ``pv`` per layer, ``plens`` per entry) for rows that
        read entry ``row_entry[r]`` (-1: none); None when there is no entry."""
        if not plens:
            return None
        n_e, pmax = len(plens), max(plens)
        members: list[list[int]] = [[] for _ in range(n_e)]
        slot = [0] * len(row_entry)
        for r, e in enumerate(row_entry):
            if e >= 0:
                slot[r] = len(members[e])
                members[e].append(r)
        m = max(len(x) for x in members)
        q_index = [x + [x[0]] * (m - len(x)) for x in members]  # padded with a member (its result is unused)
        lens = torch.tensor(plens, device=device)
        mask = torch.zeros((n_e, 1, 1, pmax), dtype=dtype, device=device).masked_fill_(
            (torch.arange(pmax, device=device).view(1, -1) >= lens.view(-1, 1)).view(n_e, 1, 1, pmax), float("-inf"))
        return cls(pk, pv, n_e, pmax, m, mask, torch.tensor(q_index, device=device),
                   torch.tensor([max(e, 0) for e in row_entry], device=device), torch.tensor(slot, device=device),
                   torch.tensor([e < 0 for e in row_entry], device=device), prefix_chunks(plens),
                   *step_tensors(row_entry, plens, pk[0].shape[0], len(row_entry), device))


def step_tensors(row_entry: list[int], plens: list[int], entries: int, rows: int, device):
    """(``pe`` [rows]: each row's prefix entry, -1 for none and for padded rows; ``plen`` [entries]: each entry's
    positions, 0 for the store's unused entries): what the CPU kernel reads a step's prefixes by."""
    pe = torch.full((rows,), -1, dtype=torch.int64)
    pe[: len(row_entry)] = torch.tensor(row_entry, dtype=torch.int64)
    plen = torch.zeros(entries, dtype=torch.int64)
    plen[: len(plens)] = torch.tensor(plens, dtype=torch.int64)
    return pe.to(device), plen.to(device)


class StaticPrefix:
    """The compiled decode step's prefixes (decode_static.py): every layer's store tensors (``pk`` / ``pv``, as a
    ``PrefixBatch`` holds them) and the step's ``pe`` / ``plen``. Each layer's region gets its own pair through
    ``ForwardContext.prefix_kv``, so the graph never indexes the per-layer lists."""

    def __init__(self, pk, pv, pe, plen):
        self.pk, self.pv, self.pe, self.plen = pk, pv, pe, plen
