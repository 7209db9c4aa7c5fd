"""ServerState: what every endpoint shares (the engine, names, limits, counters) and engine I/O helpers.

``engine.stream_many`` (streams) and ``run_until_disconnect`` submit to the engine *before* any response byte is
sent, so invalid input is a 400 and not a broken stream, and both abort the engine request (freeing
its KV) when the client goes away.
"""

from __future__ import annotations

import asyncio
import collections
import time

from .media import MediaPolicy
from .metrics import ServerMetrics
from .protocol import APIError
from .settings import ServerSettings
from .tools import pick_parser


class ClientDisconnected(Exception):
    pass


class ServerState:
    """What every route shares: the engine, the settings and what they resolve to, counters and metrics."""

    def __init__(self, engine, settings: ServerSettings):
        self.engine = engine
        self.settings = settings
        policy = engine.policy
        self.model_path = settings.model_path or getattr(policy, "name_or_path", None)
        self.model_names = settings.model_names(self.model_path)
        self.default_sampling = default_sampling(policy) if settings.generation_config == "auto" else {}
        self.tokenizer = engine.tokenizer
        self.media = MediaPolicy(settings.allowed_local_media_path, settings.allow_remote_images,
                                 settings.max_images_per_request, settings.max_image_pixels)
        self.tool_parser = pick_parser(self.tokenizer, settings.tool_call_parser)
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
        return self.model_names[0]

    def adapter_for(self, name: str | None) -> str | None:
        """The LoRA adapter a request's ``model`` selects (None: the served policy); 404 when unknown."""
        if not name or name in self.model_names or name == self.model_path:
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


def default_sampling(policy) -> dict:
    """The sampling defaults of the model's generation_config.json (vLLM's ``--generation-config auto``)."""
    gc = getattr(getattr(policy, "base_model", None), "generation_config", None)
    try:
        diff = gc.to_diff_dict() if gc is not None else {}
    except Exception:
        return {}
    keys = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
    return {k: diff[k] for k in keys if diff.get(k) is not None}


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
