"""create_app() in-process: a training process serving its live policy; API key and body limits; the CLI.

Oracle: Hugging Face ``generate`` (greedy) on the same model object, before and after a weight update.
"""

import subprocess
import sys

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

import torch  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from unsloth_rollout import EngineConfig, InvalidRequestError, RolloutEngine, load_model  # noqa: E402
from unsloth_rollout.testing.tiny import build_tiny_model  # noqa: E402

KEY = "s3cret"


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    path = build_tiny_model("qwen2", "tiny", out=tmp_path_factory.mktemp("m") / "qwen2")
    return load_model(str(path), backend="transformers")


@pytest.fixture(scope="module")
def app_client(policy):
    from unsloth_rollout.serve import create_app

    engine = RolloutEngine(policy, EngineConfig(kv_cache_memory_bytes=16 << 20, max_model_len=256))
    app = create_app(engine, served_model_name="policy", api_key=KEY, max_body_bytes=4096, owns_engine=True)
    with TestClient(app) as c:
        yield c, engine


def _auth(key=KEY):
    return {"Authorization": f"Bearer {key}"}


def _hf_greedy(policy, ids, n):
    with torch.inference_mode():
        out = policy.model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                                    attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    return out[0, len(ids):].tolist()


def test_api_key(app_client):
    c, _ = app_client
    assert c.get("/health").status_code == 200  # liveness needs no key
    for headers in ({}, _auth("wrong"), {"Authorization": "Basic " + KEY}):
        r = c.get("/v1/models", headers=headers)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == 401 and r.json()["error"]["type"] == "AuthenticationError"
        assert c.post("/pause", headers=headers).status_code == 401  # the control plane too
    assert c.get("/v1/models", headers=_auth()).json()["data"][0]["id"] == "policy"


def test_serves_the_live_policy(app_client, policy):
    """Greedy tokens equal HF generate on the same model object, before and after an in-place weight update."""
    c, engine = app_client
    messages = [{"role": "user", "content": "hello there"}]
    body = {"model": "policy", "messages": messages, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    r = c.post("/v1/chat/completions", json=body, headers=_auth()).json()
    prompt = r["prompt_token_ids"]
    assert prompt == policy.tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    before = r["choices"][0]["token_ids"]
    assert before == _hf_greedy(policy, prompt, 6)

    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # "an optimizer step" on the shared weights
        w = policy.model.get_output_embeddings().weight
        w.add_(torch.randn(w.shape, generator=gen) * 0.5)
    assert c.post("/reset_prefix_cache", headers=_auth()).status_code == 200
    assert c.post("/update_weight_version", json={"version": 1}, headers=_auth()).json()["weight_version"] == 1
    after = c.post("/v1/chat/completions", json=body, headers=_auth()).json()["choices"][0]["token_ids"]
    assert after == _hf_greedy(policy, prompt, 6)
    assert after != before
    assert engine.version == 1


def test_body_limit_and_text_model_limits(app_client):
    c, _ = app_client
    big = {"model": "policy", "prompt": "x" * 5000, "max_tokens": 1}
    r = c.post("/v1/completions", json=big, headers=_auth())
    assert r.status_code == 413 and "exceeds" in r.json()["error"]["message"]
    img = {"model": "policy", "max_tokens": 1, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}]}
    r = c.post("/v1/chat/completions", json=img, headers=_auth())
    assert r.status_code == 400 and "takes no images" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "messages[0].content[0].image_url"
    assert c.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 1}, headers=_auth()).status_code == 200


def test_importing_the_package_does_not_import_fastapi():
    code = ("import sys, unsloth_rollout, unsloth_rollout.serve, unsloth_rollout.cli; "
            "assert 'fastapi' not in sys.modules and 'uvicorn' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_cli_parses_vllm_style_arguments():
    from unsloth_rollout.cli import build_parser
    from unsloth_rollout.serve.cli import _parse_loras

    args = build_parser().parse_args(["serve", "/m", "--lora", "a=/p/a", "b=/p/b", "--port", "9001", "--api-key",
                                      "k", "--served-model-name", "pol", "--allow-remote-images",
                                      "--max-model-len", "1024", "--model-backend", "transformers", "--load-in-4bit"])
    assert args.model == "/m" and args.port == 9001 and args.api_key == "k" and args.served_model_name == ["pol"]
    assert args.allow_remote_images and args.load_in_4bit and args.max_model_len == 1024
    assert _parse_loras(args.lora) == [("a", "/p/a"), ("b", "/p/b")]
    with pytest.raises(SystemExit):
        _parse_loras(["no-equals-sign"])


def test_cli_example_in_the_serve_docstring_parses():
    """The command ``unsloth_rollout.serve.cli``'s docstring shows parses with the real parser (every flag exists)."""
    import shlex

    import unsloth_rollout.serve.cli as serve_cli
    from unsloth_rollout.cli import build_parser

    example = serve_cli.__doc__.split("Example::", 1)[1].strip().split("\n\n")[0].replace("\\\n", " ")
    argv = shlex.split(example)
    assert argv[:2] == ["unsloth-rollout", "serve"], argv
    args = build_parser().parse_args(argv[1:])
    assert args.model == "./qwen2.5-vl-3b" and args.model_backend == "auto" and args.max_model_len == 8192
    assert args.lora == ["policy=./ckpt/lora-v3"] and args.port == 8000


def test_cli_sizes_the_image_processor_cache_as_vllm_does():
    from unsloth_rollout.cli import build_parser
    from unsloth_rollout.serve.cli import engine_config

    def config(*flags):
        return engine_config(build_parser().parse_args(["serve", "/m", *flags]))

    assert config().mm_processor_cache_bytes == EngineConfig().mm_processor_cache_bytes == 256 << 20
    assert config("--mm-processor-cache-bytes", "1GiB").mm_processor_cache_bytes == 1 << 30
    assert config("--mm-processor-cache-gb", "0.5").mm_processor_cache_bytes == 1 << 29  # vLLM's flag, in GiB
    assert config("--mm-processor-cache-gb", "0").mm_processor_cache_bytes == 0
    with pytest.raises(InvalidRequestError, match="mm_processor_cache_bytes"):
        config("--mm-processor-cache-gb", "-1")


def test_serve_in_thread_with_the_openai_client(policy):
    """A training process serving its live policy over real HTTP from a thread."""
    import socket

    import openai

    from unsloth_rollout.serve import create_app, serve_in_thread

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    engine = RolloutEngine(policy, EngineConfig(kv_cache_memory_bytes=16 << 20, max_model_len=256))
    server = serve_in_thread(create_app(engine, served_model_name="live"), port=port)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        resp = client.completions.create(model="live", prompt=[3, 4, 5], max_tokens=5, temperature=0,
                                         extra_body={"ignore_eos": True, "return_token_ids": True})
        assert resp.choices[0].token_ids == _hf_greedy(policy, [3, 4, 5], 5)
    finally:
        server.should_exit = True
        server.thread.join(10)
        engine.shutdown()
