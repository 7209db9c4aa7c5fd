"""Chat and text completions: OpenAI request -> GenerationRequest(s) -> engine -> vLLM-shaped response.

The prompt is rendered here with the engine's own ``render_chat`` (so tokens equal what the
in-process engine builds from the same messages) and checked against ``max_model_len`` before
anything is queued; the engine expands image placeholders and samples.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from ..engine import GenerationRequest, InvalidRequestError, SamplingParams
from .protocol import APIError, ChatCompletionRequest, CompletionRequest, NamedToolChoice, error_body
from ..engine.engine import RequestStream
from .scoring import echo_logprobs, echo_stream_logprobs, prompt_logprobs_json, truncate_prompt
from .state import ClientDisconnected, ServerState, run_until_disconnect
from .structured import from_response_format, tool_choice_outputs
from .tool_stream import ToolCallStream
from .tools import StreamGuard, ToolParse, parse_tool_calls

# Engine field -> request field, for the ``param`` of a 400.
_PARAM = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "lora_name": "model"}

# chat_template_kwargs go to apply_chat_template. These keys would change what runs, not what the template
# sees: above all "chat_template", a request's own Jinja template evaluated on the server (a nested loop
# blocked the event loop for a minute; vLLM also refuses request templates by default), then tokenize /
# return_* / conversation / tools, which the server sets itself.
_RESERVED_TEMPLATE_KWARGS = frozenset({
    "chat_template", "conversation", "tools", "tokenize", "return_dict", "return_tensors",
    "return_assistant_tokens_mask", "padding", "truncation", "max_length", "tokenizer_kwargs", "processor_kwargs",
    "load_audio_from_video"})


def template_kwargs(chat_template_kwargs: dict | None) -> dict:
    """A copy of a request's ``chat_template_kwargs``; a 400 when it sets a key the server owns."""
    kwargs = dict(chat_template_kwargs or {})
    bad = sorted(_RESERVED_TEMPLATE_KWARGS.intersection(kwargs))
    if bad:
        raise APIError(f"chat_template_kwargs may not set {bad[0]!r} on this server", param="chat_template_kwargs")
    return kwargs


@dataclass
class Prepared:
    """One OpenAI request turned into engine requests, plus what the response needs."""

    requests: list[GenerationRequest]
    prompt_ids: list[list[int]]  # per request, image placeholders expanded
    n: int
    logprobs: int | None  # top logprobs per token (None: no logprobs)
    as_token_ids: bool
    prompt_param: str
    prompt_text: str = ""
    forced: str | None = None  # tool_choice required / named: the tool-call format the grammar writes calls in
    structured_param: str = "structured_outputs"  # the request field an output constraint came from
    tools: list[dict] | None = None
    tool_choice: object = "none"
    created: int = field(default_factory=lambda: int(time.time()))
    prompt_logprobs: int | None = None  # top logprobs per prompt position (None: the prompt is not scored)
    echo_texts: list[str] | None = None  # echo: the prompt text each choice's text starts with

    @property
    def parse_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _lp(v: float) -> float:
    return max(float(v), -9999.0)  # JSON has no -inf; vLLM clamps the same way


# ====================================================================== request -> engine
def _sampling(state: ServerState, req, max_tokens: int, logprobs: int | None, lp_param: str,
              prompt_logprobs: int | None = None, structured=None) -> SamplingParams:
    for name, bad in (("use_beam_search", req.use_beam_search), ("logit_bias", req.logit_bias)):
        if bad:
            raise APIError(f"{name} is not supported by this server", param=name)
    if req.prompt_logprobs is not None and req.prompt_logprobs > state.options.max_logprobs:
        raise APIError(f"prompt_logprobs must be at most {state.options.max_logprobs} (the server's --max-logprobs), "
                       f"got {req.prompt_logprobs}", param="prompt_logprobs")
    # vLLM: no prompt_logprobs in a stream; a streamed completion echoes its prompt first (chat's echo: not here).
    if req.stream and (req.prompt_logprobs is not None or req.echo and not isinstance(req, CompletionRequest)):
        name = "prompt_logprobs" if req.prompt_logprobs is not None else "echo"
        raise APIError(f"{name} is not available when stream is true on this server", param=name)
    requested = from_response_format(req.response_format, getattr(req, "structured_outputs", None))
    if requested is not None and structured is not None:
        raise APIError("response_format / structured_outputs cannot be combined with tool_choice 'required' or a "
                       "named function", param="response_format")
    structured = structured or requested
    n = req.n if req.n is not None else 1
    if n > state.options.max_n:
        raise APIError(f"n must be at most {state.options.max_n}, got {n}", param="n")
    d = state.options.default_sampling

    def pick(value, key, fallback):
        return value if value is not None else d.get(key, fallback)

    top_k = pick(req.top_k, "top_k", -1)
    stop = req.stop if req.stop is not None else []
    try:
        return SamplingParams(
            max_new_tokens=max_tokens, min_new_tokens=req.min_tokens or 0,
            temperature=pick(req.temperature, "temperature", 1.0), top_p=pick(req.top_p, "top_p", 1.0),
            top_k=-1 if top_k == 0 else top_k, min_p=pick(req.min_p, "min_p", 0.0),
            repetition_penalty=pick(req.repetition_penalty, "repetition_penalty", 1.0),
            frequency_penalty=req.frequency_penalty or 0.0, presence_penalty=req.presence_penalty or 0.0,
            stop=[stop] if isinstance(stop, str) else list(stop), stop_token_ids=list(req.stop_token_ids or []),
            ignore_eos=bool(req.ignore_eos), seed=req.seed, logprobs=logprobs or 0, n=n,
            skip_special_tokens=req.skip_special_tokens is not False, logprobs_mode=state.options.logprobs_mode,
            prompt_logprobs=prompt_logprobs, structured_outputs=structured)
    except InvalidRequestError as e:
        param = lp_param if e.field == "logprobs" else _PARAM.get(e.field, e.field)
        raise APIError(str(e).replace(e.field, param, 1), param=param) from None


