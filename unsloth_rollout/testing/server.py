"""The real server (``python -m unsloth_rollout.serve``) in a subprocess, for tests and demos.

Example::

    with serve_subprocess(model_dir, "--max-model-len", "256", log_path=tmp / "server.log") as base:
        httpx.get(base + "/health")
        openai_client(base).models.list()
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_subprocess(model_dir: str, *args: str, log_path, timeout_s: float = 600.0, env: dict | None = None):
    """Start ``unsloth-rollout serve model_dir *args`` on a free loopback port; yield its base URL; stop it. A server
    that exits is reported at once; ``timeout_s`` only bounds a start that is slow (its engine warms up its compiled
    decode step before it answers, minutes on a loaded 2-core machine)."""
    import httpx

    port = free_port()
    log = open(log_path, "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "unsloth_rollout.serve", str(model_dir), "--port", str(port), "--model-backend",
         "transformers", "--log-level", "warning", *args],
        stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, HF_HUB_OFFLINE="1", **(env or {})))
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + timeout_s
    try:
        while True:
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError("server did not start:\n" + open(log_path).read()[-4000:])
            time.sleep(0.3)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def openai_client(base: str, timeout: float = 120):
    """The official ``openai`` client on a server's ``/v1`` (no retries: a test sees the first answer)."""
    import openai

    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=timeout)


def metrics(base: str, client=None) -> dict:
    """/metrics as {name: value} (labels dropped, except finished_reason / status kept in the key)."""
    import httpx

    text = (client or httpx).get(base + "/metrics", timeout=30).text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key.split("{")[0] if "finished_reason" not in key and "status" not in key else key] = float(value)
    return out


def completion_length_reward(completions=None, **kwargs) -> list[float]:
    """A picklable toy reward (TRL's async GRPO sends reward functions to a spawned process): longer is better."""
    return [min(len(str(c)), 100) / 100.0 for c in completions or []]
