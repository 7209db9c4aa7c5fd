"""Shared fixtures: offline tiny models (built once per machine, cached) and HF oracles."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np
import pytest
import torch

from unsloth_rollout.testing.oracles import mm_token_type_ids, perturb_lora, teacher_forced  # noqa: F401
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


def pytest_collection_modifyitems(config, items):
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


def figures_root():
    """Where tests write measured figures: $UNSLOTH_ROLLOUT_FIGURES, else the ignored .figures/ folder.
    ``scripts/record_figures.sh`` points it at benchmarks/ to refresh the recorded ones."""
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1]
    return pathlib.Path(os.environ.get("UNSLOTH_ROLLOUT_FIGURES") or root / ".figures")


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


def random_images(n: int, seed: int = 0):
    from PIL import Image

    rng = np.random.default_rng(seed)
    sizes = [(64, 48), (40, 90), (56, 56), (30, 70), (84, 28)]
    return [Image.fromarray(rng.integers(0, 255, (*sizes[i % len(sizes)], 3), dtype=np.uint8)) for i in range(n)]


def teacher_forced_logprobs(policy, prompt_ids, output_ids, temperature=1.0, pixel_values=None, image_grid_thw=None,
                            mm=None):
    """log_softmax(logits / T) of each output token from one full forward over prompt + output (the oracle),
    and the logits; see unsloth_rollout.testing.oracles. ``mm``: any other family's processor outputs for the
    prompt (pixel_values, image_sizes, token_type_ids ...)."""
    vision = {k: v for k, v in (mm or {}).items() if k not in ("input_ids", "attention_mask")}
    if pixel_values is not None:
        vision.update(pixel_values=pixel_values, image_grid_thw=image_grid_thw)
    return teacher_forced(policy, prompt_ids, output_ids, temperature, **vision)


@pytest.fixture
def qwen2_lora_policy(qwen2_dir):
    """The tiny Qwen2 with LoRA r=8 whose B matrices are random (so LoRA is not a no-op)."""
    from unsloth_rollout import load_model

    torch.manual_seed(0)  # LoRA A init draws from the global RNG
    p = load_model(qwen2_dir, backend="transformers", lora={"r": 8})
    perturb_lora(p.model, std=0.3)
    return p


def run_staggered(engine, early: list, late: list, timeout: float = 300, preempt: bool = True):
    """Submit ``early``, wait until the engine decodes, then submit ``late`` (arrivals mid-decode); with
    ``preempt``, once those decode too, preempt everything running (KV freed, recomputed when readmitted).
    Returns (outputs per request in order, the engine's stats at the end)."""
    import time

    futs = [engine.submit(r) for r in early]
    deadline = time.time() + 60
    while engine.stats()["decode_tokens"] == 0 and time.time() < deadline:
        time.sleep(0.001)
    futs += [engine.submit(r) for r in late]
    if preempt:  # a preemption whatever the timing: offload frees every running sequence's KV (recomputed later)
        done = engine.stats()["decode_tokens"]
        while engine.stats()["decode_tokens"] < done + len(late) and time.time() < deadline + 60:
            time.sleep(0.001)
        engine.offload()
        engine.onload()
    outs = [f.result(timeout=timeout) for f in futs]
    return outs, engine.stats()
