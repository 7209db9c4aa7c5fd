"""Scheduler: which sequences run this step, where their KV goes, and what a step's results mean for them.

Continuous batching: every step, waiting sequences are admitted (FIFO, as far as the KV budget,
``max_num_seqs`` and the per-step prefill token budget allow) and every running sequence decodes
one token. Identical prompts waiting together form one prefill group; a finished prefill stays
in the prefix cache (full blocks shared by reference count) so later identical prompts, such as
the rest of a GRPO group, skip their prefill. When a decode step needs a block and none is free,
prefix entries are evicted first, then the youngest running sequence is preempted (its KV freed,
recomputed when it is admitted again).

The scheduler owns these decisions (vLLM v1's ``schedule`` / ``update_from_output``): ``schedule`` returns the
step's plan (``SchedulerOutput``: the decode rows, room allocated for each, and the groups admitted); after the
step's decode, ``plan_recompute`` and ``plan_prompts`` turn the admitted groups into prefill jobs (blocks
allocated, prefix entries looked up or extended, preemptions done: a ``PrefillPlan``); the core runs the jobs and
hands the results to ``update_from_prefill``, which shares the computed prompts with their groups and returns
the sequences that sample now (a ``PrefillResult``).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch

from .config import PrefillConfig
from .kv_cache import KVCache
from .prefix_cache import PrefixCache, PrefixEntry, prefix_key
from .scoring import PromptScorer
from .sequence import Sequence, Status


PACK_MAX_TOKENS = 4096  # most prompt tokens packed into one prefill forward (its mask is quadratic in them)


@dataclass
class SchedulerOutput:
    """The step's plan, as ``schedule`` made it."""

    groups: list[list[Sequence]]  # admitted this step: a prompt's group, or one resumed sequence
    decode: list[Sequence]  # the sequences that decode one token (room for it allocated)

    @property
    def fresh(self) -> list[list[Sequence]]:
        """Groups of a new prompt."""
        return [g for g in self.groups if not g[0].output_ids]

    @property
    def resumed(self) -> list[Sequence]:
        """Sequences admitted again after preemption or a weight change: prompt + output so far recomputed."""
        return [g[0] for g in self.groups if g[0].output_ids]


@dataclass
class PrefillJob:
    """One prompt a prefill forward computes (a fresh prompt, a next turn's new tokens, or a recompute)."""

    head: Sequence  # the sequence it is computed for: its adapter, request id and prompt (images)
    ids: list[int]  # every token of the prompt: its prompt ids, or prompt + output so far for a recompute
    blocks: list[int]  # the KV blocks its positions are written into
    start: int = 0  # first position computed (> 0: the positions before are a cached prompt's shared KV)
    scorer: PromptScorer | None = None  # scores every prompt position (prompt_logprobs)
    owns_blocks: bool = True  # free ``blocks`` when it is not computed (False: the sequence's own, finish() frees)

    def runner_item(self, kv: KVCache) -> tuple:
        """What ``ModelRunner.prefill_packed`` takes per prompt: (ids, slots, prompt[, start])."""
        return (self.ids, kv.slots(self.blocks, 0, len(self.ids)), self.head.prompt) + ((self.start,) if self.start
                                                                                      else ())

    def release(self, kv: KVCache) -> None:
        if self.owns_blocks:
            kv.free(self.blocks)


@dataclass
class PrefillPlan:
    """The prefill jobs of a step's admitted groups, their blocks allocated, and how they pack into forwards."""

    jobs: dict  # key -> PrefillJob: a seq id (recompute) or a prefix key (a distinct prompt)
    limit: int  # most tokens in one packed forward
    vision: object  # PromptVision: which prompts may share a packed forward
    recompute: bool = False  # the jobs recompute resumed sequences, each its own
    groups: list = field(default_factory=list)  # (group, prefix key) of each prompt group served this step

    def packs(self) -> list[list]:
        """The keys of ``jobs`` in packed forwards: same adapter, packable vision inputs, at most
        ``limit`` tokens each; a longer prompt alone,
        where ``prefill_chunked`` splits it: no prefill forward exceeds the chunk (images aside, see there). A job
        that extends a cached prompt (``start`` > 0) runs alone, from where that prompt ends."""
        packs, open_by_adapter = [], {}
        jobs, limit = self.jobs, self.limit
        for key, job in jobs.items():
            if job.start:
                continue
            if not self.vision.can_pack(job.head.prompt):
                packs.append([key])
                continue
            n, lora = len(job.ids), job.head.lora_name
            cur = open_by_adapter.get(lora)
            if cur is None or cur[1] + n > limit:
                cur = [[], 0]
                open_by_adapter[lora] = cur
                packs.append(cur[0])
            cur[0].append(key)
            cur[1] += n
        return packs + [[k] for k, job in jobs.items() if job.start]


