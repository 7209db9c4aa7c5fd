"""vLLM's token-in / token-out route, ``POST /inference/v1/generate``, driven by the client that uses it.

Prime Intellect's ``verifiers`` (0.4) train client (``verifiers/v1/clients/train.py``, ``TrainClient.get_response``)
renders each turn with a ``renderers`` renderer and calls ``renderers.client.generate`` (renderers 0.1.12, the
version verifiers 0.4 requires), which sends the request and parses vLLM's answer. verifiers itself is not
imported: its package imports its whole stack (sandboxes, MCP, tunnels); ``generate`` and the renderer are the
client's request/response handling, used here unchanged, with the train client's turn loop written out (a full
re-render per turn: the renderer this tokenizer gets has no bridge).

Oracles: a teacher-forced forward of the same model object (``log_softmax(logits / T)``), the tokenizer's decode,
/v1/completions for the same token ids, and the HF processor's expansion of an image.
"""

import asyncio
import json
import math
import threading

import pytest

pytest.importorskip("fastapi")
renderers = pytest.importorskip("renderers")

import httpx  # noqa: E402
import torch  # noqa: E402
from renderers.client import generate  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from unsloth_rollout import EngineConfig, RolloutEngine, load_model  # noqa: E402
from unsloth_rollout.testing.adapters import images, processor_inputs  # noqa: E402
from unsloth_rollout.testing.oracles import teacher_forced  # noqa: E402
from unsloth_rollout.testing.server import free_port  # noqa: E402
from unsloth_rollout.testing.tiny import tiny_model_path  # noqa: E402
from unsloth_rollout.testing.waits import wait_for  # noqa: E402

NAME = "tiny"
TOL = 1e-5
ROUTE = "/inference/v1/generate"


@pytest.fixture(scope="module")
def policy():
    return load_model(str(tiny_model_path("qwen2")), backend="transformers")


@pytest.fixture(scope="module")
def engine(policy):
    eng = RolloutEngine(policy, EngineConfig(kv_cache_memory_bytes=16 << 20, max_model_len=512))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def server(engine):
    from unsloth_rollout.serve import create_app, serve_in_thread

    srv = serve_in_thread(create_app(engine, served_model_name=NAME), port=free_port())
    yield f"http://127.0.0.1:{srv.config.port}"
    srv.should_exit = True
    srv.thread.join(30)


def _generate(server, body, **kw):
    return httpx.post(server + ROUTE, json={"model": NAME, **body}, timeout=120, **kw)


def _assert_teacher_forced(policy, prompt_ids, ids, logprobs, temperature=1.0):
    assert ids and len(logprobs) == len(ids)
    want, _ = teacher_forced(policy, prompt_ids, ids, temperature)
    assert (want - torch.tensor(logprobs)).abs().max() <= TOL


# ====================================================================== verifiers' train client, end to end
def test_verifiers_train_client_multi_turn(server, policy):
    """Three turns as the train client runs them: render, ``generate`` (X-Session-ID, stop ids from the renderer,
    logprobs=1), parse; every turn gets token ids with one finite logprob each, equal to a teacher-forced forward,
    that decode to the message text."""
    import openai

    tok = policy.tokenizer
    renderer = renderers.create_renderer(tok)
    stop_ids = renderer.get_stop_token_ids()

    async def rollout():
        client = openai.AsyncOpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)
        messages, results = [{"role": "user", "content": "Name a colour."}], []
        try:
            for turn in range(3):
                rendered = renderer.render(messages, tools=None, add_generation_prompt=True)
                result = await generate(
                    client=client, renderer=renderer, messages=messages, model=NAME, prompt_ids=rendered.token_ids,
                    multi_modal_data=rendered.multi_modal_data, prompt_attribution=rendered, tools=None,
                    sampling_params={"temperature": 1.0, "max_tokens": 12, "seed": 10 + turn},
                    extra_headers={"X-Session-ID": "trajectory-1"})
                results.append((rendered.token_ids, result))
                messages = messages + [{"role": "assistant", "content": result["content"] or ""},
                                       {"role": "user", "content": f"And another, number {turn + 2}?"}]
        finally:
            await client.close()
        return results

    results = asyncio.run(rollout())
    for prompt_ids, r in results:
        ids, lps = r["completion_ids"], r["completion_logprobs"]
        assert r["request_id"].startswith("generate-tokens-")
        assert r["prompt_ids"] == prompt_ids  # the server ran exactly the client's rendering
        assert r["finish_reason"] in ("stop", "length")
        assert (r["finish_reason"] == "stop") == (ids[-1] in stop_ids)
        assert all(math.isfinite(v) for v in lps)
        _assert_teacher_forced(policy, prompt_ids, ids, lps)
        text = tok.decode([t for t in ids if t not in stop_ids], skip_special_tokens=True)
        assert (r["content"] or "") == text.strip()
    assert len({tuple(p) for p, _ in results}) == 3  # each turn's prompt holds the earlier turns


