"""SGLang's native routes: ``/generate`` and the control routes AReaL's ``RemoteSGLangEngine`` (SGLang is AReaL's
default rollout backend, ``sglang:d1``) and SGLang's own RL docs call, on the same engine verbs as the vLLM routes.

Pause and continue share the HTTP pause holder with /pause and AReaL's vLLM routes (``routes_control``); weights
from disk go through ``weights.load_weights_from_disk`` as /areal_update_weights does; adapters through the engine's
``load_lora_adapter``. Request and response shapes: ``sglang.py``; every route, and how it differs from SGLang's:
docs/server-sglang.md.
"""

from __future__ import annotations

import asyncio

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from .. import __version__
from ..engine import GenerationOutput, GenerationRequest, InvalidRequestError, SamplingParams
from ..models.adapters import AdapterNotFoundError
from .protocol import APIError, LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest, error_body
from .render import _check_errors, _sse
from .routes_control import pause_http, resume_http
from .sglang import (AbortRequest, GenerateRequest, Item, MemoryOccupationRequest, PauseGenerationRequest,
                     SGLangUpdateWeightsRequest, engine_refusal, generate_items, sglang_body)
from .state import ClientDisconnected, ServerState, run_until_disconnect

HEALTH_CHECK_TIMEOUT_S = 20.0  # SGLang's default for /health_generate
_PAUSE_MODES = {"abort": "abort", "retract": "keep", "in_place": "keep"}  # SGLang's mode -> engine.pause's
_MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")  # SGLang's tags
# Full-weight transfers this server does not take over SGLang's routes, and what to use instead.
_DISTRIBUTED = ("/init_weights_update_group", "/update_weights_from_distributed", "/update_weights_from_tensor",
                "/destroy_weights_update_group")


def _failure(message: str, status: int = 400, **extra) -> JSONResponse:
    """SGLang's answer to a weight or adapter route that failed: ``{"success": false, "message"}``."""
    return JSONResponse({"success": False, "message": message, **extra}, status_code=status)