def _max_tokens(state: ServerState, prompt_len: int, max_tokens: int | None, param: str, prompt_param: str) -> int:
    limit = state.engine.max_model_len
    if prompt_len >= limit:
        raise APIError(f"This model's maximum context length is {limit} tokens. However, your request has "
                       f"{prompt_len} input tokens. Please reduce the length of the input.", param=prompt_param)
    if max_tokens is None:
        return limit - prompt_len
    if prompt_len + max_tokens > limit:
        raise APIError(f"This model's maximum context length is {limit} tokens. However, you requested "
                       f"{prompt_len + max_tokens} tokens ({prompt_len} in the input, {max_tokens} in the "
                       f"completion). Please reduce the length of the input or completion.", param=param)
    return max_tokens


def normalize_messages(messages: list) -> list[dict]:
    """Check roles; parse assistant tool-call arguments (JSON strings) into objects for the template."""
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(f"messages[{i}] must be an object with a string 'role'", param=f"messages[{i}]")
        calls = m.get("tool_calls")
        if calls:
            if not isinstance(calls, list):
                raise APIError(f"messages[{i}].tool_calls must be a list", param=f"messages[{i}].tool_calls")
            m = dict(m)
            m["tool_calls"] = [_template_call(c, f"messages[{i}].tool_calls[{j}]") for j, c in enumerate(calls)]
        out.append(m)
    return out


def _template_call(call, where: str) -> dict:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise APIError(f"{where}.function must be an object with a name", param=f"{where}.function")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            pass  # left as text: the template prints what the model said
    return {**call, "function": {**fn, "arguments": args}}


def prepare_prompt(state: ServerState, greq: GenerationRequest, param: str) -> list[int]:
    """The engine's own preparation of ``greq`` (chat rendering done, images processed and placeholders
    expanded), kept on the request so the engine does not repeat it; returns the expanded prompt ids."""
    try:
        greq.prepared = state.engine.prepare(greq)
    except InvalidRequestError as e:
        # Images live inside the request's messages (or prompt): the error names that field, as at submission.
        raise APIError(str(e), param=param if e.field in ("input_ids", "images", "messages") else e.field) from None
    return greq.prepared.prompt_ids


