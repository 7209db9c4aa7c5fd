"""vLLM's OpenAI-server behaviour, as vLLM's own tests (tests/entrypoints/openai/: test_completion.py,
test_chat.py, test_prompt_logprobs / echo cases, test_metrics.py, test_tokenization.py, test_vision.py) assert
it, rewritten to run against the real ``unsloth-rollout serve`` on a tiny random VLM (one subprocess for the
module, started with ``--logprobs-mode processed_logprobs``). Shapes, counts and consistency only, never specific
words; values against a teacher-forced forward of the same weights and, for processed logprobs, an independent
computation of the sampling distribution. Each test's docstring names the vLLM test it reproduces.
"""

import base64
import io
import time

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

import torch  # noqa: E402

from unsloth_rollout.testing.oracles import teacher_forced  # noqa: E402
from unsloth_rollout.testing.fixtures import policy_fixture, server_fixture  # noqa: E402
from unsloth_rollout.testing.server import openai_client  # noqa: E402
from unsloth_rollout.testing.toy import png_data_url, seeded_image  # noqa: E402

NAME = "tiny-vlm"
TOL = 1e-5


server = server_fixture("--max-model-len", "256", "--kv-cache-memory-bytes", "32MiB", "--served-model-name", NAME,
                        "--logprobs-mode", "processed_logprobs", "--generation-config", "vllm", model="qwen2_5_vl_dir")


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


policy = policy_fixture(model="qwen2_5_vl_dir")


def _post(server, path, body, status=200):
    r = httpx.post(server + path, json=body, timeout=120)
    assert r.status_code == status, r.text
    return r.json()


def _png_url(seed=3) -> str:
    return png_data_url(seeded_image(seed, (56, 56)))


PROMPT = [5, 6, 7, 8, 9, 10, 11]


# ====================================================================== scoring: echo and prompt_logprobs
def test_prompt_logprobs_shape_and_values(server, policy):
    """test_completion.py::test_prompt_logprobs_completion: ``prompt_logprobs=k`` gives one entry per prompt
    token, None first, each a {token id: {logprob, rank, decoded_token}} holding the prompt's token and up to k
    more; the values are the teacher-forced log-softmax at T = 1 (no temperature on prompt logprobs)."""
    body = _post(server, "/v1/completions", {"model": NAME, "prompt": PROMPT, "max_tokens": 1, "temperature": 0.5,
                                             "prompt_logprobs": 2})
    plp = body["choices"][0]["prompt_logprobs"]
    assert len(plp) == len(PROMPT) and plp[0] is None
    want, logits = teacher_forced(policy, PROMPT[:1], PROMPT[1:])
    rows = torch.log_softmax(logits, -1)
    for j, entry in enumerate(plp[1:]):
        assert 1 <= len(entry) <= 3 and str(PROMPT[j + 1]) in entry
        first_id, first = next(iter(entry.items()))
        assert int(first_id) == PROMPT[j + 1] and abs(first["logprob"] - float(want[j])) <= TOL
        assert first["rank"] == int((rows[j] > rows[j][PROMPT[j + 1]]).sum()) + 1
        assert all(set(v) == {"logprob", "rank", "decoded_token"} for v in entry.values())
        for tid, v in entry.items():
            assert v["rank"] == int((rows[j] > rows[j][int(tid)]).sum()) + 1


