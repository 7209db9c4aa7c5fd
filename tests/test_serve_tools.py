"""Tool-call parsers, streamed tool calls and the streaming hold-back, on hand-written model text (no model, no
server). Tests named ``test_vllm_*`` restate, in our words, the assertions of the vLLM test they name
(vllm-project/vllm tests/tool_parsers/test_hermes_tool_parser.py and test_llama3_json_tool_parser.py)."""

import json

import pytest

pytest.importorskip("fastapi")

from unsloth_rollout.serve.tool_stream import ToolCallStream  # noqa: E402
from unsloth_rollout.serve.tools import (StreamGuard, parse_hermes, parse_llama3_json, parse_tool_calls,  # noqa: E402
                                         pick_parser)


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
    for text in ("hello", '{"not_a_call": 1}', '{"name": "f", "parameters": ', '{"name": "f"}'):
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


_CALL = '<tool_call>\n{"name": "f", "arguments": {"a": [1, "x"]}}\n</tool_call>'
_CUT_TEXTS = [
    ("hermes", parse_hermes, "Let me check. " + _CALL),
    ("hermes", parse_hermes, _CALL + "\n" + _CALL),
    ("hermes", parse_hermes, _CALL + '\n<tool_call>\n{"name": "f", "arguments": {"a": }\n</tool_call>'),  # 2nd broken
    ("hermes", parse_hermes, "No call here, only < and <tool text."),
    ("llama3_json", parse_llama3_json, 'Checking: {"name": "f", "parameters": {"a": 1}} and done.'),
    ("llama3_json", parse_llama3_json, '{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}'),
    ("llama3_json", parse_llama3_json, "Plain words {with braces} only."),
]


@pytest.mark.parametrize("parser,parse,text", _CUT_TEXTS)
def test_streamed_answer_is_the_final_answer_wherever_the_output_ends(parser, parse, text):
    """The output may end anywhere (max_tokens, an abort): what was streamed before the end is never taken back,
    and with what ``finish`` sends it is exactly the final parse of the output as it ended: content (None as "")
    and calls. A closed call is withdrawn when a later one is broken (Hermes), and prose is no content once a
    Llama-3 call appears, so neither may go out early."""
    for cut in range(len(text) + 1):
        out = text[:cut]
        content, calls, deltas = _stream(out, parser, 1, parse)
        final = parse(out)
        assert calls == final.calls, (cut, out)
        assert content == ((final.content or "") if final.calls else out), (cut, out)
        _assert_whole_calls(deltas)


def test_llama3_json_and_response_template_content_is_held_until_the_end():
    """A later call can take back any Llama-3 prose (content None), and a response template shapes the content as
    it likes: nothing is sent before the end."""
    s = ToolCallStream("llama3_json")
    text = 'Checking: {"name": "f", "parameters": {"a": 1}}'
    assert all(s.feed(text[:k]) == "" for k in range(len(text) + 1))
    assert s.finish(parse_llama3_json(text), text)[0] == ""  # the call took the prose: content None
    s, tok = ToolCallStream("transformers"), _TokWithTemplate()
    assert all(s.feed("Hello there"[:k]) == "" for k in range(12))
    content, deltas = s.finish(parse_tool_calls("Hello there", "transformers", tok), "Hello there")
    assert content == "hi" and [d["function"]["name"] for d in deltas] == ["f"]  # what the template says


# ====================================================================== vLLM's Hermes parser tests
def test_vllm_hermes_parser_non_streaming_tool_call_between_tags():
    p = parse_hermes('<tool_call>\n{"name": "final_answer", "arguments": {"trigger": true}}\n</tool_call>')
    assert p.calls == [("final_answer", '{"trigger": true}')]


def test_vllm_hermes_parser_non_streaming_tool_call_until_eos():
    p = parse_hermes('<tool_call>\n{"name": "final_answer", "arguments": {"trigger": true}}')
    assert p.calls == [("final_answer", '{"trigger": true}')]


def test_vllm_hermes_parser_non_streaming_tool_call_invalid_json():
    p = parse_hermes('<tool_call>\n{"name": "final_answer", "arguments": {"trigger": true}')
    assert p.calls == []


def test_vllm_hermes_parser_non_streaming_no_tool_call():
    assert parse_hermes("This is not a tool call.").calls == []


def test_vllm_hermes_parser_non_streaming_serialized_arguments():
    p = parse_hermes('<tool_call>\n{"name": "get_db_config", "arguments": "{\\"param\\": \\"max_connections\\"}"}\n'
                     '</tool_call>')
    assert p.calls[0][0] == "get_db_config" and json.loads(p.calls[0][1]) == {"param": "max_connections"}


