"""Streamed tool calls a client can trust: each call is sent whole, once its sample has finished.

A call streamed piece by piece (vLLM's way: the name as soon as it is written, then argument fragments) cannot be
taken back, and until the sample ends the final answer may still have no call:

- a forced call (``tool_choice`` "required" or a named function) is a call only when its grammar completed; cut
  by ``max_tokens`` or aborted, the answer is the raw text as content, with finish_reason "length" / "abort";
- a Hermes output in which a later call is cut off or is not JSON is, all of it, content (vLLM's rule), so even
  a call that closed and parsed is withdrawn.

Clients that rebuild a stream (litellm's ``stream_chunk_builder``, the OpenAI Agents SDK's streamed runner, the
``openai`` SDK's ``chat.completions.stream``) keep every call delta they were sent, and an agent runner executes
it. So a call goes out as one delta, ``{"index", "id", "type": "function", "function": {"name", "arguments"}}``
with its complete arguments, in the chunk that carries the sample's finish_reason; content streams only as far as
no continuation can take it back (``StreamGuard``). Joined, the stream is the non-streamed answer (content,
tool_calls, finish_reason) at every finish reason.

Example::

    >>> s = ToolCallStream("hermes")
    >>> s.feed('Hi<tool_call>\\n{"name": "f", "arguments": {"a"')
    'Hi'
    >>> text = 'Hi<tool_call>\\n{"name": "f", "arguments": {"a": 1}}\\n</tool_call>'
    >>> s.finish(parse_hermes(text), text)
    ('', [{'index': 0, 'id': 'chatcmpl-tool-...', 'type': 'function',
           'function': {'name': 'f', 'arguments': '{"a": 1}'}}])
"""

from __future__ import annotations

from .tools import StreamGuard, ToolParse


class ToolCallStream:
    """One sample's streamed content and tool calls (see module docstring). ``parser``: "hermes" |
    "llama3_json" | "transformers"."""

    def __init__(self, parser: str):
        self.content = StreamGuard(parser)

    def feed(self, text: str) -> str:
        """The content delta that is safe to send now, given the text generated so far; calls wait for ``finish``."""
        return self.content.feed(text)

    def finish(self, parsed: ToolParse | None, text: str) -> tuple[str, list[dict]]:
        """(content still owed, the calls) once the sample is finished: ``parsed`` is the final parse of ``text``
        (None or no calls: the answer is all content)."""
        calls = parsed.openai_tool_calls() if parsed is not None else []
        return self.content.finish(parsed, text), [{"index": k, **c} for k, c in enumerate(calls)]
