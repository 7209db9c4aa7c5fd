"""Bad input: property-based fuzzing of the real server (subprocess, tiny VLM) with hypothesis.

JSON bodies for /v1/chat/completions and /v1/completions built from a valid request with a few fields
replaced by anything (random types and nesting, huge and non-finite numbers, unicode incl. lone surrogates,
wrong or hostile content parts and image URLs), and raw malformed bytes. Properties: the server answers every
request within the client timeout; never a 5xx; a 4xx carries OpenAI's error schema; a 200 is a complete
response; nothing is fetched from an image URL (a local listener must see no connection); afterwards the
server answers a valid request. CI: 600 requests, derandomized; ``-m slow``: 7,200, random.

Figures go to <figures>/reliability/ (.figures/, or benchmarks/ via scripts/record_figures.sh): fuzz_<variant>.json.
"""

from __future__ import annotations

import json
import math
import pickle
import time

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
hypothesis = pytest.importorskip("hypothesis")

from _reliability_helpers import (Canary, ServerProcess, data_url, errors_by_status, metrics,  # noqa: E402
                                  png_bytes, write_figures)
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from unsloth_rollout.testing.tiny import tiny_model_path  # noqa: E402

NAME = "tiny-vlm"
TIMEOUT_S = 60.0  # per request: a server that does not answer within it has hung
MAX_MODEL_LEN = 128


@pytest.fixture(scope="module")
def canary():
    c = Canary()
    yield c
    c.close()


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz_media")
    (d / "cat.png").write_bytes(png_bytes(5))
    (d / "notes.txt").write_text("not an image")
    (d / "escape.png").symlink_to("/etc/passwd")
    return d


@pytest.fixture(scope="module")
def server(media_dir, tmp_path_factory):
    model_dir = str(tiny_model_path("qwen2_5_vl", "tiny"))
    with ServerProcess(model_dir, tmp_path_factory.mktemp("fuzz"), "--served-model-name", NAME,
                       "--max-model-len", str(MAX_MODEL_LEN), "--max-n", "4", "--max-images-per-request", "2",
                       "--max-image-pixels", "65536", "--max-body-mb", "1", "--kv-cache-memory-bytes", "8MiB",
                       "--allowed-local-media-path", str(media_dir), "--enable-runtime-lora") as srv:
        yield srv


# ====================================================================== strategies
def _image_urls(canary_port: int, media_dir) -> list[str]:
    png = png_bytes(1)
    return [
        data_url(png), data_url(png[:40]), data_url(b""), "data:image/png;base64,%%%", "data:,",
        data_url(pickle.dumps(object)), data_url(b"%!PS-Adobe-3.0\nshowpage\n"), data_url(png, "text/html"),
        f"http://127.0.0.1:{canary_port}/cat.png", f"https://127.0.0.1:{canary_port}/x",
        f"HTTP://localhost:{canary_port}/a", f"file://{media_dir}/cat.png", f"file://{media_dir}/notes.txt",
        f"file://{media_dir}/escape.png", f"file://{media_dir}/../../../../etc/passwd", "file:///etc/passwd",
        f"{media_dir}/cat.png", "/etc/shadow", "/dev/zero", "file:///dev/urandom", "ftp://127.0.0.1/x.png",
        "gopher://127.0.0.1:70/", "javascript:alert(1)", "", "x" * 5000,
    ]


texts = st.one_of(
    st.text(max_size=30),
    st.text(st.characters(codec="utf-8"), max_size=30),
    st.text(st.characters(categories=["Cs", "Co", "Cn", "Cc", "Zl", "Zp"]), max_size=8),  # surrogates & co
    st.sampled_from(["", " ", "\x00", "<|im_start|>", "<|image_pad|>" * 3, "<|vision_start|>", "{{ 7*7 }}",
                     "{% for x in range(10) %}x{% endfor %}", "\u202e", "\ufeff", "ÿ" * 10, "🙂" * 5]),
)
numbers = st.one_of(
    st.integers(), st.integers(min_value=-(2**130), max_value=2**130), st.floats(), st.sampled_from(
        [0, -1, 1, 2**31, 2**63, -(2**63) - 1, 2**64, 10**30, 1e308, -1e308, 5e-324, math.inf, -math.inf, math.nan]),
)
scalars = st.one_of(st.none(), st.booleans(), numbers, texts)
anything = st.recursive(scalars, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(texts, kids, max_size=4),
                        max_leaves=10)


