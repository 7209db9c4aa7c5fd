"""vLLM's full-weight transfer routes: a trainer broadcasts its weights into the served model, over NCCL or gloo.

TRL's ``GRPOTrainer(use_vllm=True, vllm_mode="server")`` syncs full weights (PEFT models: the merged adapter)
through vLLM's weight-transfer engine: ``/init_weight_transfer_engine`` (join the trainer's rendezvous),
``/start_weight_update``, ``/update_weights`` (receive the announced tensors by broadcast), and
``/finish_weight_update``. Enabled with ``--weight-transfer-config``, which ``/server_info`` then reports:

- ``{"backend": "nccl"}`` (vLLM's default and TRL's command line): the server joins the trainer's group exactly as
  a vLLM worker does (``models/nccl_wire.py``: vLLM's store rendezvous, NCCL unique id and broadcasts), so TRL's
  client on a CUDA trainer runs unchanged. The served model must be on a CUDA device (refused at start otherwise).
- ``{"backend": "gloo"}``: the same routes and payloads over a gloo group (``models/weight_wire.py``), any device.
  TRL's own trainer refuses a non-CUDA device before it gets here;
  ``unsloth_rollout.testing.trl_cpu.allow_grpo_server_mode_on_cpu`` gives it the gloo end of the wire, whose
  ``init_info`` says ``"backend": "gloo"``. Without it the client is vLLM's NCCL end, which would wait in an NCCL
  rendezvous a gloo server never joins, so it is refused (400) by name; a ``backend`` that names the other wire is
  refused either way.

With no config every route answers 501 naming the alternatives.

Every tensor is checked before a byte is written: a known name, the served weight's dtype and shape; otherwise
the broadcast is still received (so the sender is not left hanging), nothing is written, and the answer is 400
naming the tensor. From the first write to finish the engine holds a pause ("weight_transfer", mode keep): requests
in flight wait, then continue on the new weights with their KV recomputed and later tokens stamped with the new
version, which finish sets (its ``weight_version``, else the old version + 1). A refused update closes the round
(TRL's client sends no finish after an error), so the server never stays paused; so does a transfer that fails on
the wire (the trainer gone: NCCL aborts after ``timeout_s``), which also closes the group (500 naming the remedy).

Example::

    unsloth-rollout serve ./model --device cuda --weight-transfer-config '{"backend": "nccl"}'
"""

from __future__ import annotations

import asyncio
import json
import threading

import torch
from fastapi import Request

from ..engine import InvalidRequestError
from .protocol import APIError
from ..models.weight_wire import (DEFAULT_PACKED_BUFFER_SIZE_BYTES, DEFAULT_TIMEOUT_S, GlooTransferGroup,
                                  broadcast_one_by_one_consumer, packed_broadcast_consumer)
from ..models import weights as policy_weights
from .weights import base_weights

PAUSE_HOLDER = "weight_transfer"
ROUTES = ("/init_weight_transfer_engine", "/start_weight_update", "/update_weights", "/finish_weight_update")
# TRL's own ``trl vllm-serve`` routes (its older NCCL protocol): never served.
TRL_SERVE_ROUTES = ("/init_communicator", "/update_named_param", "/close_communicator")


BACKENDS = ("nccl", "gloo")


