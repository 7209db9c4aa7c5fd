"""An OpenAI request -> the engine's ``GenerationRequest`` (s): sampling settings, the completion's budget, and the
prompt (``prompt.chat_prompt`` for chat); ``Prepared`` carries them and what the response needs.

Example::

    prep = await prepare_chat(state, ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}]))
    prep.requests[0].sampling.max_new_tokens   # the room max_model_len leaves after the prompt
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from ..engine import GenerationRequest, InvalidRequestError, SamplingParams
from ..engine.options import completion_room, logits_width, sampling_from_options
from .prompt import chat_prompt, prepare_prompt, request_tools
from .protocol import APIError, ChatCompletionRequest, CompletionRequest, NamedToolChoice
from .scoring import truncate_prompt
from .state import ServerState
from .structured import from_response_format, tool_choice_outputs

# Engine field -> request field, for the ``param`` of a 400.
_PARAM = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "lora_name": "model"}


@dataclass
class Prepared:
    """One OpenAI request turned into engine requests, plus what the response needs."""

    requests: list[GenerationRequest]  # one per prompt (chat: one), prepared: the engine does not redo the prompt
    prompt_ids: list[list[int]]  # per request, image placeholders expanded
    n: int  # samples per prompt
    logprobs: int | None  # top logprobs per token (None: no logprobs)
    as_token_ids: bool  # return_tokens_as_token_ids: tokens spelled "token_id:<id>"
    prompt_param: str  # the request field the prompt came from ("messages" or "prompt"), for a 400's param
    prompt_text: str = ""  # chat: the rendered template (the tool parser reads it)
    forced: str | None = None  # tool_choice required / named: the tool-call format the grammar writes calls in
    structured_param: str = "structured_outputs"  # the request field an output constraint came from
    tools: list[dict] | None = None  # chat: the request's tools
    tool_choice: object = "none"  # chat: "none" | "auto" | "required" | a named function (dict)
    created: int = field(default_factory=lambda: int(time.time()))  # the response's "created"
    prompt_logprobs: int | None = None  # top logprobs per prompt position (None: the prompt is not scored)
    echo_texts: list[str] | None = None  # echo: the prompt text each choice's text starts with

    @property
    def parse_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"


def _sampling(state: ServerState, req, max_tokens: int, logprobs: int | None, lp_param: str,
              prompt_logprobs: int | None = None, structured=None) -> SamplingParams:
    for name, bad in (("use_beam_search", req.use_beam_search), ("logit_bias", req.logit_bias)):
        if bad:
            raise APIError(f"{name} is not supported by this server", param=name)
    limits = state.settings
    if req.prompt_logprobs is not None and 0 <= limits.max_logprobs < req.prompt_logprobs:  # -1: no cap
        raise APIError(f"prompt_logprobs must be at most {limits.max_logprobs} (the server's --max-logprobs), "
                       f"got {req.prompt_logprobs}", param="prompt_logprobs")
    # vLLM: no prompt_logprobs in a stream; a streamed answer sends what it echoes first.
    if req.stream and req.prompt_logprobs is not None:
        raise APIError("prompt_logprobs is not available when stream is true", param="prompt_logprobs")
    requested = from_response_format(req.response_format, getattr(req, "structured_outputs", None))
    if requested is not None and structured is not None:
        raise APIError("response_format / structured_outputs cannot be combined with tool_choice 'required' or a "
                       "named function", param="response_format")
    n = req.n if req.n is not None else 1
    if n > limits.max_n:
        raise APIError(f"n must be at most {limits.max_n}, got {n}", param="n")
    options = dict(
        max_new_tokens=max_tokens, min_new_tokens=req.min_tokens, temperature=req.temperature, top_p=req.top_p,
        top_k=req.top_k, min_p=req.min_p, repetition_penalty=req.repetition_penalty,
        frequency_penalty=req.frequency_penalty, presence_penalty=req.presence_penalty, stop=req.stop,
        stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos, seed=req.seed, logprobs=logprobs, n=n,
        skip_special_tokens=req.skip_special_tokens, logprobs_mode=limits.logprobs_mode,
        prompt_logprobs=prompt_logprobs, structured_outputs=structured or requested)
    try:
        return sampling_from_options(options, state.default_sampling, vocab_size=logits_width(state.engine.policy))
    except InvalidRequestError as e:
        param = lp_param if e.field == "logprobs" else _PARAM.get(e.field, e.field)
        raise APIError(str(e).replace(e.field, param, 1), param=param) from None


def _max_tokens(state: ServerState, prompt_len: int, max_tokens: int | None, param: str, prompt_param: str) -> int:
    limit = state.engine.max_model_len
    room = completion_room(prompt_len, limit)
    if room <= 0:
        raise APIError(f"This model's maximum context length is {limit} tokens. However, your request has "
                       f"{prompt_len} input tokens. Please reduce the length of the input.", param=prompt_param)
    if max_tokens is None:
        return room
    if max_tokens > room:
        raise APIError(f"This model's maximum context length is {limit} tokens. However, you requested "
                       f"{prompt_len + max_tokens} tokens ({prompt_len} in the input, {max_tokens} in the "
                       f"completion). Please reduce the length of the input or completion.", param=param)
    return max_tokens


async def prepare_chat(state: ServerState, req: ChatCompletionRequest, prompt_ids=None) -> Prepared:
    """A chat request -> one engine request; ``prompt_ids``: see ``prompt.chat_prompt``."""
    lora = state.adapter_for(req.model)
    if req.top_logprobs and not req.logprobs:
        raise APIError("when using top_logprobs, logprobs must be set to true", param="top_logprobs")
    tools = request_tools(req)
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

    prompt = await chat_prompt(state, req, prompt_ids)
    forced = grammar = None
    if choice == "required" or isinstance(choice, dict):  # the model writes the call; a grammar holds it to it
        forced, grammar = tool_choice_outputs(state.tool_parser, state.tokenizer, tools, choice,
                                              req.parallel_tool_calls is not False)
    ids = truncate_prompt(state, prompt.ids, req, "messages", has_images=bool(prompt.images))
    greq = GenerationRequest(input_ids=ids, images=prompt.images or None, request_id=uuid.uuid4().hex,
                             lora_name=lora)
    expanded = prepare_prompt(state, greq, "messages")

    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = _max_tokens(state, len(expanded), max_tokens, param, "messages")
    top = (req.top_logprobs or 0) if req.logprobs else None
    greq.sampling = _sampling(state, req, max_tokens, top, "top_logprobs", req.prompt_logprobs, grammar)
    sp = greq.sampling
    echo = None
    messages = prompt.messages
    last = messages[-1] if messages else {}
    if req.echo and last.get("role") == "assistant" and isinstance(last.get("content"), str):
        echo = [last["content"]]  # vLLM's chat echo: the answer continues the final assistant message
    return Prepared([greq], [expanded], sp.n, top, bool(req.return_tokens_as_token_ids), "messages",
                    prompt_text=prompt.text, forced=forced,
                    structured_param="tools" if forced else _structured_param(req),
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


def engine_error(e: InvalidRequestError, prep: Prepared) -> APIError:
    """The engine refused a request at submission: a 400 naming the request's field."""
    param = prep.prompt_param if e.field in ("input_ids", "images", "messages") else _PARAM.get(e.field, e.field)
    message = str(e)
    if param.startswith("structured_outputs") and prep.structured_param != "structured_outputs":
        # the grammar came from response_format or the tools: name that field
        param, message = prep.structured_param, message.replace("structured_outputs", prep.structured_param, 1)
    return APIError(message, param=param)
