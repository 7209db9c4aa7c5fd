"""`python -m unsloth_rollout.bench`: a tiny end-to-end run, its JSON schema, and the engine's logprob drift
against a teacher-forced forward (the oracle) staying <= 1e-5."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

RESULT_KEYS = {
    "backend": str, "output_tokens_per_s": float, "prompt_tokens_per_s": float, "ttft_p50_s": float,
    "ttft_p99_s": float, "peak_memory_bytes": int, "ratio_vs_engine": float,
}


def _run_cli(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "bench.json"
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, "-m", "unsloth_rollout.bench", *args, "--json", str(out), "--markdown",
         str(tmp_path / "bench.md"), "--plot", str(tmp_path / "bench.png"), "--no-progress"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc, json.loads(out.read_text())


@pytest.fixture(scope="module")
def text_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench")
    proc, report = _run_cli(tmp, "--model", "tiny-lm", "--prompts", "2", "--group", "3", "--max-new-tokens", "6",
                            "--ignore-eos", "--drift-samples", "3", "--hf-sequential-max", "2",
                            "--backends", "engine,hf-sequential,hf-batched,transformers-cb,vllm,sglang")
    return tmp, proc, report


def test_cli_json_schema(text_run):
    _, _, report = text_run
    assert {"machine", "workload", "results", "skipped"} <= set(report)
    for key in ("cpu", "cores", "torch", "transformers", "device"):
        assert report["machine"][key] is not None, key
    wl = report["workload"]
    assert (wl["kind"], wl["prompts"], wl["group"], wl["requests"], wl["max_new_tokens"]) == ("grpo", 2, 3, 6, 6)
    assert [r["backend"] for r in report["results"]] == ["engine", "hf-sequential", "hf-batched", "transformers-cb"]
    for row in report["results"]:
        for key, typ in RESULT_KEYS.items():
            assert isinstance(row[key], typ), (row["backend"], key, row[key])
        assert row["output_tokens_per_s"] > 0 and row["prompt_tokens_per_s"] > 0
        assert 0 <= row["ttft_p50_s"] <= row["ttft_p99_s"]
        assert "logprob_drift" in row
    assert report["results"][0]["ratio_vs_engine"] == pytest.approx(1.0)
    skipped = {s["backend"]: s["reason"] for s in report["skipped"]}
    assert set(skipped) == {"vllm", "sglang"}
    assert all(reason for reason in skipped.values())


def test_cli_counts_the_tokens_requested(text_run):
    """With --ignore-eos every sample runs to its own budget: the oracle is the workload's budgets."""
    _, _, report = text_run
    wl = report["workload"]
    expected = round(wl["sample_budget_mean"] * wl["requests"])
    rows = {r["backend"]: r for r in report["results"]}
    for name in ("engine", "hf-batched", "transformers-cb"):
        assert rows[name]["requests_run"] == wl["requests"]
        assert rows[name]["output_tokens"] == expected, name
    assert rows["hf-sequential"]["requests_run"] == 2


def test_cli_engine_logprob_drift(text_run):
    _, _, report = text_run
    rows = {r["backend"]: r for r in report["results"]}
    assert rows["engine"]["drift_samples_checked"] == 3
    assert rows["engine"]["logprob_drift"] <= 1e-5
    # HF baselines return raw logits (output_logits) and CB its logprobs: also checked, looser (padding, kernels).
    for name in ("hf-sequential", "hf-batched", "transformers-cb"):
        assert rows[name]["logprob_drift"] is not None and rows[name]["logprob_drift"] <= 1e-4, name


