"""RolloutEngine: continuous batching over the policy the optimizer trains.

``step()`` is the heart: schedule, prefill new prompt groups, decode one token for every running
sequence, sample, check stops, hand finished samples back. A background thread drives
``step()`` whenever there is work, so ``generate`` (blocking), ``agenerate`` (any event loop or
thread) and ``stream`` all batch together. The engine holds the PolicyModel, never a copy: after
an optimizer step and ``set_version(v + 1)`` the next tokens come from the new weights.

Example::

    engine = RolloutEngine(load_model("tiny-dir"))
    out = engine.generate([GenerationRequest(messages=[{"role": "user", "content": "hi"}],
                                             sampling=SamplingParams(max_new_tokens=16))])[0]
    print(out.output_ids, out.output_logprobs)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Iterable

import torch

from .config import EngineConfig, InvalidRequestError, SamplingParams
from .inputs import InputPreparer
from .attention import ModelNotServableError
from .kv_cache import KVCache
from .request import GenerationOutput, GenerationRequest, StreamDelta
from .runner import ModelRunner, _text_dims
from .sampler import Sampler
from .scheduler import PrefixEntry, Scheduler, prefix_key
from .sequence import Sequence, Status

logger = logging.getLogger("unsloth_rollout")


class RequestRejected(InvalidRequestError):
    """The engine cannot run this request (too long for max_model_len or the KV budget)."""


class EngineStopped(RuntimeError):
    pass


def _available_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    try:
        import psutil

        return psutil.virtual_memory().available
    except ImportError:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


@dataclass
class _Pending:
    """Bookkeeping for one submitted request (all its n samples)."""

    request_id: str
    n: int
    outputs: list[GenerationOutput | None]
    future: concurrent.futures.Future
    on_delta: object = None  # callable(StreamDelta), called from the engine thread
    emitted: list[int] = field(default_factory=list)
    emitted_text: list[int] = field(default_factory=list)


class RolloutEngine:
    """Continuous-batching rollout engine over a PolicyModel (see module docstring)."""

    def __init__(self, policy, config: EngineConfig | None = None, *, seed: int | None = None):
        self.policy = policy
        self.config = config or EngineConfig()
        self.tokenizer = policy.tokenizer
        self.inputs = InputPreparer(policy)
        tcfg = policy.text_config
        layers, kv_heads, head_dim = _text_dims(tcfg)
        dtype = policy.dtype if policy.dtype in (torch.float32, torch.float16, torch.bfloat16) else torch.float16
        device = policy.device
        per_token = KVCache.bytes_per_token(layers, kv_heads, head_dim, dtype)
        budget = self.config.kv_cache_memory_bytes
        if budget is None:
            budget = int(_available_memory_bytes(device) * self.config.kv_cache_memory_fraction)
            if device.type != "cuda":
                budget = min(budget, 1 << 30)
        bs = self.config.block_size
        num_blocks = max(1, budget // (per_token * bs))
        self.kv = KVCache(layers, kv_heads, head_dim, num_blocks, bs, dtype, device)
        model_max = getattr(tcfg, "max_position_embeddings", None) or 1 << 30
        self.max_model_len = min(self.config.max_model_len or getattr(policy, "max_seq_length", None) or model_max,
                                 model_max)
        self.runner = ModelRunner(policy, self.kv, self.config.decode_compile, self.config.compile_mode)
        self.runner.probe()  # a model that bypasses the engine's cache is refused here, by name
        self._fatal: ModelNotServableError | None = None
        self.eos_ids = self._eos_ids()
        suppress = self.inputs.vision_token_ids() if (policy.is_vlm and self.config.suppress_vision_tokens) else []
        self.sampler = Sampler(len(self.tokenizer), self.eos_ids, suppress, seed)
        self.scheduler = Scheduler(self.kv, self.config.max_num_seqs, self.config.max_prefill_tokens,
                                   self.config.prefix_cache)
        self._version = 0
        self.lora_adapters: dict[str, str] = {}
        self._cond = threading.Condition()
        self._inbox: list[Sequence] = []
        self._abort_ids: set[str] = set()
        self._pending: dict[str, _Pending] = {}
        self._paused = False
        self._stopped = False
        self._offloaded = False
        self._in_step = False
        self._thread: threading.Thread | None = None
        self._step_lock = threading.Lock()
        self._stats = {"steps": 0, "prefill_tokens": 0, "decode_tokens": 0, "prefills": 0, "requests": 0,
                       "finished": 0, "aborted": 0, "errors": 0, "busy_s": 0.0}
        logger.info("unsloth_rollout: KV cache %d blocks x %d tokens (%.1f MiB), max_model_len %d",
                    num_blocks, bs, self.kv.memory_bytes / 2**20, self.max_model_len)

    def _eos_ids(self) -> list[int]:
        ids = set()
        gc = getattr(self.policy.base_model, "generation_config", None)
        e = getattr(gc, "eos_token_id", None) if gc is not None else None
        for x in (e if isinstance(e, (list, tuple)) else [e]):
            if isinstance(x, int):
                ids.add(x)
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return sorted(ids)

    # ================================================================== versions and control
    @property
    def version(self) -> int:
        return self._version

    def set_version(self, version: int) -> None:
        """Stamp tokens sampled from now on with ``version`` (call after each optimizer step)."""
        with self._cond:
            self._version = int(version)
            self._cond.notify_all()

    def pause(self, mode: str = "keep") -> None:
        """Stop at a step boundary. mode="keep": in-flight sequences keep their state and continue on
        ``resume()``; mode="abort": they finish now with finish_reason "abort"."""
        if mode not in ("keep", "abort"):
            raise InvalidRequestError("mode", f"mode must be 'keep' or 'abort', got {mode!r}")
        with self._cond:
            self._paused = True
        with self._step_lock:  # wait for the step in progress to end
            pass
        if mode == "abort":
            self.abort_all()

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    @property
    def is_paused(self) -> bool:
        return self._paused

    def abort(self, request_id: str) -> None:
        """Finish every sample of ``request_id`` with finish_reason "abort" and free its KV."""
        with self._cond:
            self._abort_ids.add(request_id)
            self._cond.notify_all()
        if self._paused or self._thread is None:
            with self._step_lock:
                self._drain_inbox()

    def abort_all(self) -> None:
        with self._cond:
            self._abort_ids.update(self._pending)
            self._cond.notify_all()
        with self._step_lock:
            self._drain_inbox()

    def offload(self) -> None:
        """Free the KV cache memory (for training); requests wait until ``onload()``."""
        self.pause("keep")
        with self._step_lock:
            for s in list(self.scheduler.running):
                self.scheduler.preempt(s)
            self.scheduler.drop_prefix()
            self.kv.release_storage()
            self._offloaded = True
            if self.kv.device.type == "cuda":
                torch.cuda.empty_cache()

    def onload(self) -> None:
        with self._step_lock:
            self.kv.allocate_storage()
            self._offloaded = False
        self.resume()

    # ================================================================== LoRA adapters served by name
    def load_lora_adapter(self, name: str, path: str) -> None:
        """Load a PEFT adapter folder that requests select with ``lora_name=name``.

        The policy's own (trained) adapter stays active for requests without a lora_name.
        """
        if not name or name in ("__base__",):
            raise InvalidRequestError("lora_name", f"invalid adapter name {name!r}")
        if not os.path.isdir(path):
            raise InvalidRequestError("lora_path", f"lora_path {path!r} is not a folder")
        with self._step_lock, self.policy.lock:
            model = self.policy.model
            if not hasattr(model, "load_adapter") or not hasattr(model, "peft_config"):
                from peft import PeftModel

                model = PeftModel.from_pretrained(model, path, adapter_name=name, is_trainable=False)
                self.policy.model = model
                self.runner.base_default = True  # unnamed requests keep using the plain model
            else:
                active = model.active_adapter
                try:
                    model.load_adapter(path, adapter_name=name, is_trainable=False)
                except Exception as e:
                    raise InvalidRequestError("lora_path", f"cannot load adapter from {path!r}: {e}") from None
                model.set_adapter(active)
            self.lora_adapters[name] = path
            self.scheduler.drop_prefix()

    def unload_lora_adapter(self, name: str) -> None:
        if name not in self.lora_adapters:
            raise InvalidRequestError("lora_name", f"adapter {name!r} is not loaded")
        with self._step_lock, self.policy.lock:
            for s in list(self.scheduler.running) + list(self.scheduler.waiting):
                if s.lora_name == name:
                    self._finish(s, "abort", error=f"adapter {name!r} was unloaded")
            if self.runner.base_default and set(self.lora_adapters) == {name}:
                # The policy had no adapter of its own and this was the last served one: PEFT cannot run
                # with zero adapters, so take the LoRA layers out and serve the plain model again.
                self.policy.model = self.policy.model.unload()
                self.runner.base_default = False
            else:
                self.policy.model.delete_adapter(name)
            del self.lora_adapters[name]
            self.scheduler.drop_prefix()

    def invalidate_prefix_cache(self) -> None:
        with self._step_lock:
            self.scheduler.drop_prefix()

    def stats(self) -> dict:
        s = dict(self._stats)
        s.update(
            version=self._version, paused=self._paused, num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting) + len(self._inbox), kv_blocks_total=self.kv.num_blocks,
            kv_blocks_free=self.kv.num_free_blocks, kv_block_size=self.kv.block_size,
            kv_cache_bytes=self.kv.memory_bytes, kv_usage=1 - self.kv.num_free_blocks / self.kv.num_blocks,
            prefix_cache_entries=len(self.scheduler.prefix), prefix_cache_hits=self.scheduler.prefix_hits,
            num_preemptions=self.scheduler.num_preemptions, max_model_len=self.max_model_len)
        return s

    # ================================================================== submission
    def _make_sequences(self, req: GenerationRequest, on_event) -> list[Sequence]:
        if not isinstance(req, GenerationRequest):
            raise InvalidRequestError("request", f"expected a GenerationRequest, got {type(req).__name__}")
        if req.lora_name is not None and req.lora_name not in self.lora_adapters:
            raise InvalidRequestError("lora_name", f"adapter {req.lora_name!r} is not loaded")
        prompt = self.inputs.prepare(req)
        sp = req.sampling
        plen = len(prompt.prompt_ids)
        if plen >= self.max_model_len:
            raise RequestRejected("input_ids", f"the prompt has {plen} tokens; max_model_len is {self.max_model_len}")
        longest = min(plen + sp.max_new_tokens, self.max_model_len)
        if self.scheduler.blocks_for(longest) + 1 > self.kv.num_blocks:
            raise RequestRejected(
                "max_new_tokens", f"prompt ({plen}) + max_new_tokens ({sp.max_new_tokens}) needs "
                f"{longest} KV slots; the KV cache budget holds {self.kv.num_slots - self.kv.block_size}")
        return [Sequence(req.request_id, i, prompt, sp, on_event, req.lora_name) for i in range(sp.n)]

    def submit(self, req: GenerationRequest, on_delta=None) -> concurrent.futures.Future:
        """Queue a request; the future resolves to its list of n GenerationOutputs.

        Invalid input raises InvalidRequestError (naming the field) here, before anything is queued.
        """
        if self._stopped:
            raise EngineStopped("the engine is shut down")
        if self._fatal is not None:
            raise self._fatal
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if req.request_id in self._pending:
            raise InvalidRequestError("request_id", f"request_id {req.request_id!r} is already in flight")
        seqs = self._make_sequences(req, self._on_event)
        pend = _Pending(req.request_id, len(seqs), [None] * len(seqs), fut, on_delta, [0] * len(seqs),
                        [0] * len(seqs))
        with self._cond:
            self._pending[req.request_id] = pend
            self._inbox.extend(seqs)
            self._stats["requests"] += 1
            self._cond.notify_all()
        self._ensure_thread()
        return fut

    def generate(self, requests: Iterable[GenerationRequest] | GenerationRequest,
                 timeout: float | None = None) -> list[GenerationOutput]:
        """Run requests to completion; outputs in input order (a request with n samples gives n in a row).

        A request the engine cannot run (too long, bad image) yields an output with ``error`` set and
        finish_reason "abort"; the others complete.
        """
        if isinstance(requests, GenerationRequest):
            requests = [requests]
        futs = []
        for r in requests:
            try:
                futs.append((r, self.submit(r)))
            except InvalidRequestError as e:
                futs.append((r, e))
        out: list[GenerationOutput] = []
        for r, f in futs:
            if isinstance(f, Exception):
                out.append(GenerationOutput(r.request_id, list(r.input_ids or []), finish_reason="abort",
                                            error=str(f)))
            else:
                out.extend(f.result(timeout))
        return out

    async def agenerate(self, request: GenerationRequest) -> GenerationOutput | list[GenerationOutput]:
        """Await one request: a GenerationOutput, or a list of n when ``sampling.n > 1``.

        Safe from any event loop or thread; concurrent calls batch together. Cancelling the awaiting
        task aborts the request.
        """
        fut = self.submit(request)
        try:
            outs = await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            self.abort(request.request_id)
            raise
        return outs[0] if request.sampling.n == 1 else outs

    def stream(self, request: GenerationRequest) -> AsyncIterator[StreamDelta]:
        """Submit now and return an async iterator of StreamDelta pieces (the last one per sample has
        finish_reason). Call it from a running event loop; invalid input raises here, before iteration.

        Leaving the iteration early (a client disconnect) aborts the request.
        """
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        fut = self.submit(request, on_delta=lambda d: loop.call_soon_threadsafe(queue.put_nowait, d))
        # Queued after the last delta: both are put from the engine thread, in order.
        fut.add_done_callback(lambda f: loop.call_soon_threadsafe(queue.put_nowait, None))
        return self._iterate(request.request_id, fut, queue)

    async def _iterate(self, request_id: str, fut: concurrent.futures.Future, queue: asyncio.Queue):
        try:
            while (d := await queue.get()) is not None:
                yield d
            if fut.exception() is not None:
                raise fut.exception()
        finally:
            if not fut.done():
                self.abort(request_id)

    # ================================================================== engine thread
    def _ensure_thread(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        with self._cond:
            if self._thread is not None and self._thread.is_alive():
                return
            self._thread = threading.Thread(target=self._loop, name="unsloth-rollout-engine", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stopped and (self._paused or self._offloaded or not (
                        self._inbox or self._abort_ids or self.scheduler.has_work())):
                    if self._abort_ids or (self._inbox and self._paused):
                        break
                    self._cond.wait(timeout=1.0)
                if self._stopped:
                    return
            with self._step_lock:
                if self._paused or self._offloaded:
                    self._drain_inbox()
                    with self._cond:
                        if self._paused or self._offloaded:
                            self._cond.wait(timeout=0.05)
                    continue
                try:
                    self.step()
                except Exception:  # the engine must keep serving; the step already failed its sequences
                    logger.exception("unsloth_rollout: engine step failed")

    def shutdown(self) -> None:
        """Abort everything still in flight and stop the engine thread."""
        self.abort_all()
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)

    def _drain_inbox(self) -> None:
        with self._cond:
            new, self._inbox = self._inbox, []
            aborts, self._abort_ids = self._abort_ids, set()
        for s in new:
            self.scheduler.add(s)
        if aborts:
            for s in [s for s in list(self.scheduler.waiting) + list(self.scheduler.running)
                      if s.request_id in aborts]:
                self._finish(s, "abort")

    # ================================================================== the step
    def step(self) -> int:
        """Run one scheduling step; returns the number of tokens produced."""
        self._drain_inbox()
        if not self.scheduler.has_work():
            return 0
        t0 = time.perf_counter()
        policy = self.policy
        produced = 0
        with policy.lock, torch.inference_mode():
            switch = policy.inference() if policy.model.training else None
            try:
                version = self._version
                plan = self.scheduler.schedule(version)
                if plan.decode:
                    produced += self._decode(plan.decode, version)
                for group in plan.prefill_groups:
                    produced += self._prefill(group, version)
            finally:
                if switch is not None:
                    switch.__exit__(None, None, None)
        self._stats["steps"] += 1
        self._stats["busy_s"] += time.perf_counter() - t0
        return produced

    def _prefill(self, group: list[Sequence], version: int) -> int:
        sch = self.scheduler
        head = group[0]
        try:
            if head.output_ids:  # resumed after preemption: recompute prompt + output privately
                blocks = sch.allocate(sch.blocks_for(head.num_tokens))
                if blocks is None:
                    sch.preempt(head, count=False)
                    return 0
                head.block_table = blocks
                logits, delta = self.runner.prefill(head.all_ids, self.kv.slots(blocks, 0, head.num_tokens),
                                                    head.prompt.pixel_values, head.prompt.image_grid_thw,
                                                    head.lora_name, extra=head.prompt.extra)
                head.num_cached, head.rope_delta = head.num_tokens, delta
                self._stats["prefill_tokens"] += head.num_tokens
                self._stats["prefills"] += 1
                return self._sample_and_advance([head], logits.unsqueeze(0), version)
            key = prefix_key(head)
            entry = sch.prefix.get(key)
            n = len(head.prompt_ids)
            if entry is None:
                blocks = sch.allocate(sch.blocks_for(n), keep=key)
                if blocks is None:  # memory went elsewhere this step: wait in line, first
                    for s in reversed(group):
                        sch.preempt(s, count=False)
                    return 0
                try:
                    logits, delta = self.runner.prefill(head.prompt_ids, self.kv.slots(blocks, 0, n),
                                                        head.prompt.pixel_values, head.prompt.image_grid_thw,
                                                        head.lora_name, extra=head.prompt.extra)
                except Exception:
                    self.kv.free(blocks)
                    raise
                entry = PrefixEntry(blocks, n, logits, delta, version)
                sch.prefix[key] = entry
                self._stats["prefill_tokens"] += n
                self._stats["prefills"] += 1
                sch.prefix_hits += len(group) - 1
            else:
                sch.prefix.move_to_end(key)
                sch.prefix_hits += len(group)
            bs = self.kv.block_size
            full, rem = divmod(n, bs)
            for s in group:
                table = self.kv.share(entry.blocks[:full])
                if rem:
                    own = sch.allocate(1, keep=key)
                    if own is None:
                        self.kv.free(table)
                        sch.preempt(s, count=False)
                        continue
                    self.kv.copy_block(entry.blocks[full], own[0], rem)
                    table += own
                s.block_table, s.num_cached, s.rope_delta = table, n, entry.rope_delta
            if not sch.use_prefix_cache:
                sch.drop_prefix(key)
            ready = [s for s in group if s.status == Status.RUNNING]
            if not ready:
                return 0
            return self._sample_and_advance(ready, entry.logits.unsqueeze(0).expand(len(ready), -1), version)
        except ModelNotServableError as e:
            self._refuse_model(e)
            return 0
        except Exception as e:
            logger.exception("unsloth_rollout: prefill failed for request %s", head.request_id)
            for s in group:
                if not s.finished:
                    self._finish(s, "abort", error=f"prefill failed: {type(e).__name__}: {e}")
            return 0

    def _decode(self, seqs: list[Sequence], version: int) -> int:
        try:
            logits = self.runner.decode([s.last_token for s in seqs], [s.num_cached for s in seqs],
                                        [s.rope_delta for s in seqs], [s.block_table for s in seqs],
                                        [s.lora_name for s in seqs])
            for s in seqs:
                s.num_cached += 1
            self._stats["decode_tokens"] += len(seqs)
            return self._sample_and_advance(seqs, logits, version)
        except ModelNotServableError as e:
            self._refuse_model(e)
            return 0
        except Exception as e:  # fail this batch, never leave it stuck in the running list
            logger.exception("unsloth_rollout: decode step failed")
            for s in seqs:
                if not s.finished:
                    self._finish(s, "abort", error=f"decode failed: {type(e).__name__}: {e}")
            return 0

    def _sample_and_advance(self, seqs: list[Sequence], logits: torch.Tensor, version: int) -> int:
        res = self.sampler(logits, seqs)
        for i, s in enumerate(seqs):
            tok = res.tokens[i]
            s.append(tok, res.logprobs[i], version, res.top[i])
            reason, stop = self._check_stop(s, tok)
            if reason is not None:
                self._finish(s, reason, stop)
            elif s.on_event is not None:
                s.on_event(s, False)
        return len(seqs)

    def _check_stop(self, s: Sequence, tok: int):
        sp = s.sampling
        n = len(s.output_ids)
        if n >= sp.min_new_tokens:
            if tok in sp.stop_token_ids:
                return "stop", tok
            if not sp.ignore_eos and tok in self.eos_ids:
                return "stop", None
            if sp.stop:
                text = self._decode_text(s)
                hits = [(text.find(x), x) for x in sp.stop if x in text]
                if hits:
                    idx, x = min(hits)
                    s.text = text[:idx]
                    s.stop_text_truncated = True
                    return "stop", x
        if n >= sp.max_new_tokens or s.num_tokens >= self.max_model_len:
            return "length", None
        return None, None

    def _decode_text(self, s: Sequence) -> str:
        return self.tokenizer.decode(s.output_ids, skip_special_tokens=s.sampling.skip_special_tokens)

    def _refuse_model(self, e: ModelNotServableError) -> None:
        """The model cannot be served exactly (e.g. its attention bypassed the cache): nothing it produced
        is returned; every request in flight and every later submit fails with the named error."""
        logger.error("unsloth_rollout: %s", e)
        self._fatal = e
        with self._cond:
            pending, self._pending = list(self._pending.values()), {}
        for s in list(self.scheduler.waiting) + list(self.scheduler.running):
            s.on_event = None
            self._finish(s, "abort", error=str(e))
        for p in pending:
            if not p.future.done():
                p.future.set_exception(e)

    def _finish(self, s: Sequence, reason: str, stop=None, error: str | None = None) -> None:
        sch = self.scheduler
        if s.status == Status.RUNNING and s in sch.running:
            sch.running.remove(s)
        elif s.status == Status.WAITING and s in sch.waiting:
            sch.waiting.remove(s)
        sch.free_seq(s)
        if not s.stop_text_truncated:
            s.text = self._decode_text(s)
        s.finish(reason, stop, error)
        self._stats["finished"] += 1
        if reason == "abort":
            self._stats["aborted"] += 1
        if error:
            self._stats["errors"] += 1
        if s.on_event is not None:
            s.on_event(s, True)

    def _on_event(self, s: Sequence, finished: bool) -> None:
        pend = self._pending.get(s.request_id)
        if pend is None:
            return
        i = s.sample_index
        if pend.on_delta is not None:
            start = pend.emitted[i]
            text = s.text if finished else self._decode_text(s)
            if not finished:
                text = text.rstrip("\ufffd")  # an incomplete UTF-8 sequence: wait for its last byte
                if s.sampling.stop:  # hold back what a stop string still being matched could cut
                    text = text[: max(0, len(text) - max(map(len, s.sampling.stop)) + 1)]
            new_text = text[pend.emitted_text[i]:] if len(text) >= pend.emitted_text[i] else ""
            if finished or len(s.output_ids) > start:
                delta = StreamDelta(
                    s.request_id, i, s.output_ids[start:], s.output_logprobs[start:], s.output_versions[start:],
                    new_text, None if s.top_logprobs is None else s.top_logprobs[start:],
                    s.finish_reason if finished else None, s.stop_reason if finished else None,
                    s.to_output() if finished else None)
                pend.emitted[i] = len(s.output_ids)
                pend.emitted_text[i] = max(pend.emitted_text[i], len(text))
                try:
                    pend.on_delta(delta)
                except Exception:
                    logger.exception("unsloth_rollout: stream consumer failed")
        if finished:
            pend.outputs[i] = s.to_output()
            if all(o is not None for o in pend.outputs):
                with self._cond:
                    self._pending.pop(s.request_id, None)
                if not pend.future.done():
                    pend.future.set_result(pend.outputs)

    def __del__(self):
        try:
            with self._cond:
                self._stopped = True
                self._cond.notify_all()
        except Exception:
            pass


def sampling_from_dict(d: dict) -> SamplingParams:
    return SamplingParams.from_dict(d)