def test_prompt_logprobs_zero_is_honoured(server):
    """test_completion.py (prompt_logprobs=0): only the prompt's own token per position."""
    plp = _post(server, "/v1/completions", {"model": NAME, "prompt": PROMPT, "max_tokens": 1,
                                            "prompt_logprobs": 0})["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and all(len(e) == 1 for e in plp[1:])


def test_echo_with_logprobs_and_max_tokens_zero(server, policy, client):
    """test_completion.py::test_echo_logprob_completion: echo puts the prompt before the text and its tokens
    before the output's in ``logprobs`` (first token_logprob None); ``max_tokens=0`` with echo returns the prompt
    alone (finish "length", no completion tokens)."""
    text = "the cat sat"
    ids = policy.tokenizer.encode(text)
    c = client.completions.create(model=NAME, prompt=text, max_tokens=3, echo=True, logprobs=1, temperature=0)
    ch = c.choices[0]
    assert ch.text.startswith(text)
    lp = ch.logprobs
    assert len(lp.tokens) == len(ids) + c.usage.completion_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want, _ = teacher_forced(policy, ids[:1], ids[1:])
    assert max(abs(a - float(b)) for a, b in zip(lp.token_logprobs[1:len(ids)], want)) <= TOL
    assert all(len(t) <= 2 for t in lp.top_logprobs[1:])
    z = client.completions.create(model=NAME, prompt=text, max_tokens=0, echo=True)
    assert z.choices[0].text == text and z.usage.completion_tokens == 0 and z.choices[0].finish_reason == "length"


def test_streamed_echo_sends_the_prompt_first(server, client):
    """test_completion.py::test_echo_stream_completion: with stream and echo each choice's first chunk starts with
    the prompt text and its logprobs with the prompt's tokens (first None); the chunks add up to the non-streamed
    answer (text, tokens, logprobs) at temperature 0, for n = 2 and for max_tokens = 0 (the prompt alone)."""
    text = "the cat sat"
    kw = dict(model=NAME, prompt=text, echo=True, logprobs=1, temperature=0)
    for max_tokens, n in ((4, 2), (0, 1)):
        whole = client.completions.create(max_tokens=max_tokens, n=n, **kw)
        texts, tokens, lps, first = {}, {}, {}, {}
        for chunk in client.completions.create(max_tokens=max_tokens, n=n, stream=True, **kw):
            for ch in chunk.choices:
                first.setdefault(ch.index, ch)
                texts[ch.index] = texts.get(ch.index, "") + ch.text
                tokens.setdefault(ch.index, []).extend(ch.logprobs.tokens)
                lps.setdefault(ch.index, []).extend(ch.logprobs.token_logprobs)
        assert sorted(texts) == list(range(n))
        for ch in whole.choices:
            i = ch.index
            assert first[i].text.startswith(text) and first[i].logprobs.token_logprobs[0] is None
            assert texts[i] == ch.text and tokens[i] == ch.logprobs.tokens
            assert max(abs((a or 0) - (b or 0)) for a, b in zip(lps[i], ch.logprobs.token_logprobs)) <= TOL
        if max_tokens == 0:
            assert texts[0] == text


def test_max_tokens_zero_without_scoring_is_a_400(server):
    """vLLM refuses max_tokens=0 unless the prompt is echoed or scored."""
    err = _post(server, "/v1/completions", {"model": NAME, "prompt": PROMPT, "max_tokens": 0}, 400)["error"]
    assert err["param"] == "max_tokens"


def test_chat_prompt_logprobs(server, policy):
    """test_chat.py (prompt_logprobs on chat): the response's top-level ``prompt_logprobs`` covers the rendered
    prompt (``prompt_token_ids``), None first, values as teacher forcing."""
    body = _post(server, "/v1/chat/completions", {"model": NAME, "max_tokens": 1, "prompt_logprobs": 0,
                                                  "return_token_ids": True,
                                                  "messages": [{"role": "user", "content": "hello there"}]})
    ids, plp = body["prompt_token_ids"], body["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    want, _ = teacher_forced(policy, ids[:1], ids[1:])
    got = torch.tensor([next(iter(e.values()))["logprob"] for e in plp[1:]])
    assert (got - want).abs().max() <= TOL


def test_prompt_logprobs_with_stream_is_refused(server):
    """vLLM: prompt_logprobs are not available with stream=True (400 naming the field)."""
    err = _post(server, "/v1/completions", {"model": NAME, "prompt": PROMPT, "stream": True,
                                            "prompt_logprobs": 1}, 400)["error"]
    assert err["param"] == "prompt_logprobs"


# ====================================================================== logprobs_mode
def test_server_reports_and_returns_processed_logprobs(server, policy):
    """vLLM's --logprobs-mode processed_logprobs (tests/v1/sample/test_logprobs.py, processed mode): the returned
    logprob is the log of the distribution the token was drawn from: penalties, T, top-k, top-p applied and
    renormalised. Independent oracle: that distribution computed here from a teacher-forced forward (with the
    vision placeholders the engine never samples on a VLM masked out, its documented default)."""
    info = httpx.get(server + "/server_info").json()["vllm_config"]
    assert info["model_config"]["logprobs_mode"] == "processed_logprobs"
    knobs = {"temperature": 0.7, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.05}
    body = _post(server, "/v1/completions", {"model": NAME, "prompt": PROMPT, "max_tokens": 8, "seed": 5,
                                             "logprobs": 0, "return_token_ids": True, **knobs})
    ch = body["choices"][0]
    out = ch["token_ids"]
    _, logits = teacher_forced(policy, PROMPT, out)
    cfg = policy.config
    banned = [getattr(cfg, k) for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                        "vision_end_token_id")]
    banned.append(policy.tokenizer.convert_tokens_to_ids("<|vision_pad|>"))
    raw_gap = 0.0
    for i, tok in enumerate(out):
        x = logits[i].double().clone()
        seen = torch.tensor(sorted(set(PROMPT + out[:i])))
        v = x[seen]
        x[seen] = torch.where(v > 0, v / 1.05, v * 1.05)
        x[banned] = float("-inf")
        x = x / 0.7
        x[x < x.topk(20).values[-1]] = float("-inf")
        p = torch.softmax(x, -1)
        sp, order = p.sort(descending=True)
        keep = (sp.cumsum(0) - sp) < 0.9
        q = torch.zeros_like(p)
        q[order[keep]] = p[order[keep]]
        want = float(torch.log(q[tok] / q.sum()))
        assert abs(ch["logprobs"]["token_logprobs"][i] - want) <= TOL
        raw_gap = max(raw_gap, abs(want - float(torch.log_softmax(logits[i] / 0.7, -1)[tok])))
    assert raw_gap > 1e-3  # raw and processed differ for these settings: the check can fail


# ====================================================================== smaller divergences
def test_stop_token_ids_text_left_out_unless_asked(server, policy):
    """test_completion.py (stop_token_ids / include_stop_str_in_output): a stop token id's text is not in
    ``text`` unless include_stop_str_in_output; the token itself stays in token_ids."""
    greedy = _post(server, "/v1/completions", {"model": NAME, "prompt": PROMPT, "max_tokens": 6, "temperature": 0,
                                               "return_token_ids": True, "ignore_eos": True})["choices"][0]
    stop_id = greedy["token_ids"][2]
    text_of = policy.tokenizer.decode
    for include in (False, True):
        ch = _post(server, "/v1/completions", {"model": NAME, "prompt": PROMPT, "max_tokens": 6, "temperature": 0,
                                               "stop_token_ids": [stop_id], "return_token_ids": True,
                                               "include_stop_str_in_output": include})["choices"][0]
        assert ch["stop_reason"] == stop_id and ch["token_ids"][-1] == stop_id
        n = len(ch["token_ids"])
        assert ch["text"] == text_of(ch["token_ids"] if include else ch["token_ids"][:n - 1])


def test_continuous_usage_only_with_include_usage(server, client):
    """test_completion.py::test_completion_stream_options: continuous_usage_stats without include_usage adds no
    usage to chunks; with both, every chunk has usage and a final usage-only chunk closes the stream."""
    def chunks(opts):
        return list(client.completions.create(model=NAME, prompt="hi", max_tokens=3, stream=True,
                                              stream_options=opts, temperature=0))
    alone = chunks({"continuous_usage_stats": True})
    assert all(c.usage is None for c in alone)
    both = chunks({"include_usage": True, "continuous_usage_stats": True})
    assert all(c.usage is not None for c in both) and both[-1].choices == []


def test_truncate_prompt_tokens(server):
    """test_completion.py / test_truncation.py: truncate_prompt_tokens=k keeps the last k prompt tokens (left,
    vLLM's default) or the first k with truncation_side "right"; k above max_model_len is a 400."""
    left = _post(server, "/v1/completions", {"model": NAME, "prompt": PROMPT, "max_tokens": 1,
                                             "truncate_prompt_tokens": 3, "return_token_ids": True})
    assert left["choices"][0]["prompt_token_ids"] == PROMPT[-3:] and left["usage"]["prompt_tokens"] == 3
    right = _post(server, "/v1/completions", {"model": NAME, "prompt": PROMPT, "max_tokens": 1,
                                              "truncate_prompt_tokens": 3, "truncation_side": "right",
                                              "return_token_ids": True})
    assert right["choices"][0]["prompt_token_ids"] == PROMPT[:3]
    err = _post(server, "/v1/completions", {"model": NAME, "prompt": PROMPT, "truncate_prompt_tokens": 10_000},
                400)["error"]
    assert err["param"] == "truncate_prompt_tokens"


def test_metrics_have_vllms_names(server, client):
    """test_metrics.py::test_metrics_exist: the metric names a vLLM dashboard reads, histograms with _bucket /
    _sum / _count whose counts grow with requests; an idle server's kv_cache_usage_perc is 0."""
    client.completions.create(model=NAME, prompt="hello", max_tokens=3, temperature=0)
    text = httpx.get(server + "/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:cache_config_info",
                 "vllm:num_preemptions_total"):
        assert f"\n{name}{{" in text, name
    for name in ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                 "vllm:request_time_per_output_token_seconds", "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
                 "vllm:iteration_tokens_total", "vllm:request_prompt_tokens", "vllm:request_generation_tokens"):
        assert f"# TYPE {name} histogram" in text, name
        count = next(line for line in text.splitlines() if line.startswith(name + "_count"))
        assert float(count.rsplit(" ", 1)[1]) >= 1, count
    usage = next(line for line in text.splitlines() if line.startswith("vllm:kv_cache_usage_perc"))
    assert float(usage.rsplit(" ", 1)[1]) == 0.0


