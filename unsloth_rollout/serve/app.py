"""create_app(): an OpenAI/vLLM-compatible FastAPI app over one shared RolloutEngine.

A training process can serve its live policy in-process::

    engine = RolloutEngine(policy)
    app = create_app(engine, served_model_name="policy")
    uvicorn.run(app, port=8000)          # or in a thread; every request batches on the same engine

The app is a pipeline: the door (``guard``: API key, body limit, JSON), the routes (``routes_openai``,
``routes_control``, ``routes_weights``, ``routes_info``, vLLM's token route in ``routes_tokens``, SGLang's native
ones in ``routes_sglang``), and for generation request -> ``prepare`` (a ``GenerationRequest``; chat through
``prompt.chat_prompt``) -> engine -> ``render`` / ``streaming``. Errors follow OpenAI's schema with vLLM's status
codes (``errors``). Every route, with what it takes, returns and which peer calls it: docs/server.md (vLLM's token
route: docs/server-token-api.md; SGLang's: docs/server-sglang.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time

from fastapi import FastAPI

from .. import __version__
from .errors import install_errors
from .guard import Guard
from .routes_control import add_control_routes
from .routes_info import add_info_routes
from .routes_openai import add_openai_routes
from .routes_tokens import add_token_routes
from .routes_sglang import add_sglang_routes
from .routes_weights import add_weight_routes
from .settings import ServerSettings
from .state import ServerState
from .weight_transfer import check_weight_transfer_device, parse_weight_transfer_config


def create_app(engine, settings: ServerSettings | None = None, **fields) -> FastAPI:
    """Build the app; every request runs on ``engine`` (a RolloutEngine).

    ``settings`` (a ``ServerSettings``), and/or its fields as keywords (they replace the ones in ``settings``):
    ``served_model_name``, ``api_key``, the request limits (``max_n``, ``max_body_bytes``, images), the media
    policy, ``tool_call_parser``, ``generation_config``, ``logprobs_mode``, ``max_logprobs``,
    ``enable_runtime_lora``, ``owns_engine``; each field's meaning is in ``ServerSettings``.

    Example::

        app = create_app(engine, served_model_name="tiny", api_key="secret")
    """
    settings = ServerSettings(**fields) if settings is None else dataclasses.replace(settings, **fields)
    settings.weight_transfer_config = parse_weight_transfer_config(settings.weight_transfer_config)
    check_weight_transfer_device(settings.weight_transfer_config, engine.policy)
    state = ServerState(engine, settings)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        if settings.owns_engine:
            await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="unsloth_rollout", version=__version__, lifespan=lifespan)
    app.state.server = state
    install_errors(app, state)
    app.add_middleware(Guard, state=state)
    add_openai_routes(app, state)
    add_info_routes(app, state)
    add_control_routes(app, state)
    add_weight_routes(app, state)
    add_token_routes(app, state)
    add_sglang_routes(app, state)
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
