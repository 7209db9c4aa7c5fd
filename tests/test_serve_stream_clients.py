"""Streamed tool calls as the clients that rebuild a stream see them: the OpenAI Agents SDK's streamed runner
(``Runner.run_streamed`` over ``OpenAIChatCompletionsModel``) and litellm (``hosted_vllm/`` provider, then
``litellm.stream_chunk_builder``), each pointed at the server as its docs say to point it at a self-hosted
OpenAI-compatible endpoint (the real server, over HTTP, in this process).

Oracle: the server's non-streamed answer to the same request, same seed (for the Agents SDK: the body it sent,
captured, with ``stream`` off; for litellm: its own non-streamed call). The rebuilt stream must equal it (content,
tool calls, finish_reason) at every finish reason (stop, tool_calls, length, abort), and the agent must execute
exactly the calls it holds: never a tool the answer does not call, never with arguments it does not have or that
do not validate. Forced calls (``tool_choice`` "required" / named) are the model's own, written under the grammar,
over seeds and budgets around each call's end; auto calls are scripted (a random tiny model writes none on its
own: ``testing.scripted.ForcedOutput``), cut at many lengths and aborted at several points.
"""

from __future__ import annotations

import asyncio
import json
import os

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")
httpx = pytest.importorskip("httpx")
agents = pytest.importorskip("agents")  # openai-agents
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of the price list at import
litellm = pytest.importorskip("litellm")

from unsloth_rollout import EngineConfig, RolloutEngine, load_model  # noqa: E402
from unsloth_rollout.testing.scripted import ForcedOutput  # noqa: E402
from unsloth_rollout.testing.server import free_port  # noqa: E402

NAME = "policy"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}\n</tool_call>'
SCRIPTS = {  # what the model "writes" under tool_choice auto, and what the whole output is
    "content then a call": "Let me check." + CALL,  # tool_calls, content "Let me check."
    "a call, then a broken one": CALL + '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>',
    "no call": "Sunny in Rome, no tool needed.",
}

pytestmark = pytest.mark.filterwarnings("ignore:.*`ReadOnly` qualifier:UserWarning")  # litellm's own types
litellm.suppress_debug_info = True
agents.set_tracing_disabled(True)  # no trace export to OpenAI's servers


@pytest.fixture(scope="module")
def server(qwen2_dir):
    from unsloth_rollout.serve import create_app, serve_in_thread

    policy = load_model(qwen2_dir, backend="transformers")
    engine = RolloutEngine(policy, EngineConfig(kv_cache_memory_bytes=32 << 20, max_model_len=1024))
    srv = serve_in_thread(create_app(engine, served_model_name=NAME, owns_engine=True), port=free_port())
    yield f"http://127.0.0.1:{srv.config.port}", engine
    srv.should_exit = True
    srv.thread.join(timeout=60)


# ---------------------------------------------------------------------------------------------------- the clients
async def _agent_run(base: str, settings):
    """One streamed turn of an Agents SDK agent with one tool: (arguments of each tool execution, the request body
    the SDK sent, the run's final output; None when the SDK refused the turn)."""
    from openai import AsyncOpenAI

    executed, bodies = [], []

    async def get_weather(ctx, arguments: str) -> str:
        executed.append(arguments)
        return "sunny"

    async def capture(request):
        bodies.append(json.loads(request.content))

    tool = agents.FunctionTool(name="get_weather", description="Forecast", params_json_schema=WEATHER,
                               on_invoke_tool=get_weather)
    async with httpx.AsyncClient(event_hooks={"request": [capture]}, timeout=60) as http:
        client = AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, http_client=http)
        agent = agents.Agent(name="forecaster", tools=[tool], model_settings=settings,
                             model=agents.OpenAIChatCompletionsModel(model=NAME, openai_client=client),
                             tool_use_behavior="stop_on_first_tool")
        result = agents.Runner.run_streamed(agent, "Weather in Rome?", max_turns=1)
        try:
            async for _ in result.stream_events():
                pass
            final = result.final_output
        except agents.exceptions.ModelBehaviorError:  # the SDK's refusal of a turn cut before any visible output
            final = None
    (body,) = bodies
    return executed, body, final


def _answer(content, tool_calls, finish) -> tuple:
    """(content, [(name, arguments)], finish_reason) of an answer, None content read as ""."""
    return (content or "", [(c["function"]["name"], c["function"]["arguments"]) for c in tool_calls or []], finish)