async def prepare_chat(state: ServerState, req: ChatCompletionRequest, prompt_ids=None) -> Prepared:
    """``prompt_ids(messages, tools, template_kwargs) -> token ids``: tokens to run instead of the rendered
    template (a recorded session that continues its earlier turns' exact tokens); image runs in them may be
    already expanded or single placeholders."""
    engine = state.engine
    lora = state.adapter_for(req.model)
    if req.top_logprobs and not req.logprobs:
        raise APIError("when using top_logprobs, logprobs must be set to true", param="top_logprobs")
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    choice = req.tool_choice
    if isinstance(choice, NamedToolChoice):
        choice = choice.model_dump()
        if not tools or choice["function"]["name"] not in [t["function"]["name"] for t in tools]:
            raise APIError(f"tool_choice names function {choice['function']['name']!r}, which is not in tools",
                           param="tool_choice")
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "required" and not tools:
        raise APIError("tool_choice 'required' needs tools", param="tool_choice")

    kwargs = template_kwargs(req.chat_template_kwargs)
    messages = normalize_messages(req.messages)
    messages, images = await state.media.resolve_messages(messages, accept_images=engine.policy.is_vlm)
    add_generation_prompt = req.add_generation_prompt is not False
    if req.continue_final_message:
        if add_generation_prompt and "add_generation_prompt" not in (req.model_fields_set or ()):
            add_generation_prompt = False
        if add_generation_prompt:
            raise APIError("continue_final_message and add_generation_prompt cannot both be true",
                           param="continue_final_message")
        kwargs["continue_final_message"] = True
    try:
        text, _ = engine.render_chat(messages, tools, kwargs, add_generation_prompt=add_generation_prompt)
    except InvalidRequestError as e:
        raise APIError(str(e), param=e.field) from None
    forced = grammar = None
    if choice == "required" or isinstance(choice, dict):  # the model writes the call; a grammar holds it to it
        forced, grammar = tool_choice_outputs(state.tool_parser, state.tokenizer, tools, choice,
                                              req.parallel_tool_calls is not False)
    if prompt_ids is None:
        ids = state.tokenizer.encode(text, add_special_tokens=bool(req.add_special_tokens))
    else:  # a recorded session continues its earlier turns' exact tokens (image runs expanded or not)
        ids = list(prompt_ids(messages, tools, kwargs))
    ids = truncate_prompt(state, ids, req, "messages", has_images=bool(images))
    greq = GenerationRequest(input_ids=ids, images=images or None, request_id=uuid.uuid4().hex, lora_name=lora)
    expanded = prepare_prompt(state, greq, "messages")

    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = _max_tokens(state, len(expanded), max_tokens, param, "messages")
    top = (req.top_logprobs or 0) if req.logprobs else None
    greq.sampling = _sampling(state, req, max_tokens, top, "top_logprobs", req.prompt_logprobs, grammar)
    sp = greq.sampling
    echo = None
    last = messages[-1] if messages else {}
    if req.echo and last.get("role") == "assistant" and isinstance(last.get("content"), str):
        echo = [last["content"]]  # vLLM's chat echo: the answer continues the final assistant message
    return Prepared([greq], [expanded], sp.n, top, bool(req.return_tokens_as_token_ids), "messages",
                    prompt_text=text, forced=forced, structured_param="tools" if forced else _structured_param(req),
                    tools=tools, tool_choice=choice, prompt_logprobs=req.prompt_logprobs, echo_texts=echo)


def _structured_param(req) -> str:
    return "structured_outputs" if getattr(req, "structured_outputs", None) is not None else "response_format"


def prepare_completion(state: ServerState, req: CompletionRequest) -> Prepared:
    lora = state.adapter_for(req.model)
    if req.suffix:
        raise APIError("suffix is not supported by this server", param="suffix")
    p = req.prompt
    if isinstance(p, str) or (p and all(isinstance(x, int) for x in p)):
        prompts = [p]
    else:
        prompts = list(p)
    if not prompts:
        raise APIError("prompt must not be empty", param="prompt")
    all_ids = []
    for k, x in enumerate(prompts):
        ids = state.tokenizer.encode(x, add_special_tokens=req.add_special_tokens is not False) \
            if isinstance(x, str) else list(x)
        if not ids:
            raise APIError(f"prompt{'' if len(prompts) == 1 else f'[{k}]'} must not be empty", param="prompt")
        all_ids.append(truncate_prompt(state, ids, req, "prompt"))
    # vLLM: echo with logprobs scores the prompt too; max_tokens=0 only scores (echo or prompt_logprobs).
    plp = req.prompt_logprobs
    if req.echo and req.logprobs is not None:
        plp = max(plp or 0, req.logprobs)
    if req.max_tokens == 0 and plp is None:
        if not req.echo:
            raise APIError("max_tokens must be at least 1 (0 only with echo or prompt_logprobs)", param="max_tokens")
        plp = 0
    echo = None
    if req.echo:  # vLLM's echo text: the prompt as given, or decoded ("" with return_token_ids, as vLLM)
        echo = ["" if req.return_token_ids else (x if isinstance(x, str) and req.truncate_prompt_tokens is None
                                                 else state.tokenizer.decode(ids))
                for x, ids in zip(prompts, all_ids)]
    requests = []
    for ids in all_ids:
        max_tokens = _max_tokens(state, len(ids), req.max_tokens, "max_tokens", "prompt")
        sp = _sampling(state, req, max_tokens, req.logprobs, "logprobs", plp)
        requests.append(GenerationRequest(input_ids=ids, sampling=sp, request_id=uuid.uuid4().hex, lora_name=lora))
    return Prepared(requests, all_ids, requests[0].sampling.n, req.logprobs,
                    bool(req.return_tokens_as_token_ids), "prompt", prompt_logprobs=plp, echo_texts=echo,
                    structured_param=_structured_param(req))


# ====================================================================== engine -> response
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