def test_cli_writes_table_and_plot(text_run):
    tmp, proc, report = text_run
    md = (tmp / "bench.md").read_text()
    for row in report["results"]:
        assert f"| {row['backend']} |" in md
        assert f"| {row['backend']} |" in proc.stdout
    assert "vllm: vllm is not installed" in md or "vllm: vllm needs a CUDA GPU" in md
    assert (tmp / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_rejects_bad_arguments(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "unsloth_rollout.bench", "--model", "tiny-lm", "--backends",
                           "engine,nope", "--no-progress"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 2
    assert "--backends" in proc.stderr and "nope" in proc.stderr


def test_vlm_run_in_process():
    """Tiny VLM with vision + language LoRA: engine drift <= 1e-5 with pixel_values in the teacher-forced forward;
    transformers continuous batching is skipped with its reason."""
    from unsloth_rollout.bench import run_bench

    report = run_bench("tiny-vlm", prompts=2, group=2, max_new_tokens=5, backends=["engine", "hf-batched",
                                                                                   "transformers-cb"],
                       drift_samples=4, progress=False)
    rows = {r["backend"]: r for r in report["results"]}
    assert set(rows) == {"engine", "hf-batched"}
    assert report["workload"]["images"] == 2
    assert rows["engine"]["drift_samples_checked"] == 4
    assert rows["engine"]["logprob_drift"] <= 1e-5
    assert "vision + language" in rows["engine"]["lora"]
    skipped = {s["backend"]: s["reason"] for s in report["skipped"]}
    assert "text-only" in skipped["transformers-cb"]


def test_compiled_engine_runs_beside_the_eager_one():
    """``--backends engine,engine-compiled,engine-eager``: the compiled step forced on and every step eager are
    bench backends of their own, opt-in (not in the default list), their samples as many tokens as the default
    engine's, drift <= 1e-5 against the teacher-forced forward, no recompile after the warm-up."""
    from unsloth_rollout.bench import run_bench
    from unsloth_rollout.bench.backends import DEFAULT_BACKENDS

    assert "engine-compiled" not in DEFAULT_BACKENDS and "engine-eager" not in DEFAULT_BACKENDS
    assert "engine" in DEFAULT_BACKENDS
    report = run_bench("tiny-lm", prompts=2, group=2, max_new_tokens=6,
                       backends=["engine", "engine-compiled", "engine-eager"], drift_samples=4, progress=False)
    rows = {r["backend"]: r for r in report["results"]}
    assert set(rows) == {"engine", "engine-compiled", "engine-eager"}, report["skipped"]
    for name in ("engine-compiled", "engine-eager"):
        assert rows[name]["output_tokens"] == rows["engine"]["output_tokens"]
        assert rows[name]["logprob_drift"] <= 1e-5
    assert not any("compiled decode" in n for n in rows["engine-eager"]["notes"])
    st = rows["engine-compiled"]["engine_stats"]
    assert st["decode_recompiles"] == 0 and st["decode_warmup_s"] > 0, st
    assert any("compiled decode" in n for n in rows["engine-compiled"]["notes"])


def test_old_backend_names_are_still_accepted():
    """``engine-static`` (the bench) and ``static`` (``--workload long``) name the compiled step, as they did; an
    unknown name is refused, before any model is loaded."""
    from unsloth_rollout.bench import run_bench
    from unsloth_rollout.bench.long import backend_spec

    with pytest.raises(ValueError, match=r"unknown backend\(s\) \['engine-fast'\]"):
        run_bench("tiny-lm", backends=["engine-static", "engine-fast"], progress=False)
    assert backend_spec("static-whole-rows@2") == ("compiled", True, 2) == backend_spec("compiled-whole-rows@2")


def test_a_failing_engine_makes_the_bench_fail(monkeypatch, capsys):
    """A backend that raises (the engine included) is reported and the command exits non-zero."""
    from unsloth_rollout.bench import __main__ as cli
    from unsloth_rollout.bench import harness

    real = harness._run_backend

    def run_backend(name, *args, **kwargs):
        if name == "engine":
            raise RuntimeError("simulated engine failure")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(harness, "_run_backend", run_backend)
    rc = cli.main(["--model", "tiny-lm", "--backends", "engine,hf-batched", "--prompts", "1", "--group", "2",
                   "--max-new-tokens", "3", "--no-progress", "--kv-cache-memory-bytes", "16MiB"])
    assert rc == 1
    assert "backends failed: engine" in capsys.readouterr().err


def test_parse_bytes_is_the_one_memory_unit():
    from unsloth_rollout.engine.config import parse_bytes

    assert parse_bytes("1073741824") == parse_bytes("1GiB") == 1 << 30
    assert parse_bytes("512MiB") == 512 << 20 and parse_bytes("1.5GB") == 1_500_000_000 and parse_bytes(7) == 7
    with pytest.raises(ValueError, match="byte count"):
        parse_bytes("12 parsecs")


def test_long_workload(tmp_path):
    """`--workload long`: the gather backend reads the paged pool through an index every step, the workspace
    never does; the KV bytes a step attends to follow the model's own dimensions; logprobs at the long context
    match a teacher-forced forward (<= 1e-5)."""
    out = tmp_path / "long.json"
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, "-m", "unsloth_rollout.bench", "--workload", "long", "--model", "tiny-lm", "--batch", "3",
         "--contexts", "24,160", "--steps", "3", "--drift-samples", "2", "--json", str(out), "--markdown",
         str(tmp_path / "long.md"), "--no-progress"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(out.read_text())
    from transformers import AutoConfig

    from unsloth_rollout.bench.harness import model_path

    cfg = AutoConfig.from_pretrained(model_path("tiny-lm")).get_text_config()
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4
    assert report["kv_bytes_per_token"] == per_token
    rows = {(r["backend"], r["context"]): r for r in report["rows"]}
    assert set(rows) == {("workspace", 24), ("workspace", 160), ("gather", 24), ("gather", 160)}
    for (backend, ctx), r in rows.items():  # the first timed step: 3 rows of ctx + 1 cached tokens, one new
        assert r["kv_bytes_per_step"] == per_token * 3 * (ctx + 2)
        assert (r["pool_index_ops_per_step"] == 0) == (backend == "workspace"), r
        assert r["drift_samples_checked"] == 2 and r["logprob_drift"] <= 1e-5, r
        assert r["decode_tok_s"] > 0 and len(r["step_ms_all"]) == 3
    assert set(report["summary"]) == {"workspace", "gather"}
    md = (tmp_path / "long.md").read_text()
    assert "| workspace | 160 |" in md
    for backend, s in report["summary"].items():  # the measured ratio, short over long context, as printed
        assert s["ratio"] == rows[(backend, 24)]["decode_tok_s"] / rows[(backend, 160)]["decode_tok_s"]
        assert f"- {backend}: decode tok/s at 24 / at 160 = {s['ratio']:.2f}x;" in md, md
    # One prompt sampled 3 times: with shared prefixes the step reads the 160-token prompt once (its 10 full
    # blocks) and each row's own 1 + 1 positions; whole rows read 3 x 162. The 24-token prompt shares one block,
    # under the 32-position minimum: no prefix entry.
    proc = subprocess.run(
        [sys.executable, "-m", "unsloth_rollout.bench", "--workload", "long", "--model", "tiny-lm", "--batch", "3",
         "--group", "3", "--contexts", "24,160", "--steps", "3", "--drift-samples", "3", "--backends",
         "workspace,workspace-whole-rows", "--json", str(out), "--no-progress"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(out.read_text())
    rows = {(r["backend"], r["context"]): r for r in report["rows"]}
    assert report["group"] == 3 and "--group 3" in report["command"]
    assert rows[("workspace", 160)]["kv_bytes_per_step"] == per_token * (3 * 2 + 160)
    assert rows[("workspace-whole-rows", 160)]["kv_bytes_per_step"] == per_token * 3 * 162
    assert rows[("workspace", 24)]["kv_bytes_per_step"] == rows[("workspace-whole-rows", 24)]["kv_bytes_per_step"]
    assert rows[("workspace", 160)]["shared_prefix_steps"] > 0 and rows[("workspace", 24)]["shared_prefix_steps"] == 0
    assert all(r["shared_prefix_steps"] == 0 for (b, _), r in rows.items() if b == "workspace-whole-rows")
    assert all(r["logprob_drift"] <= 1e-5 for r in rows.values())


def test_long_workload_rejects_bad_arguments(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    for args, field in ((["--contexts", "64"], "--contexts"), (["--backends", "engine"], "--backends"),
                        (["--batch", "0"], "--batch"), (["--batch", "4", "--group", "3"], "--group")):
        proc = subprocess.run([sys.executable, "-m", "unsloth_rollout.bench", "--workload", "long", "--model",
                               "tiny-lm", *args, "--no-progress"], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=300, check=False)
        assert proc.returncode == 2, (args, proc.stderr[-2000:])
        assert field in proc.stderr, (args, proc.stderr[-2000:])


def test_help_gives_the_engine_s_shared_prompt_thresholds():
    """--shared-prefix-min-tokens' default, as the help states it, is the engine's: the eager threshold also for
    the compiled step on the CPU attention kernel (it reads prefix entries in the graph), the higher one only for
    the compiled step without it (its steps over prefix entries run eager)."""
    from unsloth_rollout.bench.__main__ import build_parser
    from unsloth_rollout.engine.decode.choose import COMPILED_MIN_SHARED, EAGER_MIN_SHARED

    text = " ".join(build_parser().format_help().split())
    assert (f"{EAGER_MIN_SHARED} with eager steps and with the compiled step on the CPU attention kernel, "
            f"{COMPILED_MIN_SHARED} with the compiled step without the kernel") in text, text