def _non_streamed(base: str, body: dict) -> tuple:
    body = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    r = httpx.post(base + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    return _answer(c["message"]["content"], c["message"]["tool_calls"], c["finish_reason"])


def _litellm(base: str, body: dict, stream: bool) -> tuple:
    """litellm's answer to the request ``body`` holds: rebuilt from the stream by ``stream_chunk_builder``, or not
    streamed (litellm rewrites the tools, dropping ``strict`` and ``additionalProperties``: its own non-streamed
    call is its oracle)."""
    kw = {k: body[k] for k in ("messages", "tools", "tool_choice", "parallel_tool_calls", "max_tokens", "seed",
                               "temperature") if k in body}
    kw.update(model="hosted_vllm/" + NAME, api_base=base + "/v1", api_key="unused")
    if stream:
        resp = litellm.stream_chunk_builder(list(litellm.completion(stream=True, **kw)), messages=kw["messages"])
    else:
        resp = litellm.completion(**kw)
    c = resp.choices[0]
    calls = [{"function": {"name": t.function.name, "arguments": t.function.arguments}}
             for t in c.message.tool_calls or []]
    return _answer(c.message.content, calls, c.finish_reason)


def _check(base: str, settings, where) -> tuple:
    """Run the agent's streamed turn and litellm's stream for the same request; hold both to the non-streamed
    answer (the agent's: returned)."""
    executed, body, final = asyncio.run(_agent_run(base, settings))
    want = _non_streamed(base, body)
    content, calls, finish = want
    # The agent executed exactly the answer's calls, each with complete arguments valid for the tool's schema.
    assert executed == [args for _, args in calls], (where, want, executed)
    for args in executed:
        jsonschema.validate(json.loads(args), WEATHER)
    if calls:
        assert final == "sunny", (where, want, final)
    else:  # the answer is text: the agent's output is that text (the SDK refuses a turn with nothing visible)
        assert final == content or (final is None and content == "" and finish == "length"), (where, want, final)
    if finish == "abort":  # litellm reads a streamed "abort" as an upstream failure, for its router to retry
        with pytest.raises(litellm.exceptions.MidStreamFallbackError, match="aborted"):
            _litellm(base, body, stream=True)
    else:
        assert _litellm(base, body, stream=True) == _litellm(base, body, stream=False), where
    return want


def _settings(**kw):
    return agents.ModelSettings(temperature=1.0, **kw)


# ---------------------------------------------------------------------------------------------------- forced calls
def _forced(choice, seed: int) -> dict:
    return dict(tool_choice="get_weather" if isinstance(choice, dict) else choice, parallel_tool_calls=False,
                extra_args={"seed": seed})


def _whole_call_length(base: str, kw: dict) -> int:
    """How many tokens the model's whole forced call takes, EOS included (the request the agent sends, not cut)."""
    _, body, _ = asyncio.run(_agent_run(base, _settings(max_tokens=64, **kw)))
    r = httpx.post(base + "/v1/chat/completions", json={**body, "stream": False, "return_token_ids": True},
                   timeout=60).json()
    assert r["choices"][0]["message"]["tool_calls"], r  # the whole call fits in 64 tokens
    return len(r["choices"][0]["token_ids"])


@pytest.mark.parametrize("choice", ["required", NAMED])
@pytest.mark.parametrize("seed", [0, 1, 5])
def test_forced_call_streamed_equals_the_answer_at_every_budget(server, choice, seed):
    """The model writes the call under the grammar. Budgets: the whole call, one token short of it (the call is
    closed but its grammar not ended: "length", no call), half of it and one token: the agent executes the call
    only when the answer holds it, with its arguments; litellm rebuilds the answer."""
    base, _ = server
    kw = _forced(choice, seed)
    n = _whole_call_length(base, kw)
    finishes = set()
    for budget in (n, n - 1, n // 2, 1):
        finishes.add(_check(base, _settings(max_tokens=budget, **kw), (choice, seed, budget))[2])
    assert finishes == {"stop" if isinstance(choice, dict) else "tool_calls", "length"}


def test_forced_call_aborted_is_no_call(server):
    """A forced request aborted mid-call, or once the call is closed but before its grammar ended, answers
    finish_reason "abort" with the raw text as content: the agent executes nothing."""
    base, engine = server
    kw = _forced("required", 0)
    n = _whole_call_length(base, kw)
    for at in (n // 2, n - 1):
        with ForcedOutput(engine, None, abort_at=at):
            content, calls, finish = _check(base, _settings(max_tokens=64, **kw), at)
        assert finish == "abort" and not calls and content.startswith("<tool_call>")
    assert content.endswith("</tool_call>")  # the last abort came right after the call closed


# ---------------------------------------------------------------------------------------------------- auto calls
def _cuts(ids: list[int], tags: set[int]) -> list[int]:
    """Output lengths to cut a script at: its start, just before and just after each tool-call tag, a few inside,
    its end (len + 1: the whole script and EOS)."""
    n = len(ids)
    around = {i + d for i, t in enumerate(ids) if t in tags for d in (0, 1)}
    return sorted(k for k in {1, n // 3, n // 2, n - 1, n, n + 1} | around if 1 <= k <= n + 1)


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_auto_call_streamed_equals_the_answer_wherever_the_output_ends(server, script):
    """Scripted outputs under tool_choice auto, cut by max_tokens at many lengths (and whole, ended by EOS): a call
    streams only as the answer holds it. The second script's first call closes and parses, yet the broken call
    after it makes the whole output content (vLLM's Hermes rule), so even a closed call must not go out early."""
    base, engine = server
    tok = engine.tokenizer
    ids = tok.encode(SCRIPTS[script], add_special_tokens=False)
    tags = set(tok.convert_tokens_to_ids(["<tool_call>", "</tool_call>"]))
    finishes = set()
    with ForcedOutput(engine, ids):
        for budget in _cuts(ids, tags):
            finishes.add(_check(base, _settings(max_tokens=budget), (script, budget))[2])
    whole = {"content then a call": "tool_calls", "a call, then a broken one": "stop", "no call": "stop"}[script]
    assert finishes == {whole, "length"}


@pytest.mark.parametrize("script", ["content then a call", "a call, then a broken one"])
def test_auto_call_aborted_streamed_equals_the_answer(server, script):
    """The same scripts aborted before the call, inside it, and right after its closing tag (a closed call that
    parses is a call of the aborted answer; litellm refuses a stream that ends in "abort")."""
    base, engine = server
    tok = engine.tokenizer
    ids = tok.encode(SCRIPTS[script], add_special_tokens=False)
    close = ids.index(tok.convert_tokens_to_ids("</tool_call>")) + 1
    for at in (2, close - 3, close):
        with ForcedOutput(engine, ids, abort_at=at):
            assert _check(base, _settings(max_tokens=96), (script, at))[2] == "abort", (script, at)
