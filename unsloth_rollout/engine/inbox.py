"""Inbox: requests in flight between ``submit`` and their futures — queued sequences, aborts, results.

A submitted request becomes ``n`` Sequences (``sequences_for``: the request checked against the engine's limits),
queued here until the step driver (worker.py) hands them to the core; the core reports each new token and each
finish through ``on_event`` (engine thread), which streams deltas and resolves the request's future once all its
samples finished. ``refuse`` fails everything when the model cannot be served. Guarded by the driver's condition.
"""

from __future__ import annotations

import concurrent.futures
import threading
from dataclasses import dataclass, field

from ..errors import InvalidRequestError, ModelNotServableError, RequestRejected
from ..logs import get_logger
from .options import completion_room
from .request import GenerationOutput, GenerationRequest
from .sequence import Sequence

logger = get_logger("unsloth_rollout")


@dataclass
class _Pending:
    """Bookkeeping for one submitted request (all its n samples)."""

    request_id: str
    outputs: list[GenerationOutput | None]  # per sample, set when it finishes
    future: concurrent.futures.Future  # resolves to ``outputs`` when every sample finished
    on_delta: object = None  # callable(StreamDelta), called from the engine thread
    sent_tokens: list[int] = field(default_factory=list)  # per sample: tokens / characters already streamed
    sent_chars: list[int] = field(default_factory=list)


def sequences_for(core, req: GenerationRequest, adapters, on_event) -> list[Sequence]:
    """The ``n`` Sequences of ``req``, or InvalidRequestError / RequestRejected naming the field that is wrong:
    an adapter not in ``adapters``, a prompt or budget the engine cannot hold. Prepares the prompt (chat template,
    images) unless the request carries one."""
    if not isinstance(req, GenerationRequest):
        raise InvalidRequestError("request", f"expected a GenerationRequest, got {type(req).__name__}")
    if req.lora_name is not None and req.lora_name not in adapters:
        raise InvalidRequestError("lora_name", f"adapter {req.lora_name!r} is not loaded")
    prompt = req.prepared if req.prepared is not None else core.inputs.prepare(req)
    sp, limit, kv = req.sampling, core.max_model_len, core.kv
    plen = len(prompt.prompt_ids)
    if plen >= limit:
        raise RequestRejected("input_ids", f"the prompt has {plen} tokens; max_model_len is {limit}")
    longest = plen + min(sp.max_new_tokens, completion_room(plen, limit))
    if core.scheduler.blocks_for(longest) + 1 > kv.num_blocks:
        raise RequestRejected(
            "max_new_tokens", f"prompt ({plen}) + max_new_tokens ({sp.max_new_tokens}) needs "
            f"{longest} KV slots; the KV cache budget holds {kv.num_slots - kv.block_size}")
    seqs = [Sequence(req.request_id, i, prompt, sp, on_event, req.lora_name) for i in range(sp.n)]
    if sp.structured_outputs is not None:  # compiled once per request; each sample gets its own matcher
        grammar = core.grammars.compile(sp.structured_outputs)
        for s in seqs:
            s.constraint = grammar.matcher()
    return seqs


class Inbox:
    """Sequences submitted and not yet handed to the core, abort requests, and each request's future."""

    def __init__(self, cond: threading.Condition, delta):
        self.cond = cond
        self.delta = delta  # OutputProcessor.delta: the stream piece of a sample since what was sent
        self.queued: list[Sequence] = []
        self.abort_ids: set[str] = set()
        self.pending: dict[str, _Pending] = {}
        self.fatal: ModelNotServableError | None = None  # set once: the model cannot be served
        self.requests = 0  # submitted so far

    def put(self, core, req: GenerationRequest, adapters, on_delta=None) -> concurrent.futures.Future:
        """Queue the sequences of a new request (``sequences_for``); the future of their outputs."""
        if self.fatal is not None:
            raise self.fatal
        request_id = getattr(req, "request_id", None)
        if request_id in self.pending:
            raise InvalidRequestError("request_id", f"request_id {request_id!r} is already in flight")
        seqs = sequences_for(core, req, adapters, self.on_event)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        n = len(seqs)
        pend = _Pending(request_id, [None] * n, fut, on_delta, [0] * n, [0] * n)
        with self.cond:
            self.pending[request_id] = pend
            self.queued.extend(seqs)
            self.requests += 1
        return fut

    def take(self) -> tuple[list[Sequence], set[str]]:
        """(sequences to hand to the core, request ids to abort), emptied."""
        with self.cond:
            new, self.queued = self.queued, []
            aborts, self.abort_ids = self.abort_ids, set()
        return new, aborts

    def abort(self, request_ids) -> None:
        with self.cond:
            self.abort_ids.update(request_ids)
            self.cond.notify_all()

    def wait_idle(self, stopped, timeout: float | None = None) -> bool:
        """Block until no request is in flight or ``stopped()`` (woken by each finish); False on timeout."""
        with self.cond:
            return self.cond.wait_for(lambda: not self.pending or stopped(), timeout)

    def on_event(self, s: Sequence, finished: bool) -> None:
        """Called by the core after each new token of ``s`` and when it finishes (engine thread)."""
        pend = self.pending.get(s.request_id)
        if pend is None:
            return
        i = s.sample_index
        if pend.on_delta is not None:
            delta, pend.sent_tokens[i], pend.sent_chars[i] = self.delta(
                s, pend.sent_tokens[i], pend.sent_chars[i], finished)
            if delta is not None:
                try:
                    pend.on_delta(delta)
                except Exception:
                    logger.exception("unsloth_rollout: stream consumer failed")
        if finished:
            pend.outputs[i] = s.to_output()
            if all(o is not None for o in pend.outputs):
                with self.cond:
                    self.pending.pop(s.request_id, None)
                    self.cond.notify_all()
                if not pend.future.done():
                    pend.future.set_result(pend.outputs)

    def refuse(self, e: ModelNotServableError, core) -> None:
        """The model cannot be served exactly (e.g. its attention bypassed the cache): nothing it produced
        is returned; every request in flight and every later submit fails with the named error."""
        logger.error("unsloth_rollout: %s", e)
        self.fatal = e
        with self.cond:
            pending, self.pending = list(self.pending.values()), {}
            self.cond.notify_all()
        for s in core.sequences():
            s.on_event = None
            core.finish(s, "abort", error=str(e))
        for p in pending:
            if not p.future.done():
                p.future.set_exception(e)
