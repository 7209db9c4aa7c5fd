"""OpenAI ``response_format`` / vLLM ``structured_outputs`` and ``tool_choice`` -> the engine's StructuredOutputs.

``response_format`` ``{"type": "json_object"}`` and ``{"type": "json_schema", "json_schema": {"schema": ...}}`` and
vLLM's ``structured_outputs`` field (json / regex / choice / grammar) constrain the whole output;
``tool_choice="required"`` or a named function constrains it to a tool call (engine/tool_grammar.py).

Example::

    >>> from_response_format({"type": "json_object"}, None)
    StructuredOutputs(json=None, json_object=True, ...)
"""

from __future__ import annotations

import json

from ..engine.config import InvalidRequestError
from ..engine.constraints import StructuredOutputs
from ..engine.tool_grammar import template_format, tool_call_outputs
from .protocol import APIError


def from_response_format(response_format: dict | None, structured_outputs: dict | None) -> StructuredOutputs | None:
    """The request's output constraint, or None; an APIError naming the field when it is malformed."""
    if structured_outputs is not None and response_format and response_format.get("type") not in (None, "text"):
        raise APIError("give either response_format or structured_outputs, not both", param="response_format")
    if structured_outputs is not None:
        try:
            return StructuredOutputs.from_dict(structured_outputs)
        except InvalidRequestError as e:
            raise APIError(str(e), param=e.field) from None
    kind = (response_format or {}).get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return StructuredOutputs(json_object=True)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema", spec.get("json_schema")) if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise APIError("response_format.json_schema.schema must be a JSON schema object",
                           param="response_format.json_schema")
        return StructuredOutputs(json=schema)
    raise APIError(f"response_format type {kind!r} is not supported; supported: 'text', 'json_object', "
                   "'json_schema'", param="response_format")


def tool_choice_outputs(parser: str, tokenizer, tools: list[dict], choice, parallel: bool):
    """(format, StructuredOutputs) of a ``tool_choice`` "required" or named: calls are written in the server's
    parser's format (for the tokenizer's own response template: the format its chat template shows)."""
    fmt = parser if parser in ("hermes", "llama3_json") else template_format(tokenizer)
    try:
        return fmt, tool_call_outputs(fmt, tools, choice, parallel, tokenizer)
    except InvalidRequestError as e:
        raise APIError(str(e), param=e.field) from None
