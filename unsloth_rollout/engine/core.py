"""EngineCore: one step of continuous batching: schedule, run, sample, output. No threads.

``step()`` asks the scheduler for the step's plan, decodes one token for every running sequence, runs the prefill
jobs the scheduler planned for the admitted groups (once per distinct prompt) and hands their results back to it,
samples, and hands finished samples to their ``on_event`` callback. The scheduler decides (admission, blocks,
preemption, the prefix cache); this module runs what it decided. ``RolloutEngine`` (engine.py) drives it from a
thread and adds futures, asyncio, pause and weight-change bookkeeping."""

from __future__ import annotations

import math
import time
from contextlib import nullcontext

import torch

from ..logs import get_logger
from ..models.families import text_dims
from .attention import ModelNotServableError
from .config import EngineConfig
from .constraints import GrammarCompiler
from .inputs import InputPreparer
from .kv_cache import build_kv_cache
from .output import OutputProcessor, eos_token_ids
from .runner import ModelRunner
from .sampler import Sampler
from .scheduler import PrefillPlan, Scheduler
from .sequence import Sequence, Status
from .weights import WeightsClock

logger = get_logger("unsloth_rollout")


class EngineCore:
    def __init__(self, policy, config: EngineConfig, seed: int | None = None):
        self.policy = policy
        self.config = config
        self.tokenizer = policy.tokenizer
        self.inputs = InputPreparer(policy, config.multimodal.mm_processor_cache_bytes)
        self.kv = build_kv_cache(text_dims(policy.text_config), policy.dtype, policy.device, config)
        model_max = getattr(policy.text_config, "max_position_embeddings", None) or 1 << 30
        self.max_model_len = min(config.max_model_len or getattr(policy, "max_seq_length", None) or model_max,
                                 model_max)
        self._vision_ids = frozenset(self.inputs.vision_token_ids()) if policy.is_vlm else frozenset()
        self.weights = WeightsClock()  # the version and the stale-KV rule; the compiled step re-checks on a change
        self.runner = ModelRunner(policy, self.kv, config, self._vision_ids, self.weights)
        self.runner.probe()  # a model that bypasses the engine's cache is refused here, by name
        self.eos_ids = eos_token_ids(policy)
        suppress = sorted(self._vision_ids) if (policy.is_vlm and config.multimodal.suppress_vision_tokens) else []
        self.sampler = Sampler(len(self.tokenizer), self.eos_ids, suppress, seed, self.runner.log_softmax)
        self.grammars = GrammarCompiler(self.tokenizer)  # structured outputs (llguidance loaded on first use)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.prefill, config.prefix_cache,
                                   self.runner.vision, self._vision_ids)
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
                if resumed := plan.resumed:  # after preemption or a weight change: prompt + output recomputed
                    produced += self._prefill(self.scheduler.plan_recompute(resumed), version, stamp_of)
                if fresh := plan.fresh:  # each distinct new prompt once (or found in the prefix cache)
                    produced += self._prefill(self.scheduler.plan_prompts(fresh, stamp_of), version, stamp_of)
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

    def _prefill(self, plan: PrefillPlan, version: int, stamp_of) -> int:
        """Run a plan's prefill jobs, packed into as few forwards as the budget allows, and hand the results back to
        the scheduler; one sampler call for every sequence they made ready."""
        done, failed = self._run_packs(plan.packs(), plan.jobs)
        result = self.scheduler.update_from_prefill(plan, done, failed, version, stamp_of)
        for s, reason, error in result.finished:
            self.finish(s, reason, error=error)
        for name, n in result.counts().items():
            self.stats[name] += n
        if not result.ready:
            return 0
        return self._sample([s for s, _ in result.ready], result.logits(), version)

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
