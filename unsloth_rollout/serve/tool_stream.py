"""Streaming tool calls as vLLM streams them.

Per sample, ``ToolCallStream.feed(text_so_far)`` returns (content delta, tool-call deltas): the text before the
first call as content; for each call, first ``{"index", "id", "type": "function", "function": {"name"}}`` once its
name is complete, then ``{"index", "function": {"arguments": fragment}}`` as its arguments grow. ``finish``
sends what the final (non-streaming) parse holds that was not sent yet, so the fragments of each call always
join to exactly the non-streaming ``arguments``: they are cut from the arguments re-serialized as json.dumps
writes them (whole tokens only; a string-valued argument waits for its closing quote, as vLLM's Hermes does).

Hermes calls stream as they are written; Llama-3 JSON calls stream when the output starts with a call (as in
vLLM: text before a call is content); the tokenizer's own response template is read whole at the end.

Example::

    >>> s = ToolCallStream("hermes")
    >>> s.feed('Hi<tool_call>\\n{"name": "f", "arguments": {"a"')
    ('Hi', [{'index': 0, 'id': ..., 'type': 'function', 'function': {'name': 'f'}}, ...])
"""

from __future__ import annotations

import json
import re
import uuid

from ..engine.tool_grammar import HERMES_END, HERMES_START, PYTHON_TAG
from .tools import ToolParse, hermes_arguments

_PYTHON_TAG = PYTHON_TAG
_NAME_RE = re.compile(r'"name"\s*:\s*("(?:[^"\\]|\\.)*")')
_NUMBER_CHARS = frozenset("0123456789+-.eE")
_LITERALS = ("true", "false", "null")


def _string_end(text: str, i: int) -> int | None:
    """Index just past the JSON string starting at ``text[i] == '"'``, or None while it is open."""
    j = i + 1
    while j < len(text):
        c = text[j]
        if c == "\\":
            j += 2
            continue
        if c == '"':
            return j + 1
        j += 1
    return None


def normalized_prefix(raw: str) -> tuple[str, int | None]:
    """(prefix of ``json.dumps(json.loads(value), ensure_ascii=False)`` settled by ``raw``, end of the value in
    ``raw`` or None while it is open) for the JSON value at the start of ``raw``. Raises ValueError on text that
    is not JSON."""
    out: list[str] = []
    depth, i, n = 0, 0, len(raw)
    while i < n:
        c = raw[i]
        if c in " \t\r\n":
            i += 1
            continue
        if c in "{[":
            out.append(c)
            depth += 1
        elif c in "}]":
            out.append(c)
            depth -= 1
        elif c == ":":
            out.append(": ")
        elif c == ",":
            out.append(", ")
        elif c == '"':
            end = _string_end(raw, i)
            if end is None:
                return "".join(out), None
            out.append(json.dumps(json.loads(raw[i:end]), ensure_ascii=False))
            i = end
            if depth == 0:
                return "".join(out), i
            continue
        else:
            j = i
            while j < n and raw[j] in _NUMBER_CHARS:
                j += 1
            word = next((w for w in _LITERALS if raw.startswith(w, i)), None)
            if j > i and j < n:
                out.append(json.dumps(json.loads(raw[i:j])))  # ValueError when it is no number
                i = j
            elif word:
                out.append(word)
                i += len(word)
            elif j == n or any(w.startswith(raw[i:]) for w in _LITERALS):
                return "".join(out), None  # a number or literal that may still grow
            else:
                raise ValueError(f"not JSON at {i}: {raw[i:i + 10]!r}")
            if depth == 0:
                return "".join(out), i
            continue
        i += 1
        if depth == 0:
            return "".join(out), i
    return "".join(out), None


class _Call:
    def __init__(self):
        self.id = f"chatcmpl-tool-{uuid.uuid4().hex[:24]}"
        self.name: str | None = None
        self.args = ""  # arguments sent so far


