"""Engine outputs -> vLLM-shaped response bodies: choices, text, logprobs, tool calls, usage.

Example::

    body = chat_response(state, req, prep, outs, "chatcmpl-1")   # {"id", "object", "choices", "usage", ...}
"""

from __future__ import annotations

import json

from .prepare import Prepared
from .protocol import APIError, ChatCompletionRequest, CompletionRequest
from .scoring import _lp, echo_logprobs, prompt_logprobs_json
from .tools import ToolParse, parse_tool_calls


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _chat_logprobs(state, prep: Prepared, ids, lps, tops) -> dict:
    content = []
    for i, (t, lp) in enumerate(zip(ids, lps)):
        s = state.token_str(t, prep.as_token_ids)
        top = sorted((tops[i] if tops else {}).items(), key=lambda kv: -kv[1])
        content.append({"token": s, "logprob": _lp(lp), "bytes": list(s.encode("utf-8")),
                        "top_logprobs": [{"token": (ts := state.token_str(tt, prep.as_token_ids)), "logprob": _lp(v),
                                          "bytes": list(ts.encode("utf-8"))} for tt, v in top]})
    return {"content": content}


def _completion_logprobs(state, prep: Prepared, ids, lps, tops, offset: int = 0) -> dict:
    tokens, offsets, top_out = [], [], []
    for i, (t, lp) in enumerate(zip(ids, lps)):
        s = state.token_str(t, prep.as_token_ids)
        tokens.append(s)
        offsets.append(offset)
        offset += len(state.token_str(t))
        if lp is None:  # an echoed prompt's first token: no context, no logprob (vLLM's None)
            top_out.append(None)
            continue
        entry = {s: _lp(lp)}  # the sampled token first, then the top ``logprobs`` (vLLM's shape)
        for tt, v in sorted((tops[i] if tops else {}).items(), key=lambda kv: -kv[1]):
            if len(entry) > (prep.logprobs or 0):
                break
            entry.setdefault(state.token_str(tt, prep.as_token_ids), _lp(v))
        top_out.append(entry)
    return {"text_offset": offsets, "token_logprobs": [None if v is None else _lp(v) for v in lps],
            "tokens": tokens, "top_logprobs": top_out}


def _text(state, out, req) -> str:
    text = out.text
    if req.include_stop_str_in_output:
        if isinstance(out.stop_reason, str):
            text += out.stop_reason
    elif out.finish_reason == "stop" and not isinstance(out.stop_reason, str) and out.output_ids:
        tail = state.token_str(out.output_ids[-1])  # an EOS or stop_token_ids token: vLLM leaves its text out
        if tail and text.endswith(tail):
            text = text[:-len(tail)]
    return text


def _check_errors(outs) -> None:
    for out in outs:
        if out.error:
            raise APIError(f"generation failed: {out.error}", 500)


def _parse(state, prep: Prepared, out) -> ToolParse:
    if prep.forced:  # a constrained call is a call only when its grammar completed (vLLM: "length", no call)
        if out.finish_reason != "stop":
            return ToolParse(out.text or None)
        return parse_tool_calls(out.text, prep.forced)
    return parse_tool_calls(out.text, state.tool_parser, state.tokenizer, prep.prompt_text, prep.tools)


def _tool_finish(prep: Prepared, finish: str) -> str:
    """OpenAI's (and vLLM's) finish_reason of a completed call: "tool_calls", but "stop" for a named function."""
    return "tool_calls" if finish == "stop" and not isinstance(prep.tool_choice, dict) else finish


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": None}


def chat_response(state, req: ChatCompletionRequest, prep: Prepared, outs: list, rid: str) -> dict:
    _check_errors(outs)
    choices = []
    for out in outs:
        state.count_finished(out)
        text = _text(state, out, req)
        if prep.echo_texts:
            text = prep.echo_texts[0] + text
        message = {"role": "assistant", "content": text, "refusal": None, "tool_calls": [], "reasoning": None}
        finish = out.finish_reason
        if prep.parse_tools:
            parsed = _parse(state, prep, out)
            if parsed.calls:
                message["content"] = parsed.content
                message["tool_calls"] = parsed.openai_tool_calls()
                finish = _tool_finish(prep, finish)
        choice = {"index": out.sample_index, "message": message,
                  "logprobs": None if prep.logprobs is None else _chat_logprobs(
                      state, prep, out.output_ids, out.output_logprobs, out.top_logprobs),
                  "finish_reason": finish, "stop_reason": out.stop_reason}
        if req.return_token_ids:
            choice["token_ids"] = out.output_ids
        choices.append(choice)
    prompt_ids = outs[0].prompt_ids
    body = {"id": rid, "object": "chat.completion", "created": prep.created, "model": req.model or state.model_name,
            "choices": choices, "usage": _usage(len(prompt_ids), sum(len(o.output_ids) for o in outs)),
            "prompt_logprobs": prompt_logprobs_json(state, outs[0]) if prep.prompt_logprobs is not None else None}
    if req.return_token_ids:
        body["prompt_token_ids"] = prompt_ids
    return body


def completion_response(state, req: CompletionRequest, prep: Prepared, results: list[list], rid: str) -> dict:
    choices, prompt_tokens, completion_tokens = [], 0, 0
    for k, outs in enumerate(results):
        _check_errors(outs)
        prompt_tokens += len(outs[0].prompt_ids)
        for out in outs:
            state.count_finished(out)
            completion_tokens += len(out.output_ids)
            text, lp_in = _text(state, out, req), (out.output_ids, out.output_logprobs, out.top_logprobs)
            if prep.echo_texts is not None:
                text = prep.echo_texts[k] + text
                lp_in = echo_logprobs(out)
            choice = {"index": k * prep.n + out.sample_index, "text": text,
                      "logprobs": None if prep.logprobs is None else _completion_logprobs(state, prep, *lp_in),
                      "finish_reason": out.finish_reason, "stop_reason": out.stop_reason,
                      "prompt_logprobs": prompt_logprobs_json(state, out) if prep.prompt_logprobs is not None
                      else None}
            if req.return_token_ids:
                choice["prompt_token_ids"] = out.prompt_ids
                choice["token_ids"] = out.output_ids
            choices.append(choice)
    return {"id": rid, "object": "text_completion", "created": prep.created, "model": req.model or state.model_name,
            "choices": choices, "usage": _usage(prompt_tokens, completion_tokens)}


async def _replay_chat_events(body: dict, req: ChatCompletionRequest):
    """A finished chat completion as SSE chunks (role, content, tool calls, finish, usage, [DONE])."""
    head = {k: body[k] for k in ("id", "created", "model")}
    head["object"] = "chat.completion.chunk"
    for choice in body["choices"]:
        msg, i = choice["message"], choice["index"]
        deltas = [{"role": "assistant", "content": ""}]
        if msg.get("content"):
            deltas.append({"content": msg["content"]})
        if msg.get("tool_calls"):
            deltas.append({"tool_calls": [{"index": j, **c} for j, c in enumerate(msg["tool_calls"])]})
        for d in deltas:
            yield _sse({**head, "choices": [{"index": i, "delta": d, "logprobs": None, "finish_reason": None}]})
        yield _sse({**head, "choices": [{"index": i, "delta": {}, "logprobs": None,
                                         "finish_reason": choice["finish_reason"],
                                         "stop_reason": choice.get("stop_reason")}]})
    if req.stream_options and req.stream_options.include_usage:
        yield _sse({**head, "choices": [], "usage": body["usage"]})
    yield "data: [DONE]\n\n"
