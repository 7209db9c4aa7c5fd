"""engine/malloc.py: on Linux/glibc the engine keeps freed CPU memory for reuse, so that a forward's activations
do not fault their pages in again at every layer. Oracle: the kernel's page-fault count (getrusage)."""

from __future__ import annotations

import resource
import sys

import pytest
import torch

from unsloth_rollout import EngineConfig, RolloutEngine, load_model
from unsloth_rollout.engine import malloc

linux_glibc = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


@linux_glibc
def test_freed_activations_are_reused_without_page_faults(qwen2_dir):
    RolloutEngine(load_model(qwen2_dir, backend="transformers"), EngineConfig(kv_cache_memory_bytes=4 << 20)).shutdown()
    assert malloc.retain_freed_memory() is True, "the engine on a CPU set glibc's thresholds"
    pages = (16 << 20) // 4096
    for _ in range(2):  # the first round may grow the heap
        t = torch.empty(4 << 20)  # 16 MiB, an activation's size at a long prefill
        t.fill_(1.0)
        del t
    # Three windows of five: the best must be near zero. (Late in a long test process the heap is fragmented by
    # earlier tests, and one allocation may still land on a fresh region once; memory handed back would fault in
    # all 4096 pages at every allocation of every window.)
    windows = []
    for _ in range(3):
        before = _faults()
        for _ in range(5):
            t = torch.empty(4 << 20)
            t.fill_(1.0)
            del t
        windows.append(_faults() - before)
    assert min(windows) < pages // 10, f"freed memory was handed back and faulted in again: {windows}"


def test_the_setting_is_a_named_boolean():
    with pytest.raises(ValueError, match="cpu_retain_freed_memory"):
        EngineConfig(cpu_retain_freed_memory="yes")
