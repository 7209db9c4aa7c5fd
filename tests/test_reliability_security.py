"""Security of the real server (subprocess, tiny VLM, started with an API key and no --host):
loopback by default, 401 without the key, no remote image fetching (a local listener must see no
connection), local image files only under the allowed folder (no traversal, no escaping symlink), request
limits (body, images, pixels, n, max_tokens), and nothing from a request unpickled or evaluated (an AST scan
of the code that handles requests, plus payloads that would leave a trace if they were)."""

from __future__ import annotations

import argparse
import ast
import json
import pickle
import socket
import struct
import zlib

import pytest

pytest.importorskip("fastapi")
psutil = pytest.importorskip("psutil")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from _reliability_helpers import ROOT, Canary, ServerProcess, data_url, png_bytes, write_figures  # noqa: E402

from unsloth_rollout.testing.tiny import tiny_model_path  # noqa: E402

NAME = "tiny-vlm"
KEY = "s3cret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_MODEL_LEN = 128


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("security")


@pytest.fixture(scope="module")
def media_dir(workdir):
    d = workdir / "media"
    d.mkdir()
    (d / "cat.png").write_bytes(png_bytes(4))
    (d / "sub").mkdir()
    (d / "sub" / "dog.png").write_bytes(png_bytes(5))
    (workdir / "outside.png").write_bytes(png_bytes(6))  # a real image just outside the folder
    (d / "escape.png").symlink_to(workdir / "outside.png")
    (d / "passwd.png").symlink_to("/etc/passwd")
    (d / "sub" / "up").symlink_to(workdir)
    return d


@pytest.fixture(scope="module")
def server(media_dir, workdir):
    model_dir = str(tiny_model_path("qwen2_5_vl", "tiny"))
    with ServerProcess(model_dir, workdir, "--served-model-name", NAME, "--api-key", KEY,
                       "--max-model-len", str(MAX_MODEL_LEN), "--allowed-local-media-path", str(media_dir),
                       "--max-body-mb", "1", "--max-images-per-request", "2", "--max-image-pixels", "10000",
                       "--max-n", "4", "--kv-cache-memory-bytes", "8MiB", host_arg=False) as srv:  # default host
        yield srv


@pytest.fixture(scope="module")
def canary():
    c = Canary()
    yield c
    c.close()


def _chat(server, messages, headers=AUTH, **kw):
    body = {"model": NAME, "messages": messages, "max_tokens": 2, **kw}
    return httpx.post(server.base + "/v1/chat/completions", json=body, headers=headers, timeout=60)


def _image_msg(*urls):
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": u}} for u in urls]
             + [{"type": "text", "text": "What is it?"}]}]


def _err(r, status: int, needle: str | None = None, param: str | None = None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status
    if needle:
        assert needle in err["message"], err
    if param:
        assert err["param"] == param, err
    return err


# ====================================================================== network exposure and auth
def test_binds_loopback_by_default(server):
    from unsloth_rollout.serve.cli import add_serve_arguments

    assert add_serve_arguments(argparse.ArgumentParser()).parse_args(["m"]).host == "127.0.0.1"
    # The server was started without --host: it listens on loopback only.
    listening = [c.laddr for c in psutil.Process(server.pid).net_connections(kind="inet")
                 if c.status == psutil.CONN_LISTEN]
    assert listening and all(a.ip in ("127.0.0.1", "::1") for a in listening), listening
    others = [a.address for addrs in psutil.net_if_addrs().values() for a in addrs
              if a.family == socket.AF_INET and not a.address.startswith("127.")]
    for ip in others:  # the same port on a non-loopback address of this machine refuses the connection
        with pytest.raises(OSError), socket.create_connection((ip, server.port), timeout=2):
            pass


def test_api_key_required(server):
    body = {"model": NAME, "prompt": [1, 2], "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": "Basic " + KEY},
                    {"Authorization": f"Bearer {KEY}x"}, {"x-api-key": "nope"}):
        r = httpx.post(server.base + "/v1/completions", json=body, headers=headers, timeout=30)
        _err(r, 401)
    for path in ("/v1/models", "/pause", "/v1/load_lora_adapter", "/update_weight_version", "/tokenize"):
        method = httpx.get if path == "/v1/models" else httpx.post
        assert method(server.base + path, timeout=30).status_code == 401, path
    assert httpx.post(server.base + "/v1/completions", json=body, headers=AUTH, timeout=60).status_code == 200
    assert httpx.post(server.base + "/v1/completions", json=body, headers={"x-api-key": KEY},
                      timeout=60).status_code == 200
    assert httpx.get(server.base + "/health").status_code == 200  # probes stay open
    # The official client: typed AuthenticationError with a wrong key, a completion with the right one.
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base + "/v1", api_key="wrong", max_retries=0).models.list()
    good = openai.OpenAI(base_url=server.base + "/v1", api_key=KEY, max_retries=0, timeout=60)
    assert good.completions.create(model=NAME, prompt=[1, 2], max_tokens=1).choices[0].finish_reason