@dataclass
class PrefillResult:
    """What a step's prefill means for its sequences."""

    ready: list = field(default_factory=list)  # (sequence, logits [V]): sample its next token from these
    finished: list = field(default_factory=list)  # (sequence, finish reason, error or None)
    prefill_tokens: int = 0  # prompt positions computed
    prefills: int = 0  # prompts computed
    query_tokens: int = 0  # prompt tokens of the members served (vLLM's prefix_cache_queries)
    hit_tokens: int = 0  # of those, the ones not computed this step (vLLM's prefix_cache_hits)

    def counts(self) -> dict:
        """The core's counters this result adds to."""
        return {"prefill_tokens": self.prefill_tokens, "prefills": self.prefills,
                "prefix_cache_query_tokens": self.query_tokens, "prefix_cache_hit_tokens": self.hit_tokens}

    def computed(self, tokens: int) -> None:
        self.prefill_tokens += tokens
        self.prefills += 1

    def logits(self) -> torch.Tensor:
        return torch.stack([row for _, row in self.ready])


class Scheduler:
    def __init__(self, kv: KVCache, max_num_seqs: int, prefill: PrefillConfig, prefix_cache: bool, vision,
                 vision_ids=frozenset()):
        self.kv = kv
        self.vision = vision  # PromptVision: which prompts may share a packed forward
        self.vision_ids = frozenset(vision_ids)  # image placeholders: a prompt extension holding one needs pixels
        self.max_num_seqs = max_num_seqs
        self.max_prefill_tokens = prefill.max_tokens
        # The packed mask is [total, total]: packs stay small enough that it never outweighs the forward.
        self.pack_limit = min(prefill.max_tokens, prefill.chunk_tokens, PACK_MAX_TOKENS)
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
    def schedule(self) -> SchedulerOutput:
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
        return SchedulerOutput(groups, [s for s in decode if s.status == Status.RUNNING])

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

    # ------------------------------------------------------------------ prefill plans (after the step's decode)
    def plan_recompute(self, seqs: list[Sequence]) -> "PrefillPlan":
        """Resumed sequences (after preemption or a weight change): each gets blocks for prompt + output so far
        and a job computing them privately; one that finds no room goes back first in line."""
        jobs = {}
        for s in seqs:
            blocks = self.allocate(self.blocks_for(s.num_tokens))
            if blocks is None:
                self.preempt(s, count=False)
                continue
            s.block_table = blocks
            jobs[s.seq_id] = PrefillJob(s, s.all_ids, blocks, owns_blocks=False)  # finish() frees a failed one's
        return PrefillPlan(jobs, self.pack_limit, self.vision, recompute=True)

    def plan_prompts(self, groups: list[list[Sequence]], stamp_of) -> "PrefillPlan":
        """Each distinct new prompt once: found in the prefix cache, extending a cached prompt's KV (a next turn),
        or computed into new blocks; a group whose blocks went elsewhere this step goes back first in line."""
        prefix = self.prefix
        jobs: dict = {}  # prefix key -> PrefillJob: the distinct prompts to compute this step
        plan = PrefillPlan(jobs, self.pack_limit, self.vision)
        for group in groups:
            key = prefix_key(group[0])
            want = max((s.sampling.prompt_logprobs for s in group if s.sampling.prompt_logprobs is not None),
                       default=None)
            if want is not None:
                entry = prefix.lookup(key)
                if entry is not None and (entry.scores is None or entry.scores.k < want):
                    prefix.drop(key)  # cached without (enough) scores: computed again below, scored
            if key not in jobs and prefix.lookup(key) is None:
                head = group[0]
                job = None if want is not None else self._extendable(head, stamp_of)
                if job is None:
                    blocks = self.allocate(self.blocks_for(len(head.prompt_ids)), keep=key)
                    if blocks is None:  # memory went elsewhere this step: wait in line, first
                        for s in reversed(group):
                            self.preempt(s, count=False)
                        continue
                    job = PrefillJob(head, head.prompt_ids, blocks,
                                     scorer=PromptScorer(head.prompt_ids, want) if want is not None else None)
                jobs[key] = job
            plan.groups.append((group, key))
        return plan

    def _extendable(self, head: Sequence, stamp_of) -> "PrefillJob | None":
        """A job from ``start`` when ``head``'s prompt extends a cached prompt's KV (a next turn): its block
        table is the cached prompt's full blocks, shared, plus new blocks for the rest, which the step prefills
        from ``start``. None when no cached prompt qualifies, the new tokens hold image placeholders (they need
        their pixels), or memory is short (the prompt is then prefilled whole)."""
        prefix = self.prefix
        if not prefix.enabled:
            return None
        key = prefix_key(head)
        hit = prefix.longest_prefix(key, stamp_of(head.lora_name))
        if hit is None:
            return None
        hit_key, entry = hit
        ids, bs = head.prompt_ids, self.kv.block_size
        full = len(hit_key[0]) // bs
        start = full * bs
        if self.vision_ids and not self.vision_ids.isdisjoint(ids[start:]):
            return None
        new = self.allocate(self.blocks_for(len(ids)) - full, keep=hit_key)
        if new is None:
            return None
        return PrefillJob(head, ids, self.kv.share(entry.blocks[:full]) + new, start)

    # ------------------------------------------------------------------ results
    def update_from_prefill(self, plan: "PrefillPlan", done: dict, failed: dict, version: int,
                            stamp_of) -> "PrefillResult":
        """Apply a plan's computed jobs (``done``: key -> (logits, rope_delta); ``failed``: key -> error): the
        sequences that sample now, with their logits rows, and those to finish."""
        result = PrefillResult()
        if plan.recompute:
            for k, error in failed.items():
                result.finished.append((plan.jobs[k].head, "abort", error))
            for k, (logits, delta) in done.items():
                s = plan.jobs[k].head
                s.num_cached, s.rope_delta = s.num_tokens, delta
                s.kv_stamp, s.kv_version = stamp_of(s.lora_name), version
                s.kv_epoch += 1
                result.computed(s.num_tokens)
                result.ready.append((s, logits))
            return result
        prefix, jobs = self.prefix, plan.jobs
        for k, (logits, delta) in done.items():
            job = jobs[k]
            n, start = len(job.ids), job.start
            scores = job.scorer.result() if job.scorer is not None else None
            prefix.insert(k, PrefixEntry(job.blocks, n, logits, delta, version, stamp_of(job.head.lora_name), scores))
            result.computed(n - start)
            if start:
                prefix.extensions += 1
                prefix.reused_tokens += start
        for group, key in plan.groups:
            if key in failed:
                result.finished += [(s, "abort", failed[key]) for s in group if not s.finished]
                continue
            entry = prefix.lookup(key)
            if entry is None:  # evicted by an earlier group's blocks this step: prefill again next step
                for s in reversed(group):
                    self.preempt(s, count=False)
                continue
            computed_here = jobs.pop(key, None)
            prefix.hits += len(group) - (1 if computed_here is not None else 0)
            # Token counts as vLLM's prefix_cache_queries / hits: each member's prompt, and what it did not compute.
            result.query_tokens += len(group) * entry.num_tokens
            result.hit_tokens += len(group) * entry.num_tokens - (
                entry.num_tokens - computed_here.start if computed_here is not None else 0)
            for s in group:
                if s.sampling.prompt_logprobs is not None:
                    s.prompt_scores = entry.scores
                if s.sampling.max_new_tokens == 0:  # scoring only: nothing to sample
                    result.finished.append((s, "length", None))
                    continue
                own = []
                if prefix.needs_own_block(entry) and (own := self.allocate(1, keep=key)) is None:
                    self.preempt(s, count=False)
                    continue
                s.block_table, s.num_cached, s.rope_delta = prefix.share(entry, own), entry.num_tokens, entry.rope_delta
                s.kv_stamp, s.kv_version = entry.stamp, entry.version
                s.kv_epoch += 1
                result.ready.append((s, entry.logits))
            if not prefix.enabled:
                prefix.drop(key)
        return result
