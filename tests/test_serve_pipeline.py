"""The server's pipeline: one chat-to-tokens route, one sampling rule for every front end, settings declared once.

Oracles: the tokenizer's own ``apply_chat_template`` (tokens), the dataclasses' own defaults (flags), and each
front end's documented spelling of "top-k off" (vLLM 0 / -1, transformers 0, AReaL 1e8).
"""

import argparse
import dataclasses
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from starlette.testclient import TestClient  # noqa: E402

from unsloth_rollout import EngineConfig, RolloutEngine, load_model  # noqa: E402
from unsloth_rollout.testing.tiny import build_tiny_model  # noqa: E402

MAX_MODEL_LEN = 128
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the lazy dog"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from unsloth_rollout.serve import create_app

    path = build_tiny_model("qwen2", "tiny", out=tmp_path_factory.mktemp("m") / "qwen2")
    policy = load_model(str(path), backend="transformers")
    engine = RolloutEngine(policy, EngineConfig(kv_cache_memory_bytes=8 << 20, max_model_len=MAX_MODEL_LEN))
    with TestClient(create_app(engine, served_model_name="m", owns_engine=True)) as client:
        yield client, engine


def test_tokenize_gives_the_tokens_chat_runs(served):
    """/tokenize on messages answers the template's tokens, and exactly those a chat completion reports running."""
    client, engine = served
    tok = engine.tokenizer
    for extra, messages in (({}, MESSAGES),
                            ({"continue_final_message": True}, MESSAGES + [{"role": "assistant", "content": "it"}])):
        want = tok.apply_chat_template(messages, tokenize=True, return_dict=False,
                                       add_generation_prompt=not extra, **extra)
        body = client.post("/tokenize", json={"messages": messages, **extra}).json()
        chat = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1,
                                                         "return_token_ids": True, **extra}).json()
        assert body["tokens"] == list(want) == chat["prompt_token_ids"]
        assert body["count"] == len(want) and body["max_model_len"] == MAX_MODEL_LEN
        # The completion's budget is the room the prompt leaves: max_tokens unset runs to max_model_len.
        full = client.post("/v1/chat/completions", json={"messages": messages, "ignore_eos": True, **extra}).json()
        assert full["usage"] == {"prompt_tokens": len(want), "completion_tokens": MAX_MODEL_LEN - len(want),
                                 "total_tokens": MAX_MODEL_LEN, "prompt_tokens_details": None}


def test_tokenize_refuses_what_chat_refuses(served):
    client, _ = served
    both = {"messages": MESSAGES, "continue_final_message": True, "add_generation_prompt": True}
    for path in ("/tokenize", "/v1/chat/completions"):
        r = client.post(path, json=both)
        assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message", r.json()
        r = client.post(path, json={"messages": MESSAGES, "chat_template_kwargs": {"tokenize": True}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs", r.json()


def test_every_front_end_reads_top_k_off_the_same_way(served):
    """Server, AReaL and TRL options all reach the engine's one rule (engine.options.top_k_or_off)."""
    from areal.api.cli_args import GenerationHyperparameters

    from unsloth_rollout.areal.inference_engine import UnslothInferenceEngine
    from unsloth_rollout.serve.prepare import _sampling
    from unsloth_rollout.serve.protocol import CompletionRequest
    from unsloth_rollout.trl.rollout import sampling_params_from_trainer

    client, engine = served
    state = client.app.state.server
    width = engine.policy.text_config.vocab_size

    def serve(k):
        return _sampling(state, CompletionRequest(prompt=[1], top_k=k), 4, None, "logprobs").top_k

    def areal(k):
        return UnslothInferenceEngine._sampling(SimpleNamespace(rollout_engine=engine),
                                                GenerationHyperparameters(top_k=k, max_new_tokens=4), 4).top_k

    def trl(k):
        trainer = SimpleNamespace(max_completion_length=4, temperature=1.0, top_k=k,
                                  args=SimpleNamespace(generation_kwargs=None))
        return sampling_params_from_trainer(trainer, n=1).top_k

    assert [serve(k) for k in (0, -1, 5, width)] == [-1, -1, 5, -1]
    assert [areal(k) for k in (0, -1, 5, int(1e8))] == [-1, -1, 5, -1]
    assert [trl(k) for k in (None, 0, -1, 5)] == [-1, -1, -1, 5]


def test_cli_flags_take_their_defaults_from_the_settings_dataclasses(monkeypatch):
    from unsloth_rollout.serve.cli import ENGINE_FLAGS, add_serve_arguments
    from unsloth_rollout.serve.settings import ServerSettings

    monkeypatch.delenv("UNSLOTH_ROLLOUT_API_KEY", raising=False)
    args = add_serve_arguments(argparse.ArgumentParser()).parse_args(["m"])
    server = [f for f in dataclasses.fields(ServerSettings) if f.metadata.get("cli", True)]
    assert len(server) >= 12
    for f in server:
        assert getattr(args, f.name) == f.default, f.name
    for f in dataclasses.fields(EngineConfig):
        if f.name in ENGINE_FLAGS:
            assert getattr(args, f.name) == f.default, f.name
    assert ServerSettings(**{f.name: getattr(args, f.name) for f in server}).max_n == ServerSettings().max_n
    with pytest.raises(ValueError, match="logprobs_mode"):
        ServerSettings(logprobs_mode="nope")


# docs/server.md's layout, top to bottom: each module may import only modules after it here.
LAYERS = ["cli", "app", "guard", "errors", "routes_openai", "routes_info", "routes_control", "routes_weights",
          "weight_transfer", "completions", "streaming", "render", "prepare", "prompt", "scoring", "structured",
          "weights", "state", "metrics", "media", "settings", "tool_stream", "tools", "protocol"]


def test_serve_modules_import_one_way():
    import pathlib
    import re

    import unsloth_rollout.serve as serve

    root = pathlib.Path(serve.__file__).parent
    modules = [p.stem for p in root.glob("*.py") if p.stem in LAYERS]
    assert len(modules) == len(LAYERS)
    for name in modules:
        src = (root / f"{name}.py").read_text()
        deps = set(re.findall(r"^\s*from \.(\w+) import", src, re.M)) | set(re.findall(r"^\s*from \. import (\w+)",
                                                                                      src, re.M))
        upward = [d for d in deps if d in LAYERS and LAYERS.index(d) <= LAYERS.index(name)]
        assert not upward, f"serve/{name}.py imports {upward}, above it in the layout"