def _histogram(text, name):
    """(count, {le: cumulative count}) of a histogram in Prometheus text."""
    buckets = {}
    for line in text.splitlines():
        if line.startswith(name + "_bucket"):
            buckets[line.split('le="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
    count = next(float(x.rsplit(" ", 1)[1]) for x in text.splitlines() if x.startswith(name + "_count"))
    return count, buckets


def test_inter_token_latency_is_observed_per_token(server):
    """test_metrics.py (inter_token_latency_seconds: one observation per output token after the first, the time
    since the previous token): a stream held by /pause?mode=keep for 1.5 s between two of its tokens adds exactly
    one observation above 1 s (up to 3 where the machine itself stalls), and n - 1 in all; a per-sample mean would
    spread the pause over every token, a time since the request began would put every later token above 1 s.
    ``request_time_per_output_token_seconds`` gets one observation per sample."""
    name, per_request = "vllm:inter_token_latency_seconds", "vllm:request_time_per_output_token_seconds"
    before = httpx.get(server + "/metrics").text
    (c0, b0), (r0, _) = _histogram(before, name), _histogram(before, per_request)
    n_tokens = 200
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": n_tokens, "ignore_eos": True, "stream": True,
            "temperature": 0}
    with httpx.stream("POST", server + "/v1/completions", json=body, timeout=120) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))  # the first token is out
        httpx.post(server + "/pause", params={"mode": "keep"})
        time.sleep(1.5)
        httpx.post(server + "/resume")
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    after = httpx.get(server + "/metrics").text
    (c1, b1), (r1, _) = _histogram(after, name), _histogram(after, per_request)
    assert c1 - c0 == n_tokens - 1 and r1 - r0 == 1
    slow = (c1 - b1["1.0"]) - (c0 - b0["1.0"])
    assert 1 <= slow <= 3, (slow, b1)  # another gap over 1 s only if the machine itself stalled


