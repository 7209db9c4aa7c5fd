"""RolloutEngine: the engine's front — futures, asyncio, pause holders and weight changes.

``EngineCore`` (core.py) runs one step at a time; ``StepDriver`` (worker.py) runs it on the thread of a
caller that waits (``generate``) or else on a worker thread that exits when idle, so ``generate``
(blocking), ``agenerate`` (any event loop or thread) and ``stream`` all batch together, and only one
thread's OpenMP team does the model's work. The engine holds the PolicyModel, never a copy: after an optimizer
step and ``set_version(v + 1)`` the next tokens come from the new weights.

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
from dataclasses import dataclass, field
from typing import AsyncIterator, Iterable

import torch

from .attention import ModelNotServableError
from .config import EngineConfig, InvalidRequestError
from .core import EngineCore
from .request import GenerationOutput, GenerationRequest, StreamDelta
from .sequence import Sequence
from .worker import StepDriver

logger = logging.getLogger("unsloth_rollout")


class RequestRejected(InvalidRequestError):
    """The engine cannot run this request (too long for max_model_len or the KV budget)."""


class EngineStopped(RuntimeError):
    pass


@dataclass
class _Pending:
    """Bookkeeping for one submitted request (all its n samples)."""

    request_id: str
    outputs: list[GenerationOutput | None]
    future: concurrent.futures.Future
    on_delta: object = None  # callable(StreamDelta), called from the engine thread
    sent_tokens: list[int] = field(default_factory=list)  # per sample: tokens / characters already streamed
    sent_chars: list[int] = field(default_factory=list)


class RequestStream:
    """Deltas of submitted requests as they are produced; ``close()`` aborts what has not finished."""

    def __init__(self, engine: "RolloutEngine", indexed: bool):
        self.engine = engine
        self.indexed = indexed
        self.queue: asyncio.Queue = asyncio.Queue()
        self.futures: list[tuple[str, concurrent.futures.Future]] = []

    def __aiter__(self):
        return self._iterate()

    async def _iterate(self):
        remaining = len(self.futures)
        try:
            while remaining:
                k, d = await self.queue.get()
                if d is None:
                    remaining -= 1
                    exc = self.futures[k][1].exception()
                    if exc is not None:
                        raise exc
                    continue
                yield (k, d) if self.indexed else d
        finally:
            self.close()

    def close(self) -> None:
        for rid, fut in self.futures:
            if not fut.done():
                self.engine.abort(rid)


class RolloutEngine:
    """Continuous-batching rollout engine over a PolicyModel (see module docstring)."""

    def __init__(self, policy, config: EngineConfig | None = None, *, seed: int | None = None):
        self.policy = policy
        self.config = config or EngineConfig()
        self.core = EngineCore(policy, self.config, seed)
        self.lora_adapters: dict[str, str] = {}
        self.driver = StepDriver(self.core, self._refuse_model)
        self._cond = self.driver.cond
        self._step_lock = self.driver.step_lock  # held by whichever thread runs a step
        self._pending: dict[str, _Pending] = {}
        self._fatal: ModelNotServableError | None = None
        self._requests = 0
        kv = self.kv
        logger.info("unsloth_rollout: KV cache %d blocks x %d tokens (%.1f MiB), max_model_len %d",
                    kv.num_blocks, kv.block_size, kv.memory_bytes / 2**20, self.max_model_len)

    # The core's parts, for front ends and tests that inspect them.
    tokenizer = property(lambda self: self.core.tokenizer)
    inputs = property(lambda self: self.core.inputs)
    kv = property(lambda self: self.core.kv)
    runner = property(lambda self: self.core.runner)
    sampler = property(lambda self: self.core.sampler)
    scheduler = property(lambda self: self.core.scheduler)
    eos_ids = property(lambda self: self.core.eos_ids)
    max_model_len = property(lambda self: self.core.max_model_len)

    # ================================================================== weights and versions
    @property
    def version(self) -> int:
        return self.core.weights.version

    def set_version(self, version: int) -> None:
        """Stamp tokens sampled from now on with ``version`` (call after each optimizer step).

        A new version means new weights: ``weights_changed(version)``. Setting the current version again
        changes nothing."""
        version = int(version)
        if version != self.core.weights.version:
            self.weights_changed(version)

    def weights_changed(self, version: int | None = None, *, lora_name: str | None = None) -> None:
        """The one owner of weight changes: every path that changes weights the engine samples from calls it.

        KV computed by the old weights is not used again: the prefix cache entries they made are dropped
        and, before its next token, every sequence in flight has its cached positions recomputed with the
        new weights (as preemption does), so each token stamped v is sampled from and scored by weights v.
        (``EngineConfig(recompute_on_weight_change=False)`` keeps their stale cache instead and says so
        per token in ``output_kv_versions``.) ``version``: stamp later tokens with it (None: unchanged).
        ``lora_name``: only the served adapter of that name changed (the base and other adapters did not).
        Never blocks, safe from any thread: done now when no step runs (e.g. while paused), else at the
        start of the next step, before any token is sampled.
        """
        self.core.weights.bump(version, lora_name)
        with self._cond:
            self._cond.notify_all()
        if self._step_lock.acquire(blocking=False):
            try:
                self.core.apply_weight_changes(*self.core.weights.state()[1:])
            finally:
                self._step_lock.release()

    # ================================================================== pause, abort, offload
    def pause(self, mode: str = "keep", holder: str = "user") -> None:
        """Stop at a step boundary. mode="keep": in-flight sequences keep their state and continue on
        ``resume()``; mode="abort": they finish now with finish_reason "abort"; mode="wait": admit nothing
        new and return once the requests in flight have finished.

        Pauses are held by name: the engine runs again only when every holder has resumed, so
        ``onload()`` (holder "offload"), a trainer's hold ("trainer"), AReaL's pause_generation ("areal"),
        the server's /pause ("http") and a user's pause ("user") never release one another. Pausing again
        under a name already held is a no-op (no counting).
        """
        if mode not in ("keep", "abort", "wait"):
            raise InvalidRequestError("mode", f"mode must be 'keep', 'abort' or 'wait', got {mode!r}")
        if not isinstance(holder, str) or not holder:
            raise InvalidRequestError("holder", f"holder must be a non-empty string, got {holder!r}")
        if mode == "wait":
            self.wait_idle()
        with self._cond:
            self.driver.pause_holders.add(holder)
        with self._step_lock:  # wait for the step in progress to end
            pass
        if mode == "abort":
            self.abort_all()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until no request is in flight (woken by each finished request, no polling); False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._pending or self.driver.stopped, timeout)

    def resume(self, holder: str = "user") -> None:
        """Release ``holder``'s pause; generation continues once no one else holds one."""
        with self._cond:
            self.driver.pause_holders.discard(holder)
        self.driver.kick()  # sequences in flight: the worker exited while paused

    @property
    def _paused(self) -> bool:
        return bool(self.driver.pause_holders)

    @property
    def is_paused(self) -> bool:
        return self._paused

    @property
    def paused_by(self) -> frozenset[str]:
        """Who holds a pause now (empty: running)."""
        with self._cond:
            return frozenset(self.driver.pause_holders)

    def abort(self, request_id: str) -> None:
        """Finish every sample of ``request_id`` with finish_reason "abort" and free its KV."""
        with self._cond:
            self.driver.abort_ids.add(request_id)
            self._cond.notify_all()
            applied_now = self.driver.paused or self.driver.owner is None
        if applied_now:  # nobody is stepping: apply it here
            with self._step_lock:
                self.driver.drain_inbox()

    def abort_all(self) -> None:
        with self._cond:
            self.driver.abort_ids.update(self._pending)
            self._cond.notify_all()
        with self._step_lock:
            self.driver.drain_inbox()

    def offload(self) -> None:
        """Free the KV cache memory (for training); requests wait until ``onload()``.

        Holds its own pause ("offload"): ``onload()`` releases only that one, never a pause someone else holds."""
        self.pause("keep", holder="offload")
        with self._step_lock:
            for s in list(self.scheduler.running):
                self.scheduler.preempt(s)
            self.scheduler.prefix.drop()
            self.kv.release_storage()
            self.driver.offloaded = True
            if self.kv.device.type == "cuda":
                torch.cuda.empty_cache()

    def onload(self) -> None:
        with self._step_lock:
            self.kv.allocate_storage()
            self.driver.offloaded = False
        self.resume(holder="offload")

    # ================================================================== LoRA adapters served by name
    def load_lora_adapter(self, name: str, path: str, load_inplace: bool = False) -> None:
        """Load a PEFT adapter folder that requests select with ``lora_name=name`` (models/adapters.py).

        Refused before anything changes, with InvalidRequestError naming the reason (``AdapterNotFoundError``
        when there is no adapter at ``path``): DoRA, ``modules_to_save``, a rank above ``config.max_lora_rank``,
        modules or shapes the model lacks (another base model), unreadable weights, more than
        ``config.max_loras`` adapters. The policy's own adapter stays active for requests without a lora_name.
        ``load_inplace=True`` replaces a loaded adapter's weights: its requests in flight continue, recomputed
        with the new weights (a refused replacement leaves the old one serving).
        """
        from ..models import adapters

        if not isinstance(name, str) or not name or name == adapters.BASE:
            raise InvalidRequestError("lora_name", f"invalid adapter name {name!r}")
        replace = name in self.lora_adapters
        if replace and not load_inplace:
            raise InvalidRequestError("lora_name", f"The lora adapter '{name}' has already been loaded.")
        cap = self.config.max_loras
        if not replace and cap is not None and len(self.lora_adapters) >= cap:
            raise InvalidRequestError("lora_name", f"{len(self.lora_adapters)} adapters are loaded, max_loras is "
                                                   f"{cap}: unload one first")
        if replace:  # refuse a bad replacement before the old adapter goes
            adapters.read_adapter(self.policy, path, self.config.max_lora_rank)
        with self._step_lock, self.policy.lock:
            before = self.policy.model
            if replace:
                adapters.unload_adapter(self.policy, name)
            try:
                adapters.load_adapter(self.policy, name, path, self.config.max_lora_rank)
            except Exception:
                if replace:  # the old weights are gone: its requests cannot continue
                    self._drop_adapter_requests(name, "could not be reloaded")
                    del self.lora_adapters[name]
                raise
            self.lora_adapters[name] = path
            changed = name if self.policy.model is before else None  # a new wrapper object: recompute all
        self.weights_changed(lora_name=changed)

    def unload_lora_adapter(self, name: str) -> None:
        """Remove a loaded adapter; its requests in flight finish with finish_reason "abort"."""
        from ..models import adapters

        if name not in self.lora_adapters:
            raise InvalidRequestError("lora_name", f"adapter {name!r} is not loaded")
        with self._step_lock, self.policy.lock:
            self._drop_adapter_requests(name, "was unloaded")
            before = self.policy.model
            adapters.unload_adapter(self.policy, name)
            del self.lora_adapters[name]
            changed = name if self.policy.model is before else None
        self.weights_changed(lora_name=changed)

    def _drop_adapter_requests(self, name: str, why: str) -> None:
        # Requests still in the inbox count too: a step between an unload and a reload would prefill them
        # under an adapter that no longer exists (found by the differential test).
        self.driver.drain_inbox()
        for s in self.core.sequences():
            if s.lora_name == name:
                self.core.finish(s, "abort", error=f"adapter {name!r} {why}")

    def invalidate_prefix_cache(self) -> None:
        with self._step_lock:
            self.scheduler.prefix.drop()

    def stats(self) -> dict:
        s = dict(self.core.stats)
        sch, kv = self.scheduler, self.kv
        s.update(
            requests=self._requests, version=self.version, paused=self._paused, paused_by=sorted(self.paused_by),
            num_running=len(sch.running), num_waiting=len(sch.waiting) + len(self.driver.inbox),
            kv_blocks_total=kv.num_blocks, kv_blocks_free=kv.num_free_blocks, kv_block_size=kv.block_size,
            kv_cache_bytes=kv.memory_bytes, kv_usage=1 - kv.num_free_blocks / kv.num_blocks,
            decode_workspace_bytes=ws.memory_bytes if (ws := self.core.runner.workspace) is not None else 0,
            decode_workspace_peak_bytes=ws.peak_bytes if ws is not None else 0,
            decode_workspace_budget_bytes=ws.budget_bytes if ws is not None else 0,
            decode_workspace_fallbacks=ws.fallbacks if ws is not None else 0,
            prefix_cache_entries=len(sch.prefix), prefix_cache_hits=sch.prefix.hits,
            prefix_cache_extensions=sch.prefix.extensions, prefix_cache_reused_tokens=sch.prefix.reused_tokens,
            num_preemptions=sch.num_preemptions, max_model_len=self.max_model_len,
            decode_backend=self.core.runner.decode_backend)
        if (st := self.core.runner.static) is not None:  # the captured decode (decode_static.py)
            s.update(decode_warmup_s=st.warmup_s, decode_recompiles=st.recompiles, decode_eager_steps=st.eager_steps)
        return s

    # ================================================================== submission
    def _make_sequences(self, req: GenerationRequest) -> list[Sequence]:
        if not isinstance(req, GenerationRequest):
            raise InvalidRequestError("request", f"expected a GenerationRequest, got {type(req).__name__}")
        if req.lora_name is not None and req.lora_name not in self.lora_adapters:
            raise InvalidRequestError("lora_name", f"adapter {req.lora_name!r} is not loaded")
        prompt = req.prepared if req.prepared is not None else self.inputs.prepare(req)
        sp = req.sampling
        plen = len(prompt.prompt_ids)
        if plen >= self.max_model_len:
            raise RequestRejected("input_ids", f"the prompt has {plen} tokens; max_model_len is {self.max_model_len}")
        longest = min(plen + sp.max_new_tokens, self.max_model_len)
        if self.scheduler.blocks_for(longest) + 1 > self.kv.num_blocks:
            raise RequestRejected(
                "max_new_tokens", f"prompt ({plen}) + max_new_tokens ({sp.max_new_tokens}) needs "
                f"{longest} KV slots; the KV cache budget holds {self.kv.num_slots - self.kv.block_size}")
        seqs = [Sequence(req.request_id, i, prompt, sp, self._on_event, req.lora_name) for i in range(sp.n)]
        if sp.structured_outputs is not None:  # compiled once per request; each sample gets its own matcher
            grammar = self.core.grammars.compile(sp.structured_outputs)
            for s in seqs:
                s.constraint = grammar.matcher()
        return seqs

    def submit(self, req: GenerationRequest, on_delta=None) -> concurrent.futures.Future:
        """Queue a request; the future resolves to its list of n GenerationOutputs.

        Invalid input raises InvalidRequestError (naming the field) here, before anything is queued. The
        engine's worker thread steps it (a caller blocked in ``generate`` steps everyone's requests instead).
        """
        return self._submit(req, on_delta, start_worker=True)

    def _submit(self, req: GenerationRequest, on_delta, start_worker: bool) -> concurrent.futures.Future:
        if self.driver.stopped:
            raise EngineStopped("the engine is shut down")
        if self._fatal is not None:
            raise self._fatal
        if req.request_id in self._pending:
            raise InvalidRequestError("request_id", f"request_id {req.request_id!r} is already in flight")
        seqs = self._make_sequences(req)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        n = len(seqs)
        pend = _Pending(req.request_id, [None] * n, fut, on_delta, [0] * n, [0] * n)
        with self._cond:
            self._pending[req.request_id] = pend
            self.driver.inbox.extend(seqs)
            self._requests += 1
        if start_worker:
            self.driver.kick()
        return fut

    def generate(self, requests: Iterable[GenerationRequest] | GenerationRequest,
                 timeout: float | None = None) -> list[GenerationOutput]:
        """Run requests to completion; outputs in input order (a request with n samples gives n in a row).

        A request the engine cannot run (too long, bad image) yields an output with ``error`` set and
        finish_reason "abort"; the others complete. The steps run on the calling thread (together with any
        other requests in flight), so no second thread's OpenMP team competes with it for the cores.
        """
        if isinstance(requests, GenerationRequest):
            requests = [requests]
        futs = []
        for r in requests:
            try:
                futs.append((r, self._submit(r, None, start_worker=False)))
            except InvalidRequestError as e:
                futs.append((r, e))
        self.driver.drive_until([f for _, f in futs if not isinstance(f, Exception)], timeout)
        out: list[GenerationOutput] = []
        for r, f in futs:
            if isinstance(f, Exception):
                out.append(GenerationOutput(r.request_id, list(r.input_ids or []), finish_reason="abort",
                                            error=str(f)))
            else:
                out.extend(f.result(timeout))
        return out

    def wait_for(self, futures: Iterable[concurrent.futures.Future], timeout: float | None = None) -> None:
        """Block until these ``submit()`` futures are done, running the engine's steps on this thread meanwhile
        (as ``generate`` does: the worker thread hands over, so no second OpenMP team competes for the cores).
        Raises TimeoutError after ``timeout`` seconds; the requests stay in flight."""
        self.driver.drive_until(list(futures), timeout)

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

    def stream(self, request: GenerationRequest) -> AsyncIterator[StreamDelta]:  # a RequestStream
        """Submit now and return an async iterator of StreamDelta pieces (the last one per sample has
        finish_reason). Call it from a running event loop; invalid input raises here, before iteration.

        Leaving the iteration early (a client disconnect) aborts the request.
        """
        return self.stream_many([request], indexed=False)

    def stream_many(self, requests: list[GenerationRequest], indexed: bool = True) -> "RequestStream":
        """Submit all ``requests`` now (an invalid one raises here and none stays queued) and return an async
        iterable of ``(request_index, StreamDelta)`` (bare deltas with ``indexed=False``) across them.

        Leaving the iteration early, or ``close()`` (a client disconnect), aborts whatever is still running."""
        loop = asyncio.get_running_loop()
        stream = RequestStream(self, indexed)
        try:
            for k, req in enumerate(requests):
                fut = self.submit(req, on_delta=lambda d, k=k: loop.call_soon_threadsafe(stream.queue.put_nowait,
                                                                                         (k, d)))
                # Queued after the last delta: both are put from the engine thread, in order.
                fut.add_done_callback(lambda f, k=k: loop.call_soon_threadsafe(stream.queue.put_nowait, (k, None)))
                stream.futures.append((req.request_id, fut))
        except BaseException:
            stream.close()
            raise
        return stream

    # ================================================================== stepping (worker.py)
    def shutdown(self) -> None:
        """Abort everything still in flight and stop the engine's worker thread."""
        self.abort_all()
        self.driver.stop()

    def step(self) -> int:
        """Take in new requests and aborts, then run one core step on this thread; returns the tokens produced."""
        with self._step_lock:
            return self.driver.step()

    # ================================================================== outputs to callers
    def _refuse_model(self, e: ModelNotServableError) -> None:
        """The model cannot be served exactly (e.g. its attention bypassed the cache): nothing it produced
        is returned; every request in flight and every later submit fails with the named error."""
        logger.error("unsloth_rollout: %s", e)
        self._fatal = e
        with self._cond:
            pending, self._pending = list(self._pending.values()), {}
            self._cond.notify_all()
        for s in self.core.sequences():
            s.on_event = None
            self.core.finish(s, "abort", error=str(e))
        for p in pending:
            if not p.future.done():
                p.future.set_exception(e)

    def _on_event(self, s: Sequence, finished: bool) -> None:
        """Called by the core after each new token of ``s`` and when it finishes (engine thread)."""
        pend = self._pending.get(s.request_id)
        if pend is None:
            return
        i = s.sample_index
        if pend.on_delta is not None:
            delta, pend.sent_tokens[i], pend.sent_chars[i] = self.core.output.delta(
                s, pend.sent_tokens[i], pend.sent_chars[i], finished)
            if delta is not None:
                try:
                    pend.on_delta(delta)
                except Exception:
                    logger.exception("unsloth_rollout: stream consumer failed")
        if finished:
            pend.outputs[i] = s.to_output()
            if all(o is not None for o in pend.outputs):
                with self._cond:
                    self._pending.pop(s.request_id, None)
                    self._cond.notify_all()
                if not pend.future.done():
                    pend.future.set_result(pend.outputs)

    def __del__(self):
        try:
            with self._cond:
                self.driver.stopped = True
                self._cond.notify_all()
        except Exception:
            pass
