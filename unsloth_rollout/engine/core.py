"""EngineCore: one step of continuous batching: schedule, run, sample, output. No threads.

``step()`` asks the scheduler which sequences run, prefills the new prompt groups (once per distinct prompt), decodes
one token for every running sequence, samples, and hands finished samples to their ``on_event`` callback.
``RolloutEngine`` (engine.py) drives it from a thread and adds futures, asyncio, pause and weight-change bookkeeping."""

from __future__ import annotations

import math
import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from ..logs import get_logger
from ..models.families import text_dims
from .attention import ModelNotServableError
from .config import EngineConfig
from .constraints import GrammarCompiler
from .inputs import InputPreparer
from .kv_cache import KVCache, build_kv_cache
from .output import OutputProcessor
from .prefix_cache import PrefixEntry, prefix_key
from .runner import ModelRunner
from .sampler import Sampler
from .scheduler import Scheduler
from .scoring import PromptScorer
from .sequence import Sequence, Status
from .weights import WeightsClock

logger = get_logger("unsloth_rollout")

PACK_MAX_TOKENS = 4096  # most prompt tokens packed into one prefill forward (its mask is quadratic in them)


def eos_token_ids(policy) -> list[int]:
    """EOS ids from the generation config (one or a list) and the tokenizer."""
    ids = set()
    gc = getattr(policy.base_model, "generation_config", None)
    e = getattr(gc, "eos_token_id", None) if gc is not None else None
    for x in (e if isinstance(e, (list, tuple)) else [e]):
        if isinstance(x, int):
            ids.add(x)
    if policy.tokenizer.eos_token_id is not None:
        ids.add(policy.tokenizer.eos_token_id)
    return sorted(ids)


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