def add_sglang_routes(app: FastAPI, state: ServerState) -> None:
    engine = state.engine
    by_rid: dict[str, set[str]] = {}  # SGLang request id -> the engine's request ids running for it (abort_request)

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(req: GenerateRequest, raw: Request):
        """Generate from token ids or text (one prompt or a batch), images, LoRA adapters, logprobs.

        Takes: SGLang's ``GenerateReqInput`` (``input_ids`` / ``text``, ``image_data``, ``sampling_params``,
        ``return_logprob``, ``top_logprobs_num``, ``logprob_start_len``, ``lora_path``, ``rid``, ``stream``).
        Returns: ``{"text", "output_ids", "meta_info": {"id", "finish_reason", "prompt_tokens",
        "completion_tokens", "weight_version", "e2e_latency", "output_token_logprobs": [[logprob, id, text]],
        "input_token_logprobs", ...}}``; a list for a batch or ``n`` > 1; SSE chunks (each the output so far, then
        ``[DONE]``) when streaming.
        Called by: AReaL's ``RemoteSGLangEngine`` (``SGLangBackend``: generation and ``compute_logp``) and other
        SGLang clients.

        Example request::

            {"input_ids": [1, 2, 3], "return_logprob": true, "sampling_params": {"max_new_tokens": 8}}
        """
        state.counters[("requests", "generate")] += 1
        await state.wait_gate()
        items, single = await generate_items(state, req)
        requests = [it.request for it in items]
        n = requests[0].sampling.n
        state.counters["prompt_tokens"] += sum(len(r.prepared.prompt_ids) for r in requests)
        for it in items:
            by_rid.setdefault(it.rid, set()).add(it.request.request_id)
        if req.stream:
            try:
                stream = engine.stream_many(requests)
            except InvalidRequestError as e:
                _forget(by_rid, items)
                raise engine_refusal(e, items) from None
            return StreamingResponse(_events(state, items, stream, n), media_type="text/event-stream",
                                     background=BackgroundTask(_close, stream, by_rid, items))
        try:
            results = await run_until_disconnect(engine, requests, raw)
        except ClientDisconnected:
            return Response(status_code=499)
        except InvalidRequestError as e:
            raise engine_refusal(e, items) from None
        finally:
            _forget(by_rid, items)
        bodies = []
        for it, outs in zip(items, results):
            _check_errors(outs)
            for out in outs:
                state.count_finished(out)
                bodies.append(sglang_body(state, it, out, out.sample_index, n))
        return JSONResponse(bodies[0] if single and n == 1 else bodies)

    @app.get("/health_generate")
    async def health_generate():
        """Health through a generated token: 200 once the engine produced one, 503 while generation is paused or
        asleep, or when no token came within 20 s. Called by: SGLang-style load balancers and launchers."""
        if engine.is_paused or state.sleeping:
            who = ", ".join(sorted(engine.paused_by)) or "sleep"
            raise APIError(f"generation is paused (held by: {who}); no token can be generated now", 503)
        probe = GenerationRequest(input_ids=[0], sampling=SamplingParams(max_new_tokens=1, temperature=0))
        fut = engine.submit(probe)
        try:
            await asyncio.wait_for(asyncio.wrap_future(fut), HEALTH_CHECK_TIMEOUT_S)
        except asyncio.TimeoutError:
            engine.abort(probe.request_id)
            raise APIError(f"no token was generated within {HEALTH_CHECK_TIMEOUT_S:.0f} s", 503) from None
        return Response(status_code=200)

    @app.get("/get_model_info")
    async def get_model_info():
        """Returns: ``{"model_path", "tokenizer_path", "is_generation", "preferred_sampling_params",
        "weight_version", "has_image_understanding", "model_type", "architectures"}``.
        Called by: SGLang clients."""
        config = getattr(engine.policy, "config", None)
        return {"model_path": state.model_path, "tokenizer_path": state.model_path, "is_generation": True,
                "preferred_sampling_params": state.default_sampling or None,
                "weight_version": str(engine.version), "has_image_understanding": bool(engine.policy.is_vlm),
                "has_audio_understanding": False, "model_type": getattr(config, "model_type", None),
                "architectures": getattr(config, "architectures", None)}

    @app.get("/get_server_info")
    async def get_server_info():
        """SGLang's server description: its server-argument names for what this engine is, ``status``, and
        ``internal_states`` (one entry: ``last_gen_throughput``, decode tokens per busy second since start, and the
        running / waiting counts).
        Called by: SGLang clients and benchmarks (``bench_one_batch_server`` reads
        ``internal_states[0]["last_gen_throughput"]``), routers that detect an SGLang server by it."""
        cfg, s, policy = engine.config, engine.stats(), engine.policy
        return {"model_path": state.model_path, "tokenizer_path": state.model_path,
                "served_model_name": state.model_name, "context_length": engine.max_model_len,
                "dtype": str(policy.dtype).removeprefix("torch."), "device": policy.device.type,
                "tp_size": 1, "dp_size": 1, "pp_size": 1, "page_size": s["kv_block_size"],
                "max_running_requests": cfg.max_num_seqs, "max_prefill_tokens": cfg.prefill.max_tokens,
                "max_total_num_tokens": s["kv_blocks_total"] * s["kv_block_size"],
                "max_req_input_len": engine.max_model_len - 1, "disable_radix_cache": not cfg.prefix_cache,
                "enable_lora": True, "max_lora_rank": cfg.lora.max_lora_rank,
                "max_loaded_loras": cfg.lora.max_loras, "is_embedding": False,
                "enable_multimodal": bool(policy.is_vlm), "weight_version": str(engine.version),
                "status": "ready",
                "internal_states": [{"last_gen_throughput": s["decode_tokens"] / s["busy_s"] if s["busy_s"] else 0.0,
                                     "num_running_reqs": s["num_running"], "num_waiting_reqs": s["num_waiting"]}],
                "version": __version__}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        """Drop the prefix cache (KV that requests hold stays). Returns: text, 200. Called by: SGLang clients
        between weight versions."""
        await asyncio.to_thread(engine.invalidate_prefix_cache)
        return PlainTextResponse("Cache flushed.\n")

    @app.post("/pause_generation")
    async def pause_generation(req: PauseGenerationRequest | None = None):
        """Pause generation; requests that arrive meanwhile wait for /continue_generation.

        Takes: ``{"mode": "abort"}`` (the default, also for an empty body: in-flight requests return their partial
        output with finish_reason ``{"type": "abort"}``, which AReaL resubmits), ``"retract"`` or ``"in_place"``
        (they keep their tokens and continue on /continue_generation).
        Returns: ``{"message", "status": "ok"}``.
        Called by: AReaL's ``RemoteSGLangEngine.pause_generation`` (before each weight update).
        """
        mode = (req or PauseGenerationRequest()).mode
        await pause_http(state, _PAUSE_MODES[mode], clear_cache=False)
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    async def continue_generation():
        """Release the pause. Returns: ``{"message", "status": "ok"}``.
        Called by: AReaL's ``RemoteSGLangEngine.continue_generation``."""
        await resume_http(state)
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.post("/abort_request")
    async def abort_request(req: AbortRequest):
        """Abort requests by SGLang request id (``rid``, a prefix of it too) or all (``abort_all``); they return
        their partial output with finish_reason ``{"type": "abort"}``. Returns: 200. Called by: SGLang clients."""
        if req.abort_all:
            await asyncio.to_thread(engine.abort_all)
        elif req.rid:
            for rid, ids in list(by_rid.items()):
                if rid.startswith(req.rid):
                    for request_id in list(ids):
                        engine.abort(request_id)
        return Response(status_code=200)

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(req: SGLangUpdateWeightsRequest):
        """Full-model update from a ``save_pretrained`` folder of the same model, copied into the served policy.

        Takes: ``{"model_path", "abort_all_requests", "weight_version", "load_format"}``. With
        ``abort_all_requests`` in-flight requests return their partial output (AReaL resubmits); without, they
        stop at a step boundary and continue on the new weights. ``weight_version`` (an integer: the engine's
        versions are AReaL's) stamps tokens sampled from then on.
        Returns: ``{"success": true, "message", "num_paused_requests"}``; ``{"success": false, "message"}`` with
        400 for a checkpoint that does not fit the model.
        Called by: AReaL's ``RemoteSGLangEngine.update_weights_from_disk`` (full-weight updates).
        """
        from .weights import load_weights_from_disk

        if req.load_format not in (None, "auto"):
            return _failure(f"load_format {req.load_format!r} is not served (the checkpoint is read as "
                            "save_pretrained wrote it); leave it unset or 'auto'", num_paused_requests=0)
        version = None
        if req.weight_version is not None:
            try:
                version = int(req.weight_version)
            except (TypeError, ValueError):
                return _failure(f"weight_version must be an integer (the engine's versions are AReaL's), got "
                                f"{req.weight_version!r}", num_paused_requests=0)
        stats = engine.stats()
        in_flight = stats["num_running"] + stats["num_waiting"]  # sequences, as SGLang counts its requests
        mode = "abort" if req.abort_all_requests else "keep"
        try:
            n = await asyncio.to_thread(load_weights_from_disk, engine, req.model_path, mode)
        except InvalidRequestError as e:
            return _failure(str(e), num_paused_requests=0)
        message = f"Succeeded to update model weights ({n} tensors from {req.model_path})."
        if version is not None:
            engine.set_version(version)
            message += f" Weight version updated to {version}."
        return {"success": True, "message": message, "num_paused_requests": in_flight}

    @app.post("/load_lora_adapter")
    async def load_lora_adapter(req: LoadLoRAAdapterRequest):
        """Load a PEFT adapter folder; requests then name it in ``lora_path``.

        Off unless runtime adapter loading is on (``--enable-runtime-lora``, as SGLang needs ``--enable-lora``).
        An adapter the engine cannot serve exactly is refused with the reason; adapters loaded before keep serving.
        Takes: ``{"lora_name": "policy-v3", "lora_path": "/ckpt/v3"}``.
        Returns: ``{"success": true, "error_message": "", "loaded_adapters": {name: path}}``; ``success: false``
        and the reason in ``error_message`` with 400.
        Called by: AReaL's ``RemoteSGLangEngine`` (LoRA updates from disk, one adapter per version).
        """
        failure = _adapter_check(state, req.lora_name)
        if failure is None:
            try:
                await asyncio.to_thread(engine.load_lora_adapter, req.lora_name, req.lora_path,
                                        bool(req.load_inplace))
            except (AdapterNotFoundError, InvalidRequestError) as e:
                failure = str(e)
        return _adapters(engine, failure)

    @app.post("/unload_lora_adapter")
    async def unload_lora_adapter(req: UnloadLoRAAdapterRequest):
        """Unload an adapter by name; its in-flight requests finish with finish_reason abort.
        Takes: ``{"lora_name"}``. Returns: as /load_lora_adapter (``success: false`` with 400 when not loaded).
        Called by: AReaL's ``RemoteSGLangEngine`` (the version that left ``lora_keep_versions``)."""
        failure = _adapter_check(state, None)
        if failure is None:
            if req.lora_name not in engine.lora_adapters:
                failure = f"LoRA adapter {req.lora_name!r} is not loaded"
            else:
                await asyncio.to_thread(engine.unload_lora_adapter, req.lora_name)
        return _adapters(engine, failure)

    @app.api_route("/release_memory_occupation", methods=["GET", "POST"])
    async def release_memory_occupation(req: MemoryOccupationRequest | None = None):
        """Free the KV cache memory; requests wait until /resume_memory_occupation. The weights stay where they are
        (they are the served model's, often the trainer's own). Takes: ``{"tags"}`` (SGLang's tags, accepted).
        Returns: 200. Called by: AReaL's ``RemoteSGLangEngine.offload``."""
        _check_tags(req)
        await asyncio.to_thread(engine.offload)
        state.sleeping = True
        return Response(status_code=200)

    @app.api_route("/resume_memory_occupation", methods=["GET", "POST"])
    async def resume_memory_occupation(req: MemoryOccupationRequest | None = None):
        """Reallocate the KV cache after /release_memory_occupation. Takes: ``{"tags"}`` (accepted). Returns: 200.
        Called by: AReaL's ``RemoteSGLangEngine.onload``."""
        _check_tags(req)
        await asyncio.to_thread(engine.onload)
        state.sleeping = False
        return Response(status_code=200)

    async def distributed_update():
        """SGLang's NCCL weight-update routes: 501 naming what this server takes instead."""
        return _failure("weight updates over NCCL are not served here: use /update_weights_from_disk (AReaL's "
                        "weight_update_mode='disk'), adapters by /load_lora_adapter, or vLLM's /update_weights "
                        "over gloo (--weight-transfer-config)", 501)

    for path in _DISTRIBUTED:
        app.add_api_route(path, distributed_update, methods=["POST"])