def test_image_url_must_be_an_object(server):
    """test_vision.py (schema): ``image_url`` given as a bare string is a 400 naming the part."""
    msg = [{"role": "user", "content": [{"type": "image_url", "image_url": _png_url()},
                                        {"type": "text", "text": "what?"}]}]
    err = _post(server, "/v1/chat/completions", {"model": NAME, "messages": msg, "max_tokens": 2}, 400)["error"]
    assert "image_url" in err["param"]


def test_image_uuid_is_cached_and_reused(server):
    """test_vision.py / multimodal uuid tests: an image sent with a ``uuid`` is accepted; a later part with only
    that uuid reuses it (same prompt tokens and the same greedy answer); an unknown uuid alone is a 400."""
    def chat(part):
        return _post(server, "/v1/chat/completions", {"model": NAME, "max_tokens": 4, "temperature": 0,
                                                      "return_token_ids": True, "messages": [{"role": "user",
                                                      "content": [part, {"type": "text", "text": "what?"}]}]})
    first = chat({"type": "image_url", "image_url": {"url": _png_url(4)}, "uuid": "img-4"})
    again = chat({"type": "image_url", "image_url": None, "uuid": "img-4"})
    assert again["prompt_token_ids"] == first["prompt_token_ids"]
    assert again["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
    r = httpx.post(server + "/v1/chat/completions", json={"model": NAME, "max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": None, "uuid": "never-sent"}]}]})
    assert r.status_code == 400