class EngineCore:
    def __init__(self, policy, config: EngineConfig, seed: int | None = None):
        self.policy = policy
        self.config = config
        self.tokenizer = policy.tokenizer
        self.inputs = InputPreparer(policy, config.mm_processor_cache_bytes)
        self.kv = build_kv_cache(text_dims(policy.text_config), policy.dtype, policy.device, config)
        model_max = getattr(policy.text_config, "max_position_embeddings", None) or 1 << 30
        self.max_model_len = min(config.max_model_len or getattr(policy, "max_seq_length", None) or model_max,
                                 model_max)
        self._vision_ids = frozenset(self.inputs.vision_token_ids()) if policy.is_vlm else frozenset()
        self.runner = ModelRunner(policy, self.kv, config.decode_compile, config.compile_mode, config.decode_backend,
                                  config.prefill_chunk_tokens, self._vision_ids, config.decode_workspace_bytes,
                                  config.shared_prefix_decode, config.cpu_attention_kernel,
                                  config.shared_prefix_min_tokens, config.decode_layers_per_call)
        self.runner.weights_clock = self.weights = WeightsClock()  # the captured step re-checks on a change
        self.runner.probe()  # a model that bypasses the engine's cache is refused here, by name
        self.eos_ids = eos_token_ids(policy)
        suppress = sorted(self._vision_ids) if (policy.is_vlm and config.suppress_vision_tokens) else []
        self.sampler = Sampler(len(self.tokenizer), self.eos_ids, suppress, seed, self.runner.log_softmax)
        self.grammars = GrammarCompiler(self.tokenizer)  # structured outputs (llguidance loaded on first use)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_prefill_tokens, config.prefix_cache)
        self.output = OutputProcessor(self.tokenizer, self.eos_ids, self.max_model_len)
        self.stats = {"steps": 0, "prefill_tokens": 0, "decode_tokens": 0, "prefills": 0, "prefill_forwards": 0,
                      "finished": 0, "aborted": 0, "errors": 0, "busy_s": 0.0, "weight_recomputes": 0,
                      "prefix_cache_query_tokens": 0, "prefix_cache_hit_tokens": 0}
        # Called with the tokens each step computed (prompt + decode), after the step: e.g. a server's histogram.
        self.step_observers: list = []

    # ================================================================== the step
    def step(self) -> int:
        """Run one step; returns the number of tokens produced. ModelNotServableError propagates."""
        if not self.scheduler.has_work():
            return 0
        t0 = time.perf_counter()
        produced = 0
        computed = self.stats["prefill_tokens"] + self.stats["decode_tokens"]
        policy = self.policy
        # The mode switch walks every module: only when a trainer left the policy in training mode.
        with policy.lock, torch.inference_mode(), (policy.inference() if policy.model.training else nullcontext()):
            self.weights.watch(policy.model)  # PEFT's switches (disable_adapter, ...) moved: a weight change
            version, stamp_of, changes = self.weights.state()
            self.apply_weight_changes(stamp_of, changes)
            plan = self._schedule()
            if plan is not None:
                if plan.decode:
                    produced += self._decode(plan.decode, version)
                fresh = [g for g in plan.prefill_groups if not g[0].output_ids]
                resumed = [g[0] for g in plan.prefill_groups if g[0].output_ids]
                if resumed:  # after preemption or a weight change: recompute prompt + output privately
                    produced += self._recompute(resumed, version, stamp_of)
                if fresh:
                    produced += self._prefill_groups(fresh, version, stamp_of)
        self.stats["steps"] += 1
        self.stats["busy_s"] += time.perf_counter() - t0
        computed = self.stats["prefill_tokens"] + self.stats["decode_tokens"] - computed
        for observe in self.step_observers:
            observe(computed)
        return produced

    def _schedule(self):
        try:
            return self.scheduler.schedule()
        except Exception as e:  # never leave sequences queued behind a broken scheduler: fail them
            logger.exception("unsloth_rollout: scheduling failed")
            self.fail_all(f"scheduling failed: {type(e).__name__}: {e}")
            return None

    def apply_weight_changes(self, stamp_of, changes: int) -> None:
        """The stale-KV rule (``WeightsClock.apply``, engine/weights.py) on this core's scheduler."""
        self.weights.apply(self.scheduler, stamp_of, changes, self.config.recompute_on_weight_change, self.stats)

    def _recompute(self, seqs: list[Sequence], version: int, stamp_of) -> int:
        """Recompute resumed sequences (prompt + output so far, each into its own blocks), packed into as few
        forwards as the budget allows; one sampler call for all of them."""
        sch = self.scheduler
        jobs = {}
        for s in seqs:
            blocks = sch.allocate(sch.blocks_for(s.num_tokens))
            if blocks is None:
                sch.preempt(s, count=False)
                continue
            s.block_table = blocks
            jobs[s.seq_id] = PrefillJob(s, s.all_ids, blocks, owns_blocks=False)  # finish() frees a failed one's
        done, failed = self._run_packs(self._packs(jobs), jobs)
        for k, error in failed.items():
            self.finish(jobs[k].head, "abort", error=error)
        ready, rows = [], []
        for k, (logits, delta) in done.items():
            s = jobs[k].head
            s.num_cached, s.rope_delta = s.num_tokens, delta
            s.kv_stamp, s.kv_version = stamp_of(s.lora_name), version
            s.kv_epoch += 1
            self.stats["prefill_tokens"] += s.num_tokens
            self.stats["prefills"] += 1
            ready.append(s)
            rows.append(logits)
        return self._sample(ready, torch.stack(rows), version) if ready else 0

    def _run_packs(self, packs: list[list], jobs: dict) -> tuple[dict, dict]:
        """Run each pack of keys of ``jobs`` in one packed prefill forward.
        Returns ({key: (logits, rope_delta)}, {key: error}). A pack that raises is retried one prompt at a time,
        so a bad prompt fails alone; ModelNotServableError propagates (after releasing every job not computed)."""
        done, failed = {}, {}
        queue = list(packs)
        while queue:
            pack = queue.pop(0)
            try:
                scorers = [jobs[k].scorer for k in pack]
                outs = self.runner.prefill_packed([jobs[k].runner_item(self.kv) for k in pack],
                                                  jobs[pack[0]].head.lora_name, scorers if any(scorers) else None)
            except ModelNotServableError:
                for k in [k for p in [pack] + queue for k in p]:
                    jobs[k].release(self.kv)
                raise
            except Exception as e:
                if len(pack) > 1:
                    queue[:0] = [[k] for k in pack]
                    continue
                logger.exception("unsloth_rollout: prefill failed for request %s", jobs[pack[0]].head.request_id)
                jobs[pack[0]].release(self.kv)
                failed[pack[0]] = f"prefill failed: {type(e).__name__}: {e}"
                continue
            self.stats["prefill_forwards"] += 1
            done.update(zip(pack, outs))
        return done, failed

    def _packs(self, jobs: dict) -> list[list]:
        """The keys of ``jobs`` in packed forwards: same adapter, packable vision inputs, at most
        ``max_prefill_tokens``, ``prefill_chunk_tokens`` (and PACK_MAX_TOKENS) tokens each; a longer prompt alone,
        where ``prefill_chunked`` splits it: no prefill forward exceeds the chunk (images aside, see there). A job
        that extends a cached prompt (``start`` > 0) runs alone, from where that prompt ends."""
        packs, open_by_adapter = [], {}
        # The packed mask is [total, total]: packs stay small enough that it never outweighs the forward.
        limit = min(self.config.max_prefill_tokens, self.config.prefill_chunk_tokens, PACK_MAX_TOKENS)
        for key, job in jobs.items():
            if job.start:
                continue
            if not self.runner.can_pack(job.head.prompt):
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

    def _prefill_groups(self, groups: list[list[Sequence]], version: int, stamp_of) -> int:
        """Prefill each distinct new prompt once (or find it in the prefix cache), the distinct prompts of this step
        packed into as few forwards as the budget allows; every member of a group shares its prompt's KV. One
        sampler call for all members."""
        sch, prefix = self.scheduler, self.scheduler.prefix
        todo: dict = {}  # prefix key -> PrefillJob: the distinct prompts to compute this step
        ready = []
        for group in groups:
            key = prefix_key(group[0])
            want = max((s.sampling.prompt_logprobs for s in group if s.sampling.prompt_logprobs is not None),
                       default=None)
            if want is not None:
                entry = prefix.lookup(key)
                if entry is not None and (entry.scores is None or entry.scores.k < want):
                    prefix.drop(key)  # cached without (enough) scores: computed again below, scored
            if key not in todo and prefix.lookup(key) is None:
                head = group[0]
                job = None if want is not None else self._extendable(head, stamp_of)
                if job is None:
                    blocks = sch.allocate(sch.blocks_for(len(head.prompt_ids)), keep=key)
                    if blocks is None:  # memory went elsewhere this step: wait in line, first
                        for s in reversed(group):
                            sch.preempt(s, count=False)
                        continue
                    job = PrefillJob(head, head.prompt_ids, blocks,
                                     scorer=PromptScorer(head.prompt_ids, want) if want is not None else None)
                todo[key] = job
            ready.append((group, key))
        done, failed = self._run_packs(self._packs(todo), todo)
        for k, (logits, delta) in done.items():
            job = todo[k]
            n, start = len(job.ids), job.start
            scores = job.scorer.result() if job.scorer is not None else None
            prefix.insert(k, PrefixEntry(job.blocks, n, logits, delta, version, stamp_of(job.head.lora_name), scores))
            self.stats["prefill_tokens"] += n - start
            self.stats["prefills"] += 1
            if start:
                prefix.extensions += 1
                prefix.reused_tokens += start
        seqs, rows = [], []
        for group, key in ready:
            if key in failed:
                for s in group:
                    if not s.finished:
                        self.finish(s, "abort", error=failed[key])
                continue
            entry = prefix.lookup(key)
            if entry is None:  # evicted by an earlier group's blocks this step: prefill again next step
                for s in reversed(group):
                    sch.preempt(s, count=False)
                continue
            computed_here = todo.pop(key, None)
            prefix.hits += len(group) - (1 if computed_here is not None else 0)
            # Token counts as vLLM's prefix_cache_queries / hits: each member's prompt, and what it did not compute.
            self.stats["prefix_cache_query_tokens"] += len(group) * entry.num_tokens
            self.stats["prefix_cache_hit_tokens"] += len(group) * entry.num_tokens - (
                entry.num_tokens - computed_here.start if computed_here is not None else 0)
            for s in group:
                if s.sampling.prompt_logprobs is not None:
                    s.prompt_scores = entry.scores
                if s.sampling.max_new_tokens == 0:  # scoring only: nothing to sample
                    self.finish(s, "length")
                    continue
                own = []
                if prefix.needs_own_block(entry) and (own := sch.allocate(1, keep=key)) is None:
                    sch.preempt(s, count=False)
                    continue
                s.block_table, s.num_cached, s.rope_delta = prefix.share(entry, own), entry.num_tokens, entry.rope_delta
                s.kv_stamp, s.kv_version = entry.stamp, entry.version
                s.kv_epoch += 1
                seqs.append(s)
                rows.append(entry.logits)
            if not prefix.enabled:
                prefix.drop(key)
        if not seqs:
            return 0
        return self._sample(seqs, torch.stack(rows), version)

    def _extendable(self, head: Sequence, stamp_of) -> "PrefillJob | None":
        """A job from ``start`` when ``head``'s prompt extends a cached prompt's KV (a next turn): its block
        table is the cached prompt's full blocks, shared, plus new blocks for the rest, which the step prefills
        from ``start``. None when no cached prompt qualifies, the new tokens hold image placeholders (they need
        their pixels), or memory is short (the prompt is then prefilled whole, as before)."""
        sch, prefix = self.scheduler, self.scheduler.prefix
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
        if self._vision_ids and not self._vision_ids.isdisjoint(ids[start:]):
            return None
        new = sch.allocate(sch.blocks_for(len(ids)) - full, keep=hit_key)
        if new is None:
            return None
        return PrefillJob(head, ids, self.kv.share(entry.blocks[:full]) + new, start)

    def _decode(self, seqs: list[Sequence], version: int) -> int:
        try:
            runner = self.runner
            keys = [(s.seq_id, s.kv_epoch) for s in seqs]
            # how large the rows may get (sequences that may still join, each one's longest possible length), so
            # the decode workspace grows once instead of at every join and every 25% of context
            reach = [min(self.max_model_len, len(s.prompt_ids) + s.sampling.max_new_tokens) for s in seqs]
            sch = self.scheduler
            hint = (min(self.config.max_num_seqs, len(sch.running) + len(sch.waiting)), max(reach), reach)
            order = runner.arrange_decode(keys, [s.num_cached for s in seqs], [s.block_table for s in seqs], hint)
            seqs = [seqs[i] for i in order]  # the backend's row order
            logits = runner.decode([s.last_token for s in seqs], [s.num_cached for s in seqs],
                                   [s.rope_delta for s in seqs], [s.block_table for s in seqs],
                                   [s.lora_name for s in seqs], keys=[keys[i] for i in order])
        except ModelNotServableError:
            raise
        except Exception as e:  # fail this batch, never leave it stuck in the running list
            logger.exception("unsloth_rollout: decode step failed")
            for s in seqs:
                if not s.finished:
                    self.finish(s, "abort", error=f"decode failed: {type(e).__name__}: {e}")
            return 0
        for s in seqs:
            s.num_cached += 1
        self.stats["decode_tokens"] += len(seqs)
        return self._sample(seqs, logits, version)

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor, version: int) -> int:
        res = self.sampler(logits, seqs)
        for i, s in enumerate(seqs):
            tok, lp = res.tokens[i], res.logprobs[i]
            if i in res.errors:  # a structured output's grammar failed: never hand back an unconstrained token
                self.finish(s, "abort", error=f"ConstraintError: structured_outputs: {res.errors[i]}")
                continue
            if not math.isfinite(lp):  # never hand back NaN/inf as a logprob: fail this sample, by name
                self.finish(s, "abort", error=f"NonFiniteLogprob: output_logprobs: the logprob of token {tok} "
                            f"at output position {len(s.output_ids)} is {lp} (non-finite model output); "
                            f"the sample is failed instead of returned")
                continue
            s.append(tok, lp, version, res.top[i], min(s.kv_version, version),
                     res.constrained[i] if res.constrained is not None else None)
            reason, stop = self.output.check_stop(s, tok)
            if reason is None and s.constraint is not None and (err := s.constraint.advance(tok)) is not None:
                self.finish(s, "abort", error=f"ConstraintError: structured_outputs: {err}")
                continue
            if reason is not None:
                self.finish(s, reason, stop)
            elif s.on_event is not None:
                s.on_event(s, False)
        return len(seqs)

    # ================================================================== sequences in and out
    def add(self, seq: Sequence) -> None:
        self.scheduler.add(seq)

    def sequences(self) -> list[Sequence]:
        return list(self.scheduler.waiting) + list(self.scheduler.running)

    def finish(self, s: Sequence, reason: str, stop=None, error: str | None = None) -> None:
        sch = self.scheduler
        if s.status == Status.RUNNING and s in sch.running:
            sch.running.remove(s)
        elif s.status == Status.WAITING and s in sch.waiting:
            sch.waiting.remove(s)
        sch.free_seq(s)
        self.output.finalize_text(s)
        s.finish(reason, stop, error)
        self.stats["finished"] += 1
        if reason == "abort":
            self.stats["aborted"] += 1
        if error:
            self.stats["errors"] += 1
        if s.on_event is not None:
            s.on_event(s, True)

    def fail_all(self, error: str) -> None:
        for s in self.sequences():
            self.finish(s, "abort", error=error)
