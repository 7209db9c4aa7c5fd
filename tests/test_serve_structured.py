"""The server's structured outputs: response_format, structured_outputs and tool_choice required / named.

A random tiny model, which on its own writes no JSON and no tool calls, driven by the official ``openai`` client
over the in-process app. Oracles: ``jsonschema`` (every finished response and every call's arguments validate
against the schema the request gave), the Hermes parser applied to the completion tokens, and the non-streamed
response of the same seeded request (a streamed call equals it).
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("llguidance")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from starlette.testclient import TestClient  # noqa: E402

from unsloth_rollout import EngineConfig, RolloutEngine, load_model  # noqa: E402

NAME = "policy"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "now", "description": "The time"}}]
NOW = {"type": "object", "properties": {}, "additionalProperties": False}
SCHEMA_OF = {"get_weather": WEATHER, "now": NOW}
MSGS = [{"role": "user", "content": "Weather in Rome?"}]


@pytest.fixture(scope="module")
def setup(qwen2_dir):
    from unsloth_rollout.serve import create_app

    policy = load_model(qwen2_dir, backend="transformers")
    engine = RolloutEngine(policy, EngineConfig(kv_cache_memory_bytes=32 << 20, max_model_len=1024))
    app = create_app(engine, served_model_name=NAME, owns_engine=True)
    with TestClient(app) as tc:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=tc, max_retries=0), policy


def test_json_schema_and_json_object_responses_validate(setup):
    client, _ = setup
    free = client.chat.completions.create(model=NAME, messages=MSGS, max_tokens=24, n=8, seed=0)
    assert not any(_is_json(c.message.content) for c in free.choices)  # garbage without the grammar
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER, "strict": True}}
    done = 0
    for seed in range(4):
        resp = client.chat.completions.create(model=NAME, messages=MSGS, response_format=fmt, max_tokens=48, n=8,
                                              seed=seed, temperature=1.0)
        for c in resp.choices:
            assert c.finish_reason in ("stop", "length")
            if c.finish_reason == "stop":
                jsonschema.validate(json.loads(c.message.content), WEATHER)
                done += 1
    assert done >= 28
    resp = client.chat.completions.create(model=NAME, messages=MSGS, response_format={"type": "json_object"},
                                          max_tokens=64, n=8, seed=1)
    assert all(isinstance(json.loads(c.message.content), dict) for c in resp.choices if c.finish_reason == "stop")
    # vLLM's own field, on text completions too
    resp = client.completions.create(model=NAME, prompt="Pick:", max_tokens=8, n=6, seed=2,
                                     extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}})
    assert all(c.text in ("red", "green", "blue") and c.finish_reason == "stop" for c in resp.choices)


def _is_json(text) -> bool:
    try:
        json.loads(text)
        return True
    except (TypeError, ValueError):
        return False


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_required_and_named_tool_choice_always_give_schema_valid_calls(setup, choice):
    client, policy = setup
    calls = 0
    for seed in range(4):
        resp = client.chat.completions.create(model=NAME, messages=MSGS, tools=TOOLS, tool_choice=choice,
                                              max_tokens=96, n=8, seed=seed, temperature=1.0,
                                              extra_body={"return_token_ids": True})
        for c in resp.choices:
            # OpenAI's (and vLLM's) finish_reason: "tool_calls", but "stop" when the function was named
            assert c.finish_reason in ("stop" if isinstance(choice, dict) else "tool_calls", "length")
            if c.finish_reason == "length":
                assert not c.message.tool_calls
                continue
            assert c.message.tool_calls and c.message.content is None
            for tc in c.message.tool_calls:
                assert tc.type == "function" and tc.id.startswith("chatcmpl-tool-")
                if isinstance(choice, dict):
                    assert tc.function.name == "get_weather"
                jsonschema.validate(json.loads(tc.function.arguments), SCHEMA_OF[tc.function.name])
                calls += 1
            # The model wrote the call itself, in its template's format: the completion tokens hold all of it.
            text = policy.tokenizer.decode(c.token_ids, skip_special_tokens=True)
            assert text.startswith('<tool_call>\n{"name": ') and text.endswith("</tool_call>")
    assert calls >= 24
    # The prompt ends where the template's generation prompt does: nothing forced into it.
    assert policy.tokenizer.decode(resp.prompt_token_ids).endswith("<|im_start|>assistant\n")


def test_named_tool_choice_out_of_tokens_is_length_without_a_call(setup):
    client, _ = setup
    choice = {"type": "function", "function": {"name": "get_weather"}}
    for max_tokens in (1, 6):
        resp = client.chat.completions.create(model=NAME, messages=MSGS, tools=TOOLS, tool_choice=choice,
                                              max_completion_tokens=max_tokens, seed=0)
        c = resp.choices[0]
        assert c.finish_reason == "length" and not c.message.tool_calls


def test_streamed_tool_call_arrives_whole_with_the_finish_reason(setup):
    """A streamed call is one delta (index, id, type, name and its complete arguments) in the chunk that carries
    the finish_reason, equal to the non-streamed call; no chunk before it names a call (docs/server.md)."""
    client, _ = setup
    kw = dict(model=NAME, messages=MSGS, tools=TOOLS, tool_choice="required", max_tokens=96, seed=3,
              temperature=1.0, parallel_tool_calls=False)
    whole = client.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "tool_calls" and len(whole.message.tool_calls) == 1
    chunks = [ch for ch in client.chat.completions.create(stream=True, **kw) if ch.choices]
    with_calls = [ch for ch in chunks if ch.choices[0].delta.tool_calls]
    assert len(with_calls) == 1 and with_calls[0] is chunks[-1]
    (d,) = with_calls[0].choices[0].delta.tool_calls
    w = whole.message.tool_calls[0]
    assert d.index == 0 and d.id.startswith("chatcmpl-tool-") and d.type == "function"
    assert (d.function.name, d.function.arguments) == (w.function.name, w.function.arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == ""


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "nonsense"}}}}}}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"response_format": {"type": "json_object"}, "tools": TOOLS, "tool_choice": "required"}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "nonsense"}}}}}], "tool_choice": "required"}, "tools"),
])
def test_bad_structured_requests_get_400_naming_the_field(setup, body, param):
    client, _ = setup
    known = {k: v for k, v in body.items() if k != "structured_outputs"}
    extra = {k: v for k, v in body.items() if k == "structured_outputs"}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, messages=MSGS, max_tokens=4, extra_body=extra, **known)
    assert e.value.body["param"] == param
    assert client.chat.completions.create(model=NAME, messages=MSGS, max_tokens=2).choices  # still serving
