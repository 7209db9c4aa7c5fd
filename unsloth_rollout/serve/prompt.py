"""Messages -> prompt tokens: the server's one route from a chat request to the tokens the engine runs.

Chat completions and ``/tokenize`` both call ``chat_prompt`` (so ``/tokenize`` answers exactly the tokens a chat
request with the same fields runs), which renders with the engine's own ``render_chat``: the tokens equal what the
in-process engine builds from the same messages. ``prepare_prompt`` then lets the engine process the images and
expand their placeholders, once, before anything is queued.

Example::

    prompt = await chat_prompt(state, ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}]))
    expanded = prepare_prompt(state, GenerationRequest(input_ids=prompt.ids, images=prompt.images), "messages")
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..engine import GenerationRequest, InvalidRequestError
from .protocol import APIError
from .state import ServerState

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


@dataclass
class ChatPrompt:
    """A chat request's messages as the model reads them, rendered and tokenized."""

    messages: list[dict]  # roles checked, tool-call arguments parsed, image parts replaced by {"type": "image"}
    images: list  # the images of those parts, in order
    tools: list[dict] | None  # the request's tools, as the chat template reads them
    template_kwargs: dict  # chat_template_kwargs (checked), plus continue_final_message when set
    text: str  # the rendered chat template
    ids: list[int]  # the prompt's token ids; image placeholders not yet expanded


def request_tools(req) -> list[dict] | None:
    """A request's ``tools`` as the chat template (and the tool-call grammar) reads them."""
    return [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None


async def chat_prompt(state: ServerState, req, prompt_ids=None) -> ChatPrompt:
    """The tokens a chat request (``ChatCompletionRequest`` or ``TokenizeRequest``) runs.

    ``prompt_ids(messages, tools, template_kwargs) -> token ids``: tokens to run instead of the rendered template
    (a recorded session that continues its earlier turns' exact tokens); image runs in them may be already
    expanded or single placeholders.
    """
    kwargs = template_kwargs(req.chat_template_kwargs)
    tools = request_tools(req)
    messages = normalize_messages(req.messages)
    messages, images = await state.media.resolve_messages(messages, accept_images=state.engine.policy.is_vlm)
    add_generation_prompt = req.add_generation_prompt is not False
    if req.continue_final_message:
        if add_generation_prompt and "add_generation_prompt" not in (req.model_fields_set or ()):
            add_generation_prompt = False
        if add_generation_prompt:
            raise APIError("continue_final_message and add_generation_prompt cannot both be true",
                           param="continue_final_message")
        kwargs["continue_final_message"] = True
    try:
        text, _ = state.engine.render_chat(messages, tools, kwargs, add_generation_prompt=add_generation_prompt)
    except InvalidRequestError as e:
        raise APIError(str(e), param=e.field) from None
    if prompt_ids is None:
        ids = state.tokenizer.encode(text, add_special_tokens=bool(req.add_special_tokens))
    else:  # a recorded session continues its earlier turns' exact tokens (image runs expanded or not)
        ids = list(prompt_ids(messages, tools, kwargs))
    return ChatPrompt(messages, images, tools, kwargs, text, ids)


def prepare_prompt(state: ServerState, greq: GenerationRequest, param: str) -> list[int]:
    """The engine's own preparation of ``greq`` (chat rendering done, images processed and placeholders
    expanded), kept on the request so the engine does not repeat it; returns the expanded prompt ids."""
    try:
        greq.prepared = state.engine.prepare(greq)
    except InvalidRequestError as e:
        # Images live inside the request's messages (or prompt): the error names that field, as at submission.
        raise APIError(str(e), param=param if e.field in ("input_ids", "images", "messages") else e.field) from None
    return greq.prepared.prompt_ids
