"""Tool-calling VLM agents on the unsloth backend (issue 13), on the tiny Qwen2.5-VL, CPU, offline.

- ArealOpenAI (areal 1.0.4, no sglang / vllm) returns parsed tool_calls for Hermes/Qwen and Llama-3 JSON
  output, identical to what the project's server returns for the same model text;
- multi-turn VLM trajectories (an image in turn 1, a tool-returned image in turn 3) carry the engine's own
  pixel values; their logprobs match a teacher-forced forward over the whole conversation; the train
  engine's forward sees exactly those pixels (a hook on the vision tower);
- an agent written against ``openai.AsyncOpenAI(base_url=...)`` runs unchanged on the engine's in-process
  server, its interactions recorded the way AReaL's proxy records them; bad agents end their episode only.
"""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

pytest.importorskip("areal")
pytest.importorskip("fastapi")
pytestmark = pytest.mark.areal

from areal.api.cli_args import InferenceEngineConfig  # noqa: E402

from unsloth_rollout import EngineConfig, RolloutEngine, load_model  # noqa: E402
from unsloth_rollout.areal import install  # noqa: E402
from unsloth_rollout.areal.inference_engine import UnslothInferenceEngine  # noqa: E402

try:  # tests/ as a package or as a plain folder on sys.path
    from tests._areal_helpers import ForcedOutput, png_data_url, random_image  # noqa: E402
except ImportError:
    from _areal_helpers import ForcedOutput, png_data_url, random_image  # noqa: E402

TOOLS = [
    {"type": "function", "function": {"name": "count", "description": "Count the shapes of one color",
                                      "parameters": {"type": "object", "properties": {"color": {"type": "string"}},
                                                     "required": ["color"]}}},
    {"type": "function", "function": {"name": "zoom", "description": "Zoom into a region of the image",
                                      "parameters": {"type": "object", "properties": {
                                          "region": {"type": "string", "enum": ["top", "bottom", "left", "right"]}},
                                          "required": ["region"]}}},
]
HERMES_TEXT = ('Let me look.\n<tool_call>\n{"name": "count", "arguments": {"color": "red"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "zoom", "arguments": {"region": "top"}}\n</tool_call>')
THINK_HERMES_TEXT = '<think>red first</think><tool_call>\n{"name": "count", "arguments": {"color": "red"}}\n</tool_call>'
LLAMA_TEXT = '{"name": "count", "parameters": {"color": "blue"}}; {"name": "zoom", "parameters": {"region": "left"}}'


@pytest.fixture(scope="module")
def policy(qwen2_5_vl_dir):
    install()
    return load_model(qwen2_5_vl_dir, backend="transformers", lora={"r": 8, "random_state": 0})


@pytest.fixture(scope="module")
def rollout_engine(policy):
    eng = RolloutEngine(policy, EngineConfig(kv_cache_memory_bytes=32 << 20, max_model_len=1024), seed=0)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def engine(rollout_engine):
    e = UnslothInferenceEngine(InferenceEngineConfig(backend="unsloth:d1", consumer_batch_size=2),
                               rollout_engine=rollout_engine)
    e.initialize()
    yield e
    e.destroy()


def _calls(calls) -> list[tuple[str, dict]]:
    out = []
    for c in calls or []:
        fn = c["function"] if isinstance(c, dict) else c.function
        name, args = (fn["name"], fn["arguments"]) if isinstance(fn, dict) else (fn.name, fn.arguments)
        out.append((name, json.loads(args)))
    return out


def _server_message(rollout_engine, parser: str, messages, text: str) -> dict:
    from starlette.testclient import TestClient

    from unsloth_rollout.serve import create_app

    app = create_app(rollout_engine, served_model_name="tiny", tool_call_parser=parser)
    with TestClient(app) as client, ForcedOutput(rollout_engine, rollout_engine.tokenizer.encode(text)):
        r = client.post("/v1/chat/completions", json={"model": "tiny", "messages": messages, "tools": TOOLS,
                                                       "max_tokens": 128, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


# ============================================================================ 1. tool calls through ArealOpenAI
@pytest.mark.parametrize("areal_parser,server_parser,text,want", [
    ("qwen", "hermes", HERMES_TEXT, [("count", {"color": "red"}), ("zoom", {"region": "top"})]),
    ("hermes", "hermes", THINK_HERMES_TEXT, [("count", {"color": "red"})]),
    ("llama3_json", "llama3_json", LLAMA_TEXT, [("count", {"color": "blue"}), ("zoom", {"region": "left"})]),
])
def test_areal_openai_tool_calls_match_the_server(engine, rollout_engine, areal_parser, server_parser, text, want):
    from areal.experimental.openai import ArealOpenAI

    from unsloth_rollout.areal.openai_compat import external_parsers_installed

    assert not external_parsers_installed(), "this test is about an install without sglang / vllm"
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": png_data_url(1)}},
                                             {"type": "text", "text": "How many red shapes?"}]}]
    client = ArealOpenAI(engine=engine, tokenizer=rollout_engine.tokenizer, tool_call_parser=areal_parser)
    with ForcedOutput(rollout_engine, rollout_engine.tokenizer.encode(text)):
        comp = asyncio.run(client.chat.completions.create(messages=messages, tools=TOOLS, max_completion_tokens=128,
                                                          temperature=0))
    choice = comp.choices[0]
    assert _calls(choice.message.tool_calls) == want
    assert choice.finish_reason == "tool_calls"

    served = _server_message(rollout_engine, server_parser, messages, text)
    assert _calls(served["message"]["tool_calls"]) == want  # the same calls, same argument strings
    assert [c.function.arguments for c in choice.message.tool_calls] == \
        [c["function"]["arguments"] for c in served["message"]["tool_calls"]]
    assert (choice.message.content or None) == served["message"]["content"]
    assert served["finish_reason"] == "tool_calls"


def test_areal_openai_plain_and_malformed_text_has_no_tool_calls(engine, rollout_engine):
    from areal.experimental.openai import ArealOpenAI

    client = ArealOpenAI(engine=engine, tokenizer=rollout_engine.tokenizer, tool_call_parser="qwen")
    messages = [{"role": "user", "content": "hi"}]
    for text in ("just an answer: 3", '<tool_call>\n{"name": "count", "arguments": {broken\n</tool_call>'):
        with ForcedOutput(rollout_engine, rollout_engine.tokenizer.encode(text)):
            comp = asyncio.run(client.chat.completions.create(messages=messages, tools=TOOLS,
                                                              max_completion_tokens=64, temperature=0))
        assert comp.choices[0].message.tool_calls is None
        assert comp.choices[0].message.content == text and comp.choices[0].finish_reason == "stop"
        served = _server_message(rollout_engine, "hermes", messages, text)
        assert served["message"]["tool_calls"] == [] and served["message"]["content"] == text


def test_unknown_parser_name_is_a_clear_error(engine, rollout_engine):
    from areal.experimental.openai import ArealOpenAI

    client = ArealOpenAI(engine=engine, tokenizer=rollout_engine.tokenizer, tool_call_parser="qwen3_coder")
    with ForcedOutput(rollout_engine, rollout_engine.tokenizer.encode("x")):
        with pytest.raises(ValueError, match="tool_call_parser"):
            asyncio.run(client.chat.completions.create(messages=[{"role": "user", "content": "hi"}], tools=TOOLS,
                                                       max_completion_tokens=8, temperature=0))
