"""Waiting for a condition another thread or process brings about, with a deadline (a test never hangs).

Example::

    wait_for(lambda: engine.stats()["decode_tokens"] > 0, timeout=60, what="the first decode step")
"""

from __future__ import annotations

import time


def wait_for(cond, timeout: float = 60.0, what: str = "condition", poll_s: float = 0.001) -> None:
    """Return once ``cond()`` is true; AssertionError naming ``what`` after ``timeout`` seconds."""
    deadline = time.time() + timeout
    while not cond():
        if time.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(poll_s)
