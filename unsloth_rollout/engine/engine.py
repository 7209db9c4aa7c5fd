"""RolloutEngine: the engine's face — submit / generate / agenerate / stream, pauses, weight changes, stats.

Its parts, each a class of its own, depend one way: ``EngineCore`` (core.py) runs one step, no threads;
``StepDriver`` (worker.py) runs it on the thread of a caller that waits (``generate``) or else on a worker thread
that exits when idle, over the ``Inbox`` (inbox.py: requests in flight and their futures) and ``PauseHolders``
(pauses.py); ``RequestStream`` (streams.py) turns deltas into async iterators; ``WeightsClock`` (weights.py) is the
weight version and the stale-KV rule. So ``generate`` (blocking), ``agenerate`` (any event loop or thread) and
``stream`` all batch together, and only one thread's OpenMP team does the model's work. The engine holds the
PolicyModel, never a copy: after an optimizer step and ``set_version(v + 1)`` the next tokens come from the new
weights.

Example::

    engine = RolloutEngine(load_model("tiny-dir"))
    out = engine.generate([GenerationRequest(messages=[{"role": "user", "content": "hi"}],
                                             sampling=SamplingParams(max_new_tokens=16))])[0]
    print(out.output_ids, out.output_logprobs)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import types
from typing import AsyncIterator, Iterable

from ..logs import get_logger
from ..errors import EngineStopped, InvalidRequestError, RequestRejected  # noqa: F401  (re-exported)
from ..models import weights as policy_weights
from .config import EngineConfig
from .core import EngineCore
from .inputs import PreparedPrompt
from .malloc import retain_freed_memory
from .precision import model_precision
from .request import GenerationOutput, GenerationRequest, StreamDelta
from .stats import engine_stats
from .streams import RequestStream, open_stream
from .worker import StepDriver

logger = get_logger("unsloth_rollout")


class RolloutEngine:
    """Continuous-batching rollout engine over a PolicyModel (see module docstring). ``tokenizer``,
    ``max_model_len`` (prompt + completion) and ``eos_ids`` describe the model served; ``core`` holds the parts."""

    def __init__(self, policy, config: EngineConfig | None = None, *, seed: int | None = None):
        self.policy = policy
        self.config = config or EngineConfig()
        retain_freed_memory(policy.device, self.config.cpu_retain_freed_memory)  # CPU: keep freed activations
        with model_precision(policy):  # the probe at start runs in the model's own dtype too (precision.py)
            self.core = EngineCore(policy, self.config, seed)
        self.tokenizer, self.max_model_len, self.eos_ids = policy.tokenizer, self.core.max_model_len, self.core.eos_ids
        self.driver = StepDriver(self.core)  # the thread, the inbox (requests in flight) and the pause holders
        kv = self.core.kv
        logger.info("unsloth_rollout: KV cache %d blocks x %d tokens (%.1f MiB), max_model_len %d", kv.num_blocks,
                    kv.block_size, kv.memory_bytes / 2**20, self.max_model_len)

    # ================================================================== prompts
    def prepare(self, request: GenerationRequest) -> PreparedPrompt:
        """The prompt ``request`` becomes (chat template, images, placeholders expanded), e.g. to count its tokens;
        set it as ``request.prepared`` and ``submit`` uses it instead of preparing again."""
        return self.core.inputs.prepare(request)

    def render_chat(self, messages: list[dict], tools=None, chat_template_kwargs=None,
                    add_generation_prompt: bool = True):
        """(prompt text, images) of chat ``messages``, rendered with the chat template as ``prepare`` renders it."""
        return self.core.inputs.render_chat(messages, tools, chat_template_kwargs,
                                            add_generation_prompt=add_generation_prompt)

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
        start of the next step, before any token is sampled (the rule: ``WeightsClock.apply``, weights.py).
        """
        self.core.weights.bump(version, lora_name)
        self.driver.weights_changed()

    # ================================================================== LoRA adapters served by name
    @property
    def lora_adapters(self) -> types.MappingProxyType:
        """The adapters served by name: name -> the folder it was loaded from (read-only)."""
        return types.MappingProxyType(self.policy.adapter_paths)

    def load_lora_adapter(self, name: str, path: str, load_inplace: bool = False) -> None:
        """Load a PEFT adapter folder that requests select with ``lora_name=name`` (models/weights.py).

        Refused before anything changes, with InvalidRequestError naming the reason (``AdapterNotFoundError``
        when there is no adapter at ``path``): DoRA, ``modules_to_save``, a rank above ``config.lora.max_lora_rank``,
        modules or shapes the model lacks (another base model), unreadable weights, more than
        ``config.lora.max_loras`` adapters. The policy's own adapter stays active for requests without a lora_name.
        ``load_inplace=True`` replaces a loaded adapter's weights: its requests in flight continue, recomputed
        with the new weights (a refused replacement leaves the old one serving).
        """
        had = name in self.policy.adapter_paths
        with self.driver.step_lock:
            try:
                rewrapped = policy_weights.load_adapter(self.policy, name, path, self.config.lora.max_lora_rank,
                                                        self.config.lora.max_loras, replace=load_inplace)
            finally:
                if had and name not in self.policy.adapter_paths:  # the old weights are gone: its requests too
                    self.driver.abort_adapter(name, f"adapter {name!r} could not be reloaded")
        self.weights_changed(lora_name=None if rewrapped else name)  # a new wrapper object: recompute all

    def unload_lora_adapter(self, name: str) -> None:
        """Remove a loaded adapter; its requests in flight finish with finish_reason "abort"."""
        if name not in self.policy.adapter_paths:
            raise InvalidRequestError("lora_name", f"adapter {name!r} is not loaded")
        with self.driver.step_lock:
            self.driver.abort_adapter(name, f"adapter {name!r} was unloaded")
            rewrapped = policy_weights.unload_adapter(self.policy, name)
        self.weights_changed(lora_name=None if rewrapped else name)

    def invalidate_prefix_cache(self) -> None:
        with self.driver.step_lock:
            self.core.scheduler.prefix.drop()

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
        self.driver.pauses.check(mode, holder)
        if mode == "wait":
            self.wait_idle()
        self.driver.hold(holder)
        if mode == "abort":
            self.abort_all()

    def resume(self, holder: str = "user") -> None:
        """Release ``holder``'s pause; generation continues once no one else holds one."""
        self.driver.release(holder)

    @property
    def is_paused(self) -> bool:
        return bool(self.driver.pauses.holders)

    @property
    def paused_by(self) -> frozenset[str]:
        """Who holds a pause now (empty: running)."""
        with self.driver.cond:
            return frozenset(self.driver.pauses.holders)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until no request is in flight (woken by each finished request, no polling); False on timeout."""
        return self.driver.inbox.wait_idle(lambda: self.driver.stopped, timeout)

    def abort(self, request_id: str) -> None:
        """Finish every sample of ``request_id`` with finish_reason "abort" and free its KV."""
        self.driver.abort([request_id])

    def abort_all(self) -> None:
        self.driver.abort_all()

    def offload(self) -> None:
        """Free the KV cache memory (for training); requests wait until ``onload()``.

        Holds its own pause ("offload"): ``onload()`` releases only that one, never a pause someone else holds."""
        self.pause("keep", holder="offload")
        self.driver.offload()

    def onload(self) -> None:
        """Allocate the KV cache again and release the "offload" pause."""
        self.driver.onload()
        self.resume(holder="offload")

    def stats(self) -> dict:
        """Counters and gauges of the engine (steps, tokens, KV and prefix-cache use, pauses): see stats.py."""
        return engine_stats(self)

    # ================================================================== submission
    def submit(self, req: GenerationRequest, on_delta=None) -> concurrent.futures.Future:
        """Queue a request; the future resolves to its list of n GenerationOutputs.

        Invalid input raises InvalidRequestError (naming the field) here, before anything is queued. The
        engine's worker thread steps it (a caller blocked in ``generate`` steps everyone's requests instead).
        """
        return self._submit(req, on_delta, start_worker=True)

    def _submit(self, req: GenerationRequest, on_delta, start_worker: bool) -> concurrent.futures.Future:
        if self.driver.stopped:
            raise EngineStopped("the engine is shut down")
        fut = self.driver.inbox.put(self.core, req, self.policy.adapter_paths, on_delta)
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
        return open_stream(self, [request], indexed=False)

    def stream_many(self, requests: list[GenerationRequest], indexed: bool = True) -> RequestStream:
        """Submit all ``requests`` now (an invalid one raises here and none stays queued) and return an async
        iterable of ``(request_index, StreamDelta)`` (bare deltas with ``indexed=False``) across them.

        Leaving the iteration early, or ``close()`` (a client disconnect), aborts whatever is still running."""
        return open_stream(self, requests, indexed)

    # ================================================================== stepping (worker.py)
    def shutdown(self) -> None:
        """Abort everything still in flight and stop the engine's worker thread."""
        self.abort_all()
        self.driver.stop()

    def step(self) -> int:
        """Take in new requests and aborts, then run one core step on this thread; returns the tokens produced."""
        with self.driver.step_lock:
            return self.driver.step()

    def __del__(self):
        try:
            self.driver.stop(join=False)
        except Exception:
            pass
