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
from .prefix_batch import PrefixBatch

DECODE_BACKENDS = ("gather", "workspace", "static")


class DecodeWorkspace:
    """Per-layer ``[rows, H, capacity, D]`` key and value rows of the sequences now decoding."""

    def __init__(self, cache: KVCache, min_capacity: int = 256, budget_bytes: int | None = None,
                 shared_prefix: bool = False, min_prefix: int = 32):
        self.cache = cache
        self.min_capacity = min_capacity
        # Shared prefixes (``shared_prefix``): rows whose sequences share their leading full KV blocks (a GRPO
        # group's samples of one prompt, through the prefix cache) hold only their own positions; the shared
        # ones are held once, in the prefix store, and attention reads them once for all the rows that share them.
        self.shared_prefix = shared_prefix
        self.min_prefix = min_prefix  # fewest shared positions worth a prefix entry
        self.origins: list[int] = []  # per row: its first position held (> 0: the rest is its prefix entry's)
        self.row_entry: list[int] = []  # per row: its prefix entry, or -1
        self.pk: list[torch.Tensor] = []  # per layer [entries, H, prefix capacity, D]
        self.pv: list[torch.Tensor] = []
        self.pkeys: list[tuple] = []  # per entry: ((block, block generation), ...) of the shared blocks
        self.plens: list[int] = []  # per entry: shared positions
        self.prefs: list[int] = []  # per entry: rows that read it
        self.prefix_steps = 0  # decode steps that read shared prefixes once per group
        self.min_entries = 1  # fewest entries the store is sized for (2 for the compiled step: no size-1 dim)
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
        self.rehomed = 0  # whole rows refilled to hold only their own positions once their prefix became shared
        # (rows, length) the batch may reach: rows that may still join, the longest length a row may reach
        # (``arrange``'s hint; growth aims there first, within the budget)
        self.hint: tuple[int, int] | None = None

    @property
    def rows(self) -> int:
        return len(self.keys)

    @property
    def memory_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v + self.pk + self.pv)

    @property
    def prefix_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.pk + self.pv)

    @property
    def own_lengths(self) -> list[int]:
        """Per row: the positions the row itself holds (its length past its shared prefix)."""
        return [n - o for n, o in zip(self.lengths, self.origins)]

    @property
    def has_prefixes(self) -> bool:
        return bool(self.pkeys)

    def release(self) -> None:
        """Drop every row and free the tensors (offload; the pool keeps the KV)."""
        self.k, self.v, self.keys, self.lengths = [], [], [], []
        self.origins, self.row_entry = [], []
        self.pk, self.pv, self.pkeys, self.plens, self.prefs = [], [], [], [], []

    # ------------------------------------------------------------------ storage
    def _shape(self, rows: int, length: int, cur_r: int, cur_c: int, reserve: int = 0) -> tuple[int, int] | None:
        """The (rows, capacity) to grow to: first what the hint says the batch may reach (the rows that may still
        join; the longest length a row may reach, at most twice this length or 256 more), then headroom (rows
        doubled, capacity +25% in steps of 128), when the budget allows; else the least that holds this batch
        (spare rows and positions dropped), else None. ``reserve``: bytes kept free for prefix entries to come."""
        grow_r = max(rows, 2 * cur_r, 8) if rows > cur_r else cur_r
        grow_c = -(-max(length, cur_c + cur_c // 4, self.min_capacity) // 128) * 128 if length > cur_c else cur_c
        shapes = [(grow_r, grow_c), (rows, grow_c), (rows, -(-length // 128) * 128), (rows, -(-length // 16) * 16)]
        if self.hint is not None:
            hint_r = max(rows, cur_r, self.hint[0])
            hint_c = max(cur_c, -(-max(length, min(self.hint[1] + 1, max(2 * length, length + 256))) // 16) * 16)
            shapes = [(hint_r, hint_c), (rows if rows > cur_r else cur_r, hint_c)] + shapes
        budget = self.budget_bytes - self.prefix_bytes - reserve
        for r, c in shapes:
            if r * c * self.bytes_per_position <= budget:
                return r, c
        return None

    def _ensure(self, rows: int, length: int, reserve: int = 0) -> bool:
        """Room for ``rows`` rows of ``length`` positions, inside the budget (less ``reserve`` bytes); False when it
        cannot fit."""
        cur_r = self.k[0].shape[0] if self.k else 0
        cur_c = self.k[0].shape[2] if self.k else 0
        if rows <= cur_r and length <= cur_c:
            return True
        shape = self._shape(rows, length, cur_r, cur_c, reserve)
        if shape is None:
            return False
        new_r, new_c = shape
        keep = min(cur_c, new_c)  # every held row's length is below ``length`` <= new_c
        for store in (self.k, self.v):
            self._regrow(store, new_r, new_c, self.rows, keep)
        self.grows += 1
        return True

    def _regrow(self, store: list[torch.Tensor], first: int, cap: int, n: int, keep: int) -> None:
        """Replace each layer's tensor of ``store`` (rows or prefix entries) with a ``[first, H, cap, D]`` one holding
        the first ``n`` entries' first ``keep`` positions. Zeros, not empty: masked keys past a row's length are
        multiplied by a zero weight, never NaN. One layer at a time: the old is freed as the new replaces it."""
        c = self.cache
        for i in range(c.num_layers):
            t = torch.zeros((first, c.num_kv_heads, cap, c.head_dim), dtype=c.dtype, device=c.device)
            if i < len(store):
                if n:
                    t[:n, :, :keep].copy_(store[i][:n, :, :keep])
                store[i] = t
            else:
                store.append(t)
        self.peak_bytes = max(self.peak_bytes, self.memory_bytes)

    def _from_pool(self, k: list[torch.Tensor], v: list[torch.Tensor], index: int, slots: list[int]) -> None:
        """Copy the pool's keys and values at ``slots`` into ``k[layer][index, :, :len(slots)]`` (and ``v``)."""
        c = self.cache
        idx = torch.tensor(slots, device=c.device)
        n = len(slots)
        for i in range(c.num_layers):
            k[i][index, :, :n].copy_(c.k[i].index_select(0, idx).transpose(0, 1))
            v[i][index, :, :n].copy_(c.v[i].index_select(0, idx).transpose(0, 1))

    def _fill(self, row: int, block_table: list[int], length: int, origin: int = 0) -> None:
        """Copy a sequence's cached positions ``origin .. length-1`` from the pool into ``row`` (once, when it
        joins)."""
        if length <= origin:
            return
        self._from_pool(self.k, self.v, row, self.cache.slots(block_table, origin, length))
        self.fills += 1

    def _move(self, src: int, dst: int) -> None:
        n = self.lengths[src] - self.origins[src]
        for store in (self.k, self.v):
            for t in store:
                t[dst, :, :n].copy_(t[src, :, :n])
        self.keys[dst], self.lengths[dst] = self.keys[src], self.lengths[src]
        self.origins[dst], self.row_entry[dst] = self.origins[src], self.row_entry[src]
        self.moves += 1

    def _drop_row(self, row: int) -> None:
        entry = self.row_entry[row]
        last = self.rows - 1
        if row != last:
            self._move(last, row)
        for lst in (self.keys, self.lengths, self.origins, self.row_entry):
            lst.pop()
        if entry >= 0:
            self.prefs[entry] -= 1
            if self.prefs[entry] == 0:
                self._drop_entry(entry)

    # ------------------------------------------------------------------ the prefix store
    def _prefix_key(self, block_table: list[int], length: int) -> tuple:
        """The leading full blocks this sequence shares with others (KV refcount > 1), each with its allocation
        generation, so a block freed and reused for other KV never matches: () when fewer than ``min_prefix``
        positions. The step's new token (position ``length``) is always the row's own."""
        c, bs = self.cache, self.cache.block_size
        n = 0
        while n < len(block_table) and (n + 1) * bs <= length and c.refcount[block_table[n]] > 1:
            n += 1
        if n * bs < self.min_prefix:
            return ()
        return tuple((b, c.generation[b]) for b in block_table[:n])

    def _entry(self, key: tuple) -> int:
        """The prefix entry holding the positions of these shared blocks, filled from the pool when new (in the
        room ``arrange`` made for the step's new entries: ``_grow_prefix_store``)."""
        try:
            e = self.pkeys.index(key)
        except ValueError:
            e = -1
        if e >= 0:
            self.prefs[e] += 1
            return e
        c = self.cache
        n = len(key) * c.block_size
        e = len(self.pkeys)
        self._from_pool(self.pk, self.pv, e, c.slots([b for b, _ in key], 0, n))
        self.pkeys.append(key)
        self.plens.append(n)
        self.prefs.append(1)
        return e

    def _drop_entry(self, e: int) -> None:
        last = len(self.pkeys) - 1
        if e != last:  # keep the entries compacted: the last moves into the hole
            n = self.plens[last]
            for t in self.pk + self.pv:
                t[e, :, :n].copy_(t[last, :, :n])
            self.pkeys[e], self.plens[e], self.prefs[e] = self.pkeys[last], self.plens[last], self.prefs[last]
            self.row_entry = [e if x == last else x for x in self.row_entry]
        self.pkeys.pop()
        self.plens.pop()
        self.prefs.pop()
        if not self.pkeys:
            self.pk, self.pv = [], []

    def _store_dims(self) -> tuple[int, int]:
        """(entries, capacity) the prefix store has room for now."""
        return (self.pk[0].shape[0], self.pk[0].shape[2]) if self.pk else (0, 0)

    def _prefix_shape(self, keys: list[tuple]) -> tuple[int, int]:
        """(entries, capacity) of a prefix store holding ``keys`` (new ones included): the entries it holds now, or
        the distinct keys, and half as many again once it has grown before (groups that arrive later); the
        longest key's positions."""
        cur_e, cur_c = self._store_dims()
        need = len(set(keys))
        n = max((len(k) for k in keys), default=0) * self.cache.block_size
        ents = cur_e if need <= cur_e else max(need, cur_e + cur_e // 2, self.min_entries)
        return ents, max(cur_c, -(-n // 16) * 16)

    def _prefix_bytes_for(self, keys: list[tuple]) -> int:
        """Bytes the prefix store would take holding ``keys`` (new ones included)."""
        if not keys:
            return 0
        ents, cap = self._prefix_shape(keys)
        return ents * cap * self.bytes_per_position

    def _grow_prefix_store(self, keys: list[tuple]) -> None:
        """Room for ``keys`` in the prefix store, in one regrow: the entries a step adds are then filled in place
        (growing entry by entry doubled the entries each time a longer prefix arrived: 1024 entries of which 16
        were used, on the default bench, once joiners came in order of length)."""
        cur_e, cur_c = self._store_dims()
        ents, cap = self._prefix_shape(keys)
        if ents > cur_e or cap > cur_c:
            for store in (self.pk, self.pv):
                self._regrow(store, ents, cap, len(self.pkeys), cur_c)

    # ------------------------------------------------------------------ the calls
    def arrange(self, keys: list[tuple], lengths: list[int], block_tables: list[list[int]],
                hint: tuple | None = None) -> list[int] | None:
        """Make the rows exactly this step's decode batch; returns, for each row 0..B-1, the index (into the
        arguments) of the sequence it holds. ``lengths[i]``: positions cached in the pool for sequence i. None
        (and ``gathering``) when the batch's rows x (longest + 1) positions do not fit the budget. ``hint``:
        (rows, length[, reach]) the batch may reach, so that the rows grow once where the budget allows. With
        ``shared_prefix``, a joining sequence whose leading full blocks another sequence of the batch shares
        holds only the positions past them; the shared positions go in one prefix entry. ``reach[i]``: the longest
        length sequence i may reach; with shared prefixes the hinted length is the most any row may hold of its
        own (reach less its origin), so rows are not sized to the shared prompt they do not hold."""
        reach = hint[2] if hint is not None and len(hint) > 2 else None
        self.hint = hint = None if hint is None else (hint[0], hint[1])
        want = {k: i for i, k in enumerate(keys)}
        if len(want) != len(keys):
            raise ValueError("decode batch holds the same sequence twice")
        for r in range(self.rows - 1, -1, -1):  # leavers, stale incarnations and rows out of step
            i = want.get(self.keys[r])
            if i is None or self.lengths[r] != lengths[i]:
                self._drop_row(r)
        have = set(self.keys)
        joiners = [i for i, k in enumerate(keys) if k not in have]
        pkey = {}
        reserve = 0
        origin = {i: 0 for i in joiners}
        if self.shared_prefix and joiners:
            for i in joiners:
                pkey[i] = self._prefix_key(block_tables[i], lengths[i])
            for i in self._rehome(pkey, want, lengths, block_tables):
                joiners.append(i)
                origin[i] = 0
            count: dict = {}
            for k in [pkey[i] for i in joiners] + [self.pkeys[e] for e in self.row_entry if e >= 0]:
                if k:
                    count[k] = count.get(k, 0) + 1
            for i in joiners:
                if count.get(pkey[i], 0) >= 2:  # shared by another row of the batch
                    origin[i] = len(pkey[i]) * self.cache.block_size
                else:
                    pkey[i] = ()
            total = self._prefix_bytes_for(self.pkeys + [pkey[i] for i in joiners if pkey[i]])
            if total > self.budget_bytes:  # the prefix store alone would not fit: whole rows
                origin = {i: 0 for i in joiners}
                pkey = {i: () for i in joiners}
            else:
                reserve = total - self.prefix_bytes  # for the entries the joiners will add
        if hint is not None and self.shared_prefix:  # rows grow to their own positions, not the shared ones
            reach = reach if reach is not None else [hint[1]] * len(keys)  # no reach: every row may reach hint[1]
            org = {want[k]: o for k, o in zip(self.keys, self.origins)}
            org.update(origin)
            self.hint = (hint[0], max((reach[i] - org[i] for i in range(len(keys))), default=0))
        own = [self.lengths[r] - self.origins[r] for r in range(self.rows)] + [lengths[i] - origin[i] for i in joiners]
        self.gathering = bool(keys) and not self._ensure(len(keys), max(own, default=0) + 1, reserve)
        if self.gathering:
            self.fallbacks += 1
            return None
        joiners.sort(key=lambda i: origin[i])  # new prefix entries in order of length (``prefix_chunks``)
        if any(origin[i] for i in joiners):
            self._grow_prefix_store(self.pkeys + [pkey[i] for i in joiners if origin[i]])
        for i in joiners:
            row = self.rows
            self.keys.append(keys[i])
            self.lengths.append(lengths[i])
            self.origins.append(origin[i])
            self.row_entry.append(self._entry(pkey[i]) if origin[i] else -1)
            self._fill(row, block_tables[i], lengths[i], origin[i])
        return [want[k] for k in self.keys]

    def _rehome(self, pkey: dict, want: dict, lengths: list[int], block_tables: list[list[int]]) -> list[int]:
        """Whole rows whose leading blocks a joiner or a prefix entry now shares leave their rows; returns their
        indices (``pkey`` gets their keys) so that they join again holding only their own positions. This is the
        first sample of a group that decoded alone before its siblings arrived (AReaL and the server submit a
        group's samples one by one): left whole, it would make every row's own part as long as its history."""
        new = {k for k in pkey.values() if k} | set(self.pkeys)
        if not new:
            return []
        back = []
        for r in range(self.rows - 1, -1, -1):
            if self.row_entry[r] >= 0:
                continue
            i = want[self.keys[r]]
            k = self._prefix_key(block_tables[i], lengths[i])
            if k in new:
                self._drop_row(r)
                pkey[i] = k
                back.append(i)
                self.rehomed += 1
        return back

    def prefix_batch(self, device) -> "PrefixBatch | None":
        """The prefix entries of this step's rows, laid out for the attention over them (None: no entry)."""
        return PrefixBatch.of(self.pk, self.pv, self.plens, self.row_entry, self.cache.dtype, device)

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
