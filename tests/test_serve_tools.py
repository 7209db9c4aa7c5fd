"""Tool-call parsers and the streaming hold-back, on hand-written model text (no model, no server)."""

import json

import pytest

pytest.importorskip("fastapi")

from unsloth_rollout.serve.tools import (StreamGuard, forced_prefix, parse_forced, parse_hermes,  # noqa: E402
                                         parse_llama3_json, parse_tool_calls, pick_parser)


def _calls(parse):
    return [(name, json.loads(args)) for name, args in parse.calls]


def test_hermes_single_call_and_leading_content():
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    p = parse_hermes(text)
    assert p.content == "Let me check.\n"
    assert _calls(p) == [("get_weather", {"city": "Paris"})]


def test_hermes_several_calls_and_unterminated_last():
    text = ('<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n'
            '<tool_call>\n{"name": "b", "arguments": {"x": [1, 2]}}')  # stopped at EOS before </tool_call>
    p = parse_hermes(text)
    assert p.content is None
    assert _calls(p) == [("a", {}), ("b", {"x": [1, 2]})]


def test_hermes_invalid_json_is_plain_content():
    text = "<tool_call>\n{not json}\n</tool_call>"
    p = parse_hermes(text)
    assert p.calls == [] and p.content == text


def test_hermes_no_call():
    assert parse_hermes("just text").content == "just text"
    assert parse_hermes("").content is None


def test_llama3_json_parameters_and_several_calls():
    p = parse_llama3_json('{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {"b": "x"}}')
    assert _calls(p) == [("f", {"a": 1}), ("g", {"b": "x"})]
    p = parse_llama3_json('<|python_tag|>{"name": "f", "arguments": {"a": 2}}')
    assert _calls(p) == [("f", {"a": 2})]


def test_llama3_json_rejects_non_calls():
    for text in ("hello", '{"not_a_call": 1}', '{"name": "f", "parameters": '):
        p = parse_llama3_json(text)
        assert p.calls == [] and p.content == text


def test_arguments_given_as_string_pass_through():
    p = parse_hermes('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>')
    assert p.calls == [("f", '{"a": 1}')]


def test_openai_tool_calls_shape():
    calls = parse_hermes('<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>').openai_tool_calls()
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("chatcmpl-tool-")
    assert calls[0]["function"] == {"name": "f", "arguments": '{"a": 1}'}


class _TokWithTemplate:
    response_template = {"dummy": True}
    chat_template = "<tool_call>"

    def parse_response(self, text, prefix=None, tools=None):
        return {"role": "assistant", "content": "hi", "tool_calls": [
            {"type": "function", "function": {"name": "f", "arguments": {"q": 1}}}]}


def test_transformers_response_template_is_preferred():
    tok = _TokWithTemplate()
    assert pick_parser(tok) == "transformers"
    p = parse_tool_calls("anything", "transformers", tok, "prompt")
    assert p.content == "hi" and _calls(p) == [("f", {"q": 1})]


def test_pick_parser_by_chat_template():
    class T:
        response_template = None

    t = T()
    t.chat_template = "... <tool_call> ..."
    assert pick_parser(t) == "hermes"
    t.chat_template = 'return {"name": function name, "parameters": ...}'
    assert pick_parser(t) == "llama3_json"
    with pytest.raises(ValueError):
        pick_parser(t, "nope")


def test_forced_prefix_named_function_round_trip():
    tools = [{"type": "function", "function": {"name": "get_weather"}}]
    choice = {"type": "function", "function": {"name": "get_weather"}}
    prefix = forced_prefix("hermes", choice, tools)
    assert prefix == '<tool_call>\n{"name": "get_weather", "arguments": '
    p = parse_forced(prefix, '{"city": "Rome"}}\n</tool_call>', "hermes", choice)
    assert _calls(p) == [("get_weather", {"city": "Rome"})]
    # A model that writes no valid JSON still yields the named call; its arguments are the raw text.
    p = parse_forced(prefix, "garbage}", "hermes", choice)
    assert p.calls == [("get_weather", "garbage")]
    assert forced_prefix("llama3_json", choice, tools) == '{"name": "get_weather", "parameters": '


def test_stream_guard_never_leaks_a_call():
    text = 'Sure. <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    g = StreamGuard("hermes")
    sent = ""
    for i in range(1, len(text) + 1):  # one character at a time
        sent += g.feed(text[:i])
    assert sent == "Sure. "
    parsed = parse_hermes(text)
    assert sent + g.finish(parsed, text) == "Sure. "
    # No call at all: everything is sent, a held-back partial "<tool" included at the end.
    g = StreamGuard("hermes")
    sent = g.feed("a <tool")
    assert sent == "a "
    assert sent + g.finish(parse_hermes("a <tool"), "a <tool") == "a <tool"
