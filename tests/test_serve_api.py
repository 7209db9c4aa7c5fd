"""The real server (``python -m unsloth_rollout.serve``) in a subprocess, driven by the official ``openai``
client, raw HTTP and TRL's request shapes (AReaL's remote engine against it: test_serve_areal.py).

Oracles: an in-process RolloutEngine on the same model folder (token ids equal, logprobs close), the
Hugging Face tokenizer's chat template (prompt tokens), and a teacher-forced PEFT forward (LoRA outputs).
One server and one in-process engine per module: the model loads once each.
"""

import base64
import json
import threading

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

import torch  # noqa: E402

from unsloth_rollout import GenerationRequest, SamplingParams  # noqa: E402
from unsloth_rollout.testing.adapters import save_peft_adapter  # noqa: E402
from unsloth_rollout.testing.fixtures import engine_fixture, policy_fixture  # noqa: E402
from unsloth_rollout.testing.oracles import hf_logprobs  # noqa: E402
from unsloth_rollout.testing.server import metrics, openai_client, serve_subprocess  # noqa: E402
from unsloth_rollout.testing.tiny import build_tiny_model  # noqa: E402
from unsloth_rollout.testing.toy import png_data_url, seeded_image  # noqa: E402
from unsloth_rollout.testing.waits import wait_for  # noqa: E402

MAX_MODEL_LEN = 512
NAME = "tiny-vlm"
LP_TOL = 2e-4
IMAGE_SIZE = (84, 56)  # (width, height) of the test images


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("serve")


@pytest.fixture(scope="module")
def model_dir(workdir):
    return str(build_tiny_model("qwen2_5_vl", "tiny", out=workdir / "model"))


@pytest.fixture(scope="module")
def media_dir(workdir):
    d = workdir / "media"
    d.mkdir()
    seeded_image(7, IMAGE_SIZE).save(d / "cat.png")
    return d


@pytest.fixture(scope="module")
def server(model_dir, media_dir, workdir):
    with serve_subprocess(model_dir, "--max-model-len", str(MAX_MODEL_LEN), "--served-model-name", NAME,
                          "--max-images-per-request", "2", "--max-n", "8", "--max-image-pixels", "10000",
                          "--allowed-local-media-path", str(media_dir), "--kv-cache-memory-bytes", "64MiB",
                          "--enable-runtime-lora", log_path=workdir / "server.log") as base:
        yield base


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


policy = policy_fixture()
engine = engine_fixture(MAX_MODEL_LEN)


def _one(engine, **kw) -> list:
    sampling = kw.pop("sampling")
    return engine.generate([GenerationRequest(sampling=SamplingParams(**sampling), **kw)])


# ====================================================================== discovery
def test_health_and_models(server, client):
    assert httpx.get(server + "/health").status_code == 200
    models = client.models.list().data
    assert models[0].id == NAME
    # TRL's async GRPO reads data[0]["max_model_len"].
    assert httpx.get(server + "/v1/models").json()["data"][0]["max_model_len"] == MAX_MODEL_LEN


def test_tokenize_detokenize(server, policy):
    tok = policy.tokenizer
    r = httpx.post(server + "/tokenize", json={"model": NAME, "prompt": "hello world"}).json()
    assert r["tokens"] == tok.encode("hello world") and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == MAX_MODEL_LEN
    msgs = [{"role": "user", "content": "hi"}]
    r = httpx.post(server + "/tokenize", json={"messages": msgs}).json()
    assert r["tokens"] == tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)["input_ids"]
    r = httpx.post(server + "/detokenize", json={"tokens": [100, 200, 300]}).json()
    assert r["prompt"] == tok.decode([100, 200, 300])


