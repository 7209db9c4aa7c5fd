"""Shared helpers of the test_reliability_* files: the real server in a subprocess, its /metrics and RSS,
a teacher-forced oracle for greedy outputs, and the figures written to <figures>/reliability/*.json (figures_root)."""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import pathlib
import platform
import socket
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import torch

from unsloth_rollout.testing.figures import figures_root
from unsloth_rollout.testing.server import free_port, metrics  # noqa: F401 - the reliability tests' /metrics

ROOT = pathlib.Path(__file__).resolve().parents[1]


FIGURES = figures_root() / "reliability"
MiB = 1 << 20


class ServerProcess:
    """``python -m unsloth_rollout.serve MODEL ARGS...`` in a subprocess, started and waited for.

    ``prelude``: Python run in the server process before the CLI (fault injection). The server runs with
    OMP_NUM_THREADS=1: on a shared 2-core machine two OpenMP threads made each tiny matmul wait ~16 ms for
    a busy core (x2000 slower); one thread is what a tiny model wants anyway.

    Example::

        with ServerProcess(model_dir, tmp_path, "--max-model-len", "256") as srv:
            httpx.get(srv.base + "/health")
    """

    def __init__(self, model_dir: str, workdir: pathlib.Path, *args: str, prelude: str | None = None,
                 host_arg: bool = True, env: dict | None = None, name: str = "server"):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = pathlib.Path(workdir) / f"{name}.log"
        cmd = [model_dir, "--port", str(self.port), "--model-backend", "transformers", "--log-level", "warning", *args]
        if host_arg:
            cmd += ["--host", "127.0.0.1"]
        if prelude is None:
            argv = [sys.executable, "-m", "unsloth_rollout.serve", *cmd]
        else:
            argv = [sys.executable, "-c", prelude + "\nimport sys\nfrom unsloth_rollout.serve.cli import main\n"
                    "main(sys.argv[1:])\n", *cmd]
        self._log = open(self.log_path, "w")
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "UNSLOTH_ROLLOUT_API_KEY": "",
               **(env or {})}  # no API key unless --api-key: a key in the caller's environment stays out
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        self.pid = self.proc.pid
        deadline = time.time() + 240
        while True:
            try:
                if httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.time() > deadline:
                self.stop()
                raise RuntimeError("server did not start:\n" + self.log()[-4000:])
            time.sleep(0.2)

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def rss(self) -> int:
        import psutil

        return psutil.Process(self.pid).memory_info().rss

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()