def test_same_ids_same_logprobs_as_completions(server, policy):
    """For the same prompt ids, seed and sampling, /inference/v1/generate returns /v1/completions' tokens and
    logprobs; the top list is the sampled token, then the most likely others (teacher-forced logits)."""
    prompt = [747, 82, 88, 82, 290, 76, 198]
    sp = {"temperature": 0.8, "top_p": 0.9, "seed": 7, "n": 2, "max_tokens": 10, "logprobs": 3}
    r = _generate(server, {"token_ids": prompt, "sampling_params": sp})
    assert r.status_code == 200, r.text
    body = r.json()
    ref = httpx.post(server + "/v1/completions", timeout=120, json={
        "model": NAME, "prompt": prompt, "return_token_ids": True, "temperature": 0.8, "top_p": 0.9, "seed": 7,
        "n": 2, "max_tokens": 10, "logprobs": 3}).json()
    assert body["prompt_token_ids"] == prompt and body["usage"]["prompt_tokens"] == len(prompt)
    assert sorted(c["index"] for c in body["choices"]) == [0, 1]
    for choice in body["choices"]:
        want = next(c for c in ref["choices"] if c["index"] == choice["index"])
        ids = choice["token_ids"]
        content = choice["logprobs"]["content"]
        assert ids == want["token_ids"]
        assert [e["token"] for e in content] == [f"token_id:{t}" for t in ids]
        lps = [e["logprob"] for e in content]
        assert max(abs(a - b) for a, b in zip(lps, want["logprobs"]["token_logprobs"])) <= TOL
        got, logits = teacher_forced(policy, prompt, ids, 0.8)
        assert (got - torch.tensor(lps)).abs().max() <= TOL
        full = torch.log_softmax(logits / 0.8, dim=-1)
        for i, e in enumerate(content):
            tops = [int(x["token"].split(":")[1]) for x in e["top_logprobs"]]
            others = [t for t in full[i].topk(4).indices.tolist() if t != ids[i]]
            assert tops == [ids[i], *others][:3]
            for x, t in zip(e["top_logprobs"], tops):
                assert abs(x["logprob"] - full[i, t].item()) <= TOL


