"""Free the calling thread's OpenMP thread team before another thread takes over the model's work.

libgomp gives every OS thread that runs a parallel region a team of its own, kept until the thread exits, and
once a process manages more OpenMP threads than there are CPUs every team stops spinning and sleeps on a
futex between parallel regions: each of the hundreds of small ops in a decode step then pays a wake-up.
Measured on 2 cores: a thread that had run one forward made another thread's forwards 2.4-4.4x slower while
it merely existed. OpenMP 5.0's ``omp_pause_resource_all`` frees the calling thread's team; the next parallel
op on that thread builds a new one (one thread start, microseconds), so calling this costs nothing measurable.
"""

from __future__ import annotations

import ctypes
import functools
import os

_OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: free the threads, keep the settings
_RUNTIMES = ("libgomp", "libiomp5", "libomp")  # GNU (torch's Linux wheels), Intel, LLVM


@functools.lru_cache(maxsize=1)
def _pause_all():
    """``omp_pause_resource_all`` of the OpenMP runtime this process loaded, or None (none loaded / too old)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if line.rstrip().endswith((".so", ".so.1", ".so.5"))}
    except OSError:  # not Linux: nothing to free (macOS wheels use one libomp pool per process anyway)
        return None
    for path in sorted(paths):
        if os.path.basename(path).split(".")[0].split("-")[0] in _RUNTIMES:
            try:
                fn = ctypes.CDLL(path).omp_pause_resource_all
            except (OSError, AttributeError):
                continue
            fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
            return fn
    return None


def release_thread_team() -> bool:
    """Free the calling thread's OpenMP team (if it has one); True when a runtime took the call.

    Call it on a thread that is about to wait while another thread runs the model (the trainer waiting for
    rollouts, an event loop that hands requests to the engine's worker). Never call it inside a parallel
    region (torch never calls back into Python from one).
    """
    fn = _pause_all()
    return fn is not None and fn(_OMP_PAUSE_SOFT) == 0