def test_vllm_hermes_parser_non_streaming_bare_string_arguments():
    p = parse_hermes('<tool_call>\n{"name": "do_thing", "arguments": "hello"}\n</tool_call>')
    assert json.loads(p.calls[0][1]) == "hello"


def test_hermes_call_without_arguments_is_content():
    """vLLM's Hermes parser reads ``call["arguments"]``: a call without it makes the output plain content."""
    text = 'Hi <tool_call>{"name": "f"}</tool_call>'
    assert parse_hermes(text).calls == [] and parse_hermes(text).content == text


def _stream(text: str, parser: str, step: int, parse):
    """Feed ``text`` ``step`` characters at a time, then finish with ``parse(text)``; returns (content,
    [(name, arguments)], the tool-call deltas). No call may be sent before the sample has finished."""
    s, content = ToolCallStream(parser), ""
    for k in range(step, len(text) + step, step):
        content += s.feed(text[:k])
    c, deltas = s.finish(parse(text), text)
    content += c
    calls = {}
    for d in deltas:
        calls.setdefault(d["index"], []).append(d)
    return content, [(v[0]["function"]["name"], "".join(x["function"].get("arguments", "") for x in v))
                     for _, v in sorted(calls.items())], deltas


def _assert_whole_calls(deltas):
    """Each call is one delta with index, id, type, name and its complete arguments (nothing to join, nothing a
    client could execute half-written)."""
    assert [d["index"] for d in deltas] == list(range(len(deltas)))
    for d in deltas:
        assert set(d) == {"index", "id", "type", "function"} and d["type"] == "function"
        assert set(d["function"]) == {"name", "arguments"} and d["id"].startswith("chatcmpl-tool-")
        json.loads(d["function"]["arguments"])


@pytest.mark.parametrize("step", [1, 2, 3, 5, 8])
def test_vllm_hermes_streaming_tool_call_with_stream_interval(step):
    text = ('<tool_call>{"name": "get_current_temperature", "arguments": {"location": "San Francisco", '
            '"unit": "celsius"}}</tool_call>')
    content, calls, deltas = _stream(text, "hermes", step, parse_hermes)
    _assert_whole_calls(deltas)
    assert content == "" and [c[0] for c in calls] == ["get_current_temperature"]
    assert json.loads(calls[0][1]) == {"location": "San Francisco", "unit": "celsius"}
    assert calls == parse_hermes(text).calls  # exactly the non-streaming arguments


@pytest.mark.parametrize("step", [2, 3, 5, 8])
def test_vllm_hermes_streaming_content_then_tool_call_with_stream_interval(step):
    text = 'Sure, let me check the weather.<tool_call>{"name": "get_weather", "arguments": {"city": "NYC"}}</tool_call>'
    content, calls, deltas = _stream(text, "hermes", step, parse_hermes)
    assert content == "Sure, let me check the weather."
    assert calls == [("get_weather", '{"city": "NYC"}')]


@pytest.mark.parametrize("step", [1, 2, 4])
def test_vllm_hermes_streaming_multiple_tool_calls_with_stream_interval(step):
    text = ('<tool_call>{"name": "search", "arguments": {"q": "cats"}}</tool_call>'
            '<tool_call>{"name": "search", "arguments": {"q": "dogs"}}</tool_call>')
    _, calls, deltas = _stream(text, "hermes", step, parse_hermes)
    _assert_whole_calls(deltas)
    assert [(n, json.loads(a)) for n, a in calls] == [("search", {"q": "cats"}), ("search", {"q": "dogs"})]


@pytest.mark.parametrize("step", [2, 5])
def test_vllm_hermes_streaming_boolean_args_with_stream_interval(step):
    text = '<tool_call>\n{"name": "final_answer", "arguments": {"trigger": true}}\n</tool_call>'
    _, calls, _ = _stream(text, "hermes", step, parse_hermes)
    assert calls == [("final_answer", '{"trigger": true}')]


@pytest.mark.parametrize("step", [2, 3, 5])
def test_vllm_hermes_streaming_just_forward_text_with_stream_interval(step):
    text = "This is plain text with no tool calling involved."
    content, calls, deltas = _stream(text, "hermes", step, parse_hermes)
    assert content == text and calls == [] and deltas == []


@pytest.mark.parametrize("args_value", ['{"param": "max_connections"}', "hello", "{hello world}", "[oops",
                                        '{"a": 1} tail text'])
@pytest.mark.parametrize("step", [1, 3])
def test_vllm_hermes_streaming_string_arguments_match_non_streaming(args_value, step):
    text = "<tool_call>" + json.dumps({"name": "f", "arguments": args_value}) + "</tool_call>"
    _, calls, _ = _stream(text, "hermes", step, parse_hermes)
    assert calls == parse_hermes(text).calls
    json.loads(calls[0][1])  # valid JSON whatever the model wrote