@pytest.mark.parametrize("ctype", ["application/x-www-form-urlencoded", "text/plain"])
def test_non_json_body_is_a_400(server, ctype):
    """vLLM's validate_json_request: a body that is not application/json is refused (400, OpenAI error schema)."""
    r = httpx.post(server + "/v1/completions", content=b'{"prompt": "hi"}', headers={"content-type": ctype})
    assert r.status_code == 400 and "application/json" in r.json()["error"]["message"]


def test_tokenize_token_strs(server, policy):
    """test_tokenization.py::test_tokenize_completions (return_token_strs): token_strs align with tokens."""
    body = _post(server, "/tokenize", {"model": NAME, "prompt": "hello world", "return_token_strs": True})
    assert body["token_strs"] == policy.tokenizer.convert_ids_to_tokens(body["tokens"])
    assert _post(server, "/tokenize", {"model": NAME, "prompt": "hello"})["token_strs"] is None


def test_beam_search_is_a_documented_400(server):
    """The one refusal of the sampling API: use_beam_search answers 400 naming the field."""
    err = _post(server, "/v1/completions", {"model": NAME, "prompt": PROMPT, "use_beam_search": True},
                400)["error"]
    assert err["param"] == "use_beam_search"


def test_chat_prompt_logprobs_with_an_image(server, policy):
    """test_vision.py with prompt_logprobs: a chat prompt holding an image is scored with the image's pixels; the
    expanded prompt (``prompt_token_ids``) and the processor's own pixel_values feed the teacher-forced oracle."""
    import numpy as np
    from PIL import Image

    url = _png_url(9)
    body = _post(server, "/v1/chat/completions", {"model": NAME, "max_tokens": 1, "prompt_logprobs": 0,
                                                  "return_token_ids": True, "messages": [{"role": "user", "content": [
                                                      {"type": "image_url", "image_url": {"url": url}},
                                                      {"type": "text", "text": "what is it?"}]}]})
    ids, plp = body["prompt_token_ids"], body["prompt_logprobs"]
    assert policy.config.image_token_id in ids
    img = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGB")
    vis = policy.processor.image_processor(images=[np.asarray(img)], return_tensors="pt")
    want, _ = teacher_forced(policy, ids[:1], ids[1:], pixel_values=vis["pixel_values"],
                             image_grid_thw=vis["image_grid_thw"])
    got = torch.tensor([next(iter(e.values()))["logprob"] for e in plp[1:]])
    assert (got - want).abs().max() <= TOL


def test_chat_echo_continues_the_final_assistant_message(server):
    """test_chat.py::test_echo (chat): with echo and a final assistant message continued, the returned content
    starts with that message; without echo it does not repeat it."""
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Well, "}]
    def content(echo):
        return _post(server, "/v1/chat/completions", {"model": NAME, "max_tokens": 3, "temperature": 0,
                                                      "echo": echo, "continue_final_message": True,
                                                      "add_generation_prompt": False, "messages": msgs}
                     )["choices"][0]["message"]["content"]
    with_echo, without = content(True), content(False)
    assert with_echo == "Well, " + without


def test_streamed_chat_echo_sends_the_final_assistant_message_first(client):
    """vLLM's streamed chat echo: after each choice's role chunk comes a chunk with the continued assistant message,
    and each choice's chunks add up to the non-streamed echoed content (n = 2, temperature 0)."""
    kw = dict(model=NAME, max_tokens=4, temperature=0, n=2, messages=[
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "Well, "}],
        extra_body={"echo": True, "continue_final_message": True, "add_generation_prompt": False})
    whole = client.chat.completions.create(**kw)
    texts, seen = {}, {}
    for chunk in client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            if ch.delta.content:
                seen.setdefault(ch.index, ch.delta.content)
                texts[ch.index] = texts.get(ch.index, "") + ch.delta.content
    assert seen == {0: "Well, ", 1: "Well, "}
    assert texts == {ch.index: ch.message.content for ch in whole.choices}
    assert whole.choices[0].message.content.startswith("Well, ")