# ====================================================================== chat
def test_chat_with_image_matches_engine(client, engine):
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": png_data_url(seeded_image(1, IMAGE_SIZE))}},
                                             {"type": "text", "text": "What is in the picture?"}]}]
    resp = client.chat.completions.create(model=NAME, messages=messages, max_tokens=8, temperature=0,
                                          extra_body={"return_token_ids": True})
    (want,) = _one(engine, messages=messages, sampling=dict(max_new_tokens=8, temperature=0))
    assert resp.prompt_token_ids == want.prompt_ids  # image pads expanded as the engine does
    assert resp.choices[0].token_ids == want.output_ids
    assert resp.choices[0].message.content == want.text
    assert resp.usage.prompt_tokens == len(want.prompt_ids)
    assert resp.usage.completion_tokens == len(want.output_ids)


def test_chat_local_image_file(client, media_dir, engine):
    from PIL import Image

    messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": f"file://{media_dir / 'cat.png'}"}},
        {"type": "text", "text": "Describe."}]}]
    resp = client.chat.completions.create(model=NAME, messages=messages, max_tokens=4, temperature=0,
                                          extra_body={"return_token_ids": True})
    img = Image.open(media_dir / "cat.png").convert("RGB")
    (want,) = _one(engine, messages=[{"role": "user", "content": [{"type": "image"}, {"type": "text",
                                                                                    "text": "Describe."}]}],
                   images=[img], sampling=dict(max_new_tokens=4, temperature=0))
    assert resp.choices[0].token_ids == want.output_ids


def test_chat_n4_logprobs_match_engine(client, engine, policy):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count to three."}]
    resp = client.chat.completions.create(model=NAME, messages=messages, n=4, temperature=1.0, seed=1234,
                                          max_tokens=6, logprobs=True, top_logprobs=3,
                                          extra_body={"return_token_ids": True})
    want = _one(engine, messages=messages, sampling=dict(n=4, temperature=1.0, seed=1234, max_new_tokens=6,
                                                         logprobs=3))
    assert len(resp.choices) == 4
    assert len({tuple(c.token_ids) for c in resp.choices}) > 1  # four different samples
    tok = policy.tokenizer
    for choice in resp.choices:
        w = want[choice.index]
        assert choice.token_ids == w.output_ids
        content = choice.logprobs.content
        assert [c.token for c in content] == [tok.decode([t]) for t in w.output_ids]
        for c, lp, top in zip(content, w.output_logprobs, w.top_logprobs):
            assert c.logprob == pytest.approx(lp, abs=LP_TOL)
            assert len(c.top_logprobs) == 3
            best = sorted(top.items(), key=lambda kv: -kv[1])
            assert [t.token for t in c.top_logprobs] == [tok.decode([i]) for i, _ in best]
            assert [t.logprob for t in c.top_logprobs] == pytest.approx([v for _, v in best], abs=LP_TOL)
    assert resp.usage.completion_tokens == sum(len(w.output_ids) for w in want)


def test_chat_stream_with_usage(server, client, engine):
    messages = [{"role": "user", "content": "Tell me a story."}]
    stream = client.chat.completions.create(model=NAME, messages=messages, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    (want,) = _one(engine, messages=messages, sampling=dict(max_new_tokens=12, temperature=0))
    assert text == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == want.finish_reason
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == len(want.output_ids)
    assert chunks[-1].usage.prompt_tokens == len(want.prompt_ids)
    # Raw SSE: token ids per chunk and the closing [DONE].
    body = {"model": NAME, "messages": messages, "max_tokens": 12, "temperature": 0, "stream": True,
            "return_token_ids": True}
    with httpx.stream("POST", server + "/v1/chat/completions", json=body, timeout=60) as r:
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(ln[6:]) for ln in lines[:-1]]
    assert events[0]["prompt_token_ids"] == want.prompt_ids
    assert sum((e["choices"][0].get("token_ids") or [] for e in events[1:]), []) == want.output_ids