def test_vllm_hermes_streaming_content_and_tool_call_in_single_chunk():
    text = 'Hi!<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
    content, calls, _ = _stream(text, "hermes", 9999, parse_hermes)
    assert content == "Hi!" and calls == [("f", '{"x": 1}')]


# ====================================================================== vLLM's Llama-3 JSON parser tests
def test_vllm_llama3_extract_tool_calls_simple():
    p = parse_llama3_json('Here is the result: {"name": "getOpenIncidentsTool", "parameters": {}} '
                          'Would you like to know more?')
    assert p.calls == [("getOpenIncidentsTool", "{}")] and p.content is None


def test_vllm_llama3_extract_tool_calls_with_arguments_and_arguments_key():
    p = parse_llama3_json('{"name": "searchTool", "parameters": {"query": "test query", "limit": 10}}')
    assert p.calls == [("searchTool", '{"query": "test query", "limit": 10}')]
    p = parse_llama3_json('{"name": "searchTool", "arguments": {"query": "test"}}')
    assert p.calls == [("searchTool", '{"query": "test"}')]


def test_vllm_llama3_extract_tool_calls_no_json_and_invalid_json():
    for text in ("This is just some text without any tool calls",
                 '{"name": "invalidTool", "parameters": {invalid json}'):
        p = parse_llama3_json(text)
        assert p.calls == [] and p.content == text


@pytest.mark.parametrize("sep", ["; ", " ; "])
def test_vllm_llama3_extract_tool_calls_multiple_json(sep):
    text = sep.join(['{"name": "searchTool", "parameters": {"query": "test1"}}',
                     '{"name": "getOpenIncidentsTool", "parameters": {}}',
                     '{"name": "searchTool", "parameters": {"query": "test2"}}'])
    for t in (text, "Here are the results: " + text + " Would you like to know more?"):
        p = parse_llama3_json(t)
        assert [n for n, _ in p.calls] == ["searchTool", "getOpenIncidentsTool", "searchTool"]
        assert json.loads(p.calls[2][1]) == {"query": "test2"} and p.calls[1][1] == "{}"


def test_vllm_llama3_extract_tool_calls_deeply_nested_and_quoted():
    p = parse_llama3_json('{"name": "complexTool", "parameters": {"level1": {"level2": {"level3": {"level4": '
                          '{"value": "deep"}}}}}}')
    assert json.loads(p.calls[0][1])["level1"]["level2"]["level3"]["level4"]["value"] == "deep"
    p = parse_llama3_json('{"name": "simpleTool", "parameters": {"value": "test"}}; {"name": "complexTool", '
                          '"parameters": {"config": {"database": {"connection": {"pool": {"size": 10}}}}}}')
    assert json.loads(p.calls[1][1])["config"]["database"]["connection"]["pool"]["size"] == 10
    p = parse_llama3_json('{"name": "searchTool", "parameters": {"query": "test {value} [complex]",'
                          '"nested": {"inner": "more {brackets}"}}}')
    assert json.loads(p.calls[0][1]) == {"query": "test {value} [complex]", "nested": {"inner": "more {brackets}"}}
    p = parse_llama3_json('{"name": "parserTool", "parameters": {"text": "He said \\"Hello {world}\\""}}')
    assert json.loads(p.calls[0][1]) == {"text": 'He said "Hello {world}"'}


def test_vllm_llama3_extract_tool_calls_missing_keys():
    for text in ('{"parameters": {}}', '{"name": "toolWithoutParams"}'):
        p = parse_llama3_json(text)
        assert p.calls == [] and p.content == text


def test_vllm_llama3_extract_tool_calls_brace_or_json_in_trailing_text():
    for tail in (" I used {searchTool} for this.", ' The arguments I passed were {"query": "test"}'):
        p = parse_llama3_json('{"name": "searchTool", "parameters": {"query": "test"}}' + tail)
        assert [n for n, _ in p.calls] == ["searchTool"]


@pytest.mark.parametrize("sep", ["; ", ";", ";\n", "\n"])
def test_vllm_llama3_streaming_parallel_separators(sep):
    text = '{"name": "searchTool", "parameters": {"query": "test1"}}' + sep + \
        '{"name": "getOpenIncidentsTool", "parameters": {}}'
    _, calls, deltas = _stream(text, "llama3_json", 7, parse_llama3_json)
    _assert_whole_calls(deltas)
    assert [n for n, _ in calls] == ["searchTool", "getOpenIncidentsTool"]
    assert json.loads(calls[0][1]) == {"query": "test1"} and calls == parse_llama3_json(text).calls
