"""create_app(): an OpenAI/vLLM-compatible FastAPI app over one shared RolloutEngine.

A training process can serve its live policy in-process::

    engine = RolloutEngine(policy)
    app = create_app(engine, served_model_name="policy")
    uvicorn.run(app, port=8000)          # or in a thread; every request batches on the same engine

Endpoints (vLLM's shapes): ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``, ``/health``,
``/tokenize``, ``/detokenize``, ``/metrics``, ``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter``,
``/pause``, ``/resume``, ``/is_paused``, ``/weight_info``, ``/update_weight_version``, ``/sleep``,
``/wake_up``, ``/reset_prefix_cache``, and AReaL's ``/areal_pause_generation``,
``/areal_continue_generation`` and ``/areal_update_weights``. Errors follow OpenAI's schema with vLLM's
status codes.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import os
import re
import time

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..logs import get_logger
from .. import __version__
from ..engine import EngineStopped, GenerationRequest, InvalidRequestError
from ..engine.config import LOGPROBS_MODES
from ..models.adapters import AdapterNotFoundError
from . import completions as comp
from .media import MediaPolicy
from .metrics import metrics_text
from .protocol import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest, LoadLoRAAdapterRequest,
                       TokenizeRequest, UnloadLoRAAdapterRequest, UpdateWeightsFromDiskRequest,
                       UpdateWeightVersionRequest, error_body)
from .state import ServerOptions, ServerState
from .weight_transfer import install_weight_transfer_routes, parse_weight_transfer_config

logger = get_logger("unsloth_rollout.serve")

# Endpoints whose body is JSON: another content type is refused (400), as vLLM's validate_json_request does.
_JSON_PATHS = {"/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize", "/v1/load_lora_adapter",
               "/v1/unload_lora_adapter", "/update_weight_version", "/areal_update_weights"}
# Reachable without the API key (liveness probes and scrapers).
_OPEN_PATHS = {"/health", "/ping", "/metrics", "/version"}
# The pause the HTTP endpoints hold (/pause, /resume and AReaL's pause/continue share it, as in vLLM); /sleep
# (offload) and /areal_update_weights hold their own, so none of them releases another's.
HTTP_PAUSE = "http"


def create_app(engine, *, served_model_name: str | list[str] | None = None, api_key: str | None = None,
               model_path: str | None = None, allowed_local_media_path: str | None = None,
               allow_remote_images: bool = False, max_images_per_request: int = 16,
               max_image_pixels: int = 4096 * 4096, max_n: int = 64, max_body_bytes: int = 32 << 20,
               tool_call_parser: str = "auto", generation_config: str = "auto",
               owns_engine: bool = False, logprobs_mode: str = "raw_logprobs", max_logprobs: int = 20,
               enable_runtime_lora: bool | None = None, weight_transfer_config: dict | str | None = None) -> FastAPI:
    """Build the app; every request runs on ``engine`` (a RolloutEngine).

    Args:
        served_model_name: name(s) a request's ``model`` may use for the policy (the first is reported);
            default the model folder's name. Loaded LoRA adapters are selected by their own names.
        api_key: when set, every endpoint but /health, /metrics and /version needs
            ``Authorization: Bearer <api_key>`` (401 otherwise).
        allowed_local_media_path: images may be read from files under this folder (off by default).
        allow_remote_images: fetch ``http(s)`` image URLs (off by default: such requests get a 400).
        max_images_per_request, max_image_pixels, max_n, max_body_bytes: request limits (400 / 413).
        tool_call_parser: "auto" | "hermes" | "llama3_json" | "transformers".
        generation_config: "auto" takes default temperature / top_p / top_k / min_p /
            repetition_penalty from the model's generation_config.json (as vLLM does); "vllm" ignores it.
        owns_engine: shut the engine down when the app stops.
        logprobs_mode: "raw_logprobs" (``log_softmax(logits / T)``, what a trainer recomputes; the default) or
            "processed_logprobs" (the distribution each token was drawn from, as vLLM's ``--logprobs-mode``).
        max_logprobs: the largest ``prompt_logprobs`` a request may ask (vLLM's ``--max-logprobs``).
        enable_runtime_lora: serve ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (404 otherwise, as
            vLLM without ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``); None: that environment variable decides.
        weight_transfer_config: ``{"backend": "gloo"}`` serves vLLM's full-weight transfer routes over gloo
            (``weight_transfer.py``); None: they answer 501.

    Example::

        app = create_app(engine, served_model_name="tiny", api_key="secret")
    """
    policy = engine.policy
    path = model_path or getattr(policy, "name_or_path", None)
    if isinstance(served_model_name, str):
        names = [served_model_name]
    else:
        names = list(served_model_name or []) or [str(path).rstrip("/").rsplit("/", 1)[-1] if path
                                                  else "unsloth-rollout"]
    options = ServerOptions(
        served_model_names=names, model_path=path, api_key=api_key,
        media=MediaPolicy(allowed_local_media_path, allow_remote_images, max_images_per_request, max_image_pixels),
        max_n=max_n, max_body_bytes=max_body_bytes, tool_call_parser=tool_call_parser,
        default_sampling=_default_sampling(policy) if generation_config == "auto" else {}, owns_engine=owns_engine,
        logprobs_mode=logprobs_mode, max_logprobs=max_logprobs,
        enable_runtime_lora=runtime_lora_from_env() if enable_runtime_lora is None else bool(enable_runtime_lora),
        weight_transfer_config=parse_weight_transfer_config(weight_transfer_config))
    if logprobs_mode not in LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {logprobs_mode!r}")
    state = ServerState(engine, options)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        if options.owns_engine:
            await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="unsloth_rollout", version=__version__, lifespan=lifespan)
    app.state.server = state
    _install_errors(app, state)
    app.add_middleware(_Guard, state=state)
    _add_openai_routes(app, state)
    _add_control_routes(app, state)
    return app


def serve_in_thread(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, log_level: str = "warning",
                    **uvicorn_options):
    """Run ``app`` with uvicorn in a daemon thread: a training process serving its live policy over HTTP.

    Returns the ``uvicorn.Server`` once it accepts connections; ``server.should_exit = True`` stops it.
    ``uvicorn_options`` go to ``uvicorn.Config`` (e.g. ``timeout_keep_alive``).

    Example::

        server = serve_in_thread(create_app(engine), port=8000)
        ...   # train; rollout clients call http://127.0.0.1:8000/v1/...
        server.should_exit = True
    """
    import threading

    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, **uvicorn_options))
    thread = threading.Thread(target=server.run, name="unsloth-rollout-serve", daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError(f"the server did not start on {host}:{port} (see the log above)")
        time.sleep(0.01)
    server.thread = thread
    return server


def _default_sampling(policy) -> dict:
    gc = getattr(getattr(policy, "base_model", None), "generation_config", None)
    try:
        diff = gc.to_diff_dict() if gc is not None else {}
    except Exception:
        return {}
    keys = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
    return {k: diff[k] for k in keys if diff.get(k) is not None}


# ====================================================================== middleware and errors
class _Guard:
    """Pure ASGI: API key check and request-body size limit (read once, then replayed to the app)."""

    def __init__(self, app, state: ServerState):
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        opts = self.state.options
        headers = dict(scope.get("headers") or [])
        if opts.api_key and scope["path"] not in _OPEN_PATHS:
            auth = headers.get(b"authorization", b"").decode("latin-1")
            token = auth[7:] if auth[:7].lower() == "bearer " else headers.get(b"x-api-key", b"").decode("latin-1")
            if not hmac.compare_digest(token.encode(), opts.api_key.encode()):
                return await _send_json(send, 401, error_body("Invalid or missing API key", 401))
        limit = opts.max_body_bytes
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return await _send_json(send, 413, error_body(f"Request body exceeds {limit} bytes", 413))
        body, more = bytearray(), True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # disconnected before the body arrived
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > limit:
                return await _send_json(send, 413, error_body(f"Request body exceeds {limit} bytes", 413))
        where = _lone_surrogate(body)
        if where is not None:
            self.state.counters[("errors", 400)] += 1
            return await _send_json(send, 400, error_body(
                f"{where} holds a lone UTF-16 surrogate, which is not valid Unicode text", 400, where))
        media_type = headers.get(b"content-type", b"").split(b";", 1)[0].strip().lower()
        if scope.get("method") == "POST" and scope["path"] in _JSON_PATHS and media_type != b"application/json":
            self.state.counters[("errors", 400)] += 1  # vLLM's answer to a form or text body, a 400
            return await _send_json(send, 400, error_body(
                "Unsupported Media Type: Only 'application/json' is allowed", 400, "content-type"))
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


# A JSON escape of a UTF-16 surrogate ("\\ud800"), or its raw CESU-8 bytes (json.loads reads bytes with
# "surrogatepass"). Paired ones are fine; a lone one is not text: it broke the tokenizer and UTF-8 encoding
# of any error message that quoted it (a 500). Checked here, once, for every endpoint.
_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}|\xed[\xa0-\xbf]")


def _lone_surrogate(body: bytes) -> str | None:
    """Where a JSON ``body`` holds a string with a lone surrogate (``"messages[0].content"``), else None."""
    if not _SURROGATE.search(body):
        return None
    try:
        stack = [("body", json.loads(body))]
    except (ValueError, RecursionError):
        return None  # not JSON: the endpoint answers 400 itself
    while stack:
        path, obj = stack.pop()
        if isinstance(obj, dict):
            for k, v in obj.items():
                if not _is_text(k):
                    return path
                stack.append((k if path == "body" else f"{path}.{k}", v))
        elif isinstance(obj, list):
            stack += [(f"{path}[{i}]", v) for i, v in enumerate(obj)]
        elif isinstance(obj, str) and not _is_text(obj):
            return path
    return None


def _is_text(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


async def _send_json(send, status: int, body: dict) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})


def _json_error(status: int, message: str, param: str | None = None, type: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, param, type), status_code=status)


def _install_errors(app: FastAPI, state: ServerState) -> None:
    def counted(status: int) -> None:
        state.counters[("errors", status)] += 1

    @app.exception_handler(RequestValidationError)
    async def _validation(request, exc: RequestValidationError):
        counted(400)
        errors = exc.errors()
        parts, param = [], None
        for err in errors[:3]:
            loc = [str(x) for x in err.get("loc", ()) if x != "body"]
            if err.get("type") == "json_invalid":
                parts.append(f"Invalid JSON body: {err.get('msg')}")
                continue
            field = ".".join(loc) if loc else "body"
            param = param or field
            got = err.get("input")
            got_s = "" if isinstance(got, (dict, list)) or got is None else f" (got {got!r})"
            parts.append(f"{field}: {err.get('msg')}{got_s}")
        return _json_error(400, "; ".join(parts) or "Invalid request", param)

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        counted(exc.status)
        return _json_error(exc.status, exc.message, exc.param, exc.type)

    @app.exception_handler(InvalidRequestError)
    async def _engine_invalid(request, exc: InvalidRequestError):
        counted(400)
        return _json_error(400, str(exc), exc.field)

    @app.exception_handler(EngineStopped)
    async def _stopped(request, exc):
        counted(503)
        return _json_error(503, str(exc) or "the engine is shut down")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, exc: StarletteHTTPException):
        counted(exc.status_code)
        return _json_error(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _internal(request, exc: Exception):
        counted(500)
        logger.exception("unsloth_rollout.serve: unhandled error")
        return _json_error(500, f"{type(exc).__name__}: {exc}")


# ====================================================================== OpenAI endpoints
def _add_openai_routes(app: FastAPI, state: ServerState) -> None:
    engine = state.engine

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request):
        """Chat completion (text and images, tools, n, logprobs, streaming).

        Example::

            curl localhost:8000/v1/chat/completions -d '{"model": "tiny", "max_tokens": 8,
                 "messages": [{"role": "user", "content": "hi"}]}'
        """
        return await comp.chat_completions(state, req, raw)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request):
        """Text completion; ``prompt`` is text, token ids, or a list of either.

        Example::

            curl localhost:8000/v1/completions -d '{"prompt": [1, 2, 3], "max_tokens": 8, "logprobs": 0,
                 "return_token_ids": true}'
        """
        return await comp.completions(state, req, raw)

    @app.get("/v1/models")
    async def models():
        """The served model (with ``max_model_len``) and every loaded LoRA adapter (``parent`` = the model)."""
        def card(name, root, parent):
            return {"id": name, "object": "model", "created": state.start_time, "owned_by": "unsloth_rollout",
                    "root": root, "parent": parent, "max_model_len": engine.max_model_len, "permission": []}

        data = [card(n, state.options.model_path or n, None) for n in state.options.served_model_names[:1]]
        data += [card(n, p, state.model_name) for n, p in engine.lora_adapters.items()]
        return {"object": "list", "data": data}

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        """``{"prompt": "text"}`` or ``{"messages": [...]}`` -> ``{"count", "max_model_len", "tokens"}``."""
        if (req.prompt is None) == (req.messages is None):
            raise APIError("give exactly one of prompt or messages", param="prompt")
        state.adapter_for(req.model)
        if req.prompt is not None:
            ids = state.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens is not False)
        else:
            kwargs = comp.template_kwargs(req.chat_template_kwargs)
            messages, images = await state.media.resolve_messages(comp.normalize_messages(req.messages),
                                                                  accept_images=engine.policy.is_vlm)
            tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
            if req.continue_final_message:
                kwargs["continue_final_message"] = True
            try:
                text, _ = engine.render_chat(messages, tools, kwargs,
                                                    add_generation_prompt=bool(req.add_generation_prompt)
                                                    and not req.continue_final_message)
            except InvalidRequestError as e:
                raise APIError(str(e), param=e.field) from None
            ids = state.tokenizer.encode(text, add_special_tokens=bool(req.add_special_tokens))
            ids = comp.prepare_prompt(state, GenerationRequest(input_ids=ids, images=images or None), "messages")
        body = {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}
        body["token_strs"] = state.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return body

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        """``{"tokens": [...]}`` -> ``{"prompt": text}``."""
        state.adapter_for(req.model)
        vocab = len(state.tokenizer)
        bad = next((t for t in req.tokens if t < 0 or t >= vocab), None)
        if bad is not None:
            raise APIError(f"tokens holds token id {bad} outside [0, {vocab})", param="tokens")
        return {"prompt": state.tokenizer.decode(req.tokens)}

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(req: LoadLoRAAdapterRequest):
        """Load a PEFT adapter folder; requests select it with ``"model": lora_name``. Off unless runtime LoRA
        updating is enabled (``--enable-runtime-lora`` or ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``, as in vLLM).
        An adapter the engine cannot serve exactly is refused with 400 and the reason, a missing one with 404;
        either way everything loaded before keeps serving. ``load_inplace`` replaces a loaded adapter's weights.

        Example body: ``{"lora_name": "policy-v3", "lora_path": "/ckpt/v3"}``
        """
        _require_runtime_lora(state)
        name = req.lora_name
        if name in state.options.served_model_names:
            raise APIError(f"lora_name {name!r} is the served model's name", param="lora_name")
        try:
            await asyncio.to_thread(engine.load_lora_adapter, name, req.lora_path, bool(req.load_inplace))
        except AdapterNotFoundError as e:
            raise APIError(str(e), 404, param=e.field) from None
        except InvalidRequestError as e:
            raise APIError(str(e), param=e.field) from None
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(req: UnloadLoRAAdapterRequest):
        """Unload an adapter by name; its in-flight requests finish with finish_reason "abort"."""
        _require_runtime_lora(state)
        if req.lora_name not in engine.lora_adapters:
            raise APIError(f"The lora adapter '{req.lora_name}' cannot be found.", 404, param="lora_name")
        await asyncio.to_thread(engine.unload_lora_adapter, req.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")


def runtime_lora_from_env() -> bool:
    """vLLM's switch for loading adapters over HTTP: ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` set to 1 / true."""
    return os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").strip().lower() in ("1", "true")


