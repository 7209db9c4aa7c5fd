"""What ``ArealOpenAI`` needs from an unsloth-only install: tool-call parsing and VLM trajectories.

- ``process_tool_calls_unsloth``: AReaL's ``process_tool_calls`` contract (same arguments, same
  ``(tool_calls, text, finish_reason)`` result) answered by the project's own parsers in
  ``unsloth_rollout.serve.tools`` -- the code path the OpenAI-compatible server uses, so
  ``ArealOpenAI`` and the server read the same model text into the same ``tool_calls``. AReaL calls
  it where it would otherwise give up ("Neither sglang nor vllm is installed"): ``install()``
  wraps ``process_tool_calls``; ``patches/areal-1.0.4-unsloth-backend.patch`` adds the fallback.
- ``UnslothModelResponse``: a ``ModelResponse`` that also carries the vision inputs (pixel values,
  grid) the engine ran the prompt with; ``to_tensor_dict_with_images`` adds them to AReaL's
  trajectory as ``multi_modal_input``, so the trainer sees the very pixels the rollout used.
- ``patch_openai()``: installs both into AReaL (idempotent); ``install()`` and
  ``UnslothInferenceEngine.initialize()`` call it.

AReaL parser names map onto the project's formats: ``qwen`` / ``qwen25`` / ``hermes`` ->
Hermes (``<tool_call>{json}</tool_call>``), ``llama3`` / ``llama3_json`` -> Llama-3 JSON. Reasoning
(``<think>...</think>`` for ``qwen3``, ``deepseek-r1``, ...) is split off before tool calls are
looked for and kept at the head of the text, as AReaL's SGLang path does.

Example::

    calls, text, finish = process_tool_calls_unsloth(
        '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>', tools, "qwen", "qwen3", "stop")
    # calls[0].function.name == "f", finish == "tool_calls"
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

from areal.api import ModelResponse

# AReaL's tool_call_parser names -> serve.tools parser names.
TOOL_PARSERS = {"qwen": "hermes", "qwen25": "hermes", "hermes": "hermes",
                "llama3": "llama3_json", "llama3_json": "llama3_json"}
# AReaL's reasoning_parser names -> (start, end) tags.
_THINK = ("<think>", "</think>")
REASONING_TAGS = {"qwen3": _THINK, "qwen3-thinking": _THINK, "deepseek-r1": _THINK, "deepseek_r1": _THINK,
                  "deepseek-v3": _THINK, "glm45": _THINK, "minimax": _THINK, "step3": _THINK,
                  "kimi": ("◁think▷", "◁/think▷")}


def project_tool_parser(name: str) -> str:
    """The serve.tools parser for an AReaL ``tool_call_parser`` name; ValueError naming the field otherwise."""
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"tool_call_parser: the unsloth backend parses {sorted(TOOL_PARSERS)} "
                         f"(Hermes/Qwen and Llama-3 JSON tool calls), got {name!r}") from None


def split_reasoning(text: str, reasoning_parser: str | None) -> tuple[str, str]:
    """``(reasoning incl. its tags, the rest)``; ``("", text)`` when the parser has no tags or none occur."""
    tags = REASONING_TAGS.get(reasoning_parser or "")
    if tags is None:
        return "", text
    start, end = tags
    if start not in text:
        return "", text
    rest = text.replace(start, "")
    if end not in rest:  # cut off before the end tag: all of it is reasoning
        return start + rest, ""
    reasoning, normal = rest.split(end, 1)
    return start + reasoning + end, normal


def process_tool_calls_unsloth(text: str, tools: list[Any], tool_call_parser: str, reasoning_parser: str,
                               finish_reason: str, use_responses: bool = False, tokenizer: Any = None):
    """AReaL's ``process_tool_calls`` on the project's parsers: ``(tool_calls | None, text, finish_reason)``.

    ``text`` keeps the reasoning block and drops the calls (AReaL's convention); ``finish_reason``
    "stop" becomes "tool_calls" when there is a call. Text that is not a well-formed call stays
    content (no calls), as on the server.
    """
    from openai.types.chat.chat_completion_message_function_tool_call import (
        ChatCompletionMessageFunctionToolCall, Function)
    from openai.types.responses.response_function_tool_call import ResponseFunctionToolCall

    from ..serve.tools import parse_tool_calls

    parser = project_tool_parser(tool_call_parser)
    reasoning, content = split_reasoning(text, reasoning_parser)
    parsed = parse_tool_calls(content, parser)
    if not parsed.calls:
        return None, text, finish_reason
    if finish_reason == "stop":
        finish_reason = "tool_calls"
    calls = []
    for c in parsed.openai_tool_calls():  # the server's ids and argument strings
        fn = c["function"]
        if use_responses:
            calls.append(ResponseFunctionToolCall(type="function_call", id=f"fc-{c['id'][len('chatcmpl-tool-'):]}",
                                                  call_id=c["id"], name=fn["name"], arguments=fn["arguments"],
                                                  status="completed"))
        else:
            calls.append(ChatCompletionMessageFunctionToolCall(
                type="function", id=c["id"], function=Function(name=fn["name"], arguments=fn["arguments"])))
    return calls, reasoning + (parsed.content or ""), finish_reason


def external_parsers_installed() -> bool:
    """True when AReaL would parse with SGLang's or vLLM's parsers (either package importable)."""
    return any(importlib.util.find_spec(m) is not None for m in ("sglang", "vllm"))


def wrap_process_tool_calls(original):
    """AReaL's ``process_tool_calls``, falling back to the project's parsers where AReaL would give up."""
    def process_tool_calls(text, tools, tool_call_parser, reasoning_parser, finish_reason, use_responses=False,
                           tokenizer=None):
        if external_parsers_installed():
            return original(text, tools, tool_call_parser, reasoning_parser, finish_reason, use_responses,
                            tokenizer=tokenizer)
        return process_tool_calls_unsloth(text, tools, tool_call_parser, reasoning_parser, finish_reason,
                                          use_responses, tokenizer=tokenizer)

    process_tool_calls.__doc__ = original.__doc__
    process_tool_calls._unsloth_wrapped = True
    return process_tool_calls


# ============================================================================ VLM trajectories
@dataclass
class UnslothModelResponse(ModelResponse):
    """A ModelResponse whose ``input_tokens`` have every image placeholder expanded, plus the vision
    inputs the engine ran that prompt with (``{"pixel_values", "image_grid_thw"}``, or None)."""

    multi_modal_input: dict | None = None


def multi_modal_of(model_response) -> dict | None:
    mm = getattr(model_response, "multi_modal_input", None)
    return mm if isinstance(mm, dict) and mm.get("pixel_values") is not None else None


def wrap_to_tensor_dict(original):
    """``InteractionWithTokenLogpReward.to_tensor_dict`` that adds ``multi_modal_input`` (batch of one)."""
    def to_tensor_dict(self):
        out = original(self)
        mm = multi_modal_of(self.model_response)
        if mm is not None and "multi_modal_input" not in out:
            out["multi_modal_input"] = [dict(mm)]
        return out

    to_tensor_dict.__doc__ = original.__doc__
    to_tensor_dict._unsloth_wrapped = True
    return to_tensor_dict


def patch_openai() -> None:
    """ArealOpenAI on an unsloth-only install: the project's tool-call parsers where AReaL finds none,
    and ``multi_modal_input`` (the engine's own pixel values) in its trajectories. Idempotent; also run by
    ``UnslothInferenceEngine.initialize()`` so ArealOpenAI works on the engine without ``install()``."""
    from areal.experimental.openai import client, tool_call_parser, types

    if not getattr(tool_call_parser, "UNSLOTH_TOOL_PARSERS", False):
        if not getattr(tool_call_parser.process_tool_calls, "_unsloth_wrapped", False):
            wrapped = wrap_process_tool_calls(tool_call_parser.process_tool_calls)
            tool_call_parser.process_tool_calls = wrapped
            client.process_tool_calls = wrapped  # imported by name there
    cls = types.InteractionWithTokenLogpReward
    if not getattr(types, "UNSLOTH_MULTI_MODAL", False) and not getattr(cls.to_tensor_dict, "_unsloth_wrapped", False):
        cls.to_tensor_dict = wrap_to_tensor_dict(cls.to_tensor_dict)
