"""Faults under load against the real server (subprocess, tiny VLM, a 1 MiB KV budget that forces preemption):
clients that hang up mid-stream or time out, abort storms, pause(keep)/resume and weight-version bumps, an
AReaL abort-pause, a LoRA adapter loaded while requests run, corrupt images, and an exception injected into
one request's prefill. Every request must end with tokens or a clear error; greedy outputs must be what a
teacher-forced forward picks (LoRA outputs: the PEFT model's forward); all KV returns to the pool; the
engine keeps serving.

Figures go to <figures>/reliability/ (.figures/, or benchmarks/ via scripts/record_figures.sh): faults_<variant>.json. CI: 48 workers, 12 chaos cycles; ``-m slow``: 80.
"""

from __future__ import annotations

import asyncio
import json
import pickle
import random
import struct
import time
import zlib

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("psutil")
httpx = pytest.importorskip("httpx")

from _reliability_helpers import (MiB, GreedyOracle, ServerProcess, add_stream_event,  # noqa: E402
                                  check_kv_returned, data_url, metrics, png_bytes, wait_idle, write_figures)

from unsloth_rollout.testing.adapters import save_peft_adapter  # noqa: E402
from unsloth_rollout.testing.tiny import tiny_model_path  # noqa: E402

NAME = "tiny-vlm"
LORA = "chaos-lora"
WORKERS = 48
MAGIC = [701, 702, 703, 704]  # a prompt holding these ids makes the server's prefill raise (see PRELUDE)
PRELUDE = f"""
from unsloth_rollout.engine import runner as _runner
_prefill = _runner.ModelRunner.prefill
def _faulty_prefill(self, ids, *args, **kwargs):
    ids = list(ids)
    if any(ids[i:i + 4] == {MAGIC!r} for i in range(len(ids) - 3)):
        raise RuntimeError("injected fault (reliability test)")
    return _prefill(self, ids, *args, **kwargs)
_runner.ModelRunner.prefill = _faulty_prefill
_packed = _runner.ModelRunner.prefill_packed
def _faulty_packed(self, items, *args, **kwargs):
    for ids, *_ in items:
        ids = list(ids)
        if any(ids[i:i + 4] == {MAGIC!r} for i in range(len(ids) - 3)):
            raise RuntimeError("injected fault (reliability test)")
    return _packed(self, items, *args, **kwargs)
_runner.ModelRunner.prefill_packed = _faulty_packed
"""
TEXTS = ["Count to three.", "Name a colour.", "Say hello.", "What is two plus two?", "Tell me a story.",
         "Describe the sea in detail.", "List three fruits.", "Why is the sky blue?"]


def _png_claiming(width: int, height: int) -> bytes:
    """A PNG whose header claims ``width x height`` pixels (a decompression bomb's header, a few bytes long)."""
    png = png_bytes(0, (1, 1))
    ihdr = struct.pack(">II", width, height) + png[24:29]
    chunk = b"IHDR" + ihdr
    return png[:8] + struct.pack(">I", 13) + chunk + struct.pack(">I", zlib.crc32(chunk)) + png[33:]


