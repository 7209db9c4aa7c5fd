"""Chat and text completions: the two generation routes' handlers, OpenAI request -> ``prepare`` ->
engine -> ``render`` (or ``streaming``).

Each handler submits to the engine *before* any response byte is sent, so invalid input is a 400 and not a broken
stream; a client that goes away aborts its engine requests.
"""

from __future__ import annotations

import uuid

from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from ..engine import InvalidRequestError
from .prepare import Prepared, engine_error, prepare_chat, prepare_completion
from .protocol import APIError, ChatCompletionRequest, CompletionRequest
from .render import _replay_chat_events, chat_response, completion_response
from .state import ClientDisconnected, ServerState, run_until_disconnect
from .streaming import _chat_events, _completion_events


async def chat_completions(state: ServerState, req: ChatCompletionRequest, raw) -> Response:
    state.counters[("requests", "chat")] += 1
    if req.stream_options and not req.stream:
        raise APIError("stream_options can only be set when stream is true", param="stream_options")
    session = state.sessions.lookup(raw) if state.sessions is not None else None
    if session is not None:
        if (req.n or 1) != 1:
            raise APIError("n must be 1 in a recorded session (one completion per request)", param="n")
        req.model = session.model  # the trainer's policy answers, whatever model the agent names (as AReaL's proxy)
    await state.wait_gate()
    rid = f"chatcmpl-{req.request_id or uuid.uuid4().hex}"
    if session is not None:
        try:
            return await _session_chat(state, req, raw, session, rid)
        finally:
            session.discard(rid)  # a request that was not recorded (an error, a disconnect) leaves nothing
    prep = await prepare_chat(state, req)
    if req.stream:
        return _streamed(state, req, prep, _chat_events, rid)
    results = await _results(state, prep, raw)
    if results is None:
        return Response(status_code=499)
    return JSONResponse(chat_response(state, req, prep, results[0], rid))


async def _session_chat(state: ServerState, req: ChatCompletionRequest, raw, session, rid: str) -> Response:
    """A recorded session's request: run it whole, record it, then answer (a stream is replayed)."""
    prep = await prepare_chat(state, req, prompt_ids=session.prompt_ids_for(rid, req))
    results = await _results(state, prep, raw)
    if results is None:
        return Response(status_code=499)
    (outs,) = results
    body = chat_response(state, req, prep, outs, rid)
    session.record(rid, req, prep, outs, body)  # before the agent can see the answer
    if req.stream:
        return StreamingResponse(_replay_chat_events(body, req), media_type="text/event-stream")
    return JSONResponse(body)


async def completions(state: ServerState, req: CompletionRequest, raw) -> Response:
    state.counters[("requests", "completions")] += 1
    if req.stream_options and not req.stream:
        raise APIError("stream_options can only be set when stream is true", param="stream_options")
    await state.wait_gate()
    prep = prepare_completion(state, req)
    rid = f"cmpl-{req.request_id or uuid.uuid4().hex}"
    if req.stream:
        return _streamed(state, req, prep, _completion_events, rid)
    results = await _results(state, prep, raw)
    if results is None:
        return Response(status_code=499)
    return JSONResponse(completion_response(state, req, prep, results, rid))


async def _results(state: ServerState, prep: Prepared, raw) -> list[list] | None:
    """Count the prompt tokens, run ``prep``'s requests and return their outputs, per request; None when the client
    went away first (its requests are aborted, freeing their KV)."""
    state.counters["prompt_tokens"] += sum(len(p) for p in prep.prompt_ids)
    try:
        return await run_until_disconnect(state.engine, prep.requests, raw)
    except ClientDisconnected:
        return None
    except InvalidRequestError as e:
        raise engine_error(e, prep) from None


def _streamed(state: ServerState, req, prep: Prepared, events, rid: str) -> StreamingResponse:
    """Count the prompt tokens, submit ``prep``'s requests, then answer with ``events(state, req, prep, stream, rid)`` (SSE); closing the
    response closes the stream, which aborts what is still running."""
    state.counters["prompt_tokens"] += sum(len(p) for p in prep.prompt_ids)
    try:
        stream = state.engine.stream_many(prep.requests)
    except InvalidRequestError as e:
        raise engine_error(e, prep) from None
    return StreamingResponse(events(state, req, prep, stream, rid), media_type="text/event-stream",
                             background=BackgroundTask(stream.close))
