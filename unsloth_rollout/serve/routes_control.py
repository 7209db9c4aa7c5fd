"""Control routes: pause and resume generation (vLLM's and AReaL's), sleep and wake (KV memory), the prefix cache.

The HTTP pause routes (SGLang's too: ``routes_sglang.py``) share one pause holder (``HTTP_PAUSE``, as vLLM's do,
through ``pause_http`` / ``resume_http``); /sleep (offload) and /areal_update_weights hold their own, so none of
them releases another's.
"""

from __future__ import annotations

import asyncio

from fastapi import FastAPI, Query
from fastapi.responses import Response

from .protocol import APIError
from .state import ServerState

# The pause /pause, /resume and AReaL's pause/continue hold.
HTTP_PAUSE = "http"


async def pause_http(state: ServerState, mode: str, clear_cache: bool) -> None:
    """Take the HTTP pause (``engine.pause`` modes); ``clear_cache`` with abort drops the prefix cache."""
    if mode == "wait":  # hold new requests at the door; the engine returns once in-flight ones finish
        state.gate.clear()
    await asyncio.to_thread(state.engine.pause, mode, HTTP_PAUSE)
    if clear_cache and mode == "abort":
        await asyncio.to_thread(state.engine.invalidate_prefix_cache)


async def resume_http(state: ServerState) -> None:
    """Release the HTTP pause."""
    await asyncio.to_thread(state.engine.resume, HTTP_PAUSE)
    state.gate.set()


def add_control_routes(app: FastAPI, state: ServerState) -> None:
    engine = state.engine

    @app.post("/pause")
    async def pause(mode: str = "abort", clear_cache: bool = True):
        """Pause generation; requests that arrive meanwhile wait for /resume.

        Takes: query ``mode``: ``abort`` (in-flight requests return now with finish_reason "abort"), ``keep``
        (they freeze and continue on /resume) or ``wait`` (they finish first); ``clear_cache`` (with abort: drop the
        prefix cache).
        Returns: ``{"status": "paused"}``.
        Called by: TRL's async GRPO trainer around each adapter sync (vLLM's ``/pause``).
        """
        if mode not in ("abort", "keep", "wait"):
            raise APIError(f"mode must be one of 'abort', 'keep', 'wait'; got {mode!r}", param="mode")
        await pause_http(state, mode, clear_cache)
        return {"status": "paused"}

    @app.post("/resume")
    async def resume():
        """Release the HTTP pause. Returns: ``{"status": "resumed"}``. Called by: TRL's async GRPO trainer."""
        await resume_http(state)
        return {"status": "resumed"}

    @app.get("/is_paused")
    async def is_paused():
        """Returns: ``{"is_paused": bool}`` (any holder's pause). Called by: scripts (vLLM's route)."""
        return {"is_paused": engine.is_paused}

    @app.post("/areal_pause_generation")
    async def areal_pause_generation():
        """AReaL's pause: abort in-flight requests (they return partial output, finish_reason "abort") and drop the
        prefix cache; requests that arrive meanwhile wait for /areal_continue_generation.

        Returns: ``{"success": true, "message"}``.
        Called by: AReaL's ``RemotevLLMEngine.pause_generation`` (before a weight update).
        """
        await pause_http(state, "abort", True)
        return {"success": True, "message": "Generation paused and all requests aborted"}

    @app.post("/areal_continue_generation")
    async def areal_continue_generation():
        """Release AReaL's pause. Returns: ``{"success": true, "message"}``.
        Called by: AReaL's ``RemotevLLMEngine.continue_generation``."""
        await resume_http(state)
        return {"success": True, "message": "Generation continued"}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        """Drop the prefix cache (KV that requests hold stays). Returns: 200, no body.
        Called by: TRL's ``VLLMClient.reset_prefix_cache``."""
        await asyncio.to_thread(engine.invalidate_prefix_cache)
        return Response(status_code=200)

    @app.post("/sleep")
    async def sleep(level: int = 1):
        """Free the KV cache memory; requests wait until /wake_up. Takes: query ``level`` (accepted, as vLLM's).
        Returns: 200, no body. Called by: AReaL's ``RemotevLLMEngine`` (offload)."""
        await asyncio.to_thread(engine.offload)
        state.sleeping = True
        return Response(status_code=200)

    @app.post("/wake_up")
    async def wake_up(tags: list[str] | None = Query(None)):
        """Reallocate the KV cache after /sleep. Takes: query ``tags`` (accepted, as vLLM's). Returns: 200, no body.
        Called by: AReaL's ``RemotevLLMEngine`` (onload)."""
        await asyncio.to_thread(engine.onload)
        state.sleeping = False
        return Response(status_code=200)

    @app.get("/is_sleeping")
    async def is_sleeping():
        """Returns: ``{"is_sleeping": bool}``. Called by: scripts (vLLM's route)."""
        return {"is_sleeping": state.sleeping}
