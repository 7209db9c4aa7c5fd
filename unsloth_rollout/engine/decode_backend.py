"""Decode attention backends: where a decode step's keys and values come from.

The paged pool (``KVCache``) is the source of truth for every cached position: prefill, prefix sharing,
preemption and recompute all work on its blocks, and every decode step writes its new token there too.
What a backend decides is how the decode step's attention *reads* each row's history:

- ``"gather"``: index_select every row's whole history out of the pool into a fresh ``[B, H, L, D]`` tensor,
  per layer, per step. O(batch x context) bytes copied every step; kept for the compiled (bucketed) decode
  and as the reference.
- ``"workspace"``: a persistent decode workspace per layer, laid out ``[rows, H, capacity, D]``, in which each
  running sequence owns one row. Its history is copied in once, when it joins the decode batch; every step
  then writes only the new token into its row (and into the pool) and attention reads the view
  ``ws[:B, :, :L]`` in place. Rows are kept compacted: when a sequence leaves, the last row moves into the hole
  (O(history) once per finish or preemption, not per step). No per-step copy of the history.
  The rows live inside a byte budget (``EngineConfig.decode_workspace_bytes``, by default the pool's own
  size): a step whose batch would need more (rows x its longest row: one long conversation beside many short
  rows) decodes through the gather path instead, so memory stays bounded and the tokens are the same.

A row is keyed by the sequence's id *and* its KV incarnation (``Sequence.kv_epoch``, bumped by the core each
time the sequence's KV is computed or recomputed: after preemption or a weight change the row is refilled from
the pool, never reused stale), and by its length (a row whose length is not the sequence's cached length is
refilled too). A CUDA paged-attention kernel reading the pool's blocks in place (varlen with a block table)
would be a third backend behind the same two calls: ``arrange`` and ``view``.
"""

from __future__ import annotations

import torch

from .kv_cache import CacheView, KVCache

DECODE_BACKENDS = ("gather", "workspace", "static")


