"""The server's door, a pure ASGI middleware: the API key, the body-size limit, lone UTF-16 surrogates and the
JSON content type are checked here, once for every route, before any route reads the body.
"""

from __future__ import annotations

import hmac
import json
import re

from .protocol import error_body
from .state import ServerState

# Routes whose body is JSON: another content type is refused (400), as vLLM's validate_json_request does.
JSON_PATHS = {"/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize", "/v1/load_lora_adapter",
              "/v1/unload_lora_adapter", "/update_weight_version", "/areal_update_weights",
              "/inference/v1/generate"}
# Reachable without the API key (liveness probes and scrapers).
OPEN_PATHS = {"/health", "/ping", "/metrics", "/version"}


class Guard:
    """Pure ASGI: API key check and request-body size limit (read once, then replayed to the app)."""

    def __init__(self, app, state: ServerState):
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        opts = self.state.settings
        headers = dict(scope.get("headers") or [])
        if opts.api_key and scope["path"] not in OPEN_PATHS:
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
        if scope.get("method") == "POST" and scope["path"] in JSON_PATHS and media_type != b"application/json":
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