def _chat_strategy(image_urls: list[str]):
    url = st.one_of(st.sampled_from(image_urls), texts)
    image_part = st.one_of(
        st.builds(lambda u: {"type": "image_url", "image_url": {"url": u}}, url),
        st.builds(lambda u: {"type": "image_url", "image_url": u}, url),
        st.builds(lambda u: {"type": "image", "image": u}, url),
        st.builds(lambda u: {"type": "input_image", "image_url": u}, url),
        st.builds(lambda v: {"type": "image_url", "image_url": v}, anything),
    )
    part = st.one_of(
        st.builds(lambda t: {"type": "text", "text": t}, texts), image_part,
        st.builds(lambda k, v: {"type": k, k: v},
                  st.sampled_from(["video_url", "input_audio", "audio_url", "file", "refusal", "tool", ""]) | texts,
                  anything),
        anything,
    )
    content = st.one_of(texts, st.lists(part, max_size=3), anything)
    message = st.one_of(
        st.builds(lambda r, c: {"role": r, "content": c},
                  st.sampled_from(["user", "assistant", "system", "tool", "developer", "function"]) | texts, content),
        st.builds(lambda c, calls: {"role": "assistant", "content": c, "tool_calls": calls}, content,
                  st.lists(st.one_of(anything, st.builds(
                      lambda n, a: {"id": "c", "type": "function", "function": {"name": n, "arguments": a}},
                      texts, anything | texts)), max_size=2)),
        anything,
    )
    fields = {
        "model": st.sampled_from([NAME, None, "", "gpt-4", "../../etc"]) | anything,
        "messages": st.lists(message, max_size=3) | anything,
        "max_tokens": st.integers(1, 8) | numbers | anything,
        "max_completion_tokens": st.integers(1, 8) | numbers | anything,
        "n": st.integers(1, 4) | numbers, "temperature": numbers | anything, "top_p": numbers,
        "top_k": numbers | anything, "min_p": numbers, "seed": numbers | anything, "min_tokens": numbers,
        "presence_penalty": numbers, "frequency_penalty": numbers, "repetition_penalty": numbers,
        "stop": texts | st.lists(texts, max_size=3) | anything, "stop_token_ids": st.lists(numbers, max_size=3),
        "logprobs": st.booleans() | numbers, "top_logprobs": numbers, "ignore_eos": st.booleans() | anything,
        "stream": st.booleans() | anything, "stream_options": st.fixed_dictionaries(
            {}, optional={"include_usage": st.booleans(), "continuous_usage_stats": st.booleans()}) | anything,
        "tools": st.lists(st.builds(lambda n, p: {"type": "function", "function": {"name": n, "parameters": p}},
                                    texts, anything), max_size=2) | anything,
        "tool_choice": st.sampled_from(["none", "auto", "required"]) | anything,
        "response_format": anything, "logit_bias": anything, "echo": anything, "use_beam_search": anything,
        "chat_template_kwargs": st.dictionaries(st.sampled_from(
            ["enable_thinking", "chat_template", "tokenize", "return_dict", "conversation", "tools",
             "add_generation_prompt", "documents", "padding", "x"]) | texts, anything, max_size=3) | anything,
        "add_generation_prompt": anything, "continue_final_message": anything, "skip_special_tokens": anything,
        "return_token_ids": anything, "return_tokens_as_token_ids": anything, "request_id": anything,
        "include_stop_str_in_output": anything, "prompt_logprobs": anything, "user": anything,
    }
    base = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    return _mutations(base, fields)


def _completion_strategy():
    token = st.integers(0, 767) | numbers
    fields = {
        "model": st.sampled_from([NAME, None, "", "nope"]) | anything,
        "prompt": st.one_of(texts, st.lists(token, max_size=8), st.lists(st.lists(token, max_size=5), max_size=3),
                            st.lists(texts, max_size=3), st.lists(st.integers(0, 767), min_size=120, max_size=200),
                            anything),
        "max_tokens": st.integers(1, 8) | numbers | anything, "n": st.integers(1, 4) | numbers,
        "temperature": numbers, "top_p": numbers, "top_k": numbers, "min_p": numbers, "seed": numbers,
        "min_tokens": numbers, "repetition_penalty": numbers, "presence_penalty": numbers,
        "stop": texts | st.lists(texts, max_size=3) | anything, "stop_token_ids": st.lists(numbers, max_size=3),
        "logprobs": numbers | anything, "echo": anything, "suffix": anything, "best_of": anything,
        "stream": st.booleans() | anything, "stream_options": anything, "ignore_eos": anything,
        "add_special_tokens": anything, "return_token_ids": anything, "return_tokens_as_token_ids": anything,
        "include_stop_str_in_output": anything, "logit_bias": anything, "response_format": anything,
    }
    base = {"model": NAME, "prompt": [1, 2, 3], "max_tokens": 4}
    return _mutations(base, fields)