class DecodeWorkspace:
    """Per-layer ``[rows, H, capacity, D]`` key and value rows of the sequences now decoding."""

    def __init__(self, cache: KVCache, min_capacity: int = 256, budget_bytes: int | None = None):
        self.cache = cache
        self.min_capacity = min_capacity
        # Most bytes the rows may hold (None: the pool's own size). A batch whose rows x longest row would not fit
        # decodes through the gather path that step instead (``gathering``): never preempted, never over budget.
        self.budget_bytes = cache.memory_bytes if budget_bytes is None else budget_bytes
        self.bytes_per_position = KVCache.bytes_per_token(cache.num_layers, cache.num_kv_heads, cache.head_dim,
                                                          cache.dtype)
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.keys: list[tuple] = []  # per row: (seq_id, kv_epoch)
        self.lengths: list[int] = []  # per row: positions held (0 .. length-1)
        self.gathering = False  # this step's batch did not fit the budget: it decodes through the gather path
        self.fills = 0  # rows filled from the pool (joins), for tests and the profile
        self.moves = 0  # rows moved to keep the rows compacted
        self.fallbacks = 0  # decode steps that gathered because the batch did not fit the budget
        self.peak_bytes = 0  # the most the rows ever held
        self.grows = 0  # times the rows were reallocated (each copies every held row)
        # (rows, length) the batch may reach: rows that may still join, the longest length a row may reach
        # (``arrange``'s hint; growth aims there first, within the budget)
        self.hint: tuple[int, int] | None = None

    @property
    def rows(self) -> int:
        return len(self.keys)

    @property
    def memory_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def release(self) -> None:
        """Drop every row and free the tensors (offload; the pool keeps the KV)."""
        self.k, self.v, self.keys, self.lengths = [], [], [], []

    # ------------------------------------------------------------------ storage
    def _shape(self, rows: int, length: int, cur_r: int, cur_c: int) -> tuple[int, int] | None:
        """The (rows, capacity) to grow to: first what the hint says the batch may reach (the rows that may still
        join; the longest length a row may reach, at most twice this length or 256 more), then headroom (rows
        doubled, capacity +25% in steps of 128), when the budget allows; else the least that holds this batch
        (spare rows and positions dropped), else None."""
        grow_r = max(rows, 2 * cur_r, 8) if rows > cur_r else cur_r
        grow_c = -(-max(length, cur_c + cur_c // 4, self.min_capacity) // 128) * 128 if length > cur_c else cur_c
        shapes = [(grow_r, grow_c), (rows, grow_c), (rows, -(-length // 128) * 128), (rows, -(-length // 16) * 16)]
        if self.hint is not None:
            hint_r = max(rows, cur_r, self.hint[0])
            hint_c = max(cur_c, -(-max(length, min(self.hint[1] + 1, max(2 * length, length + 256))) // 16) * 16)
            shapes = [(hint_r, hint_c), (rows if rows > cur_r else cur_r, hint_c)] + shapes
        for r, c in shapes:
            if r * c * self.bytes_per_position <= self.budget_bytes:
                return r, c
        return None

    def _ensure(self, rows: int, length: int) -> bool:
        """Room for ``rows`` rows of ``length`` positions, inside the budget; False when it cannot fit."""
        c = self.cache
        cur_r = self.k[0].shape[0] if self.k else 0
        cur_c = self.k[0].shape[2] if self.k else 0
        if rows <= cur_r and length <= cur_c:
            return True
        shape = self._shape(rows, length, cur_r, cur_c)
        if shape is None:
            return False
        new_r, new_c = shape
        keep = min(cur_c, new_c)  # every held row's length is below ``length`` <= new_c
        n = self.rows
        # Zeros, not empty: masked keys past a row's length are multiplied by a zero weight, never NaN.
        for store in (self.k, self.v):
            for i in range(c.num_layers):  # one layer at a time: the old layer is freed as the new one replaces it
                t = torch.zeros((new_r, c.num_kv_heads, new_c, c.head_dim), dtype=c.dtype, device=c.device)
                if len(store) > i:
                    if n:
                        t[:n, :, :keep].copy_(store[i][:n, :, :keep])
                    store[i] = t
                else:
                    store.append(t)
        self.peak_bytes = max(self.peak_bytes, self.memory_bytes)
        self.grows += 1
        return True

    def _fill(self, row: int, block_table: list[int], length: int) -> None:
        """Copy a sequence's first ``length`` cached positions from the pool into ``row`` (once, when it joins)."""
        if length == 0:
            return
        slots = torch.tensor(self.cache.slots(block_table, 0, length), device=self.cache.device)
        for i in range(self.cache.num_layers):
            self.k[i][row, :, :length].copy_(self.cache.k[i].index_select(0, slots).transpose(0, 1))
            self.v[i][row, :, :length].copy_(self.cache.v[i].index_select(0, slots).transpose(0, 1))
        self.fills += 1

    def _move(self, src: int, dst: int) -> None:
        n = self.lengths[src]
        for store in (self.k, self.v):
            for t in store:
                t[dst, :, :n].copy_(t[src, :, :n])
        self.keys[dst], self.lengths[dst] = self.keys[src], self.lengths[src]
        self.moves += 1

    def _drop_row(self, row: int) -> None:
        last = self.rows - 1
        if row != last:
            self._move(last, row)
        self.keys.pop()
        self.lengths.pop()

    # ------------------------------------------------------------------ the two calls
    def arrange(self, keys: list[tuple], lengths: list[int], block_tables: list[list[int]],
                hint: tuple[int, int] | None = None) -> list[int] | None:
        """Make the rows exactly this step's decode batch; returns, for each row 0..B-1, the index (into the
        arguments) of the sequence it holds. ``lengths[i]``: positions cached in the pool for sequence i. None
        (and ``gathering``) when the batch's rows x (longest + 1) positions do not fit the budget. ``hint``:
        (rows, length) the batch may reach, so that the rows grow once where the budget allows."""
        self.hint = hint
        want = {k: i for i, k in enumerate(keys)}
        if len(want) != len(keys):
            raise ValueError("decode batch holds the same sequence twice")
        for r in range(self.rows - 1, -1, -1):  # leavers, stale incarnations and rows out of step
            i = want.get(self.keys[r])
            if i is None or self.lengths[r] != lengths[i]:
                self._drop_row(r)
        self.gathering = bool(keys) and not self._ensure(len(keys), max(lengths, default=0) + 1)
        if self.gathering:
            self.fallbacks += 1
            return None
        have = set(self.keys)
        joiners = [i for i, k in enumerate(keys) if k not in have]
        for i in joiners:
            row = self.rows
            self.keys.append(keys[i])
            self.lengths.append(lengths[i])
            self._fill(row, block_tables[i], lengths[i])
        return [want[k] for k in self.keys]

    def view(self, write_slots: torch.Tensor, lengths: torch.Tensor, key_len: int, ctx=None) -> "WorkspaceView":
        """The cache view of a decode step over rows 0..B-1 (in ``arrange``'s order): the new token goes into the
        pool (``write_slots``) and into each row at ``lengths[i]``; attention reads ``ws[:B, :, :key_len]``."""
        if not self._ensure(self.rows, key_len):
            raise RuntimeError("decode workspace: the arranged batch does not fit its budget")
        return WorkspaceView(self, write_slots, lengths, key_len, ctx)

    def advance(self) -> None:
        """After a decode forward that wrote one token into every row."""
        self.lengths = [n + 1 for n in self.lengths]


class WorkspaceView(CacheView):
    def __init__(self, ws: DecodeWorkspace, write_slots: torch.Tensor, lengths: torch.Tensor, key_len: int, ctx):
        super().__init__(ws.cache, write_slots, None, key_len, ctx)
        self.ws = ws
        self.row_index = torch.arange(lengths.shape[0], device=lengths.device)
        self.positions = lengths

    def _update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int):
        b, q = key_states.shape[0], key_states.shape[2]
        assert q == 1, "the decode workspace takes one new token per row"
        self._write_pool(key_states, value_states, layer_idx)
        wk, wv = self.ws.k[layer_idx], self.ws.v[layer_idx]
        wk[self.row_index, :, self.positions] = key_states[:, :, 0, :].to(wk.dtype)  # [B, H, D]
        wv[self.row_index, :, self.positions] = value_states[:, :, 0, :].to(wv.dtype)
        n = self._seq_length
        keys, values = wk[:b, :, :n], wv[:b, :, :n]  # views: no copy of the history
        return keys.to(key_states.dtype), values.to(value_states.dtype)
