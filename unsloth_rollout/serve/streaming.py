"""Streamed responses: engine deltas -> vLLM's SSE chunks for chat (content deltas; tool calls whole, with the
finish_reason) and text completions, with usage as ``stream_options`` asks; an error after the headers are sent is
reported in-band. Joined, a stream is the non-streamed answer to the same request.
"""

from __future__ import annotations

from ..engine import InvalidRequestError
from ..engine.engine import RequestStream
from .prepare import Prepared
from .protocol import APIError, ChatCompletionRequest, CompletionRequest, error_body
from .render import _chat_logprobs, _completion_logprobs, _parse, _sse, _text, _tool_finish, _usage
from .scoring import echo_stream_logprobs
from .tool_stream import ToolCallStream
from .tools import StreamGuard


def _usage_wanted(req) -> tuple[bool, bool]:
    """(include_usage, continuous usage) of a streamed request: vLLM sends continuous usage only with include_usage."""
    opts = req.stream_options
    include = bool(opts and opts.include_usage)
    return include, include and bool(opts.continuous_usage_stats)


def _in_band_error(e: Exception) -> str:
    """An error after the headers are sent, reported in the stream as vLLM does."""
    return _sse(error_body(str(e), 400 if isinstance(e, (InvalidRequestError, APIError)) else 500))


async def _chat_events(state, req: ChatCompletionRequest, prep: Prepared, stream: RequestStream, rid: str):
    model = req.model or state.model_name
    include_usage, continuous = _usage_wanted(req)
    n = prep.n
    # The engine's deltas already hold back text a stop string may still cut; a tool call goes out whole, once its
    # sample has finished (tool_stream.py: a call sent earlier could contradict the final answer).
    guards = [StreamGuard(None) for _ in range(n)]
    calls = [ToolCallStream(prep.forced or state.tool_parser) for _ in range(n)] if prep.parse_tools else None
    texts, ntoks = [""] * n, [0] * n
    prompt_len = len(prep.prompt_ids[0])

    def chunk(choices, usage=None, **extra):
        body = {"id": rid, "object": "chat.completion.chunk", "created": prep.created, "model": model,
                "choices": choices, **extra}
        if usage is not None:
            body["usage"] = usage
        return _sse(body)

    first = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
             for i in range(n)]
    extra = {"prompt_token_ids": prep.prompt_ids[0]} if req.return_token_ids else {}
    yield chunk(first, _usage(prompt_len, 0) if continuous else None, **extra)
    if prep.echo_texts and prep.echo_texts[0]:  # vLLM's chat echo: the final assistant message, then the answer
        for i in range(n):
            yield chunk([{"index": i, "delta": {"content": prep.echo_texts[0]}, "logprobs": None,
                          "finish_reason": None}], _usage(prompt_len, 0) if continuous else None)
    try:
        async for _, d in stream:
            i = d.sample_index
            ntoks[i] += len(d.token_ids)
            texts[i] += d.text
            delta: dict = {}
            finish = None
            if d.finish_reason is None:
                delta["content"] = (guards if calls is None else calls)[i].feed(texts[i])
            else:
                out = d.output
                finish = d.finish_reason
                state.count_finished(out)
                prompt_len = len(out.prompt_ids)
                if calls is None:
                    delta["content"] = guards[i].finish(None, _text(state, out, req))
                else:
                    parsed = _parse(state, prep, out)
                    delta["content"], tool_deltas = calls[i].finish(parsed, _text(state, out, req))
                    if tool_deltas:
                        delta["tool_calls"] = tool_deltas
                    if parsed.calls:
                        finish = _tool_finish(prep, finish)
                if out.error:
                    yield _sse(error_body(f"generation failed: {out.error}", 500))
            if not delta["content"] and len(delta) == 1 and finish is None and not d.token_ids:
                continue
            if not delta["content"] and "tool_calls" in delta:
                del delta["content"]  # a tool-call delta carries no content (vLLM's shape)
            choice = {"index": i, "delta": delta,
                      "logprobs": None if prep.logprobs is None else _chat_logprobs(
                          state, prep, d.token_ids, d.logprobs, d.top_logprobs),
                      "finish_reason": finish}
            if finish is not None:
                choice["stop_reason"] = d.stop_reason
            if req.return_token_ids:
                choice["token_ids"] = d.token_ids
            yield chunk([choice], _usage(prompt_len, sum(ntoks)) if continuous else None)
        if include_usage:
            yield chunk([], _usage(prompt_len, sum(ntoks)))
    except Exception as e:
        yield _in_band_error(e)
    yield "data: [DONE]\n\n"


async def _completion_events(state, req: CompletionRequest, prep: Prepared, stream: RequestStream, rid: str):
    model = req.model or state.model_name
    include_usage, continuous = _usage_wanted(req)
    n = prep.n
    total = len(prep.requests) * n
    sent_prompt, echoed, offsets, ntoks = [False] * total, [False] * total, [0] * total, [0] * total
    guards = [StreamGuard(None) for _ in range(total)]
    texts = [""] * total
    prompt_tokens = sum(len(p) for p in prep.prompt_ids)

    def usage():
        return _usage(prompt_tokens, sum(ntoks))

    try:
        async for k, d in stream:
            idx = k * n + d.sample_index
            ntoks[idx] += len(d.token_ids)
            texts[idx] += d.text
            text = guards[idx].feed(texts[idx]) if d.finish_reason is None else \
                guards[idx].finish(None, _text(state, d.output, req))
            lp_in = (d.token_ids, d.logprobs, d.top_logprobs)
            if prep.echo_texts is not None and not echoed[idx]:
                echoed[idx] = True
                text = prep.echo_texts[k] + text
                lp_in = echo_stream_logprobs(prep.prompt_ids[k], d)
            choice = {"index": idx, "text": text, "logprobs": None, "finish_reason": d.finish_reason,
                      "stop_reason": d.stop_reason}
            if prep.logprobs is not None:
                choice["logprobs"] = _completion_logprobs(state, prep, *lp_in, offsets[idx])
                offsets[idx] += sum(len(state.token_str(t)) for t in lp_in[0])
            if req.return_token_ids:
                if not sent_prompt[idx]:
                    choice["prompt_token_ids"] = prep.prompt_ids[k]
                    sent_prompt[idx] = True
                choice["token_ids"] = d.token_ids
            if d.finish_reason is not None:
                state.count_finished(d.output)
                if d.output.error:
                    yield _sse(error_body(f"generation failed: {d.output.error}", 500))
            body = {"id": rid, "object": "text_completion", "created": prep.created, "model": model,
                    "choices": [choice]}
            if continuous:
                body["usage"] = usage()
            yield _sse(body)
        if include_usage:
            yield _sse({"id": rid, "object": "text_completion", "created": prep.created, "model": model,
                        "choices": [], "usage": usage()})
    except Exception as e:
        yield _in_band_error(e)
    yield "data: [DONE]\n\n"
