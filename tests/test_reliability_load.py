"""Load: 256 concurrent clients on loopback against the real server (subprocess, tiny VLM), streaming and not,
chat and text completions, some with an image. Every request must end with a complete response (zero lost,
zero 5xx); every greedy text output must be what a teacher-forced HF forward picks (the oracle: batching 256
requests changes nothing); the server's RSS must stay flat after warm-up; all KV returns to the pool.

Figures (latency p50/p99, requests, errors, RSS per round) go to <figures>/reliability/load_<variant>.json (.figures/, or benchmarks/ via scripts/record_figures.sh).
CI runs 6 rounds (1,536 requests); ``-m slow`` runs 32 rounds (8,192 requests).
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("psutil")
httpx = pytest.importorskip("httpx")

from _reliability_helpers import (MiB, GreedyOracle, ServerProcess, add_stream_event,  # noqa: E402
                                  check_kv_returned, data_url, errors_by_status, metrics, percentile, png_bytes,
                                  write_figures)


NAME = "tiny-vlm"
CLIENTS = 256
KINDS = ("chat", "chat_stream", "completion", "completion_stream")
TEXTS = ["Count to three.", "Name a colour.", "Say hello.", "What is two plus two?", "Tell me a story.",
         "Describe the sea.", "List three fruits.", "Why is the sky blue?"]
TOKEN_PROMPTS = [[11, 22, 33, 44], [55, 66, 77], [101, 7, 9, 300, 12], [5, 6, 7, 8, 9, 10], [200, 201],
                 [17, 19, 23, 29, 31, 37], [400, 3, 400, 3], [88, 99, 111, 222, 333]]
IMAGE = data_url(png_bytes(3))
# RSS after the last round may exceed RSS after round 1 (warm-up done) by at most this much.
RSS_MARGIN_ABS = 48 * MiB
RSS_MARGIN_REL = 0.08


@pytest.fixture(scope="module")
def server(qwen2_5_vl_dir, tmp_path_factory):
    with ServerProcess(qwen2_5_vl_dir, tmp_path_factory.mktemp("load"), "--served-model-name", NAME,
                       "--max-model-len", "256", "--kv-cache-memory-bytes", "16MiB", "--max-num-seqs", "256") as srv:
        yield srv


def _request(c: int, r: int) -> tuple[str, str, dict, bool]:
    """Client ``c``'s request in round ``r``: (kind, path, body, has_image); the mix rotates every round."""
    kind = KINDS[(c + r) % len(KINDS)]
    k = (c * 7 + r) % len(TEXTS)
    max_tokens = 4 + 4 * (c % 3)
    common = {"model": NAME, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True}
    if kind.startswith("chat"):
        image = c % 16 == 0
        content = ([{"type": "image_url", "image_url": {"url": IMAGE}}] if image else []) + \
                  [{"type": "text", "text": TEXTS[k]}]
        body = {**common, "messages": [{"role": "user", "content": content}], "logprobs": True}
        path = "/v1/chat/completions"
    else:
        image = False
        body = {**common, "prompt": TOKEN_PROMPTS[k], "logprobs": 0}
        path = "/v1/completions"
    if kind.endswith("stream"):
        body.update(stream=True, stream_options={"include_usage": True})
    return kind, path, body, image


def _check_choice(res: dict, finish, n_out: int, max_tokens: int, usage: dict | None) -> None:
    if finish not in ("stop", "length"):
        raise AssertionError(f"finish_reason {finish!r}")
    if finish == "length" and n_out != max_tokens:
        raise AssertionError(f"finish 'length' after {n_out} of {max_tokens} tokens")
    if n_out > max_tokens or (usage is not None and usage["completion_tokens"] != n_out):
        raise AssertionError(f"{n_out} tokens, usage {usage}")


async def _one(client: httpx.AsyncClient, c: int, r: int) -> dict:
    kind, path, body, image = _request(c, r)
    res = {"kind": kind, "image": image, "status": None, "error": None, "prompt_ids": None, "output_ids": [],
           "logprobs": []}
    t0 = time.perf_counter()
    try:
        if not body.get("stream"):
            resp = await client.post(path, json=body)
            res["status"] = resp.status_code
            if resp.status_code == 200:
                data = resp.json()
                choice = data["choices"][0]
                res["output_ids"] = choice["token_ids"]
                if kind == "chat":
                    res["prompt_ids"] = data["prompt_token_ids"]
                    res["logprobs"] = [x["logprob"] for x in choice["logprobs"]["content"]]
                else:
                    res["prompt_ids"] = choice["prompt_token_ids"]
                    res["logprobs"] = choice["logprobs"]["token_logprobs"]
                _check_choice(res, choice["finish_reason"], len(res["output_ids"]), body["max_tokens"], data["usage"])
            else:
                res["error"] = resp.text[:300]
        else:
            async with client.stream("POST", path, json=body) as resp:
                res["status"] = resp.status_code
                lines = [ln async for ln in resp.aiter_lines() if ln.startswith("data: ")]
            if res["status"] == 200:
                if not lines or lines[-1] != "data: [DONE]":
                    raise AssertionError("the stream did not end with [DONE]")
                events = [json.loads(ln[6:]) for ln in lines[:-1]]
                if any("error" in e for e in events):
                    raise AssertionError(f"error event: {[e for e in events if 'error' in e][0]}")
                finishes = [ch["finish_reason"] for e in events for ch in e["choices"] if ch.get("finish_reason")]
                if len(finishes) != 1:
                    raise AssertionError(f"{len(finishes)} finish chunks")
                for e in events:
                    add_stream_event(res, e)
                _check_choice(res, finishes[0], len(res["output_ids"]), body["max_tokens"], events[-1]["usage"])
            else:
                res["error"] = "\n".join(lines)[:300]
    except Exception as e:  # a transport error or an incomplete / malformed response: the request is lost
        res["error"] = f"{type(e).__name__}: {e}"
        res["lost"] = True
    res["latency_s"] = time.perf_counter() - t0
    return res