def test_stream_never_sends_text_cut_by_a_stop_string(server, client, engine):
    messages = [{"role": "user", "content": "Write a long line."}]
    (full,) = _one(engine, messages=messages, sampling=dict(max_new_tokens=24, temperature=0))
    mid = len(full.text) // 2
    stop = full.text[mid:mid + 4]
    (want,) = _one(engine, messages=messages, sampling=dict(max_new_tokens=24, temperature=0, stop=[stop]))
    assert want.stop_reason == stop and len(want.text) < len(full.text)
    chunks = list(client.chat.completions.create(model=NAME, messages=messages, max_tokens=24, temperature=0,
                                                 stop=[stop], stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert chunks[-1].choices[0].finish_reason == "stop"
    # Text completions stream the same way.
    events = list(client.completions.create(model=NAME, prompt=want.prompt_ids, max_tokens=24, temperature=0,
                                            stop=[stop], stream=True))
    assert "".join(e.choices[0].text for e in events if e.choices) == want.text


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def test_tool_call_round_trip(client, engine, policy):
    """Assistant tool_calls + tool result -> final answer: prompt rendered by the model's own template."""
    call_args = {"city": "Paris"}
    messages = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": json.dumps(call_args)}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "22 C and sunny"},
    ]
    resp = client.chat.completions.create(model=NAME, messages=messages, tools=TOOLS, max_tokens=8, temperature=0,
                                          extra_body={"return_token_ids": True})
    # Oracle prompt: the tokenizer's chat template, with the arguments as an object (as HF templates expect).
    hf_messages = [dict(m) for m in messages]
    hf_messages[1] = {**messages[1], "tool_calls": [{**messages[1]["tool_calls"][0], "function": {
        "name": "get_weather", "arguments": call_args}}]}
    tok = policy.tokenizer
    text = tok.apply_chat_template(hf_messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\n22 C and sunny\n</tool_response>" in text
    assert resp.prompt_token_ids == tok.encode(text, add_special_tokens=False)
    (want,) = _one(engine, messages=hf_messages, tools=TOOLS, sampling=dict(max_new_tokens=8, temperature=0))
    assert resp.choices[0].token_ids == want.output_ids


def test_named_tool_choice_yields_the_call(client, policy):
    """The model writes the whole call under a grammar (the prompt ends at the generation prompt); its arguments
    are JSON for the function's schema; streamed, the same call arrives whole."""
    messages = [{"role": "user", "content": "Weather in Rome?"}]
    choice = {"type": "function", "function": {"name": "get_weather"}}
    tools = json.loads(json.dumps(TOOLS))
    tools[0]["function"]["parameters"]["properties"]["city"]["maxLength"] = 8  # a greedy random model never stops
    kw = dict(model=NAME, messages=messages, tools=tools, tool_choice=choice, max_tokens=48, temperature=0)
    resp = client.chat.completions.create(extra_body={"return_token_ids": True}, **kw)
    calls = resp.choices[0].message.tool_calls
    assert resp.choices[0].finish_reason == "stop"  # OpenAI's and vLLM's for a named function
    assert calls and calls[0].function.name == "get_weather" and calls[0].type == "function"
    assert isinstance(json.loads(calls[0].function.arguments)["city"], str)
    assert policy.tokenizer.decode(resp.prompt_token_ids).endswith("<|im_start|>assistant\n")
    # Streaming delivers the same call in one tool_calls delta (name and complete arguments), never as content.
    chunks = list(client.chat.completions.create(stream=True, **kw))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    streamed = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert [(tc.function.name, tc.function.arguments) for tc in streamed] == [("get_weather",
                                                                               calls[0].function.arguments)]
    assert "".join(d.content or "" for d in deltas) == ""


# ====================================================================== completions
def test_completions_token_ids(client, engine):
    prompts = [[11, 22, 33, 44], [55, 66, 77]]
    resp = client.completions.create(model=NAME, prompt=prompts, max_tokens=6, temperature=0, logprobs=0,
                                     extra_body={"return_token_ids": True, "return_tokens_as_token_ids": True})
    want = engine.generate([GenerationRequest(input_ids=p, sampling=SamplingParams(max_new_tokens=6, temperature=0))
                            for p in prompts])
    assert [c.index for c in resp.choices] == [0, 1]
    for c, w, p in zip(resp.choices, want, prompts):
        assert c.prompt_token_ids == p
        assert c.token_ids == w.output_ids
        assert c.logprobs.tokens == [f"token_id:{t}" for t in w.output_ids]
        assert c.logprobs.token_logprobs == pytest.approx(w.output_logprobs, abs=LP_TOL)
        # logprobs=0: only the chosen token's logprob per position (vLLM semantics)
        assert [list(d) for d in c.logprobs.top_logprobs] == [[f"token_id:{t}"] for t in w.output_ids]
    assert resp.usage.prompt_tokens == 7


def test_completions_text_prompt_seeded_n2(client, engine, policy):
    resp = client.completions.create(model=NAME, prompt="Once upon a time", max_tokens=5, n=2, seed=99,
                                     temperature=0.8, top_p=0.9, extra_body={"top_k": 20, "return_token_ids": True})
    ids = policy.tokenizer.encode("Once upon a time")
    want = _one(engine, input_ids=ids, sampling=dict(max_new_tokens=5, n=2, seed=99, temperature=0.8, top_p=0.9,
                                                     top_k=20))
    assert [c.token_ids for c in resp.choices] == [w.output_ids for w in want]
    assert [c.text for c in resp.choices] == [w.text for w in want]


def test_trl_async_grpo_request_shape(server, engine):
    """TRL's rollout worker: token-id prompt, return_token_ids, logprobs=0; then pause keep / resume."""
    body = {"model": NAME, "prompt": [5, 6, 7, 8], "max_tokens": 5, "temperature": 1.0, "seed": 3, "n": 1,
            "logprobs": 0, "return_token_ids": True}
    r = httpx.post(server + "/v1/completions", json=body, timeout=60).json()
    (w,) = _one(engine, input_ids=[5, 6, 7, 8], sampling=dict(max_new_tokens=5, temperature=1.0, seed=3))
    choice = r["choices"][0]
    assert choice["token_ids"] == w.output_ids
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(w.output_logprobs, abs=LP_TOL)
    assert httpx.post(server + "/pause", params={"mode": "keep"}).json() == {"status": "paused"}
    assert httpx.get(server + "/is_paused").json() == {"is_paused": True}
    assert httpx.post(server + "/resume").json() == {"status": "resumed"}
    assert httpx.get(server + "/is_paused").json() == {"is_paused": False}


# ====================================================================== control plane
def test_pause_keep_holds_requests_until_resume(server):
    httpx.post(server + "/pause", params={"mode": "keep"})
    result = {}
    body = {"model": NAME, "prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    t = threading.Thread(target=lambda: result.update(httpx.post(server + "/v1/completions", json=body,
                                                                 timeout=60).json()))
    t.start()
    try:
        wait_for(lambda: metrics(server)["vllm:num_requests_waiting"] == 1, timeout=30.0, what="the request to queue",
                 poll_s=0.02)
        assert not result
    finally:
        httpx.post(server + "/resume")
    t.join(60)
    assert result["choices"][0]["finish_reason"] == "length"
    assert len(result["choices"][0]["text"]) > 0


