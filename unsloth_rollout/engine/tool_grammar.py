"""The grammar of a forced tool call, in the text format the model's chat template writes calls in.

``tool_choice="required"`` (one or more calls) or a named function (one call) becomes a Lark grammar over the
Hermes format ``<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>`` or Llama-3 JSON
``{"name": ..., "parameters": ...}`` (several joined by "; "), each call's arguments held to its function's
``parameters`` schema. The model writes every token of the call itself, so the completion is the model's own
tool-call turn and parses with the same parser. Used by the server and by TRL's rollout_func.

Example::

    >>> tool_call_outputs("hermes", [{"type": "function", "function": {"name": "f"}}], "required", True, tok)
    StructuredOutputs(grammar='start: call ...')
"""

from __future__ import annotations

import json

from .config import InvalidRequestError
from .constraints import JSON_STYLE, StructuredOutputs

HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
# A function without ``parameters`` takes no arguments (OpenAI's rule): its arguments are {}.
_NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


def template_format(tokenizer, chat_template=None) -> str:
    """The tool-call text format a chat template shows: "hermes" or "llama3_json" (default "hermes")."""
    template = chat_template or getattr(tokenizer, "chat_template", None) or ""
    if not isinstance(template, str):
        template = json.dumps(template)
    if HERMES_START in template:
        return "hermes"
    if PYTHON_TAG in template or '"parameters"' in template:
        return "llama3_json"
    return "hermes"


def _literal(tokenizer, text: str) -> str:
    """A Lark terminal for ``text``: the tokenizer's single added token when it has one (what encode() gives
    and what llguidance treats as a special token), else the quoted text."""
    tid = (tokenizer.get_added_vocab() if hasattr(tokenizer, "get_added_vocab") else {}).get(text)
    return f"<[{tid}]>" if tid is not None else json.dumps(text)


def _schema(tool: dict) -> dict:
    params = tool["function"].get("parameters")
    if params is None:
        params = _NO_PARAMETERS
    if not isinstance(params, dict):
        raise InvalidRequestError("tools", f"tools: function {tool['function']['name']!r} has parameters that are "
                                           "not a JSON schema")
    own = params.get("x-guidance")
    return {**params, "x-guidance": {**JSON_STYLE, **(own if isinstance(own, dict) else {})}}


def tool_call_outputs(fmt: str, tools: list[dict], choice, parallel: bool, tokenizer) -> StructuredOutputs:
    """The grammar of ``tool_choice`` ("required" or {"type": "function", "function": {"name"}}) in ``fmt``:
    one call (a named choice, or ``parallel_tool_calls=false``) or one or more, each of a listed function with
    arguments valid for its schema."""
    if isinstance(choice, dict):
        tools = [t for t in tools if t["function"]["name"] == choice["function"]["name"]]
    rules, alts = [], []
    for k, tool in enumerate(tools):
        name = json.dumps(tool["function"]["name"], ensure_ascii=False)
        args = f"args{k}: %json " + json.dumps(_schema(tool), ensure_ascii=False)
        if fmt == "llama3_json":
            body = " ".join([json.dumps('{"name": ' + name + ', "parameters": '), f"args{k}", json.dumps("}")])
        else:
            body = " ".join([_literal(tokenizer, HERMES_START), json.dumps('\n{"name": ' + name + ', "arguments": '),
                             f"args{k}", json.dumps("}\n"), _literal(tokenizer, HERMES_END)])
        rules += [f"call{k}: {body}", args]
        alts.append(f"call{k}")
    sep = json.dumps("; " if fmt == "llama3_json" else "\n")
    many = parallel and not isinstance(choice, dict)
    start = f"start: call ({sep} call)*" if many else "start: call"
    return StructuredOutputs(grammar="\n".join([start, "call: " + " | ".join(alts)] + rules) + "\n")
