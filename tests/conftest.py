"""Fixtures and pytest hooks only: offline tiny models (built once per machine, cached), the smoke selection.
Shared helpers live in ``unsloth_rollout.testing`` (oracles, toy, drive, figures, server, waits, logs)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Under pytest-xdist each worker gets its share of the cores (the README's command: 2 workers on 2 cores, one torch
# thread each), and so do the processes its tests start (servers, trainers): OpenMP teams that together ask for more
# threads than there are cores wait at every barrier for a thread that is not running, and run several times slower.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
if _WORKERS > 1 and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // _WORKERS))
# Likewise inductor's compile workers: with more than one thread, every process that compiles (each worker, each
# server or trainer a test starts) starts a pool of subprocesses that each import torch, on cores already in use.
if _WORKERS > 1 and "TORCHINDUCTOR_COMPILE_THREADS" not in os.environ:
    os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = os.environ["OMP_NUM_THREADS"]

import pytest
import torch

if _WORKERS > 1:
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

from unsloth_rollout.testing.oracles import perturb_lora
from unsloth_rollout.testing.tiny import tiny_model_path


# The smoke selection (`pytest -m smoke`) that scripts/smoke_newest.sh runs on the newest transformers/peft pip
# resolves: engine greedy/logprob parity against HF on two text families (Qwen2 tiny, Llama real checkpoint) and one
# VLM (Qwen2.5-VL tiny, with LoRA). Listed here, in one place, by test node id.
SMOKE_TESTS = (
    "test_engine_parity.py::test_greedy_parity_batched_and_staggered[base-qwen2]",
    "test_engine_parity.py::test_greedy_parity_batched_and_staggered[lora-qwen2_5_vl]",
    "test_engine_parity.py::test_logprob_parity_with_batching_and_group_sharing[1.0-qwen2]",
    "test_real_checkpoint.py::test_real_checkpoint_mixed_length_batch_matches_hf",
    "test_families.py::test_family_mixed_batch_exact[gemma2]",
    "test_families.py::test_family_mixed_batch_exact[mistral]",
    "test_vlm_families.py::test_vlm_family_mixed_batch_exact[gemma3]",
)


# Test files that take longest (minutes: real-checkpoint GRPO runs, subprocess launches, every family's parity),
# run first: `--dist loadfile` hands a worker the next file when it is free, so a long file started last would keep
# one worker busy while the other has nothing left. The rest keep their collection order.
LONGEST_FIRST = (
    "test_compiled.py", "test_real_rl.py", "test_bench_cli.py", "test_areal_distributed.py", "test_real_checkpoint.py",
    "test_vlm_families.py", "test_families.py", "test_areal_train_engine.py", "test_trl.py",
    "test_lora_adapters.py", "test_engine_weight_updates.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0].split("/")[-1], len(rank)))
    found = set()
    for item in items:
        node = item.nodeid.split("/")[-1]
        if node in SMOKE_TESTS:
            item.add_marker(pytest.mark.smoke)
            found.add(node)
    # A renamed test or parameter must not silently drop out of the smoke run.
    files = {item.nodeid.split("/")[-1].split("::")[0] for item in items}
    missing = [t for t in SMOKE_TESTS if t.split("::")[0] in files and t not in found]
    if missing and config.getoption("markexpr") == "smoke":
        raise pytest.UsageError(f"smoke tests listed in conftest.SMOKE_TESTS but not collected: {missing}")


@pytest.fixture(scope="session")
def qwen2_dir():
    return str(tiny_model_path("qwen2", "tiny"))


@pytest.fixture(scope="session")
def qwen2_vl_dir():
    return str(tiny_model_path("qwen2_vl", "tiny"))


@pytest.fixture(scope="session")
def qwen2_5_vl_dir():
    return str(tiny_model_path("qwen2_5_vl", "tiny"))


@pytest.fixture(scope="session")
def model_dirs(qwen2_dir, qwen2_vl_dir, qwen2_5_vl_dir):
    return {"qwen2": qwen2_dir, "qwen2_vl": qwen2_vl_dir, "qwen2_5_vl": qwen2_5_vl_dir}


@pytest.fixture
def qwen2_lora_policy(qwen2_dir):
    """The tiny Qwen2 with LoRA r=8 whose B matrices are random (so LoRA is not a no-op)."""
    from unsloth_rollout import load_model

    torch.manual_seed(0)  # LoRA A init draws from the global RNG
    p = load_model(qwen2_dir, backend="transformers", lora={"r": 8})
    perturb_lora(p.model, std=0.3)
    return p


_THREADS = torch.get_num_threads()


@pytest.fixture(autouse=True)
def _torch_threads_restored():
    """Each test starts on the process's own torch thread count, whatever an earlier test set (a test driving a
    bench or a trainer in-process may call ``torch.set_num_threads``). fp32 reductions split by thread count, so a
    leaked count would make a later parity test's result depend on the order the tests ran in."""
    if torch.get_num_threads() != _THREADS:
        torch.set_num_threads(_THREADS)
    yield


# Seconds per test file (setup, call and teardown of its tests), summed in the process that reports (the xdist
# controller): the summary lists the longest files, which is what orders LONGEST_FIRST above.
_FILE_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report):
    name = report.nodeid.split("::")[0]
    _FILE_SECONDS[name] = _FILE_SECONDS.get(name, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    if len(_FILE_SECONDS) < 2:
        return
    terminalreporter.section("longest test files")
    for name, secs in sorted(_FILE_SECONDS.items(), key=lambda kv: -kv[1])[:20]:
        terminalreporter.write_line(f"{secs:8.1f}s {name}")