def test_pause_wait_lets_in_flight_requests_finish(server):
    body = {"model": NAME, "prompt": [4, 5, 6], "max_tokens": 400, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    try:
        with httpx.stream("POST", server + "/v1/completions", json=body, timeout=120) as r:
            lines = r.iter_lines()
            events = []
            for line in lines:  # the first token: the request is in flight
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))
                    break
            assert httpx.post(server + "/pause", params={"mode": "wait"}, timeout=60).json() == {"status": "paused"}
            assert httpx.get(server + "/is_paused").json()["is_paused"] is True
            events += [json.loads(ln[6:]) for ln in lines if ln.startswith("data: {")]
        assert events[-1]["choices"][0]["finish_reason"] == "length"  # finished, not aborted
        assert len(sum((e["choices"][0]["token_ids"] for e in events), [])) == 400
    finally:
        httpx.post(server + "/resume")
    assert httpx.post(server + "/v1/completions", json={**body, "max_tokens": 2, "stream": False},
                      timeout=60).status_code == 200


def test_weight_version(server):
    assert httpx.post(server + "/update_weight_version", json={"version": 5}).json()["weight_version"] == 5
    assert httpx.get(server + "/weight_info").json()["weight_version"] == 5
    assert metrics(server)["unsloth_rollout_engine_version"] == 5
    httpx.post(server + "/update_weight_version", json={"version": 0})
    assert httpx.get(server + "/weight_info").json()["weight_version"] == 0


