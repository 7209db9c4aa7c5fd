"""ServerState: what every endpoint shares (the engine, names, limits, counters) and engine I/O helpers.

``engine.stream_many`` (streams) and ``run_until_disconnect`` submit to the engine *before* any response byte is
sent, so invalid input is a 400 and not a broken stream, and both abort the engine request (freeing
its KV) when the client goes away.
"""

from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass, field

from .media import MediaPolicy
from .metrics import ServerMetrics
from .protocol import APIError
from .tools import pick_parser


@dataclass
class ServerOptions:
    """Server settings; ``create_app`` takes them as keyword arguments."""

    served_model_names: list[str] = field(default_factory=lambda: ["unsloth-rollout"])
    model_path: str | None = None
    api_key: str | None = None
    media: MediaPolicy = field(default_factory=MediaPolicy)
    max_n: int = 64
    max_body_bytes: int = 32 << 20
    tool_call_parser: str = "auto"
    default_sampling: dict = field(default_factory=dict)
    owns_engine: bool = False  # shut the engine down with the app
    # "raw_logprobs" (the trainer's log_softmax(logits / T)) or "processed_logprobs" (vLLM's --logprobs-mode).
    logprobs_mode: str = "raw_logprobs"
    max_logprobs: int = 20  # largest prompt_logprobs (vLLM's --max-logprobs)
    enable_runtime_lora: bool = False  # /v1/load_lora_adapter and /v1/unload_lora_adapter answer (vLLM's switch)
    weight_transfer_config: dict | None = None  # {"backend": "gloo", ...}: vLLM's weight-transfer routes served


class ClientDisconnected(Exception):
    pass


class ServerState:
    def __init__(self, engine, options: ServerOptions):
        self.engine = engine
        self.options = options
        self.tokenizer = engine.tokenizer
        self.media = options.media
        self.tool_parser = pick_parser(self.tokenizer, options.tool_call_parser)
        self.counters: collections.Counter = collections.Counter()
        self.metrics = ServerMetrics()
        engine.core.step_observers.append(self.metrics.observe_step)
        self.start_time = int(time.time())
        self.sleeping = False
        self._token_strs: dict[int, str] = {}
        self._gate: asyncio.Event | None = None  # cleared by /pause?mode=wait: new requests wait
        # Recorded sessions (a trainer's agent episodes, unsloth_rollout.areal.agent_server): an object with
        # ``lookup(raw_request) -> session | None``; a session has ``record(req, prep, outs, body)``.
        self.sessions = None
        self.weight_receiver = None  # serve.weight_transfer.WeightReceiver when weight transfer is on

    @property
    def model_name(self) -> str:
        return self.options.served_model_names[0]

    def adapter_for(self, name: str | None) -> str | None:
        """The LoRA adapter a request's ``model`` selects (None: the served policy); 404 when unknown."""
        if not name or name in self.options.served_model_names or name == self.options.model_path:
            return None
        if name in self.engine.lora_adapters:
            return name
        raise APIError(f"The model `{name}` does not exist.", 404, param="model")

    def token_str(self, token_id: int, as_ids: bool = False) -> str:
        if as_ids:
            return f"token_id:{token_id}"
        s = self._token_strs.get(token_id)
        if s is None:
            s = self._token_strs[token_id] = self.tokenizer.decode([token_id])
        return s

    @property
    def gate(self) -> asyncio.Event:
        if self._gate is None:
            self._gate = asyncio.Event()
            self._gate.set()
        return self._gate

    async def wait_gate(self) -> None:
        if not self.gate.is_set():
            await self.gate.wait()

    def count_finished(self, out) -> None:
        self.counters["generation_tokens"] += len(out.output_ids)
        self.counters[("finished", out.finish_reason or "unknown")] += 1
        self.metrics.observe_finished(out)


async def _wait_disconnect(raw_request) -> None:
    while True:
        message = await raw_request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_until_disconnect(engine, requests: list, raw_request) -> list[list]:
    """Submit ``requests`` and wait for all outputs; abort them all if the client disconnects first."""
    futures = []
    try:
        for req in requests:
            futures.append((req.request_id, engine.submit(req)))
    except BaseException:
        for rid, f in futures:
            engine.abort(rid)
        raise
    waiter = asyncio.ensure_future(asyncio.gather(*[asyncio.wrap_future(f) for _, f in futures]))
    watcher = asyncio.ensure_future(_wait_disconnect(raw_request))
    finished = False
    try:
        done, _ = await asyncio.wait({waiter, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finished = waiter in done
    finally:
        watcher.cancel()
        if not finished:  # the client left (or the server is cancelling us): free the engine's work
            waiter.add_done_callback(lambda f: f.cancelled() or f.exception())  # aborted outputs: not needed
            for rid, f in futures:
                if not f.done():
                    engine.abort(rid)
    if not finished:
        raise ClientDisconnected()
    return waiter.result()