def _mutations(base: dict, fields: dict):
    """``base`` with 1-3 fields set to drawn values (or removed); sometimes a wholly random object."""
    names = sorted(fields)

    @st.composite
    def body(draw):
        if draw(st.integers(0, 19)) == 0:
            return draw(anything)
        out = dict(base)
        for name in draw(st.lists(st.sampled_from(names), min_size=1, max_size=3, unique=True)):
            if draw(st.integers(0, 9)) == 0:
                out.pop(name, None)
            else:
                out[name] = draw(fields[name])
        return out

    return body()


def _raw_strategy():
    valid = json.dumps({"model": NAME, "prompt": [1, 2, 3], "max_tokens": 2}).encode()
    return st.one_of(
        st.binary(max_size=600),
        st.integers(0, len(valid)).map(lambda k: valid[:k]),
        st.binary(max_size=8).map(lambda b: valid[:20] + b + valid[20:]),
        st.sampled_from([b"", b"null", b"[]", b"{}", b'"x"', b"1e999999", b"[" * 100_000, b'{"a":' * 50_000,
                         b'{"prompt": [1], "max_tokens": 2, "prompt": "dup"}', b"\xef\xbb\xbf" + valid,
                         valid.replace(b"[1, 2, 3]", b"[1, 2, 3,]"), b'{"prompt": "\xff\xfe", "max_tokens": 2}',
                         b'{"prompt": "\xed\xa0\x80", "max_tokens": 2}', valid.decode().encode("utf-16"),
                         b'{"prompt": [1], "max_tokens": NaN}', b"\x00" * 64,
                         b'{"prompt": [' + b"1," * 200_000 + b"1]}"]),
    )


# ====================================================================== the property
class Tally:
    def __init__(self):
        self.status: dict[str, int] = {}
        self.n = 0
        self.slowest = 0.0

    def add(self, status: int, seconds: float):
        self.n += 1
        self.status[str(status)] = self.status.get(str(status), 0) + 1
        self.slowest = max(self.slowest, seconds)


def _encode(body) -> bytes:
    # ensure_ascii keeps lone surrogates as \ud800 escapes (what a client in another language may send)
    return json.dumps(body, ensure_ascii=True, allow_nan=True).encode()


def _post(client: httpx.Client, path: str, content: bytes, tally: Tally, content_type: str = "application/json",
          what=None) -> None:
    t0 = time.perf_counter()
    try:
        r = client.post(path, content=content, headers={"content-type": content_type} if content_type else {})
    except httpx.TimeoutException:
        raise AssertionError(f"no answer within {TIMEOUT_S} s (hang) for {path}: {str(what or content)[:400]}")
    tally.add(r.status_code, time.perf_counter() - t0)
    where = f"{path} {r.status_code}: {r.text[:300]} <- {str(what or content)[:400]}"
    assert r.status_code < 500, where
    assert r.status_code in (200, 400, 404, 413), where
    if r.status_code != 200:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["code"] == r.status_code, where
        assert isinstance(err["message"], str) and err["message"], where
    elif r.headers["content-type"].startswith("text/event-stream"):
        lines = [ln for ln in r.text.splitlines() if ln.startswith("data: ")]
        assert lines and lines[-1] == "data: [DONE]", where
        events = [json.loads(ln[6:]) for ln in lines[:-1]]
        assert not [e for e in events if "error" in e], where
        assert [c for e in events for c in e["choices"] if c.get("finish_reason")], where
    elif path.startswith("/v1/") and "completions" in path:
        data = r.json()
        assert data["choices"] and all(c["finish_reason"] in ("stop", "length") for c in data["choices"]), where


def _settings(n: int, ci: bool):
    return settings(max_examples=n, deadline=None, database=None, derandomize=ci, print_blob=True,
                    phases=[Phase.explicit, Phase.generate], report_multiple_bugs=False,
                    suppress_health_check=list(HealthCheck))


def _still_serving(server) -> None:
    r = httpx.post(server.base + "/v1/chat/completions", timeout=TIMEOUT_S, json={
        "model": NAME, "messages": [{"role": "user", "content": "still there?"}], "max_tokens": 3})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length"), r.text
    assert server.alive()