def test_metrics_count_tokens(server):
    before = metrics(server)
    httpx.post(server + "/v1/completions", json={"prompt": [9, 8, 7], "max_tokens": 3, "temperature": 0,
                                                 "ignore_eos": True}, timeout=60)
    after = metrics(server)
    assert after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] == 3
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 3
    assert 0.0 <= after["vllm:kv_cache_usage_perc"] <= 1.0


def test_client_disconnect_aborts_and_frees(server):
    before = metrics(server)["unsloth_rollout_engine_aborted_total"]
    body = {"model": NAME, "prompt": [1, 2, 3], "max_tokens": 480, "ignore_eos": True, "stream": True}
    try:
        # Streaming: read the first token, freeze the engine (the request stays in flight), hang up.
        with httpx.stream("POST", server + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    break
            httpx.post(server + "/pause", params={"mode": "keep"})
        # Non-streaming: the request waits (paused), the client times out and leaves.
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server + "/v1/completions", json={**body, "stream": False}, timeout=1.0)
        wait_for(lambda: metrics(server)["unsloth_rollout_engine_aborted_total"] >= before + 2, timeout=30.0,
                 what="both requests to be aborted", poll_s=0.02)
    finally:
        httpx.post(server + "/resume")
    m = metrics(server)
    assert m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0


# ====================================================================== LoRA adapters at runtime
def test_lora_adapter_load_select_unload(server, client, model_dir, workdir, engine):
    path, peft_model = save_peft_adapter(model_dir, workdir / "adapter")

    prompt = [21, 34, 55, 89, 144]
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 0, "ignore_eos": True,
            "return_token_ids": True}
    base_out = httpx.post(server + "/v1/completions", json={**body, "model": NAME}, timeout=60).json()

    r = httpx.post(server + "/v1/load_lora_adapter", json={"lora_name": "sql-lora", "lora_path": str(path)},
                   timeout=60)
    assert r.status_code == 200, r.text
    cards = {m.id: m for m in client.models.list().data}
    assert cards["sql-lora"].parent == NAME and cards["sql-lora"].root == str(path)
    assert httpx.post(server + "/v1/load_lora_adapter", json={"lora_name": "sql-lora", "lora_path": str(path)},
                      timeout=60).status_code == 400  # already loaded

    lora_out = httpx.post(server + "/v1/completions", json={**body, "model": "sql-lora"}, timeout=60).json()
    lora_ids = lora_out["choices"][0]["token_ids"]
    assert lora_ids != base_out["choices"][0]["token_ids"]
    # Oracle: a teacher-forced forward of the PEFT model; each token is its greedy choice and logprob.
    lp = hf_logprobs(peft_model, prompt + lora_ids, len(lora_ids))
    suppressed = engine.core.sampler.suppress_ids
    lp_masked = lp.clone()
    lp_masked[:, suppressed] = float("-inf")
    assert lp_masked.argmax(-1).tolist() == lora_ids
    got = lora_out["choices"][0]["logprobs"]["token_logprobs"]
    assert got == pytest.approx(lp[torch.arange(len(lora_ids)), lora_ids].tolist(), abs=LP_TOL)

    r = httpx.post(server + "/v1/unload_lora_adapter", json={"lora_name": "sql-lora"}, timeout=60)
    assert r.status_code == 200
    assert "sql-lora" not in {m.id for m in client.models.list().data}
    r = httpx.post(server + "/v1/completions", json={**body, "model": "sql-lora"}, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    again = httpx.post(server + "/v1/completions", json={**body, "model": NAME}, timeout=60).json()
    assert again["choices"][0]["token_ids"] == base_out["choices"][0]["token_ids"]
    assert httpx.post(server + "/v1/unload_lora_adapter", json={"lora_name": "sql-lora"}).status_code == 404


# ====================================================================== bad input
def _chat_body(**kw):
    return {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **kw}


def _image_msg(*urls):
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": u}} for u in urls]
             + [{"type": "text", "text": "?"}]}]


