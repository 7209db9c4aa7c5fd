"""The paged step: decode attention reads every row's history in place from the paged pool, through its block table.

Each step writes the new token's keys and values into the pool (as every step does) and the cache view returns
only those; the engine's attention then reads each row's keys from the pool itself, with the Triton kernel of
decode/paged_attention.py (split-KV over the block tables). Nothing is gathered and nothing is held beside the pool,
and the attention's launch depends on the batch and the block table's width only: the piece a decode step recorded
once per batch bucket as a CUDA graph needs. This step runs it eager, one forward per step (the runner's, as the
gather step does: adapters per row, the cache-use guard).

Configured only (``DecodeConfig(backend="paged")``; ``auto`` never picks it): it needs triton and a CUDA device, or
Triton's interpreter on CPU (the tests). Split count: ``paged_attention.splits_for`` of the batch on CUDA, 2 under the
interpreter (each program runs in Python there).
"""

from __future__ import annotations

import torch

from ..attention import ForwardContext
from ..kv_cache import CacheView
from . import paged_attention
from .step import DecodeContext, DecodeRows, DecodeStep, step_inputs, write_slots


def check_device(device: torch.device) -> None:
    """The paged step's kernel runs on CUDA with triton, or on CPU under Triton's interpreter: else refused by name."""
    ok = paged_attention.available() and (device.type == "cuda" or (device.type == "cpu"
                                                                      and paged_attention.interpreted()))
    if not ok:
        raise ValueError(f"decode backend 'paged' needs triton and a CUDA device (this model is on {device}"
                         f"{'' if paged_attention.available() else ', triton is not importable'}); leave the decode "
                         "backend 'auto'")


class PagedStep(DecodeStep):
    name = "paged"

    def __init__(self, context: DecodeContext):
        check_device(context.device)
        self.context = context

    def tables(self, rows: DecodeRows) -> torch.Tensor:
        """``[B, W]`` int32: each row's blocks holding positions 0 .. lengths[i] (the new token's included), padded
        with the scratch block to the widest row's."""
        bs = self.context.kv.block_size
        need = [-(-(n + 1) // bs) for n in rows.lengths]
        width = max(need)
        pad = self.context.kv.scratch_slot // bs
        return torch.tensor([list(t[:k]) + [pad] * (width - k) for t, k in zip(rows.block_tables, need)],
                            dtype=torch.int32)

    def run(self, rows: DecodeRows) -> torch.Tensor:
        c = self.context
        kv = c.kv
        b = len(rows.tokens)
        input_ids, pos, lens_t = step_inputs(c, rows.tokens, rows.lengths, rows.deltas)
        splits = paged_attention.splits_for(b, kv.num_kv_heads) if c.device.type == "cuda" else 2
        paged = paged_attention.PagedDecode(kv.k, kv.v, kv.block_size, self.tables(rows).to(c.device),
                                            (lens_t + 1).to(torch.int32), splits)
        ctx = ForwardContext.paged_decode(lens_t, paged)
        write_t = torch.tensor(write_slots(rows.block_tables, rows.lengths, kv.block_size), device=c.device)
        view = CacheView(kv, write_t, None, max(rows.lengths) + 1, ctx)
        return c.forward(input_ids, pos, ctx, view, rows.adapters)