async def _rounds(server: ServerProcess, rounds: int) -> tuple[list[list[dict]], list[int], list[float]]:
    limits = httpx.Limits(max_connections=CLIENTS + 8, max_keepalive_connections=CLIENTS + 8)
    timeout = httpx.Timeout(300.0, connect=60.0)
    results, rss, walls = [], [], []
    async with httpx.AsyncClient(base_url=server.base, limits=limits, timeout=timeout) as client:
        for r in range(rounds):
            t0 = time.perf_counter()
            results.append(await asyncio.gather(*[_one(client, c, r) for c in range(CLIENTS)]))
            walls.append(time.perf_counter() - t0)
            rss.append(server.rss())
    return results, rss, walls


@pytest.mark.parametrize("rounds", [pytest.param(6, id="ci"), pytest.param(32, marks=pytest.mark.slow, id="full")])
def test_256_concurrent_clients_lose_nothing(server, qwen2_5_vl_dir, rounds, request):
    before = metrics(server.base)
    rss_start = server.rss()
    t0 = time.perf_counter()
    results, rss, walls = asyncio.run(_rounds(server, rounds))
    wall = time.perf_counter() - t0
    flat = [x for rnd in results for x in rnd]

    lost = [x for x in flat if x.get("lost")]
    by_status: dict[int, int] = {}
    for x in flat:
        by_status[x["status"] or 0] = by_status.get(x["status"] or 0, 0) + 1
    five_xx = [x for x in flat if x["status"] and x["status"] >= 500]
    four_xx = [x for x in flat if x["status"] and 400 <= x["status"] < 500]

    # Oracle: each distinct greedy (prompt, output) of a text request is what a teacher-forced forward picks.
    oracle = GreedyOracle(qwen2_5_vl_dir)
    seen = set()
    for x in flat:
        if x["status"] == 200 and not x.get("lost") and not x["image"]:
            key = (tuple(x["prompt_ids"]), tuple(x["output_ids"]))
            if key not in seen:
                seen.add(key)
                oracle.check(x["prompt_ids"], x["output_ids"], x["logprobs"])

    after = metrics(server.base)
    kv = check_kv_returned(server.base)
    lat = [x["latency_s"] for x in flat if x["status"] == 200 and not x.get("lost")]
    per_kind = {k: {"p50_s": round(percentile([x["latency_s"] for x in flat if x["kind"] == k], 50), 4),
                    "p99_s": round(percentile([x["latency_s"] for x in flat if x["kind"] == k], 99), 4)}
                for k in KINDS}
    baseline, final = rss[1], rss[-1]
    margin = max(RSS_MARGIN_ABS, RSS_MARGIN_REL * baseline)
    record = {
        "test": f"tests/test_reliability_load.py::{request.node.name}",
        "model": "tiny random Qwen2.5-VL (unsloth_rollout.testing.tiny), served by python -m unsloth_rollout.serve",
        "clients": CLIENTS, "rounds": rounds, "requests": len(flat),
        "mix": "chat / chat stream / completions / completions stream rotating per round; greedy, 4-12 tokens; "
               "1 in 16 chat requests with a 56x56 image",
        "completed": sum(1 for x in flat if x["status"] == 200 and not x.get("lost")),
        "lost": len(lost), "status_counts": {str(k): v for k, v in sorted(by_status.items())},
        "http_5xx": len(five_xx), "http_4xx": len(four_xx),
        "server_errors_by_status": {str(k): v - errors_by_status(before).get(k, 0)
                                    for k, v in errors_by_status(after).items()},
        "oracle_checked_pairs": oracle.checked,
        "latency_p50_s": round(percentile(lat, 50), 4), "latency_p99_s": round(percentile(lat, 99), 4),
        "latency_max_s": round(max(lat), 4) if lat else None, "latency_by_kind": per_kind,
        "round_wall_s": [round(w, 2) for w in walls], "wall_s": round(wall, 1),
        "requests_per_s": round(len(flat) / wall, 1),
        "generated_tokens": after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"],
        "rss_start_mib": round(rss_start / MiB, 1), "rss_after_round_mib": [round(v / MiB, 1) for v in rss],
        "rss_baseline_round": 1, "rss_growth_mib": round((final - baseline) / MiB, 1),
        "rss_margin_mib": round(margin / MiB, 1), **kv,
    }
    write_figures(f"load_{request.node.callspec.id}", record)
    assert not lost, f"{len(lost)} lost requests, e.g. {lost[0]}"
    assert not five_xx, f"{len(five_xx)} 5xx, e.g. {five_xx[0]}"
    assert not four_xx, f"valid requests refused: {four_xx[0]}"
    assert record["completed"] == CLIENTS * rounds
    assert oracle.checked >= len(TEXTS)
    assert final - baseline <= margin, f"RSS grew {record['rss_after_round_mib']} MiB (margin {margin / MiB:.0f})"
    # ... and the server still answers.
    ok = httpx.post(server.base + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200 and server.alive()