BAD = {
    "malformed_json": ("/v1/chat/completions", b'{"model": "tiny-vlm", "messages": [', 400, None, "JSON"),
    "unknown_model": ("/v1/chat/completions", _chat_body(model="gpt-9"), 404, "model", "gpt-9"),
    "negative_max_tokens": ("/v1/chat/completions", _chat_body(max_tokens=-5), 400, "max_tokens", "max_tokens"),
    "bad_type": ("/v1/chat/completions", _chat_body(temperature="hot"), 400, "temperature", "temperature"),
    "top_logprobs_range": ("/v1/chat/completions", _chat_body(logprobs=True, top_logprobs=50), 400,
                           "top_logprobs", "top_logprobs"),
    "n_over_limit": ("/v1/chat/completions", _chat_body(n=9), 400, "n", "n"),
    "min_tokens_over_max": ("/v1/completions", {"prompt": [1, 2], "max_tokens": 2, "min_tokens": 5}, 400,
                            "min_tokens", "min_tokens"),
    "bad_base64": ("/v1/chat/completions", _chat_body(messages=_image_msg("data:image/png;base64,@@not-b64@@")),
                   400, "messages[0].content[0].image_url", "base64"),
    "not_an_image": ("/v1/chat/completions", _chat_body(messages=_image_msg(
        "data:image/png;base64," + base64.b64encode(b"hello").decode())), 400, "messages[0].content[0].image_url",
        "decode"),
    "remote_image": ("/v1/chat/completions", _chat_body(messages=_image_msg("https://example.com/cat.png")), 400,
                     "messages[0].content[0].image_url", "remote"),
    "local_outside_allowed": ("/v1/chat/completions", _chat_body(messages=_image_msg("file:///etc/hostname")), 400,
                              "messages[0].content[0].image_url", "outside"),
    "too_many_images": ("/v1/chat/completions", _chat_body(messages=_image_msg(*[png_data_url(seeded_image(i, IMAGE_SIZE))
                                                                                  for i in range(3)])),
                        400, "messages", "At most 2"),
    "image_too_many_pixels": ("/v1/chat/completions", _chat_body(messages=_image_msg(png_data_url(seeded_image(5, (120, 100))))),
                              400, "messages[0].content[0].image_url", "pixels"),
    "prompt_too_long": ("/v1/completions", {"prompt": list(range(1, MAX_MODEL_LEN + 10)), "max_tokens": 1}, 400,
                        "prompt", "maximum context length"),
    "prompt_plus_max_tokens_too_long": ("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": MAX_MODEL_LEN},
                                        400, "max_tokens", "maximum context length"),
    "token_id_out_of_vocab": ("/v1/completions", {"prompt": [1, 10 ** 7], "max_tokens": 1}, 400, "prompt",
                              "outside"),
    "empty_messages": ("/v1/chat/completions", _chat_body(messages=[]), 400, "messages", "messages"),
    "beam_search": ("/v1/completions", {"prompt": [1], "use_beam_search": True}, 400, "use_beam_search", "beam"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_gets_4xx_naming_the_field(server, case):
    path, body, status, param, needle = BAD[case]
    if isinstance(body, bytes):
        r = httpx.post(server + path, content=body, headers={"content-type": "application/json"}, timeout=30)
    else:
        r = httpx.post(server + path, json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    assert err["param"] == param
    assert needle in err["message"]
    # ... and the server keeps serving.
    ok = httpx.post(server + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 1}, timeout=30)
    assert ok.status_code == 200


def test_openai_client_raises_its_typed_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}], max_tokens=0)
    assert e.value.body["param"] == "max_tokens"