def _require_runtime_lora(state: ServerState) -> None:
    if not state.options.enable_runtime_lora:  # vLLM does not even register these routes then: 404
        raise APIError("loading LoRA adapters at runtime is off: start the server with --enable-runtime-lora "
                       "(or VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)", 404)


# ====================================================================== health, metrics, RL control plane
def _add_control_routes(app: FastAPI, state: ServerState) -> None:
    engine = state.engine

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/ping")
    async def ping():
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics():
        """Prometheus text: requests, tokens, running / waiting, KV usage (vLLM's metric names where they exist)."""
        return PlainTextResponse(metrics_text(state), media_type="text/plain; version=0.0.4")

    async def _pause(mode: str, clear_cache: bool) -> None:
        if mode == "wait":  # hold new requests at the door; the engine returns once in-flight ones finish
            state.gate.clear()
        await asyncio.to_thread(engine.pause, mode, HTTP_PAUSE)
        if clear_cache and mode == "abort":
            await asyncio.to_thread(engine.invalidate_prefix_cache)

    @app.post("/pause")
    async def pause(mode: str = "abort", clear_cache: bool = True):
        """Pause generation. mode=abort: in-flight requests return now (finish_reason "abort");
        keep: they freeze and continue on /resume; wait: they finish first. New requests wait."""
        if mode not in ("abort", "keep", "wait"):
            raise APIError(f"mode must be one of 'abort', 'keep', 'wait'; got {mode!r}", param="mode")
        await _pause(mode, clear_cache)
        return {"status": "paused"}

    @app.post("/resume")
    async def resume():
        await asyncio.to_thread(engine.resume, HTTP_PAUSE)
        state.gate.set()
        return {"status": "resumed"}

    @app.get("/is_paused")
    async def is_paused():
        return {"is_paused": engine.is_paused}

    @app.post("/areal_pause_generation")
    async def areal_pause_generation():
        """AReaL's pause: abort in-flight requests (they return partial output, finish_reason "abort"),
        drop the prefix cache; requests that arrive meanwhile wait for /areal_continue_generation."""
        await _pause("abort", True)
        return {"success": True, "message": "Generation paused and all requests aborted"}

    @app.post("/areal_continue_generation")
    async def areal_continue_generation():
        await asyncio.to_thread(engine.resume, HTTP_PAUSE)
        state.gate.set()
        return {"success": True, "message": "Generation continued"}

    @app.post("/areal_update_weights")
    async def areal_update_weights(req: UpdateWeightsFromDiskRequest):
        """AReaL's full-model update from disk: ``{"model_path": "/ckpt/step-100"}`` (a save_pretrained folder)."""
        from .weights import load_weights_from_disk

        try:
            n = await asyncio.to_thread(load_weights_from_disk, engine, req.model_path)
        except InvalidRequestError as e:
            return JSONResponse({"success": False, "message": str(e)}, status_code=400)
        return {"success": True, "message": f"Loaded {n} weights from {req.model_path}"}

    @app.get("/weight_info")
    async def weight_info():
        return {"weight_version": engine.version, "lora_adapters": dict(engine.lora_adapters)}

    @app.get("/get_weight_version")
    async def get_weight_version():
        return {"weight_version": engine.version}

    @app.post("/update_weight_version")
    async def update_weight_version(req: UpdateWeightVersionRequest):
        """Stamp tokens sampled from now on with a new version: ``{"version": 3}``."""
        value = req.value()
        try:
            version = int(value)
        except (TypeError, ValueError):
            raise APIError(f"version must be an integer, got {value!r}", param="version") from None
        if req.abort_all_requests:
            await asyncio.to_thread(engine.abort_all)
        engine.set_version(version)
        return {"success": True, "weight_version": version, "message": f"Weight version updated to {version}"}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        await asyncio.to_thread(engine.invalidate_prefix_cache)
        return Response(status_code=200)

    @app.post("/sleep")
    async def sleep(level: int = 1):
        """Free the KV cache memory (requests wait until /wake_up)."""
        await asyncio.to_thread(engine.offload)
        state.sleeping = True
        return Response(status_code=200)

    @app.post("/wake_up")
    async def wake_up(tags: list[str] | None = Query(None)):
        await asyncio.to_thread(engine.onload)
        state.sleeping = False
        return Response(status_code=200)

    @app.get("/is_sleeping")
    async def is_sleeping():
        return {"is_sleeping": state.sleeping}

    @app.get("/get_world_size")
    async def get_world_size():
        return {"world_size": 1}

    @app.get("/server_info")
    async def server_info(config_format: str = "json"):
        """The engine's configuration in the shape of vLLM's resolved ``VllmConfig`` (``{"vllm_config": ...}``):
        what TRL's clients read (``lora_config``, ``parallel_config.data_parallel_size``,
        ``model_config.logprobs_mode``, ``weight_transfer_config``), and the engine's own settings."""
        return {"vllm_config": server_config(state), "backend": getattr(engine.policy, "backend", None),
                "version": __version__}

    install_weight_transfer_routes(app, state)


