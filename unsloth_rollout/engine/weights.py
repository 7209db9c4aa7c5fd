"""The weight clock and the stale-KV rule: what a weight change means for tokens and cached KV.

Every in-place change of the policy's weights is a method of the policy (``models/policy.py``: adapters, base
weights, checkpoints; an optimizer step changes them too) followed by ``RolloutEngine.weights_changed()``, which
bumps the ``WeightsClock`` here. At the next step boundary ``WeightsClock.apply`` drops prefix entries computed by
other weights and sends every sequence whose KV they computed back to be recomputed (the preemption path), so each
token stamped v is sampled from and scored by weights v. Find every change with ``grep -rn "weights_changed("``.
"""

from __future__ import annotations

import threading


class WeightsClock:
    """The weight version tokens are stamped with, and stamps saying which weights computed a KV entry.

    Bumped by every weight change (through ``RolloutEngine.weights_changed``); thread-safe."""

    def __init__(self):
        self._lock = threading.Lock()
        self.version = 0
        self._epoch = 0
        self._adapters: dict[str, int] = {}
        self._changes = 0  # bumps so far: a step only looks for stale KV when this moved
        self._changes_applied = 0  # bumps whose stale KV ``apply`` has already dealt with (engine thread only)

    def bump(self, version: int | None, lora_name: str | None) -> None:
        with self._lock:
            self._changes += 1
            if lora_name is None:
                self._epoch += 1
            else:
                self._adapters[lora_name] = self._adapters.get(lora_name, 0) + 1
            if version is not None:
                self.version = int(version)

    @property
    def changes(self) -> int:
        """Bumps so far (an int read: no lock needed)."""
        return self._changes

    def state(self):
        """(version, stamp_of(lora_name), number of changes so far), read together."""
        with self._lock:
            version, epoch, adapters, changes = self.version, self._epoch, dict(self._adapters), self._changes
        return version, lambda name: (epoch, adapters.get(name, 0)), changes

    def apply(self, scheduler, stamp_of, changes: int, recompute: bool, stats: dict) -> None:
        """The stale-KV rule: drop prefix entries computed by other weights and, when ``recompute``
        (``EngineConfig.recompute_on_weight_change``), put every sequence whose KV was computed by other weights back
        in line to be recomputed (as preemption does). ``changes``: the count ``state()`` returned with ``stamp_of``;
        nothing to look at when it has not moved. Call holding the engine's step lock."""
        if changes == self._changes_applied:
            return
        scheduler.prefix.drop_stale(stamp_of)
        if recompute:
            for s in reversed(list(scheduler.running)):  # reversed: preempt() puts each first in line, order is kept
                if s.num_cached > 0 and s.kv_stamp != stamp_of(s.lora_name):
                    scheduler.preempt(s, count=False)
                    stats["weight_recomputes"] += 1
        self._changes_applied = changes