class Canary:
    """A TCP listener on loopback that counts connections: an image URL pointing here must never be fetched."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        self._stop = False
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        self.sock.settimeout(0.2)
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.connections += 1
            conn.close()

    def close(self):
        self._stop = True
        self.sock.close()


def errors_by_status(m: dict) -> dict[int, float]:
    out = {}
    for k, v in m.items():
        if k.startswith("unsloth_rollout_http_errors_total") and 'status="' in k:
            out[int(k.split('status="')[1].split('"')[0])] = v
    return out


def wait_idle(base: str, timeout: float = 120.0) -> dict:
    """Wait until the engine has nothing running or waiting (aborted requests drain); return /metrics."""
    deadline = time.time() + timeout
    while True:
        m = metrics(base)
        if m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0:
            return m
        if time.time() > deadline:
            raise AssertionError(f"the engine did not go idle: {m}")
        time.sleep(0.1)


def check_kv_returned(base: str) -> dict:
    """Idle engine, prefix cache dropped: every KV block is back in the pool. Returns the figures."""
    wait_idle(base)
    assert httpx.post(base + "/reset_prefix_cache", timeout=60).status_code == 200
    m = metrics(base)
    free, total = m["unsloth_rollout_engine_kv_blocks_free"], m["unsloth_rollout_engine_kv_blocks_total"]
    assert free == total, f"KV blocks leaked: {total - free:.0f} of {total:.0f} still held"
    return {"kv_blocks_total": int(total), "kv_blocks_free": int(free)}


def add_stream_event(res: dict, event: dict) -> None:
    """Fold one SSE chunk (chat or completion) into ``res``: prompt ids, token ids and logprobs."""
    res["prompt_ids"] = res["prompt_ids"] or event.get("prompt_token_ids")
    for ch in event["choices"]:
        res["prompt_ids"] = res["prompt_ids"] or ch.get("prompt_token_ids")
        res["output_ids"] += ch.get("token_ids") or []
        lp = ch.get("logprobs")
        if lp:  # chat chunks carry logprobs.content, completion chunks token_logprobs
            res["logprobs"] += [x["logprob"] for x in lp["content"]] if "content" in lp else lp["token_logprobs"]


def percentile(values, q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=float), q)) if len(values) else float("nan")


def png_bytes(seed: int, size=(56, 56)) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def write_figures(name: str, record: dict) -> pathlib.Path:
    """<figures>/reliability/<name>.json, with the machine it ran on (see figures_root)."""
    FIGURES.mkdir(parents=True, exist_ok=True)
    path = FIGURES / f"{name}.json"
    record = {**record, "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                                    "torch": torch.__version__, "load_avg_1m": round(os.getloadavg()[0], 2)},
              "written": time.strftime("%Y-%m-%d %H:%M:%S")}
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path


@contextlib.contextmanager
def one_thread():
    """torch on one thread for the block (see ServerProcess: two threads crawl on a busy 2-core machine)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


class GreedyOracle:
    """Teacher-forced check of greedy outputs: one plain HF forward of prompt + output per distinct pair;
    each output token must be the argmax (vision tokens excluded, as the engine never samples them; ties
    within ``tie`` allowed) and each reported logprob must equal ``log_softmax(logits)[token]``."""

    def __init__(self, model_dir: str, tie: float = 1e-4, lp_tol: float = 1e-3, model=None):
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

        from unsloth_rollout.models.families import is_vlm_config

        cfg = AutoConfig.from_pretrained(model_dir)
        is_vlm = is_vlm_config(cfg)
        cls = AutoModelForImageTextToText if is_vlm else AutoModelForCausalLM
        self.model = model if model is not None else cls.from_pretrained(model_dir, dtype=torch.float32).eval()
        ids = [getattr(cfg, k, None) for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                                  "vision_end_token_id")] if is_vlm else []
        if is_vlm:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(model_dir)
            pad = tok.convert_tokens_to_ids("<|vision_pad|>")
            ids.append(pad if pad != tok.unk_token_id else None)
        self.masked = sorted({i for i in ids if isinstance(i, int)})
        self.tie, self.lp_tol = tie, lp_tol
        self.checked = 0

    def check(self, prompt_ids: list[int], output_ids: list[int], logprobs: list[float] | None = None) -> None:
        if not output_ids:
            return
        full = torch.tensor([list(prompt_ids) + list(output_ids)])
        with one_thread(), torch.inference_mode():
            logits = self.model(input_ids=full).logits[0, len(prompt_ids) - 1:-1].float()
        lp = torch.log_softmax(logits, dim=-1)
        masked = lp.clone()
        if self.masked:
            masked[:, self.masked] = float("-inf")
        out = torch.tensor(output_ids)
        chosen = masked.gather(1, out.unsqueeze(1)).squeeze(1)
        best = masked.max(dim=-1).values
        bad = (chosen < best - self.tie).nonzero().flatten().tolist()
        assert not bad, f"position {bad[0]}: token {output_ids[bad[0]]} is not the greedy choice " \
                        f"(prompt {prompt_ids[:8]}..., output {output_ids})"
        if logprobs is not None:
            want = lp.gather(1, out.unsqueeze(1)).squeeze(1).tolist()
            assert np.allclose(logprobs, want, atol=self.lp_tol), (logprobs, want)
        self.checked += 1