def server_config(state: ServerState) -> dict:
    """``/server_info``'s ``vllm_config``: vLLM's field names for what this engine is and can do."""
    engine, opts = state.engine, state.options
    policy, cfg, s = engine.policy, engine.config, engine.stats()
    return {
        "model_config": {"model": opts.model_path, "served_model_name": state.model_name,
                         "tokenizer": opts.model_path, "dtype": str(policy.dtype),
                         "max_model_len": engine.max_model_len, "logprobs_mode": opts.logprobs_mode,
                         "max_logprobs": opts.max_logprobs,
                         "generation_config": "auto" if opts.default_sampling else "vllm",
                         "is_multimodal_model": bool(policy.is_vlm)},
        "cache_config": {"block_size": s["kv_block_size"], "num_gpu_blocks": s["kv_blocks_total"],
                         "num_cpu_blocks": 0, "enable_prefix_caching": cfg.prefix_cache, "cache_dtype": "auto"},
        "parallel_config": {"data_parallel_size": 1, "tensor_parallel_size": 1, "pipeline_parallel_size": 1,
                            "world_size": 1},
        "scheduler_config": {"max_num_seqs": cfg.max_num_seqs, "max_num_batched_tokens": cfg.max_prefill_tokens,
                             "max_model_len": engine.max_model_len, "enable_chunked_prefill": True},
        # Adapters are served by the engine itself (PEFT, any target module, vision tower included).
        # The limits the engine enforces at load (EngineConfig); no max_loras: no limit, so any count a client checks.
        "lora_config": {"max_lora_rank": cfg.max_lora_rank,
                        "max_loras": cfg.max_loras if cfg.max_loras is not None else 2**31 - 1, "max_cpu_loras": None,
                        "fully_sharded_loras": False, "lora_dtype": "auto"},
        # None unless --weight-transfer-config (TRL then refuses server-mode full-weight sync at start, by name).
        "weight_transfer_config": opts.weight_transfer_config,
        "device_config": {"device": str(policy.device)},
    }