def _corrupt_images() -> dict[str, str]:
    good = png_bytes(1)
    eps = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n0 0 moveto showpage\n"
    return {
        "truncated_png": data_url(good[: len(good) // 2]),
        "random_bytes": data_url(random.Random(0).randbytes(2048)),
        "png_magic_then_garbage": data_url(good[:16] + random.Random(1).randbytes(512)),
        "pickle_payload": data_url(pickle.dumps({"__reduce__": "os.system"})),
        "postscript": data_url(eps),
        "empty": "data:image/png;base64,",
        "bad_base64": "data:image/png;base64,!!!not base64!!!",
        "claims_1e10_pixels": data_url(_png_claiming(100_000, 100_000)),
        "aspect_ratio_300": data_url(png_bytes(2, (300, 1))),  # decodes; the image processor refuses it
    }


@pytest.fixture(scope="module")
def model_dir():
    return str(tiny_model_path("qwen2_5_vl", "tiny"))


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("faults")


@pytest.fixture(scope="module")
def adapter(model_dir, workdir):
    """A saved PEFT adapter of the tiny model with non-zero B (its outputs differ from the base)."""
    return save_peft_adapter(model_dir, workdir / "adapter")


@pytest.fixture(scope="module")
def server(model_dir, workdir):
    with ServerProcess(model_dir, workdir, "--served-model-name", NAME, "--max-model-len", "256",
                       "--kv-cache-memory-bytes", "1MiB", "--max-num-seqs", "64", "--enable-runtime-lora",
                       prelude=PRELUDE) as srv:
        yield srv


class Chaos:
    """The run's shared state: outcomes per request kind, the LoRA load time, the chaos log."""

    def __init__(self):
        self.results: list[dict] = []
        self.lora_loaded_at: float | None = None
        self.events: list[str] = []
        self.version = 0
        self.done = False  # the chaos script has run to its end


def _body(rng: random.Random, stream: bool, model: str = NAME, chat: bool | None = None) -> tuple[str, dict]:
    chat = rng.random() < 0.5 if chat is None else chat
    common = {"model": model, "max_tokens": rng.randint(16, 64), "temperature": 0, "ignore_eos": True,
              "return_token_ids": True, "stream": stream}
    if chat:
        return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": rng.choice(TEXTS)}],
                                        "logprobs": True}
    prompt = [rng.randrange(1, 700) for _ in range(rng.randint(3, 40))]
    return "/v1/completions", {**common, "prompt": prompt, "logprobs": 0}


async def _send(client: httpx.AsyncClient, path: str, body: dict, timeout=120.0, read_chunks: int | None = None
                ) -> dict:
    """POST and classify: status, tokens, finish, errors; ``read_chunks``: hang up after that many SSE events."""
    res = {"status": None, "prompt_ids": None, "output_ids": [], "logprobs": [], "finish": None,
           "error_events": [], "done": False, "body": body}
    if not body.get("stream"):
        r = await client.post(path, json=body, timeout=timeout)
        res["status"] = r.status_code
        data = r.json()
        if r.status_code == 200:
            ch = data["choices"][0]
            res["output_ids"], res["finish"] = ch["token_ids"], ch["finish_reason"]
            res["prompt_ids"] = data.get("prompt_token_ids") or ch.get("prompt_token_ids")
            lp = ch["logprobs"]
            res["logprobs"] = [x["logprob"] for x in lp["content"]] if "content" in lp else lp["token_logprobs"]
            res["done"] = data["usage"]["completion_tokens"] == len(ch["token_ids"])
        else:
            res["error"] = data["error"]
        return res
    async with client.stream("POST", path, json=body, timeout=timeout) as r:
        res["status"] = r.status_code
        if r.status_code != 200:
            res["error"] = json.loads(await r.aread())["error"]
            return res
        n = 0
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                res["done"] = True
                break
            e = json.loads(line[6:])
            if "error" in e:
                res["error_events"].append(e["error"])
                continue
            add_stream_event(res, e)
            for ch in e["choices"]:
                res["finish"] = ch.get("finish_reason") or res["finish"]
            n += 1
            if read_chunks is not None and n >= read_chunks:
                res["hung_up"] = True
                break
    return res


async def _worker(client, w: int, n_requests: int, chaos: Chaos, corrupt: dict[str, str]) -> None:
    rng = random.Random(1000 + w)
    i = 0
    while i < n_requests or not chaos.done:  # at least n_requests, and load until the chaos script ends
        i += 1
        kind = rng.choices(["normal", "disconnect", "timeout", "corrupt", "fault", "lora"],
                           [50, 14, 6, 10, 6, 14])[0]
        out = {"kind": kind, "worker": w, "i": i}
        started = time.perf_counter()
        try:
            if kind == "normal":
                out.update(await _send(client, *_body(rng, stream=rng.random() < 0.5)))
            elif kind == "disconnect":
                out.update(await _send(client, *_body(rng, stream=True), read_chunks=rng.randint(1, 3)))
            elif kind == "timeout":
                try:
                    out.update(await _send(client, *_body(rng, stream=False), timeout=0.3))
                except httpx.TimeoutException:
                    out["timed_out"] = True
            elif kind == "corrupt":
                name = rng.choice(sorted(corrupt))
                body = {"model": NAME, "max_tokens": 8, "stream": rng.random() < 0.5, "messages": [{
                    "role": "user", "content": [{"type": "image_url", "image_url": {"url": corrupt[name]}},
                                                {"type": "text", "text": "What is this?"}]}]}
                out["image"] = name
                out.update(await _send(client, "/v1/chat/completions", body))
            elif kind == "fault":
                _, body = _body(rng, stream=rng.random() < 0.5, chat=False)
                body["prompt"] = body["prompt"][:5] + MAGIC + body["prompt"][5:]
                out.update(await _send(client, "/v1/completions", body))
            else:
                out["after_load"] = chaos.lora_loaded_at is not None and started > chaos.lora_loaded_at
                out.update(await _send(client, *_body(rng, stream=rng.random() < 0.5, model=LORA)))
        except Exception as e:  # transport errors, malformed responses: the request is lost
            out["lost"] = f"{type(e).__name__}: {e}"
        out["latency_s"] = time.perf_counter() - started
        chaos.results.append(out)


async def _abort_storm(client, rng: random.Random, chaos: Chaos, n: int = 32) -> None:
    """``n`` streams start; once each has its first token (or after 20 s) they all hang up at once."""
    go = asyncio.Event()
    started = []

    async def one(k):
        _, body = _body(random.Random(k), stream=True, chat=False)
        body["max_tokens"] = 200
        out = {"kind": "storm"}
        try:
            async with client.stream("POST", "/v1/completions", json=body, timeout=120) as r:
                out["status"] = r.status_code
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        break
                started.append(k)
                await asyncio.wait_for(go.wait(), 30)
            out["hung_up"] = True
        except Exception as e:
            out["lost"] = f"{type(e).__name__}: {e}"
        chaos.results.append(out)

    tasks = [asyncio.ensure_future(one(rng.randrange(10**6))) for _ in range(n)]
    deadline = time.perf_counter() + 20
    while len(started) < n and time.perf_counter() < deadline and not all(t.done() for t in tasks):
        await asyncio.sleep(0.02)
    go.set()
    await asyncio.gather(*tasks)
    chaos.events.append(f"abort storm: {len(started)}/{n} streams hung up together")


async def _chaos(client, chaos: Chaos, adapter_path: str, cycles: int) -> None:
    """A fixed script of pause(keep)/version/resume cycles with the other faults at set points."""
    rng = random.Random(7)
    for it in range(1, cycles + 1):
        await asyncio.sleep(rng.uniform(0.1, 0.3))
        r = await client.post("/pause", params={"mode": "keep"})
        assert r.status_code == 200 and (await client.get("/is_paused")).json() == {"is_paused": True}
        await asyncio.sleep(rng.uniform(0.02, 0.15))
        chaos.version += 1
        r = await client.post("/update_weight_version", json={"version": chaos.version})
        assert r.status_code == 200, r.text
        assert (await client.post("/resume")).status_code == 200
        if it == 2:  # a LoRA adapter loads while requests run
            r = await client.post("/v1/load_lora_adapter", json={"lora_name": LORA, "lora_path": adapter_path},
                                  timeout=120)
            assert r.status_code == 200, r.text
            chaos.lora_loaded_at = time.perf_counter()
            chaos.events.append(f"LoRA adapter loaded at iteration {it}")
        if it % 6 == 4:
            await _abort_storm(client, rng, chaos)
        if it % 10 == 7:  # AReaL's pause: in-flight requests return their partial output (finish_reason "abort")
            assert (await client.post("/areal_pause_generation")).json()["success"] is True
            await asyncio.sleep(0.1)
            assert (await client.post("/areal_continue_generation")).json()["success"] is True
            chaos.events.append(f"areal abort-pause at iteration {it}")
    chaos.events.append(f"{cycles} pause(keep)/version/resume cycles")
    chaos.done = True


async def _run(server, adapter_path: str, n_requests: int, cycles: int) -> Chaos:
    chaos = Chaos()
    corrupt = _corrupt_images()
    limits = httpx.Limits(max_connections=WORKERS + 48, max_keepalive_connections=WORKERS + 48)
    async with httpx.AsyncClient(base_url=server.base, limits=limits, timeout=120) as client:
        chaos_task = asyncio.ensure_future(_chaos(client, chaos, adapter_path, cycles))
        workers = asyncio.gather(*[_worker(client, w, n_requests, chaos, corrupt) for w in range(WORKERS)])
        try:  # a hang fails here rather than never ending
            await asyncio.wait_for(asyncio.gather(chaos_task, workers), timeout=600)
        finally:
            chaos.done = True
    return chaos


def _classify(x: dict) -> str:
    """'ok': complete with tokens; 'aborted': cut short by an abort-pause (finish_reason "abort", the tokens
    so far); 'clean_error': the expected clear error; 'client_left': the client hung up or timed out on
    purpose; 'lost': anything else."""
    if x.get("lost"):
        return "lost"
    kind, status = x["kind"], x.get("status")
    if kind in ("disconnect", "storm") and x.get("hung_up") and status == 200:
        return "client_left"
    if kind == "timeout" and x.get("timed_out"):
        return "client_left"
    if kind == "corrupt":
        err = x.get("error") or {}
        ok = status == 400 and str(err.get("param", "")).startswith("messages") and err.get("message")
        return "clean_error" if ok else "lost"
    if kind == "fault":
        if status == 500 and "injected fault" in (x.get("error") or {}).get("message", ""):
            return "clean_error"
        if status == 200 and x["done"] and any("injected fault" in e["message"] for e in x["error_events"]):
            return "clean_error"
        # Aborted by the abort-pause before its prefill ran (so before the fault could fire).
        return "aborted" if status == 200 and x["done"] and x["finish"] == "abort" else "lost"
    if kind == "lora" and status == 404 and not x.get("after_load"):
        return "clean_error"  # sent before the adapter was loaded
    if status == 200 and x["done"] and not x["error_events"] and x["finish"] in ("length", "abort"):
        if x["finish"] == "length" and len(x["output_ids"]) != x["body"]["max_tokens"]:
            return "lost"
        return "ok" if x["finish"] == "length" else "aborted"
    return "lost"


@pytest.mark.parametrize("n_requests,cycles", [pytest.param(6, 12, id="ci"),
                                               pytest.param(40, 80, marks=pytest.mark.slow, id="full")])
def test_faults_under_load_lose_nothing(server, model_dir, adapter, n_requests, cycles, request):
    adapter_path, peft_model = adapter
    # The server is shared by the variants: start each without the adapter its chaos script loads.
    httpx.post(server.base + "/v1/unload_lora_adapter", json={"lora_name": LORA}, timeout=60)
    before = metrics(server.base)
    rss0 = server.rss()
    t0 = time.perf_counter()
    chaos = asyncio.run(_run(server, adapter_path, n_requests, cycles))
    wall = time.perf_counter() - t0
    for x in chaos.results:
        x["outcome"] = _classify(x)
    lost = [x for x in chaos.results if x["outcome"] == "lost"]

    # Oracle: greedy outputs (finished or cut short by an abort) are what a teacher-forced forward picks.
    base_oracle, lora_oracle = GreedyOracle(model_dir), GreedyOracle(model_dir, model=peft_model)
    seen = set()
    for x in chaos.results:
        if x["outcome"] in ("ok", "aborted") and x["kind"] in ("normal", "lora") and x["prompt_ids"]:
            key = (x["kind"], tuple(x["prompt_ids"]), tuple(x["output_ids"]))
            if key not in seen:
                seen.add(key)
                (lora_oracle if x["kind"] == "lora" else base_oracle).check(x["prompt_ids"], x["output_ids"],
                                                                            x["logprobs"])

    m = wait_idle(server.base)
    version = httpx.get(server.base + "/get_weight_version").json()["weight_version"]
    kv = check_kv_returned(server.base)
    # The engine keeps serving: a final greedy request, checked against the oracle.
    final = httpx.post(server.base + "/v1/completions", json={
        "model": NAME, "prompt": [9, 8, 7, 6], "max_tokens": 12, "temperature": 0, "ignore_eos": True,
        "logprobs": 0, "return_token_ids": True}, timeout=60)
    assert final.status_code == 200, final.text
    ch = final.json()["choices"][0]
    base_oracle.check([9, 8, 7, 6], ch["token_ids"], ch["logprobs"]["token_logprobs"])
    log = server.log()

    counts: dict[str, dict[str, int]] = {}
    for x in chaos.results:
        counts.setdefault(x["kind"], {}).setdefault(x["outcome"], 0)
        counts[x["kind"]][x["outcome"]] += 1
    delta = {k: m[k] - before.get(k, 0) for k in ("unsloth_rollout_engine_num_preemptions_total",
                                                  "unsloth_rollout_engine_aborted_total",
                                                  "unsloth_rollout_engine_errors_total")}
    record = {
        "test": f"tests/test_reliability_faults.py::{request.node.name}",
        "server": "tiny random Qwen2.5-VL, --kv-cache-memory-bytes 1MiB (128 blocks x 16 tokens), --max-model-len 256",
        "workers": WORKERS, "min_requests_per_worker": n_requests, "chaos_cycles": cycles,
        "requests": len(chaos.results),
        "outcomes_by_kind": counts, "lost": len(lost), "wall_s": round(wall, 1),
        "preemptions": int(delta["unsloth_rollout_engine_num_preemptions_total"]),
        "engine_aborted": int(delta["unsloth_rollout_engine_aborted_total"]),
        "engine_errors": int(delta["unsloth_rollout_engine_errors_total"]),
        "oracle_checked_pairs": base_oracle.checked + lora_oracle.checked,
        "lora_outputs_checked": lora_oracle.checked, "final_weight_version": version,
        "chaos": chaos.events, "rss_before_mib": round(rss0 / MiB, 1), "rss_after_mib": round(server.rss() / MiB, 1),
        **kv,
    }
    write_figures(f"faults_{request.node.callspec.id}", record)

    assert not lost, f"{len(lost)} lost: {[{k: v for k, v in x.items() if k != 'body'} for x in lost[:3]]}"
    assert version == chaos.version
    assert delta["unsloth_rollout_engine_num_preemptions_total"] > 0, "the KV budget never forced a preemption"
    assert counts["normal"].get("ok", 0) > 0 and counts.get("fault", {}).get("clean_error", 0) > 0
    assert counts.get("corrupt", {}).get("clean_error", 0) > 0
    assert lora_oracle.checked > 0, "no LoRA request ran after the adapter loaded"
    assert any("injected fault" in line for line in log.splitlines())
    assert server.alive()
