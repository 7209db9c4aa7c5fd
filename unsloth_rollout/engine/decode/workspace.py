"""The eager workspace step: each running sequence owns a persistent row of decode KV; no per-step copy of history.

The paged pool (``KVCache``) is the source of truth for every cached position: prefill, prefix sharing,
preemption and recompute all work on its blocks, and every decode step writes its new token there too.
The workspace is a second home for the history of the sequences now decoding, laid out ``[rows, H, capacity, D]``
per layer, in which each running sequence owns one row. Its history is copied in once, when it joins the decode
batch; every step then writes only the new token into its row (and into the pool) and attention reads the view
``ws[:B, :, :L]`` in place. Rows are kept compacted: when a sequence leaves, the last row moves into the hole
(O(history) once per finish or preemption, not per step).

The rows live inside a byte budget (``DecodeConfig.workspace_bytes``, by default the pool's own size): a step
whose batch would need more (rows x its longest row: one long conversation beside many short rows) decodes through
the gather step instead (``gathering``), so memory stays bounded and the tokens are the same. Rows that share a
prompt's full KV blocks hold only their own positions; the shared ones sit once in the shared-prompt store
(decode/shared_prompts.py).

A row is keyed by the sequence's id *and* its KV incarnation (``Sequence.kv_epoch``, bumped by the core each
time the sequence's KV is computed or recomputed: after preemption or a weight change the row is refilled from
the pool, never reused stale), and by its length (a row whose length is not the sequence's cached length is
refilled too). The compiled step (decode/compiled.py) reads the same rows.
"""

from __future__ import annotations

import torch

from ..attention import ForwardContext
from ..kv_cache import CacheView, KVCache
from .rows import copy_from_pool, regrow
from .shared_prompts import SharedPromptBatch, SharedPromptStore
from .step import DecodeContext, DecodeRows, DecodeStep, step_inputs, write_slots