def test_stream_equals_the_full_answer(server):
    sp = {"temperature": 1.0, "seed": 3, "max_tokens": 9, "logprobs": 0, "ignore_eos": True}
    body = {"token_ids": [1, 2, 3, 4], "sampling_params": sp}
    full = _generate(server, body).json()["choices"][0]
    with httpx.stream("POST", server + ROUTE, timeout=120, json={
            "model": NAME, **body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
    assert chunks[0]["prompt_token_ids"] == [1, 2, 3, 4]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 9
    deltas = [c["choices"][0] for c in chunks[:-1]]
    assert sum((d["token_ids"] for d in deltas), []) == full["token_ids"]
    assert sum((d["logprobs"]["content"] for d in deltas), []) == full["logprobs"]["content"]
    assert deltas[-1]["finish_reason"] == "length" and all(d["finish_reason"] is None for d in deltas[:-1])


# ====================================================================== refusals
BAD = [
    ({"token_ids": []}, "token_ids"),
    ({"token_ids": [3, -1]}, "token_ids"),
    ({"token_ids": [3, 10 ** 6]}, "token_ids"),
    ({"token_ids": [3], "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
    ({"token_ids": [3], "sampling_params": {"top_p": 0}}, "sampling_params.top_p"),
    ({"token_ids": [3], "sampling_params": {"max_tokens": 10 ** 5}}, "sampling_params.max_tokens"),
    ({"token_ids": [3], "sampling_params": {"min_tokens": 5, "max_tokens": 2}}, "sampling_params.min_tokens"),
    ({"token_ids": [3], "sampling_params": {"logprobs": 21}}, "sampling_params.logprobs"),
    ({"token_ids": [3], "sampling_params": {"logprobs": -1}}, "sampling_params.logprobs"),
    ({"token_ids": [3], "sampling_params": {"n": 1000}}, "sampling_params.n"),
    ({"token_ids": [3], "sampling_params": {"logit_bias": {"5": 3.0}}}, "sampling_params.logit_bias"),
    ({"token_ids": [3], "sampling_params": {"allowed_token_ids": [5]}}, "sampling_params.allowed_token_ids"),
    ({"token_ids": [3], "sampling_params": {"bad_words": ["x"]}}, "sampling_params.bad_words"),
    ({"token_ids": [3], "sampling_params": {"structured_outputs": {"regex": "("}}},
     "sampling_params.structured_outputs"),
    ({"token_ids": [3], "sampling_params": {"temperature": "hot"}}, "sampling_params.temperature"),
    ({"token_ids": [3], "features": {"mm_hashes": {}, "mm_placeholders": {}}}, "features"),
    ({"token_ids": [3], "kv_transfer_params": {"do_remote_prefill": True}}, "kv_transfer_params"),
    ({"token_ids": [3], "priority": 5}, "priority"),
    ({"token_ids": [3], "output_mode": "text"}, "output_mode"),
    ({"token_ids": [3], "stream": True, "sampling_params": {"prompt_logprobs": 1}}, "sampling_params.prompt_logprobs"),
    ({"token_ids": [3], "content_parts": [{"type": "image_url", "url": "data:image/png;base64,iVBORw0KGgo="}]},
     "content_parts[0]"),
]


def test_bad_input_is_a_400_naming_the_field_while_others_are_served(server, policy, engine):
    long = {"token_ids": [5, 6, 7], "sampling_params": {"temperature": 1.0, "seed": 1, "max_tokens": 120,
                                                        "ignore_eos": True, "logprobs": 0}}
    result = {}
    t = threading.Thread(target=lambda: result.update(_generate(server, long).json()))
    t.start()
    wait_for(lambda: engine.stats()["num_running"] >= 1, timeout=60, what="the long request to run")
    for body, param in BAD:
        r = _generate(server, body)
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert err["param"] == param and err["type"] == "BadRequestError" and err["code"] == 400, (body, err)
    r = _generate(server, {"token_ids": [3], "model": "no-such-model"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    r = httpx.post(server + ROUTE, content=b"token_ids=3",
                   headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "content-type"
    t.join(120)
    choice = result["choices"][0]
    assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == 120
    lps = [e["logprob"] for e in choice["logprobs"]["content"]]
    _assert_teacher_forced(policy, [5, 6, 7], choice["token_ids"], lps)


# ====================================================================== pause, abort, weights
def test_pause_abort_ends_a_request_and_keep_holds_new_ones(server, policy, engine):
    body = {"token_ids": [8, 9, 10], "sampling_params": {"temperature": 1.0, "seed": 2, "max_tokens": 400,
                                                         "ignore_eos": True, "logprobs": 0}}
    result = {}
    t = threading.Thread(target=lambda: result.update(_generate(server, body).json()))
    t.start()
    try:
        wait_for(lambda: engine.stats()["num_running"] >= 1, timeout=60, what="the request to run")
        assert httpx.post(server + "/pause", params={"mode": "abort"}, timeout=60).status_code == 200
        t.join(60)
        choice = result["choices"][0]
        assert choice["finish_reason"] == "abort" and 0 < len(choice["token_ids"]) < 400
        _assert_teacher_forced(policy, [8, 9, 10], choice["token_ids"],
                               [e["logprob"] for e in choice["logprobs"]["content"]])
        httpx.post(server + "/resume")
        httpx.post(server + "/pause", params={"mode": "keep"})
        held = {}
        t = threading.Thread(target=lambda: held.update(_generate(server, {**body, "sampling_params": {
            **body["sampling_params"], "max_tokens": 4}}).json()))
        t.start()
        wait_for(lambda: engine.stats()["num_waiting"] == 1, timeout=60, what="the request to queue")
        assert not held
    finally:
        httpx.post(server + "/resume")
    t.join(60)
    assert held["choices"][0]["finish_reason"] == "length" and len(held["choices"][0]["token_ids"]) == 4


def test_a_client_that_leaves_aborts_its_request(server, engine):
    """Streamed (hang up after the first chunk) or not (time out while the request waits): the engine request is
    aborted and its KV freed."""
    before = engine.stats()["aborted"]
    body = {"model": NAME, "token_ids": [14, 15, 16], "stream": True,
            "sampling_params": {"max_tokens": 480, "ignore_eos": True, "logprobs": 0}}
    try:
        with httpx.stream("POST", server + ROUTE, json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    break
            httpx.post(server + "/pause", params={"mode": "keep"})
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server + ROUTE, json={**body, "stream": False}, timeout=1.0)
        wait_for(lambda: engine.stats()["aborted"] >= before + 2, timeout=30, what="both requests to be aborted")
    finally:
        httpx.post(server + "/resume")
    stats = engine.stats()
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0


def test_serves_the_weights_of_the_current_version(server, policy, engine):
    """After an in-place update of the shared weights and /update_weight_version, the route samples from and scores
    with the new weights."""
    body = {"token_ids": [11, 12, 13], "sampling_params": {"temperature": 0, "max_tokens": 6, "ignore_eos": True,
                                                           "logprobs": 0}}
    before = _generate(server, body).json()["choices"][0]
    w = policy.model.get_output_embeddings().weight
    saved = w.detach().clone()
    try:
        with torch.no_grad():
            w.add_(torch.randn(w.shape, generator=torch.Generator().manual_seed(0)) * 0.5)
        assert httpx.post(server + "/update_weight_version", json={"version": 1}).json()["weight_version"] == 1
        after = _generate(server, body).json()["choices"][0]
        lps = [e["logprob"] for e in after["logprobs"]["content"]]
        _assert_teacher_forced(policy, [11, 12, 13], after["token_ids"], lps)
        assert [e["logprob"] for e in before["logprobs"]["content"]] != lps
        assert engine.version == 1
    finally:
        with torch.no_grad():
            w.copy_(saved)
        httpx.post(server + "/update_weight_version", json={"version": 0})


# ====================================================================== images (content_parts)
def test_images_as_content_parts_are_expanded_as_the_processor_does():
    """A VLM: token ids with one image placeholder plus the image in ``content_parts``; the prompt the route reports
    is the processor's expansion, ``mm_placeholders`` its run of image tokens, logprobs a teacher-forced forward's."""
    import base64
    import io

    from unsloth_rollout.serve import create_app

    vlm = load_model(str(tiny_model_path("qwen2_vl")), backend="transformers")
    img = images(1, seed=4)[0]
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}]
    enc = processor_inputs(vlm, messages, [img])
    expanded = enc["input_ids"][0].tolist()
    pad = vlm.config.image_token_id
    ids, seen = [], False  # the same prompt with the image's run collapsed to one placeholder
    for t in expanded:
        if t != pad or not seen:
            ids.append(t)
        seen = seen or t == pad
    eng = RolloutEngine(vlm, EngineConfig(kv_cache_memory_bytes=16 << 20, max_model_len=512))
    with TestClient(create_app(eng, served_model_name=NAME, owns_engine=True)) as c:
        r = c.post(ROUTE, json={"model": NAME, "token_ids": ids, "return_token_ids": True,
                                "content_parts": [{"type": "image_url", "url": url}],
                                "sampling_params": {"temperature": 1.0, "seed": 5, "max_tokens": 6, "logprobs": 0}})
        assert r.status_code == 200, r.text
        body = r.json()
        bad = c.post(ROUTE, json={"model": NAME, "token_ids": ids, "sampling_params": {"max_tokens": 2}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "content_parts"
    assert body["prompt_token_ids"] == expanded
    start = expanded.index(pad)
    assert body["mm_placeholders"] == {"image": [{"offset": start, "length": expanded.count(pad)}]}
    choice = body["choices"][0]
    got = [e["logprob"] for e in choice["logprobs"]["content"]]
    want, _ = teacher_forced(vlm, expanded, choice["token_ids"], 1.0, pixel_values=enc["pixel_values"],
                             image_grid_thw=enc["image_grid_thw"])
    assert (want - torch.tensor(got)).abs().max() <= TOL
