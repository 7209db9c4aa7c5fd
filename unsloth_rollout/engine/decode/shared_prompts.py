"""Shared prompts: the samples of one prompt read its KV once per decode step, not once per sample.

Rows whose sequences share their leading full KV blocks (a GRPO group's samples of one prompt, through the prefix
cache) hold only their own positions in the decode workspace; the shared positions are held once, as one entry of
the ``SharedPromptStore``. A ``SharedPromptBatch`` says, for one step, which rows read which entry and in how many
attention calls the entries are read (``attention.shared_prompt_attention`` merges the two softmaxes exactly by
their log-sum-exps). The compiled step reads the store as graph inputs (``CompiledSharedPrompts``); the CPU kernel
reads each row's entry and then its own keys under one softmax (``cpu_kernel.decode_attention_prefixed``).
"""

from __future__ import annotations

from itertools import accumulate

import torch

from .rows import copy_from_pool, regrow

# What one more attention call over the store costs, in entry positions it would have to save (on the 2-core CPU:
# ~20 us a call against ~0.09 us an entry position, measured on the default bench's shapes).
SPLIT_COST = 256


class SharedPromptStore:
    """Per layer ``[entries, H, capacity, D]`` keys and values of the prompts the workspace's rows share."""

    def __init__(self, cache, min_tokens: int = 32):
        self.cache = cache
        self.min_tokens = min_tokens  # fewest shared positions worth an entry
        self.min_entries = 1  # fewest entries the store is sized for (2 for the compiled step: no size-1 dim)
        self.k: list[torch.Tensor] = []  # per layer [entries, H, capacity, D]
        self.v: list[torch.Tensor] = []
        self.keys: list[tuple] = []  # per entry: ((block, block generation), ...) of the shared blocks
        self.lengths: list[int] = []  # per entry: shared positions
        self.readers: list[int] = []  # per entry: rows that read it
        self.on_grow = None  # called after each regrow (the workspace's peak-memory gauge)

    @property
    def memory_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def clear(self) -> None:
        self.k, self.v, self.keys, self.lengths, self.readers = [], [], [], [], []

    def key_of(self, block_table: list[int], length: int) -> tuple:
        """The leading full blocks this sequence shares with others (KV refcount > 1), each with its allocation
        generation, so a block freed and reused for other KV never matches: () when fewer than ``min_tokens``
        positions. The step's new token (position ``length``) is always the row's own."""
        c, bs = self.cache, self.cache.block_size
        n = 0
        while n < len(block_table) and (n + 1) * bs <= length and c.refcount[block_table[n]] > 1:
            n += 1
        if n * bs < self.min_tokens:
            return ()
        return tuple((b, c.generation[b]) for b in block_table[:n])

    def take(self, key: tuple) -> int:
        """The entry holding the positions of these shared blocks (one more reader), filled from the pool when new
        (in the room ``grow`` made for the step's new entries)."""
        try:
            e = self.keys.index(key)
        except ValueError:
            e = -1
        if e >= 0:
            self.readers[e] += 1
            return e
        c = self.cache
        n = len(key) * c.block_size
        e = len(self.keys)
        copy_from_pool(c, self.k, self.v, e, c.slots([b for b, _ in key], 0, n))
        self.keys.append(key)
        self.lengths.append(n)
        self.readers.append(1)
        return e

    def release(self, e: int) -> int | None:
        """One reader of entry ``e`` fewer; an entry no row reads is dropped and the last entry moves into its place
        (the store stays compacted): returns the index that moved to ``e`` (rows reading it read ``e`` now)."""
        self.readers[e] -= 1
        if self.readers[e]:
            return None
        last = len(self.keys) - 1
        if e != last:
            n = self.lengths[last]
            for t in self.k + self.v:
                t[e, :, :n].copy_(t[last, :, :n])
            self.keys[e], self.lengths[e], self.readers[e] = self.keys[last], self.lengths[last], self.readers[last]
        self.keys.pop()
        self.lengths.pop()
        self.readers.pop()
        if not self.keys:
            self.k, self.v = [], []
        return last if e != last else None

    def dims(self) -> tuple[int, int]:
        """(entries, capacity) the store has room for now."""
        return (self.k[0].shape[0], self.k[0].shape[2]) if self.k else (0, 0)

    def shape_for(self, keys: list[tuple]) -> tuple[int, int]:
        """(entries, capacity) of a store holding ``keys`` (new ones included): the entries it holds now, or the
        distinct keys, and half as many again once it has grown before (groups that arrive later); the longest
        key's positions."""
        cur_e, cur_c = self.dims()
        need = len(set(keys))
        n = max((len(k) for k in keys), default=0) * self.cache.block_size
        ents = cur_e if need <= cur_e else max(need, cur_e + cur_e // 2, self.min_entries)
        return ents, max(cur_c, -(-n // 16) * 16)

    def bytes_for(self, keys: list[tuple], bytes_per_position: int) -> int:
        """Bytes the store would take holding ``keys`` (new ones included)."""
        if not keys:
            return 0
        ents, cap = self.shape_for(keys)
        return ents * cap * bytes_per_position

    def grow(self, keys: list[tuple]) -> None:
        """Room for ``keys``, in one regrow: the entries a step adds are then filled in place (growing entry by
        entry doubled the entries each time a longer prompt arrived: 1024 entries of which 16 were used, on the
        default bench, once joiners came in order of length)."""
        cur_e, cur_c = self.dims()
        ents, cap = self.shape_for(keys)
        if ents > cur_e or cap > cur_c:
            for store in (self.k, self.v):
                regrow(self.cache, store, ents, cap, len(self.keys), cur_c)
                if self.on_grow is not None:
                    self.on_grow()

    def batch(self, row_entry: list[int], device) -> "SharedPromptBatch | None":
        """The entries of this step's rows (``row_entry[r]``: row r's entry, -1: none), laid out for the attention
        over them; None when the store holds none."""
        return SharedPromptBatch.of(self.k, self.v, self.lengths, row_entry, self.cache.dtype, device)


def prompt_chunks(lengths: list[int]) -> list[tuple[int, int, int]]:
    """The entries ``[a, b)`` each attention call over the store covers, with its padded length: one call over them
    all (every entry padded to the longest), or two over contiguous ranges when that reads fewer padded positions
    by more than SPLIT_COST. Entries join in order of length (``DecodeWorkspace.arrange``), so one split point
    separates short prompts from long ones."""
    n = len(lengths)
    pre = list(accumulate(lengths, max))  # pre[k]: the longest of entries 0..k
    suf = list(accumulate(reversed(lengths), max))[::-1]  # suf[k]: the longest of entries k..n-1
    best, k_best = n * pre[-1], 0
    for k in range(1, n):
        cost = k * pre[k - 1] + (n - k) * suf[k] + SPLIT_COST
        if cost < best:
            best, k_best = cost, k
    return [(0, n, pre[-1])] if not k_best else [(0, k_best, pre[k_best - 1]), (k_best, n, suf[k_best])]


class SharedPromptBatch:
    """One decode step's shared prompts: ``pk[layer][:n, :, :pmax]`` hold entry e's ``plens[e]`` positions
    (``mask``: additive [n, 1, 1, pmax]); ``q_index`` [n, m]: the rows reading each entry (padded); per row,
    ``entry`` / ``slot``: where it sits in ``q_index``, ``alone``: True for rows without an entry.
    ``chunks``: ``(a, b, p)`` per attention call, over entries a..b-1 padded to p positions (``prompt_chunks``).
    ``pe`` [B]: each row's entry (-1: none) and ``plen`` [entries of the store]: each entry's positions, as the CPU
    kernel reads them (``cpu_kernel.decode_attention_prefixed``: no padding, no mask)."""

    def __init__(self, pk, pv, n, pmax, m, mask, q_index, entry, slot, alone, chunks=None, pe=None, plen=None):
        self.pk, self.pv, self.n, self.pmax, self.m = pk, pv, n, pmax, m
        self.mask, self.q_index, self.entry, self.slot, self.alone = mask, q_index, entry, slot, alone
        self.chunks = chunks or [(0, n, pmax)]
        self.pe, self.plen = pe, plen

    @classmethod
    def of(cls, pk, pv, plens: list[int], row_entry: list[int], dtype, device) -> "SharedPromptBatch | None":
        """The batch of a store (``pk`` / ``pv`` per layer, ``plens`` per entry) for rows that read entry
        ``row_entry[r]`` (-1: none); None when there is no entry."""
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
                   torch.tensor([e < 0 for e in row_entry], device=device), prompt_chunks(plens),
                   *step_tensors(row_entry, plens, pk[0].shape[0], len(row_entry), device))


def step_tensors(row_entry: list[int], plens: list[int], entries: int, rows: int, device):
    """(``pe`` [rows]: each row's entry, -1 for none and for padded rows; ``plen`` [entries]: each entry's
    positions, 0 for the store's unused entries): what the CPU kernel reads a step's shared prompts by."""
    pe = torch.full((rows,), -1, dtype=torch.int64)
    pe[: len(row_entry)] = torch.tensor(row_entry, dtype=torch.int64)
    plen = torch.zeros(entries, dtype=torch.int64)
    plen[: len(plens)] = torch.tensor(plens, dtype=torch.int64)
    return pe.to(device), plen.to(device)


class CompiledSharedPrompts:
    """The compiled step's shared prompts (decode/compiled.py): every layer's store tensors (``pk`` / ``pv``, as a
    ``SharedPromptBatch`` holds them) and the step's ``pe`` / ``plen``. Each layer's region gets its own pair
    through ``ForwardContext.shared_kv``, so the graph never indexes the per-layer lists."""

    def __init__(self, pk, pv, pe, plen):
        self.pk, self.pv, self.pe, self.plen = pk, pv, pe, plen
