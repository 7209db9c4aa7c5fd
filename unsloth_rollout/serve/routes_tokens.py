"""vLLM's token-in / token-out route, ``POST /inference/v1/generate`` (the handler: ``tokens.py``; the wire
format, with what is refused: docs/server-token-api.md).
"""

from __future__ import annotations

from fastapi import FastAPI, Request

from .state import ServerState
from .tokens import TokenGenerateRequest, generate_tokens


def add_token_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/inference/v1/generate")
    async def inference_generate(req: TokenGenerateRequest, raw: Request):
        """Token ids in; token ids, one logprob per token and the finish reason out (vLLM's token-in/token-out
        endpoint). The prompt is the client's own rendering: no chat template, no detokenizing; images come as
        ``content_parts`` with one placeholder per image in ``token_ids`` (or its full expansion).

        Takes: ``TokenGenerateRequest``: ``token_ids``, ``sampling_params`` (vLLM's ``SamplingParams``), ``model``,
        ``stream``, ``content_parts``, ``return_token_ids``; an ``X-Request-Id`` header names the request.
        Returns: ``{"request_id", "choices": [{"index", "token_ids", "logprobs": {"content": [{"token":
        "token_id:<id>", "logprob", "top_logprobs"}]}, "finish_reason", "stop_reason"}], "prompt_token_ids",
        "mm_placeholders", "usage", "prompt_logprobs"}``, or SSE chunks of that shape when ``stream`` is true.
        Called by: Prime Intellect's ``verifiers`` train client (``renderers.client.generate``; prime-rl), which
        also sends an ``X-Session-ID`` header for sticky routing (read by routers, not by this server).

        Example request::

            {"model": "tiny", "token_ids": [1, 2, 3], "sampling_params": {"temperature": 1.0, "max_tokens": 8,
             "logprobs": 1, "stop_token_ids": [2], "skip_special_tokens": false}}
        """
        return await generate_tokens(state, req, raw)