class ToolCallStream:
    """One sample's streamed tool calls (see module docstring). ``parser``: "hermes" | "llama3_json" |
    "transformers"."""

    def __init__(self, parser: str):
        self.parser = parser
        self.content_sent = 0
        self.calls: list[_Call] = []
        self.mode: str | None = None  # llama3_json: "calls" or "content", once the first character says

    # ------------------------------------------------------------------ while generating
    def feed(self, text: str) -> tuple[str, list[dict]]:
        if self.parser == "hermes":
            content_end, bodies = self._hermes(text)
        elif self.parser == "llama3_json":
            content_end, bodies = self._llama(text)
        else:  # the tokenizer's own response template, read whole at the end: hold what may open a call
            stripped = text.lstrip()
            content_end, bodies = (0 if not stripped or stripped[0] in "{<" else len(text)), []
        content = text[self.content_sent:content_end] if content_end > self.content_sent else ""
        self.content_sent = max(self.content_sent, content_end)
        deltas = []
        for k, (name, args) in enumerate(bodies):
            deltas += self._advance(k, name, args)
        return content, deltas

    def _hermes(self, text: str):
        start = text.find(HERMES_START)
        if start < 0:  # hold back a partial "<tool_call>" at the tail
            k = next((k for k in range(min(len(HERMES_START) - 1, len(text)), 0, -1)
                      if HERMES_START.startswith(text[-k:])), 0)
            return len(text) - k, []
        bodies = []
        for part in text[start:].split(HERMES_START)[1:]:
            body = part.split(HERMES_END, 1)[0]
            bodies.append(self._fields(body, "arguments"))
        return start, bodies

    def _llama(self, text: str):
        if self.mode is None:
            stripped = text.lstrip()
            if not stripped or (len(stripped) < len(_PYTHON_TAG) and _PYTHON_TAG.startswith(stripped)):
                return 0, []
            self.mode = "calls" if stripped.startswith(("{", _PYTHON_TAG)) else "content"
        if self.mode == "content":
            return len(text), []
        body = text.lstrip()
        body = body[len(_PYTHON_TAG):] if body.startswith(_PYTHON_TAG) else body
        bodies, pos = [], 0
        while (i := body.find("{", pos)) >= 0:
            try:
                _, end = normalized_prefix(body[i:])
            except ValueError:
                break
            key = "arguments" if re.search(r'"arguments"\s*:', body[i:i + (end or len(body))]) else "parameters"
            bodies.append(self._fields(body[i:i + end] if end else body[i:], key))
            if end is None:
                break
            pos = i + end
        return 0, bodies

    @staticmethod
    def _fields(body: str, args_key: str):
        """(name or None, raw text after ``"<args_key>":`` or None) of a call's (partial) JSON body."""
        m = _NAME_RE.search(body)
        name = json.loads(m.group(1)) if m else None
        a = re.search(r'"%s"\s*:\s*' % args_key, body)
        return name, (body[a.end():] if a else None)

    def _advance(self, k: int, name, raw_args) -> list[dict]:
        while len(self.calls) <= k:
            self.calls.append(_Call())
        call, out = self.calls[k], []
        if call.name is None:
            if name is None or (k > 0 and self.calls[k - 1].name is None):
                return out
            call.name = name
            out.append({"index": k, "id": call.id, "type": "function", "function": {"name": name}})
        if raw_args is None:
            return out
        try:
            if raw_args.lstrip().startswith('"'):  # a string-valued argument: judged once it is whole
                done, end = normalized_prefix(raw_args)
                settled = "" if end is None else hermes_arguments(json.loads(done)) if self.parser == "hermes" \
                    else done
            else:
                settled, _ = normalized_prefix(raw_args)
        except ValueError:
            return out
        if len(settled) > len(call.args) and settled.startswith(call.args):
            out.append({"index": k, "function": {"arguments": settled[len(call.args):]}})
            call.args = settled
        return out

    # ------------------------------------------------------------------ at the end
    def finish(self, parsed: ToolParse | None, text: str) -> tuple[str, list[dict]]:
        """(content still owed, tool-call deltas still owed) once the sample is finished and ``parsed`` is the
        final parse of ``text`` (None: not parsed)."""
        deltas = []
        calls = parsed.calls if parsed is not None else []
        for k, (name, args) in enumerate(calls):
            while len(self.calls) <= k:
                self.calls.append(_Call())
            call = self.calls[k]
            if call.name is None:
                call.name = name
                deltas.append({"index": k, "id": call.id, "type": "function", "function": {"name": name}})
            if len(args) > len(call.args) and args.startswith(call.args):
                deltas.append({"index": k, "function": {"arguments": args[len(call.args):]}})
                call.args = args
        content = (parsed.content or "") if calls else text
        return content[self.content_sent:], deltas