def _adapter_check(state: ServerState, name: str | None) -> str | None:
    """Why an adapter route cannot run now (None: it can)."""
    if not state.settings.enable_runtime_lora:
        return ("loading LoRA adapters at runtime is off: start the server with --enable-runtime-lora "
                "(SGLang's --enable-lora)")
    if name is not None and name in state.model_names:
        return f"lora_name {name!r} is the served model's name"
    return None


def _adapters(engine, failure: str | None) -> JSONResponse:
    body = {"success": failure is None, "error_message": failure or "",
            "loaded_adapters": dict(engine.lora_adapters)}
    return JSONResponse(body, status_code=200 if failure is None else 400)


def _check_tags(req: MemoryOccupationRequest | None) -> None:
    for i, tag in enumerate((req.tags if req is not None else None) or []):
        if tag not in _MEMORY_TAGS:
            raise APIError(f"tags[{i}] must be one of {', '.join(_MEMORY_TAGS)}, got {tag!r}", param=f"tags[{i}]")


def _forget(by_rid: dict, items: list[Item]) -> None:
    for it in items:
        ids = by_rid.get(it.rid)
        if ids is not None:
            ids.discard(it.request.request_id)
            if not ids:
                by_rid.pop(it.rid, None)


def _close(stream, by_rid: dict, items: list[Item]) -> None:
    stream.close()
    _forget(by_rid, items)


