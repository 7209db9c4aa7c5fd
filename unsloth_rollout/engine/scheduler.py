"""Scheduler: which sequences run this step.

Continuous batching: every step, waiting sequences are admitted (FIFO, as far as the KV budget,
``max_num_seqs`` and the per-step prefill token budget allow) and every running sequence decodes
one token. Identical prompts waiting together form one prefill group; a finished prefill stays
in the prefix cache (full blocks shared by reference count) so later identical prompts, such as
the rest of a GRPO group, skip their prefill. When a decode step needs a block and none is free,
prefix entries are evicted first, then the youngest running sequence is preempted (its KV freed,
recomputed when it is admitted again).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from .kv_cache import KVCache
from .prefix_cache import PrefixCache, prefix_key
from .sequence import Sequence, Status


@dataclass
class ScheduledStep:
    prefill_groups: list[list[Sequence]]
    decode: list[Sequence]


class Scheduler:
    def __init__(self, kv: KVCache, max_num_seqs: int, max_prefill_tokens: int, prefix_cache: bool):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.prefix = PrefixCache(kv, prefix_cache)
        self.num_preemptions = 0

    # ------------------------------------------------------------------ queue
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.kv.block_size)

    # ------------------------------------------------------------------ memory
    def free_seq(self, seq: Sequence) -> None:
        if seq.block_table:
            self.kv.free(seq.block_table)
        seq.block_table = []
        seq.num_cached = 0

    def allocate(self, n: int, keep=None) -> list[int] | None:
        """``n`` free blocks, evicting prefix entries (never ``keep``) if needed; None when there are not enough."""
        if not self.prefix.evict_for(n, keep):
            return None
        return self.kv.allocate(n)

    def preempt(self, seq: Sequence, count: bool = True) -> None:
        """Free a running sequence's KV and put it first in line; it is recomputed when admitted again."""
        self.free_seq(seq)
        seq.status = Status.WAITING
        if count:
            seq.num_preemptions += 1
            self.num_preemptions += 1
        self.running.remove(seq)
        self.waiting.appendleft(seq)

    # ------------------------------------------------------------------ scheduling
    def schedule(self) -> ScheduledStep:
        """Grow running sequences by one slot each (preempting if full), then admit waiting ones into what is left.

        Stale prefix entries and running sequences are dealt with by the engine before (weight changes)."""
        decode = self.ensure_decode_slots([s for s in self.running if s.num_cached > 0])
        groups: list[list[Sequence]] = []
        budget = self.max_prefill_tokens
        slots = self.max_num_seqs - len(self.running)
        while self.waiting and slots > 0:
            head = self.waiting[0]
            resumed = bool(head.output_ids)
            key = None if resumed else prefix_key(head)
            cost = head.num_tokens
            cached = key is not None and key in self.prefix
            if not cached and cost > budget and groups:
                break  # over this step's prefill budget; the head goes first next step
            if resumed:
                members = [head]
                need = self.blocks_for(cost)  # recompute prompt + output privately
            else:
                members = [s for s in self.waiting if not s.output_ids and prefix_key(s) == key][:slots]
                partial = 1 if cost % self.kv.block_size else 0  # each member's private copy of the last block
                need = (0 if cached else self.blocks_for(cost)) + len(members) * partial
            # Leave some room for running sequences to grow before taking new ones.
            reserve = len(self.running) // 4
            if self.kv.num_free_blocks - reserve < need and not self.prefix.evict_for(need + reserve, key):
                alone = not self.running and not groups
                if not (alone and self.prefix.evict_for(need, key)):
                    break
            for s in members:
                self.waiting.remove(s)
                if s.scheduled_time is None:  # the first admission ends the request's time in the queue
                    s.scheduled_time = time.perf_counter()
                s.status = Status.RUNNING
                self.running.append(s)
            groups.append(members)
            slots -= len(members)
            if not cached:
                budget -= cost
        return ScheduledStep(groups, [s for s in decode if s.status == Status.RUNNING])

    def ensure_decode_slots(self, seqs: list[Sequence]) -> list[Sequence]:
        """Give each decoding sequence room for one more token, preempting the youngest when full."""
        bs = self.kv.block_size
        out = []
        for seq in list(seqs):
            if seq.status != Status.RUNNING:
                continue
            if seq.num_cached < len(seq.block_table) * bs:
                out.append(seq)
                continue
            while True:
                got = self.allocate(1)
                if got is not None:
                    seq.block_table.extend(got)
                    out.append(seq)
                    break
                victims = [s for s in self.running if s is not seq and s.num_cached > 0]
                if not victims:
                    self.preempt(seq)  # alone and still no room: wait for memory
                    break
                victim = max(victims, key=lambda s: s.arrival_time)
                self.preempt(victim)
                if victim in out:
                    out.remove(victim)
        return out