# ====================================================================== images: no SSRF, no escaping the folder
def test_no_remote_image_fetch(server, canary):
    urls = [f"http://127.0.0.1:{canary.port}/cat.png", f"https://127.0.0.1:{canary.port}/cat.png",
            f"HTTP://localhost:{canary.port}/x.png", f"http://[::1]:{canary.port}/x.png"]
    for url in urls:
        _err(_chat(server, _image_msg(url)), 400, "remote image URLs are disabled",
             "messages[0].content[0].image_url")
        for kind, part in (("image", {"type": "image", "image": url}),
                           ("input_image", {"type": "input_image", "image_url": url})):
            _err(_chat(server, [{"role": "user", "content": [part]}]), 400, "remote image",
                 f"messages[0].content[0].{kind}")
    for scheme in ("ftp", "gopher", "dict", "ldap"):
        _err(_chat(server, _image_msg(f"{scheme}://127.0.0.1:{canary.port}/x")), 400, "unsupported image URL")
    assert canary.connections == 0, "the server connected to an image URL"


def test_local_images_only_under_the_allowed_folder(server, media_dir, workdir):
    assert _chat(server, _image_msg(f"file://{media_dir}/cat.png")).status_code == 200
    assert _chat(server, _image_msg(f"{media_dir}/sub/dog.png")).status_code == 200
    escapes = [
        f"file://{media_dir}/../outside.png", f"file://{media_dir}/../../../../../../etc/passwd",
        f"file://{media_dir}/%2e%2e/outside.png", f"file://{media_dir}/sub/../../outside.png",
        f"file://{media_dir}/escape.png", f"file://{media_dir}/passwd.png", f"file://{media_dir}/sub/up/outside.png",
        f"{media_dir}/../outside.png", "file:///etc/passwd", "/etc/passwd", f"file://localhost{workdir}/outside.png",
        f"file://{media_dir}_evil/x.png", "/proc/self/environ", "file:///dev/zero",
    ]
    for url in escapes:
        _err(_chat(server, _image_msg(url)), 400, "outside the allowed media directory",
             "messages[0].content[0].image_url")
    _err(_chat(server, _image_msg(f"file://{media_dir}/missing.png")), 400, "no such image file")
    _err(_chat(server, _image_msg(f"file://{media_dir}/sub")), 400, "no such image file")  # a folder


# ====================================================================== limits
def _png_claiming(width: int, height: int) -> bytes:
    png = png_bytes(0, (1, 1))
    chunk = b"IHDR" + struct.pack(">II", width, height) + png[24:29]
    return png[:8] + struct.pack(">I", 13) + chunk + struct.pack(">I", zlib.crc32(chunk)) + png[33:]


def test_request_limits(server):
    rss0 = server.rss()
    small = data_url(png_bytes(1, (56, 56)))  # 3,136 pixels: under the 10,000 limit
    # Body size: declared, and streamed without a Content-Length.
    big = json.dumps({"model": NAME, "prompt": "x" * (1 << 20), "max_tokens": 1}).encode()
    _err(httpx.post(server.base + "/v1/completions", content=big, headers={**AUTH, "content-type": "application/json"},
                    timeout=60), 413, "exceeds")
    chunks = iter([big[i:i + 65536] for i in range(0, len(big), 65536)])  # chunked: no Content-Length
    _err(httpx.post(server.base + "/v1/completions", content=chunks,
                    headers={**AUTH, "content-type": "application/json"}, timeout=60), 413, "exceeds")
    # Images per request, pixels (a real image, and a header claiming 10^10 pixels: refused before decoding).
    _err(_chat(server, _image_msg(small, small, small)), 400, "At most 2", "messages")
    _err(_chat(server, _image_msg(data_url(png_bytes(2, (120, 100))))), 400, "pixels")
    _err(_chat(server, _image_msg(data_url(_png_claiming(100_000, 100_000)))), 400, "pixels")
    assert server.rss() - rss0 < 256 << 20  # the claimed 30 GB of pixels were never allocated
    # n and max_tokens.
    _err(_chat(server, [{"role": "user", "content": "hi"}], n=5), 400, "n must be at most 4", "n")
    _err(_chat(server, [{"role": "user", "content": "hi"}], max_tokens=MAX_MODEL_LEN), 400, "maximum context length",
         "max_tokens")
    r = httpx.post(server.base + "/v1/completions", headers=AUTH, timeout=60,
                   json={"model": NAME, "prompt": list(range(1, MAX_MODEL_LEN + 2)), "max_tokens": 1})
    _err(r, 400, "maximum context length", "prompt")
    assert _chat(server, _image_msg(small, small), n=4).status_code == 200  # at the limits: served


