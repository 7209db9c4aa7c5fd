"""Keep memory a CPU forward frees in the process, for the next forward (glibc's malloc).

A prefill forward allocates and frees activations of several MiB per layer. glibc's malloc serves the larger of
them with fresh mmaps and gives memory at the top of its heap back to the kernel once more than its trim
threshold is free, so the next layer's activations fault their pages in again: on the default bench one prefill
step took 50-220 thousand page faults, a third or more of its time on a VM where a fault costs microseconds.
Fixing both thresholds (``mallopt``; the same settings as ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_``)
keeps freed blocks for reuse, as tcmalloc and jemalloc do (vLLM's and Intel's CPU guides preload one of them).
The cost: the process's resident memory stays near its high-water mark instead of shrinking after a peak.

Process-wide and once: the first ``RolloutEngine`` on a CPU device calls it unless
``EngineConfig(cpu_retain_freed_memory=False)``; a no-op (False) off Linux/glibc, or where the allocator is not
glibc's (a preloaded tcmalloc or jemalloc takes the calls; glibc's settings then do not matter).
"""

from __future__ import annotations

import ctypes
import sys

import torch

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# Allocations up to this size come from the heap (reused once freed); larger ones are still mmapped. glibc caps
# it at HEAP_MAX_SIZE / 2 (32 MiB on 64-bit): a larger value is refused and the default stays.
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = (1 << 31) - 1  # never trim the heap's top while the process runs

_state: dict = {}


def retain_freed_memory(device=None, enabled: bool = True) -> bool:
    """Set glibc's mmap and trim thresholds (once per process; only for a CPU ``device`` when one is given, and
    only if ``enabled``); True when glibc took both."""
    if not enabled or (device is not None and torch.device(device).type != "cpu"):
        return bool(_state.get("ok"))
    if "ok" in _state:
        return _state["ok"]
    ok = False
    if sys.platform.startswith("linux"):
        try:
            mallopt = ctypes.CDLL("libc.so.6").mallopt
            mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
            ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
        except (OSError, AttributeError):  # not glibc (musl has no mallopt)
            ok = False
    _state["ok"] = ok
    return ok
