"""Errors in OpenAI's schema with vLLM's status codes: one handler per kind of failure, each counted for /metrics."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine import EngineStopped, InvalidRequestError
from ..logs import get_logger
from .protocol import APIError, error_body
from .state import ServerState

logger = get_logger("unsloth_rollout.serve")


def _json_error(status: int, message: str, param: str | None = None, type: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, param, type), status_code=status)


def install_errors(app: FastAPI, state: ServerState) -> None:
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