# ====================================================================== nothing unpickled or evaluated
class _Trap:
    """Unpickling this creates ``path`` (so a trace is left if anything ever unpickles request data)."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_pickle_and_code_payloads_are_data(server, workdir):
    trap = workdir / "unpickled"
    payload = pickle.dumps(_Trap(trap))
    r = _chat(server, _image_msg(data_url(payload)))
    _err(r, 400, "cannot decode image", "messages[0].content[0].image_url")
    _err(_chat(server, _image_msg(data_url(payload, "application/python-pickle"))), 400, "cannot decode image")
    # A PostScript "image": PIL would hand it to Ghostscript; the server only decodes raster formats.
    eps = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n(pwned) print showpage\n"
    _err(_chat(server, _image_msg(data_url(eps, "image/eps"))), 400, "supported formats")
    # Text that looks like code or a template stays text: it is tokenized, never run.
    for text in (payload.decode("latin-1"), "__import__('os').system('touch /tmp/x')", "{{ 7*7 }}{% raw %}"):
        r = httpx.post(server.base + "/v1/completions", headers=AUTH, timeout=60,
                       json={"model": NAME, "prompt": text, "max_tokens": 1, "return_token_ids": True})
        assert r.status_code == 200, r.text
    # A request's own chat template would be evaluated: refused.
    _err(_chat(server, [{"role": "user", "content": "hi"}], chat_template_kwargs={"chat_template": "{{ 7*7 }}"}),
         400, "chat_template", "chat_template_kwargs")
    r = httpx.post(server.base + "/tokenize", headers=AUTH, timeout=60, json={
        "messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"chat_template": "{{ 7*7 }}"}})
    _err(r, 400, "chat_template", "chat_template_kwargs")
    assert not trap.exists(), "request data was unpickled"


DANGEROUS_CALLS = {"eval", "exec", "compile", "__import__", "breakpoint"}
DANGEROUS_MODULES = {"pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve", "subprocess", "jsonpickle"}
DANGEROUS_ATTRS = {("os", "system"), ("os", "popen"), ("yaml", "load"), ("yaml", "unsafe_load"), ("torch", "load"),
                   ("pickle", "loads"), ("pickle", "load"), ("np", "load"), ("numpy", "load")}
# The code a request's data flows through: the server, the engine and the model loading it calls.
REQUEST_PATH = ["unsloth_rollout/serve", "unsloth_rollout/engine", "unsloth_rollout/models"]


def test_no_unpickling_or_eval_on_the_request_path():
    found = []
    files = [p for d in REQUEST_PATH for p in sorted((ROOT / d).rglob("*.py"))]
    assert len(files) > 10
    for path in files:
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in DANGEROUS_CALLS:
                found.append(f"{where} {node.func.id}()")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and isinstance(
                    node.func.value, ast.Name) and (node.func.value.id, node.func.attr) in DANGEROUS_ATTRS:
                if node.func.attr == "load" and any(k.arg == "weights_only" and isinstance(k.value, ast.Constant)
                                                    and k.value.value is True for k in node.keywords):
                    continue  # torch.load(weights_only=True) unpickles nothing but tensors
                found.append(f"{where} {node.func.value.id}.{node.func.attr}()")
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                bad = [n for n in names if n.split(".")[0] in DANGEROUS_MODULES]
                if bad:
                    found.append(f"{where} import {bad[0]}")
    assert not found, "code on the request path that could run request data:\n" + "\n".join(found)


def test_security_figures(server, canary):
    """Record what this file checked (RELIABILITY.md quotes it)."""
    write_figures("security", {
        "test": "tests/test_reliability_security.py",
        "checked": ["default host 127.0.0.1 (CLI default; server started without --host listens on loopback only)",
                    "401 without / with a wrong API key (6 header variants, 5 endpoints); /health open",
                    "remote image URLs (http, https, localhost, [::1]) -> 400, local listener saw 0 connections",
                    "file images: traversal (.., %2e%2e), symlinks out of the folder, absolute paths -> 400",
                    "limits: body 413 (declared and chunked), images per request, pixels (incl. a 10^10-pixel "
                    "header), n, max_tokens / context -> 400",
                    "pickle payload as image -> 400, never unpickled (trap file absent); EPS refused (no "
                    "Ghostscript); request chat templates refused; AST scan of serve/, engine/, models/"],
        "canary_connections": canary.connections, "request_path_scanned": REQUEST_PATH,
    })
    assert canary.connections == 0