class DecodeWorkspace:
    """Per-layer ``[rows, H, capacity, D]`` key and value rows of the sequences now decoding."""

    def __init__(self, cache: KVCache, min_capacity: int = 256, budget_bytes: int | None = None,
                 shared_prompts: bool = False, min_shared_tokens: int = 32):
        self.cache = cache
        self.min_capacity = min_capacity
        # Shared prompts (``shared_prompts``): rows whose sequences share their leading full KV blocks (a GRPO
        # group's samples of one prompt, through the prefix cache) hold only their own positions; the shared
        # ones are held once, in the store, and attention reads them once for all the rows that share them.
        self.shared_prompts = shared_prompts
        self.store = SharedPromptStore(cache, min_shared_tokens)
        self.store.on_grow = self._note_peak
        self.origins: list[int] = []  # per row: its first position held (> 0: the rest is its store entry's)
        self.row_entry: list[int] = []  # per row: its store entry, or -1
        self.shared_steps = 0  # decode steps that read shared prompts once per group
        # Most bytes the rows may hold (None: the pool's own size). A batch whose rows x longest row would not fit
        # decodes through the gather step that step instead (``gathering``): never preempted, never over budget.
        self.budget_bytes = cache.memory_bytes if budget_bytes is None else budget_bytes
        self.bytes_per_position = KVCache.bytes_per_token(cache.num_layers, cache.num_kv_heads, cache.head_dim,
                                                          cache.dtype)
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.keys: list[tuple] = []  # per row: (seq_id, kv_epoch)
        self.lengths: list[int] = []  # per row: positions held (0 .. length-1)
        self.gathering = False  # this step's batch did not fit the budget: it decodes through the gather step
        self.fills = 0  # rows filled from the pool (joins), for tests and the profile
        self.moves = 0  # rows moved to keep the rows compacted
        self.fallbacks = 0  # decode steps that gathered because the batch did not fit the budget
        self.peak_bytes = 0  # the most the rows ever held
        self.grows = 0  # times the rows were reallocated (each copies every held row)
        self.rehomed = 0  # whole rows refilled to hold only their own positions once their prompt became shared
        # (rows, length) the batch may reach: rows that may still join, the longest length a row may reach
        # (``arrange``'s hint; growth aims there first, within the budget)
        self.hint: tuple[int, int] | None = None

    @property
    def rows(self) -> int:
        return len(self.keys)

    @property
    def memory_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v) + self.store.memory_bytes

    @property
    def own_lengths(self) -> list[int]:
        """Per row: the positions the row itself holds (its length past its shared prompt)."""
        return [n - o for n, o in zip(self.lengths, self.origins)]

    @property
    def has_shared(self) -> bool:
        """Whether a row of this step reads a shared prompt from the store."""
        return bool(self.store.keys)

    def release(self) -> None:
        """Drop every row and free the tensors (offload; the pool keeps the KV)."""
        self.k, self.v, self.keys, self.lengths = [], [], [], []
        self.origins, self.row_entry = [], []
        self.store.clear()

    def _note_peak(self) -> None:
        self.peak_bytes = max(self.peak_bytes, self.memory_bytes)

    # ------------------------------------------------------------------ storage
    def _shape(self, rows: int, length: int, cur_r: int, cur_c: int, reserve: int = 0) -> tuple[int, int] | None:
        """The (rows, capacity) to grow to: first what the hint says the batch may reach (the rows that may still
        join; the longest length a row may reach, at most twice this length or 256 more), then headroom (rows
        doubled, capacity +25% in steps of 128), when the budget allows; else the least that holds this batch
        (spare rows and positions dropped), else None. ``reserve``: bytes kept free for store entries to come."""
        grow_r = max(rows, 2 * cur_r, 8) if rows > cur_r else cur_r
        grow_c = -(-max(length, cur_c + cur_c // 4, self.min_capacity) // 128) * 128 if length > cur_c else cur_c
        shapes = [(grow_r, grow_c), (rows, grow_c), (rows, -(-length // 128) * 128), (rows, -(-length // 16) * 16)]
        if self.hint is not None:
            hint_r = max(rows, cur_r, self.hint[0])
            hint_c = max(cur_c, -(-max(length, min(self.hint[1] + 1, max(2 * length, length + 256))) // 16) * 16)
            shapes = [(hint_r, hint_c), (rows if rows > cur_r else cur_r, hint_c)] + shapes
        budget = self.budget_bytes - self.store.memory_bytes - reserve
        for r, c in shapes:
            if r * c * self.bytes_per_position <= budget:
                return r, c
        return None

    def ensure(self, rows: int, length: int, reserve: int = 0) -> bool:
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
            regrow(self.cache, store, new_r, new_c, self.rows, keep)
            self._note_peak()
        self.grows += 1
        return True

    def _fill(self, row: int, block_table: list[int], length: int, origin: int = 0) -> None:
        """Copy a sequence's cached positions ``origin .. length-1`` from the pool into ``row`` (once, when it
        joins)."""
        if length <= origin:
            return
        copy_from_pool(self.cache, self.k, self.v, row, self.cache.slots(block_table, origin, length))
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
        if entry >= 0 and (moved := self.store.release(entry)) is not None:
            self.row_entry = [entry if x == moved else x for x in self.row_entry]

    # ------------------------------------------------------------------ the calls
    def arrange(self, keys: list[tuple], lengths: list[int], block_tables: list[list[int]],
                hint: tuple | None = None) -> list[int] | None:
        """Make the rows exactly this step's decode batch; returns, for each row 0..B-1, the index (into the
        arguments) of the sequence it holds. ``lengths[i]``: positions cached in the pool for sequence i. None
        (and ``gathering``) when the batch's rows x (longest + 1) positions do not fit the budget. ``hint``:
        (rows, length[, reach]) the batch may reach, so that the rows grow once where the budget allows. With
        ``shared_prompts``, a joining sequence whose leading full blocks another sequence of the batch shares
        holds only the positions past them; the shared positions go in one store entry. ``reach[i]``: the longest
        length sequence i may reach; with shared prompts the hinted length is the most any row may hold of its
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
        store = self.store
        pkey = {}
        reserve = 0
        origin = {i: 0 for i in joiners}
        if self.shared_prompts and joiners:
            for i in joiners:
                pkey[i] = store.key_of(block_tables[i], lengths[i])
            for i in self._rehome(pkey, want, lengths, block_tables):
                joiners.append(i)
                origin[i] = 0
            count: dict = {}
            for k in [pkey[i] for i in joiners] + [store.keys[e] for e in self.row_entry if e >= 0]:
                if k:
                    count[k] = count.get(k, 0) + 1
            for i in joiners:
                if count.get(pkey[i], 0) >= 2:  # shared by another row of the batch
                    origin[i] = len(pkey[i]) * self.cache.block_size
                else:
                    pkey[i] = ()
            total = store.bytes_for(store.keys + [pkey[i] for i in joiners if pkey[i]], self.bytes_per_position)
            if total > self.budget_bytes:  # the store alone would not fit: whole rows
                origin = {i: 0 for i in joiners}
                pkey = {i: () for i in joiners}
            else:
                reserve = total - store.memory_bytes  # for the entries the joiners will add
        if hint is not None and self.shared_prompts:  # rows grow to their own positions, not the shared ones
            reach = reach if reach is not None else [hint[1]] * len(keys)  # no reach: every row may reach hint[1]
            org = {want[k]: o for k, o in zip(self.keys, self.origins)}
            org.update(origin)
            self.hint = (hint[0], max((reach[i] - org[i] for i in range(len(keys))), default=0))
        own = [self.lengths[r] - self.origins[r] for r in range(self.rows)] + [lengths[i] - origin[i] for i in joiners]
        self.gathering = bool(keys) and not self.ensure(len(keys), max(own, default=0) + 1, reserve)
        if self.gathering:
            self.fallbacks += 1
            return None
        joiners.sort(key=lambda i: origin[i])  # new store entries in order of length (``prompt_chunks``)
        if any(origin[i] for i in joiners):
            store.grow(store.keys + [pkey[i] for i in joiners if origin[i]])
        for i in joiners:
            row = self.rows
            self.keys.append(keys[i])
            self.lengths.append(lengths[i])
            self.origins.append(origin[i])
            self.row_entry.append(store.take(pkey[i]) if origin[i] else -1)
            self._fill(row, block_tables[i], lengths[i], origin[i])
        return [want[k] for k in self.keys]

    def _rehome(self, pkey: dict, want: dict, lengths: list[int], block_tables: list[list[int]]) -> list[int]:
        """Whole rows whose leading blocks a joiner or a store entry now shares leave their rows; returns their
        indices (``pkey`` gets their keys) so that they join again holding only their own positions. This is the
        first sample of a group that decoded alone before its siblings arrived (AReaL and the server submit a
        group's samples one by one): left whole, it would make every row's own part as long as its history."""
        new = {k for k in pkey.values() if k} | set(self.store.keys)
        if not new:
            return []
        back = []
        for r in range(self.rows - 1, -1, -1):
            if self.row_entry[r] >= 0:
                continue
            i = want[self.keys[r]]
            k = self.store.key_of(block_tables[i], lengths[i])
            if k in new:
                self._drop_row(r)
                pkey[i] = k
                back.append(i)
                self.rehomed += 1
        return back

    def shared_batch(self, device) -> "SharedPromptBatch | None":
        """The store entries of this step's rows, laid out for the attention over them (None: no entry)."""
        return self.store.batch(self.row_entry, device)

    def view(self, write_slots: torch.Tensor, lengths: torch.Tensor, key_len: int, ctx=None) -> "WorkspaceView":
        """The cache view of a decode step over rows 0..B-1 (in ``arrange``'s order): the new token goes into the
        pool (``write_slots``) and into each row at ``lengths[i]``; attention reads ``ws[:B, :, :key_len]``."""
        if not self.ensure(self.rows, key_len):
            raise RuntimeError("decode workspace: the arranged batch does not fit its budget")
        return WorkspaceView(self, write_slots, lengths, key_len, ctx)

    def advance(self) -> None:
        """After a decode forward that wrote one token into every row."""
        self.lengths = [n + 1 for n in self.lengths]

    def check_arranged(self, rows: DecodeRows) -> None:
        if self.keys != list(rows.keys) or self.lengths != list(rows.lengths):
            raise RuntimeError("decode rows are not arranged: call arrange_decode with this batch first")


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


class WorkspaceStep(DecodeStep):
    """Each step eager, over the workspace's rows (the rows a step that does not fit fall back to gathering)."""

    name = "workspace"

    def __init__(self, context: DecodeContext, workspace: DecodeWorkspace):
        self.context, self.workspace = context, workspace

    def arrange(self, keys, lengths, block_tables, hint=None) -> list[int]:
        order = self.workspace.arrange(keys, lengths, block_tables, hint)
        return list(range(len(keys))) if order is None else order

    def run(self, rows: DecodeRows) -> torch.Tensor:
        c, ws = self.context, self.workspace
        ws.check_arranged(rows)
        write_t = torch.tensor(write_slots(rows.block_tables, rows.lengths, c.kv.block_size), device=c.device)
        input_ids, pos, lens_t = step_inputs(c, rows.tokens, rows.lengths, rows.deltas)
        if ws.has_shared:  # rows hold their own positions; shared prompts are read once per group
            own_t = torch.tensor(ws.own_lengths, device=c.device)
            lmax = int(own_t.max()) + 1
            ctx = ForwardContext.decode(own_t, lmax)
            ctx.shared = ws.shared_batch(c.device)
            ws.shared_steps += 1
            view = ws.view(write_t, own_t, lmax, ctx)
        else:
            lmax = max(rows.lengths) + 1
            ctx = ForwardContext.decode(lens_t, lmax)
            view = ws.view(write_t, lens_t, lmax, ctx)
        logits = c.forward(input_ids, pos, ctx, view, rows.adapters)
        ws.advance()
        return logits

    def release(self) -> None:
        self.workspace.release()