@pytest.mark.parametrize("scale", [pytest.param(1, id="ci"), pytest.param(12, marks=pytest.mark.slow, id="full")])
def test_fuzzed_requests_never_5xx_or_hang(server, canary, media_dir, scale, request):
    ci = scale == 1
    before = metrics(server.base)
    tallies = {"chat": Tally(), "completions": Tally(), "raw": Tally()}
    t0 = time.perf_counter()
    with httpx.Client(base_url=server.base, timeout=TIMEOUT_S) as client:
        @_settings(240 * scale, ci)
        @given(body=_chat_strategy(_image_urls(canary.port, media_dir)))
        def chat(body):
            _post(client, "/v1/chat/completions", _encode(body), tallies["chat"], what=body)

        @_settings(180 * scale, ci)
        @given(body=_completion_strategy())
        def completions(body):
            _post(client, "/v1/completions", _encode(body), tallies["completions"], what=body)

        @_settings(180 * scale, ci)
        @given(raw=_raw_strategy(), path=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/tokenize",
                                                           "/detokenize", "/v1/load_lora_adapter"]),
               ctype=st.sampled_from(["application/json", "text/plain", "application/x-www-form-urlencoded",
                                      "multipart/form-data; boundary=x", ""]))
        def raw(raw, path, ctype):
            _post(client, path, raw, tallies["raw"], content_type=ctype)

        chat()
        _still_serving(server)
        completions()
        _still_serving(server)
        raw()
        _still_serving(server)
    wall = time.perf_counter() - t0
    after = metrics(server.base)
    errors = {k: v - errors_by_status(before).get(k, 0) for k, v in errors_by_status(after).items()}
    write_figures(f"fuzz_{request.node.callspec.id}", {
        "test": f"tests/test_reliability_fuzz.py::{request.node.name}",
        "requests": sum(t.n for t in tallies.values()),
        "by_endpoint": {k: {"requests": t.n, "status_counts": t.status, "slowest_s": round(t.slowest, 3)}
                        for k, t in tallies.items()},
        "server_errors_by_status": {str(k): v for k, v in errors.items()},
        "canary_connections": canary.connections, "client_timeout_s": TIMEOUT_S, "wall_s": round(wall, 1),
        "derandomized": ci, "hypothesis": hypothesis.__version__,
    })
    assert canary.connections == 0, "the server fetched an image URL (SSRF)"
    assert errors.get(500, 0) == 0


# ====================================================================== inputs the fuzzing found
REGRESSIONS = {
    # A lone surrogate must not reach the tokenizer or the UTF-8 encoding of an error message (a 500).
    "surrogate_in_model_name": ("/v1/chat/completions", b'{"model": "\\ud800", "messages": [{"role": "user", '
                                b'"content": "hi"}]}', 400, "model"),
    "surrogate_in_content": ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\udfffb"}], '
                             b'"max_tokens": 2}', 400, "messages[0].content"),
    "surrogate_in_prompt": ("/v1/completions", b'{"prompt": "x\\ud83d", "max_tokens": 2}', 400, "prompt"),
    "raw_cesu8_surrogate": ("/v1/completions", b'{"prompt": "\xed\xa0\x80", "max_tokens": 2}', 400, "prompt"),
    "paired_surrogates_are_text": ("/v1/completions", b'{"prompt": "\\ud83d\\ude00", "max_tokens": 2}', 200, None),
    # top_k beyond int64 must not overflow the sampler's tensor (the request would fail inside the engine: 500).
    "top_k_beyond_int64": ("/v1/completions", b'{"prompt": [1, 2], "max_tokens": 2, "top_k": '
                           + str(10**23).encode() + b"}", 200, None),
    # A request's own Jinja template must not run on the server (a nested loop would block the event loop).
    "request_chat_template": ("/v1/chat/completions", json.dumps({
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "chat_template_kwargs": {
            "chat_template": "{% for i in range(3000) %}{% for j in range(3000) %}{{ i }}{% endfor %}{% endfor %}"}}
    ).encode(), 400, "chat_template_kwargs"),
    "template_tokenize_kwarg": ("/v1/chat/completions", json.dumps({
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "chat_template_kwargs": {"tokenize": True}}
    ).encode(), 400, "chat_template_kwargs"),
    # JSON has no Infinity; temperature=Infinity would sample garbage with a 200.
    "infinite_temperature": ("/v1/completions", b'{"prompt": [1], "max_tokens": 2, "temperature": Infinity}', 400,
                             "temperature"),
}


@pytest.mark.parametrize("case", list(REGRESSIONS))
def test_fuzz_regressions(server, case):
    path, content, status, param = REGRESSIONS[case]
    r = httpx.post(server.base + path, content=content, headers={"content-type": "application/json"},
                   timeout=TIMEOUT_S)
    assert r.status_code == status, r.text
    if status != 200:
        assert r.json()["error"]["param"] == param, r.text