# ====================================================================== streaming
async def _chat_events(state, req: ChatCompletionRequest, prep: Prepared, stream: RequestStream, rid: str):
    model = req.model or state.model_name
    opts = req.stream_options
    include_usage = bool(opts and opts.include_usage)
    continuous = include_usage and bool(opts.continuous_usage_stats)  # vLLM: only together with include_usage
    n = prep.n
    # The engine's deltas already hold back text a stop string may still cut; tool calls stream as vLLM's do.
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
    try:
        async for _, d in stream:
            i = d.sample_index
            ntoks[i] += len(d.token_ids)
            texts[i] += d.text
            delta: dict = {}
            finish = None
            if d.finish_reason is None:
                if calls is None:
                    delta["content"] = guards[i].feed(texts[i])
                else:
                    delta["content"], tool_deltas = calls[i].feed(texts[i])
                    if tool_deltas:
                        delta["tool_calls"] = tool_deltas
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
    except Exception as e:  # headers are sent: report in-band, as vLLM does
        yield _sse(error_body(str(e), 400 if isinstance(e, (InvalidRequestError, APIError)) else 500))
    yield "data: [DONE]\n\n"


async def _completion_events(state, req: CompletionRequest, prep: Prepared, stream: RequestStream, rid: str):
    model = req.model or state.model_name
    opts = req.stream_options
    include_usage = bool(opts and opts.include_usage)
    continuous = include_usage and bool(opts.continuous_usage_stats)  # vLLM: only together with include_usage
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
        yield _sse(error_body(str(e), 400 if isinstance(e, (InvalidRequestError, APIError)) else 500))
    yield "data: [DONE]\n\n"


# ====================================================================== endpoints
def _engine_error(e: InvalidRequestError, prep: Prepared) -> APIError:
    """The engine refused a request at submission: a 400 naming the request's field."""
    param = prep.prompt_param if e.field in ("input_ids", "images", "messages") else _PARAM.get(e.field, e.field)
    message = str(e)
    if param.startswith("structured_outputs") and prep.structured_param != "structured_outputs":
        # the grammar came from response_format or the tools: name that field
        param, message = prep.structured_param, message.replace("structured_outputs", prep.structured_param, 1)
    return APIError(message, param=param)


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
    state.counters["prompt_tokens"] += len(prep.prompt_ids[0])
    try:
        if req.stream:
            stream = state.engine.stream_many(prep.requests)
            return StreamingResponse(_chat_events(state, req, prep, stream, rid), media_type="text/event-stream",
                                     background=BackgroundTask(stream.close))
        (outs,) = await run_until_disconnect(state.engine, prep.requests, raw)
    except ClientDisconnected:
        return Response(status_code=499)
    except InvalidRequestError as e:
        raise _engine_error(e, prep) from None
    return JSONResponse(chat_response(state, req, prep, outs, rid))


async def _session_chat(state: ServerState, req: ChatCompletionRequest, raw, session, rid: str) -> Response:
    """A recorded session's request: run it whole, record it, then answer (a stream is replayed)."""
    prep = await prepare_chat(state, req, prompt_ids=session.prompt_ids_for(rid, req))
    state.counters["prompt_tokens"] += len(prep.prompt_ids[0])
    try:
        (outs,) = await run_until_disconnect(state.engine, prep.requests, raw)
    except ClientDisconnected:
        return Response(status_code=499)
    except InvalidRequestError as e:
        raise _engine_error(e, prep) from None
    body = chat_response(state, req, prep, outs, rid)
    session.record(rid, req, prep, outs, body)  # before the agent can see the answer
    if req.stream:
        return StreamingResponse(_replay_chat_events(body, req), media_type="text/event-stream")
    return JSONResponse(body)


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


async def completions(state: ServerState, req: CompletionRequest, raw) -> Response:
    state.counters[("requests", "completions")] += 1
    if req.stream_options and not req.stream:
        raise APIError("stream_options can only be set when stream is true", param="stream_options")
    await state.wait_gate()
    prep = prepare_completion(state, req)
    rid = f"cmpl-{req.request_id or uuid.uuid4().hex}"
    state.counters["prompt_tokens"] += sum(len(p) for p in prep.prompt_ids)
    try:
        if req.stream:
            stream = state.engine.stream_many(prep.requests)
            return StreamingResponse(_completion_events(state, req, prep, stream, rid),
                                     media_type="text/event-stream", background=BackgroundTask(stream.close))
        results = await run_until_disconnect(state.engine, prep.requests, raw)
    except ClientDisconnected:
        return Response(status_code=499)
    except InvalidRequestError as e:
        raise _engine_error(e, prep) from None
    return JSONResponse(completion_response(state, req, prep, results, rid))
