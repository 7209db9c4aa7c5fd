"""The gather step: every row's history gathered out of the paged pool, per layer, per step.

``index_select`` of each row's whole history into a fresh ``[B, H, L, D]`` tensor: O(batch x context) bytes copied
every step. It holds nothing beside the pool, so it is the step that always runs: the reference, what a batch that
does not fit the workspace's byte budget decodes through, and the one step with no workspace at all.
"""

from __future__ import annotations

import numpy as np
import torch

from ..attention import ForwardContext
from ..kv_cache import CacheView
from .step import DecodeContext, DecodeRows, DecodeStep, step_inputs


class GatherStep(DecodeStep):
    name = "gather"

    def __init__(self, context: DecodeContext):
        self.context = context

    def run(self, rows: DecodeRows) -> torch.Tensor:
        c = self.context
        kv, bs = c.kv, c.kv.block_size
        b, lmax = len(rows.tokens), max(rows.lengths) + 1
        gather = np.full((b, lmax), kv.scratch_slot, dtype=np.int64)
        ar = np.arange(lmax)
        for i, (n, table) in enumerate(zip(rows.lengths, rows.block_tables)):
            blocks = np.asarray(table, dtype=np.int64)
            pos = ar[: n + 1]
            gather[i, : n + 1] = blocks[pos // bs] * bs + pos % bs
        write = gather[np.arange(b), np.asarray(rows.lengths)]
        gather_t = torch.from_numpy(gather).to(c.device)
        write_t = torch.from_numpy(write).to(c.device)
        input_ids, pos, lens_t = step_inputs(c, rows.tokens, rows.lengths, rows.deltas)
        ctx = ForwardContext.decode(lens_t, lmax)
        view = CacheView(kv, write_t, gather_t, lmax, ctx)
        return c.forward(input_ids, pos, ctx, view, rows.adapters)
