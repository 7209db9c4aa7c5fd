"""Tool-call parsing: model text -> OpenAI ``tool_calls``.

Three parsers, picked once per server (``pick_parser``):
  - ``"transformers"``: the tokenizer's own ``response_template`` through ``tokenizer.parse_response``,
    when the tokenizer defines one (the model's authors said how to read its output);
  - ``"hermes"``: Hermes / Qwen ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``;
  - ``"llama3_json"``: Llama-3 JSON, ``{"name": ..., "parameters": {...}}`` (several joined by ``;``).

``StreamGuard`` holds back streamed content that a tool call may still take back.

Example::

    >>> parse_tool_calls('<tool_call>\\n{"name": "f", "arguments": {"x": 1}}\\n</tool_call>', "hermes")
    ToolParse(content=None, calls=[('f', '{"x": 1}')])
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from ..engine.tool_grammar import HERMES_END, HERMES_START, template_format

PARSERS = ("auto", "hermes", "llama3_json", "transformers")

_HERMES_RE = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


@dataclass
class ToolParse:
    """Parsed assistant output: the text outside the calls (None when empty) and (name, arguments-json) pairs."""

    content: str | None
    calls: list[tuple[str, str]] = field(default_factory=list)

    def __repr__(self) -> str:
        return f"ToolParse(content={self.content!r}, calls={self.calls!r})"

    def openai_tool_calls(self) -> list[dict]:
        return [{"id": f"chatcmpl-tool-{uuid.uuid4().hex[:24]}", "type": "function",
                 "function": {"name": name, "arguments": args}} for name, args in self.calls]


def pick_parser(tokenizer, requested: str = "auto") -> str:
    """Which parser a server uses: the tokenizer's response_template first, else by the chat template."""
    if requested not in PARSERS:
        raise ValueError(f"tool_call_parser must be one of {PARSERS}, got {requested!r}")
    if requested != "auto":
        return requested
    if getattr(tokenizer, "response_template", None) is not None and hasattr(tokenizer, "parse_response"):
        return "transformers"
    return template_format(tokenizer)


def _args_json(args) -> str:
    return args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


def hermes_arguments(args) -> str:
    """The arguments string of a Hermes call, as vLLM makes it: JSON of the value; a string that itself holds a
    serialized object passes through decoded once (Granite 4 writes them so), any other string is JSON-encoded."""
    if isinstance(args, str):
        try:
            inner = json.loads(args)
        except json.JSONDecodeError:
            inner = None
        if isinstance(inner, dict):
            return json.dumps(inner, ensure_ascii=False)
    return json.dumps(args, ensure_ascii=False)


def parse_hermes(text: str) -> ToolParse:
    """vLLM's Hermes rule: every ``<tool_call>`` body (the last may run to the end) must be a JSON object with
    ``name`` and ``arguments``, or the whole output is content; the content is the text before the first call."""
    start = text.find(HERMES_START)
    if start < 0:
        return ToolParse(text or None)
    calls = []
    for body in _HERMES_RE.findall(text[start:]):
        try:
            obj = json.loads(body)
        except json.JSONDecodeError:
            obj = None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or "arguments" not in obj:
            return ToolParse(text or None)  # one bad call and the whole output is plain content (vLLM)
        calls.append((obj["name"], hermes_arguments(obj["arguments"])))
    return ToolParse(text[:start] or None, calls)


def parse_llama3_json(text: str) -> ToolParse:
    """vLLM's Llama-3 JSON rule: each JSON object anywhere in the text (outside an earlier call) with a string
    ``name`` and ``parameters`` / ``arguments`` is a call; other braces are prose. With calls, content is None."""
    dec, calls, pos = json.JSONDecoder(), [], 0
    while (i := text.find("{", pos)) >= 0:
        try:
            obj, end = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            pos = i + 1
            continue
        if isinstance(obj, dict) and isinstance(obj.get("name"), str) and ("arguments" in obj or "parameters" in obj):
            calls.append((obj["name"], json.dumps(obj["arguments"] if "arguments" in obj else obj["parameters"],
                                                  ensure_ascii=False)))
            pos = end
        else:
            pos = i + 1
    return ToolParse(None, calls) if calls else ToolParse(text or None)


def parse_transformers(text: str, tokenizer, prompt_text: str = "", tools=None) -> ToolParse:
    parsed = tokenizer.parse_response(text, prefix=prompt_text, tools=tools)
    calls = []
    for tc in parsed.get("tool_calls") or []:
        fn = tc.get("function", tc) if isinstance(tc, dict) else {}
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            calls.append((fn["name"], _args_json(fn.get("arguments", {}))))
    content = parsed.get("content")
    return ToolParse(content if content else None, calls)


def parse_tool_calls(text: str, parser: str, tokenizer=None, prompt_text: str = "", tools=None) -> ToolParse:
    """Parse ``text`` with ``parser`` ("hermes" | "llama3_json" | "transformers"); never raises."""
    if parser == "transformers" and tokenizer is not None:
        try:
            return parse_transformers(text, tokenizer, prompt_text, tools)
        except Exception:  # a template that cannot read this output: fall back to the text formats
            parser = "hermes" if HERMES_START in text else "llama3_json"
    if parser == "llama3_json":
        return parse_llama3_json(text)
    return parse_hermes(text)


class StreamGuard:
    """Holds back streamed content until no continuation of the output can take it back (the engine's deltas
    already hold back text a stop string may still cut).

    ``feed(full_text)`` returns the new text that is safe to send now; ``finish(parse, text)`` returns what is
    still owed: the final content (the parsed content when there are calls, else the final text) past what was
    sent. What is safe depends on ``parser``:

    - None (no tools): everything;
    - ``"hermes"``: the text before the first ``<tool_call>`` (a partial tag at the tail held). The final content
      starts with it whether the calls parse (the content is the text before the first call) or not (the whole
      text is content);
    - ``"llama3_json"``, ``"transformers"``: nothing until the end. A call anywhere in a Llama-3 output makes its
      content None (vLLM's rule), and a response template may shape the content any way it likes.
    """

    def __init__(self, parser: str | None):
        self.parser = parser
        self.sent = 0

    def _safe_end(self, text: str) -> int:
        if self.parser is None:
            return len(text)
        if self.parser != "hermes":
            return 0
        i = text.find(HERMES_START)
        if i >= 0:
            return i
        for k in range(min(len(HERMES_START) - 1, len(text)), 0, -1):  # a partial "<tool_call>" at the tail
            if HERMES_START.startswith(text[-k:]):
                return len(text) - k
        return len(text)

    def feed(self, text: str) -> str:
        end = self._safe_end(text)
        if end <= self.sent:
            return ""
        out, self.sent = text[self.sent:end], end
        return out

    def finish(self, parsed: ToolParse | None, text: str) -> str:
        content = parsed.content if parsed is not None and parsed.calls else text
        content = content or ""
        return content[self.sent:] if len(content) > self.sent else ""