def parse_weight_transfer_config(value) -> dict | None:
    """``--weight-transfer-config`` (JSON text or a dict) -> the config ``/server_info`` reports, or None (off).
    The backend defaults to vLLM's, ``"nccl"``; ``timeout_s`` bounds the rendezvous and each update on the wire.

    Example: ``parse_weight_transfer_config('{"backend": "gloo"}') == {"backend": "gloo", "timeout_s": 600.0}``
    """
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ValueError(f"weight_transfer_config: not JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"weight_transfer_config must be a JSON object, got {value!r}")
    unknown = set(value) - {"backend", "timeout_s"}
    if unknown:
        raise ValueError(f"weight_transfer_config: unknown key(s) {sorted(unknown)}; known: backend, timeout_s")
    backend = value.get("backend", "nccl")
    if backend not in BACKENDS:
        raise ValueError(f"weight_transfer_config.backend must be 'nccl' (CUDA) or 'gloo' (any device), got "
                         f"{backend!r}")
    timeout_s = value.get("timeout_s", DEFAULT_TIMEOUT_S)
    if not isinstance(timeout_s, (int, float)) or isinstance(timeout_s, bool) or timeout_s <= 0:
        raise ValueError(f"weight_transfer_config.timeout_s must be a positive number, got {timeout_s!r}")
    return {"backend": backend, "timeout_s": float(timeout_s)}


def check_weight_transfer_device(config: dict | None, policy) -> None:
    """Refuse, by name and before any trainer connects, an NCCL transfer this server cannot join: the served model
    off CUDA, or no loadable libnccl."""
    if config is None or config["backend"] != "nccl":
        return
    if policy.device.type != "cuda":
        raise ValueError(f"weight_transfer_config.backend 'nccl' moves weights between CUDA devices, and the served "
                         f"model is on {policy.device}; use {{\"backend\": \"gloo\"}} (any device)")
    from ..models.nccl_wire import NcclLibrary

    try:
        NcclLibrary()
    except OSError as e:
        raise ValueError(f"weight_transfer_config.backend 'nccl': libnccl does not load ({e}); point "
                         f"UNSLOTH_ROLLOUT_NCCL_SO at it, or use {{\"backend\": \"gloo\"}}") from None


def _field(info: dict, key: str, kind, where: str):
    v = info.get(key)
    if not isinstance(v, kind) or isinstance(v, bool) and kind is not bool:
        raise InvalidRequestError(f"{where}.{key}", f"{where}.{key} must be {getattr(kind, '__name__', kind)}, "
                                                    f"got {v!r}")
    return v


class WeightReceiver:
    """The server's end of the transfer: one group at a time (NCCL or gloo, as ``config`` says), one update at a
    time."""

    def __init__(self, engine, config: dict):
        self.engine = engine
        self.config = config
        self.group = None  # a GlooTransferGroup or an nccl_wire.NcclTransferGroup, once a trainer has joined
        self.packed = False
        self.buffer_size_bytes = DEFAULT_PACKED_BUFFER_SIZE_BYTES
        self.updating = False  # between start and finish (or inside one implicit update)
        self.paused = False  # holding the engine's "weight_transfer" pause
        self.written = 0  # tensors written this round
        self.busy = threading.Lock()  # a second update while one receives is refused (409), never interleaved

    def init(self, init_info) -> None:
        if not isinstance(init_info, dict):
            raise InvalidRequestError("init_info", f"init_info must be an object, got {init_info!r}")
        backend, said = self.config["backend"], init_info.get("backend")
        if said is None and backend == "gloo":  # vLLM's NCCL client would wait for an NCCL peer that never comes
            raise InvalidRequestError("init_info.backend", "this server transfers weights over gloo: init_info must "
                                      "say \"backend\": \"gloo\"; vLLM's NCCL trainer end (TRL's client on CUDA) "
                                      "is joined by a server started with --weight-transfer-config "
                                      "'{\"backend\": \"nccl\"}' (on CPU: unsloth_rollout.testing.trl_cpu."
                                      "allow_grpo_server_mode_on_cpu)")
        if said is not None and said != backend:
            raise InvalidRequestError("init_info.backend", f"this server transfers weights over {backend} "
                                                           f"(--weight-transfer-config), not {said!r}")
        address = _field(init_info, "master_address", str, "init_info")
        port = _field(init_info, "master_port", int, "init_info")
        rank = _field(init_info, "rank_offset", int, "init_info")
        world = _field(init_info, "world_size", int, "init_info")
        if world != rank + 1:  # the server is one worker (/get_world_size answers 1), after the trainer ranks
            raise InvalidRequestError("init_info.world_size", f"init_info.world_size must be rank_offset + 1 = "
                                                              f"{rank + 1} (this server is one worker), got {world}")
        base_weights(self.engine.policy, "init_info", refuse_own_adapter=True)  # refuse before any rendezvous
        self.packed = bool(init_info.get("packed", False))
        self.buffer_size_bytes = int(init_info.get("packed_buffer_size_bytes", DEFAULT_PACKED_BUFFER_SIZE_BYTES))
        self._drop_group()  # a new trainer replaces the old group
        try:
            if backend == "nccl":
                from ..models.nccl_wire import NcclTransferGroup

                self.group = NcclTransferGroup.join(address, port, rank=rank, world_size=world,
                                                    device=self.engine.policy.device,
                                                    timeout_s=self.config["timeout_s"])
            else:
                self.group = GlooTransferGroup(address, port, rank=rank, world_size=world,
                                               timeout_s=self.config["timeout_s"])
        except Exception as e:
            raise InvalidRequestError("init_info", f"cannot join the trainer's {backend} group at {address}:{port}: "
                                                   f"{e}") from None

    def _drop_group(self) -> None:
        group, self.group = self.group, None
        if group is not None:
            group.abort()

    def start(self) -> None:
        """Open an update round (``finish`` closes it); the engine pauses only once a tensor is to be written."""
        if not self.updating:  # a second start keeps the round (and what it wrote) open
            self.updating, self.written = True, 0

    def _hold(self) -> None:
        if not self.paused:
            self.engine.pause("keep", holder=PAUSE_HOLDER)
            self.paused = True

    def _release(self) -> None:
        self.updating, self.written = False, 0
        if self.paused:
            self.paused = False
            self.engine.resume(holder=PAUSE_HOLDER)

    def finish(self, weight_version=None) -> int:
        """Close the round: what was written is served from the next step on; returns the version now stamped."""
        engine = self.engine
        try:
            if weight_version is not None:
                try:
                    version = int(weight_version)
                except (TypeError, ValueError):
                    raise InvalidRequestError("weight_version", f"weight_version must be an integer, got "
                                                                f"{weight_version!r}") from None
            else:
                version = engine.version + 1 if self.written else engine.version
            if self.written:
                engine.policy.clear_rope_deltas()
                engine.weights_changed(version)
            else:
                engine.set_version(version)
            return version
        finally:
            self._release()

    def update(self, update_info) -> int:
        """Receive the tensors ``update_info`` announces and write them; returns how many were written.

        A refusal closes the round (a client that failed sends no finish): earlier writes of the round are
        published as by ``finish``, and the pause is released either way."""
        if self.group is None:
            raise InvalidRequestError("update_info", "no weight-transfer group: call /init_weight_transfer_engine "
                                                     "first")
        metadata = self._metadata(update_info)
        targets = base_weights(self.engine.policy, "update_info", refuse_own_adapter=True)
        problem = self._mismatch(metadata, targets)
        packed = bool(update_info.get("packed", self.packed))  # older vLLM clients send packed here
        if not self.busy.acquire(blocking=False):
            raise APIError("a weight update is already being received", 409, param="update_info")
        implicit, ok = not self.updating, False
        try:
            if implicit:
                self.start()
            if problem is None:
                self._hold()
            policy = self.engine.policy

            def write(pairs):
                if problem is not None:
                    return  # received and dropped: nothing is written when any tensor does not fit
                self.written += policy_weights.write_base_tensors(policy, targets, pairs)

            group = self.group
            try:
                if packed:
                    packed_broadcast_consumer(metadata, group, 0, write, self.buffer_size_bytes)
                else:
                    broadcast_one_by_one_consumer(metadata, group, 0, write)
                group.wait(self.config["timeout_s"])  # NCCL: the bytes (and writes) enqueued are in place
            except Exception as e:  # the wire failed (the trainer gone): this group is done
                self._drop_group()
                raise APIError(f"the weight transfer failed on the wire ({type(e).__name__}: {e}); the group is "
                               f"closed: join again with /init_weight_transfer_engine", 500,
                               param="update_info") from None
            ok = problem is None
        finally:
            self.busy.release()
            if implicit or not ok:
                self.finish()
        if problem is not None:
            raise problem
        return len(metadata)

    @staticmethod
    def _metadata(info) -> list[tuple[str, list[int], torch.dtype]]:
        if not isinstance(info, dict):
            raise InvalidRequestError("update_info", f"update_info must be an object, got {info!r}")
        names = _field(info, "names", list, "update_info")
        dtypes = _field(info, "dtype_names", list, "update_info")
        shapes = _field(info, "shapes", list, "update_info")
        if not len(names) == len(dtypes) == len(shapes):
            raise InvalidRequestError("update_info", f"update_info.names, dtype_names and shapes must have one "
                                                     f"entry per tensor, got {len(names)}, {len(dtypes)}, "
                                                     f"{len(shapes)}")
        out = []
        for i, (name, dname, shape) in enumerate(zip(names, dtypes, shapes)):
            dtype = getattr(torch, dname, None) if isinstance(dname, str) else None
            if not isinstance(dtype, torch.dtype):
                raise InvalidRequestError(f"update_info.dtype_names[{i}]", f"update_info.dtype_names[{i}]: unknown "
                                                                           f"dtype {dname!r}")
            if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
                raise InvalidRequestError(f"update_info.shapes[{i}]", f"update_info.shapes[{i}] must be a list of "
                                                                      f"non-negative integers, got {shape!r}")
            if not isinstance(name, str):
                raise InvalidRequestError(f"update_info.names[{i}]", f"update_info.names[{i}] must be a string")
            out.append((name, shape, dtype))
        return out

    @staticmethod
    def _mismatch(metadata, targets) -> InvalidRequestError | None:
        for i, (name, shape, dtype) in enumerate(metadata):
            p = targets.get(name)
            where = f"update_info.names[{i}]"
            if p is None:
                return InvalidRequestError(where, f"{name!r} is not a weight of the served model")
            if list(p.shape) != list(shape):
                return InvalidRequestError(where, f"{name!r}: shape {list(shape)} != the served weight's "
                                                  f"{list(p.shape)}")
            if p.dtype != dtype:
                return InvalidRequestError(where, f"{name!r}: dtype {str(dtype).removeprefix('torch.')} != the "
                                                  f"served weight's {str(p.dtype).removeprefix('torch.')} (start "
                                                  f"the server with the trainer's --dtype)")
        return None


async def _body(raw: Request) -> dict:
    try:
        body = await raw.json()
    except ValueError:
        raise APIError("Invalid JSON body", param="body") from None
    if not isinstance(body, dict):
        raise APIError("the body must be a JSON object", param="body")
    return body


async def _required(raw: Request, key: str):
    value = (await _body(raw)).get(key)
    if value is None:
        raise APIError(f"Missing '{key}' in request body", param=key)
    return value


def install_weight_transfer_routes(app, state) -> None:
    """vLLM's four transfer routes on ``app``: served when ``state.settings.weight_transfer_config`` is set, 501
    naming the alternatives otherwise; TRL's ``trl vllm-serve`` routes always answer 501."""
    config = state.settings.weight_transfer_config

    async def _off(raw: Request):
        raise APIError("full-weight transfer is off (weight_transfer_config is null): start the server with "
                       "--weight-transfer-config '{\"backend\": \"nccl\"}' (CUDA) or '{\"backend\": \"gloo\"}', "
                       "sync a PEFT adapter with "
                       "/v1/load_lora_adapter, or full weights from disk with /areal_update_weights", 501,
                       type="NotImplementedError")

    async def _trl_serve(raw: Request):
        raise APIError("TRL's `trl vllm-serve` weight routes are not served: TRL's VLLMClient uses vLLM's "
                       "/init_weight_transfer_engine and /update_weights (start the server with "
                       "--weight-transfer-config '{\"backend\": \"nccl\"}')", 501, type="NotImplementedError")

    for route in TRL_SERVE_ROUTES:
        app.add_api_route(route, _trl_serve, methods=["POST"], include_in_schema=False)
    if config is None:
        for route in ROUTES:
            app.add_api_route(route, _off, methods=["POST"], include_in_schema=False)
        return
    receiver = state.weight_receiver = WeightReceiver(state.engine, config)

    async def init_weight_transfer_engine(raw: Request):
        """Join the trainer's group: ``{"init_info": {"master_address", "master_port", "rank_offset": 1,
        "world_size": 2, "packed": true}}`` as vLLM's (plus ``"backend": "gloo"`` on a gloo server); returns once
        the trainer has joined too."""
        await asyncio.to_thread(receiver.init, await _required(raw, "init_info"))
        return {"message": "Weight transfer initialized"}

    async def start_weight_update(raw: Request):
        await asyncio.to_thread(receiver.start)
        return {"message": "Weight update started"}

    async def update_weights(raw: Request):
        """Receive ``{"update_info": {"names", "dtype_names", "shapes"}}`` by broadcast, then write them in place."""
        await asyncio.to_thread(receiver.update, await _required(raw, "update_info"))
        return {"message": "Weights updated"}

    async def finish_weight_update(raw: Request):
        body = await _body(raw) if await raw.body() else {}
        version = await asyncio.to_thread(receiver.finish, body.get("weight_version"))
        return {"message": "Weight update finished", "weight_version": version}

    for route, fn in zip(ROUTES, (init_weight_transfer_engine, start_weight_update, update_weights,
                                  finish_weight_update)):
        app.add_api_route(route, fn, methods=["POST"], include_in_schema=False)