async def _events(state: ServerState, items: list[Item], stream, n: int):
    """SSE chunks of a streamed /generate: each the output so far (SGLang's cumulative ``text`` / ``output_ids`` /
    ``meta_info``), with ``index`` when the request has several outputs, then ``[DONE]``."""
    several = len(items) > 1 or n > 1
    so_far: dict[tuple[int, int], GenerationOutput] = {}
    try:
        async for k, d in stream:
            item, i = items[k], d.sample_index
            if d.output is not None:
                out = d.output
                if out.error:
                    yield _sse(error_body(f"generation failed: {out.error}", 500))
                    continue
                state.count_finished(out)
            else:
                out = so_far.get((k, i))
                if out is None:
                    out = so_far[(k, i)] = GenerationOutput(d.request_id, list(item.request.prepared.prompt_ids),
                                                            top_logprobs=[] if d.top_logprobs is not None else None)
                if d.prompt_logprobs is not None:
                    out.prompt_logprobs = d.prompt_logprobs
                out.output_ids += d.token_ids
                out.output_logprobs += d.logprobs
                out.output_versions += d.versions
                out.text += d.text
                if out.top_logprobs is not None:
                    out.top_logprobs += d.top_logprobs or [None] * len(d.token_ids)
            body = sglang_body(state, item, out, i, n)
            if several:
                body["index"] = k * n + i
            yield _sse(body)
    except InvalidRequestError as e:
        yield _sse(error_body(str(e), 400, e.field))
    yield "data: [DONE]\n\n"
