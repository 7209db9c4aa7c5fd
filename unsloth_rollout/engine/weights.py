"""The weight clock and the stale-KV rule: what a weight change means for tokens and cached KV.

Every in-place change of the policy's weights is a function of ``unsloth_rollout/models/weights.py``
(``load_adapter`` / ``unload_adapter``, ``load_base_weights``, ``load_checkpoint``, ``write_base_tensors``; an
optimizer step changes them too) followed by ``RolloutEngine.weights_changed()``, which
bumps the ``WeightsClock`` here. At the next step boundary ``WeightsClock.apply`` drops prefix entries computed by
other weights and sends every sequence whose KV they computed back to be recomputed (the preemption path), so each
token stamped v is sampled from and scored by weights v. Find every change with ``grep -rn "weights_changed("``.

PEFT's own switches change what the model computes without touching a weight: ``with model.disable_adapter():``,
``set_adapter`` on layers, ``merge_adapter`` / ``unmerge_adapter``, ``set_scale`` / ``scale_layer``. They set
attributes of each LoRA layer, which a caller rarely pairs with ``weights_changed``, so ``WeightsClock.watch``
reads those attributes at every step start (~40 us for 252 LoRA layers) and treats a change as a weight change:
the engine then serves the model as it is, as HF ``generate`` would, never KV or a compiled step of the old state.
``unload()`` and ``merge_and_unload()`` replace the LoRA layers with their base layers: ``watch`` also checks that
each LoRA layer is still its parent's child (one dict lookup per layer, in C).
"""

from __future__ import annotations

import copy
import itertools
import operator
import threading

from ..logs import get_logger
from .internals import LORA_SWITCHES, children

log = get_logger("unsloth_rollout")


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
        self._layers = None  # (model, the __dict__ of each of its LoRA layers, bumps when listed, _homes): ``watch``
        self._switches = None  # what those layers' LORA_SWITCHES were at the last step start
        self.switch_changes = 0  # changes of the switches that ``watch`` turned into a weight change

    def bump(self, version: int | None, lora_name: str | None) -> None:
        with self._lock:
            self._changes += 1
            if lora_name is None:
                self._epoch += 1
            else:
                self._adapters[lora_name] = self._adapters.get(lora_name, 0) + 1
            if version is not None:
                self.version = int(version)

    def watch(self, model) -> bool:
        """At a step start (engine thread): bump the clock when a LoRA layer's switches (``LORA_SWITCHES``) differ from
        the last step's without a bump since; True when it did. The layers are listed again after every bump
        (an adapter load may add LoRA layers), and the switches then read as they are."""
        changes = self._changes
        if self._layers is None or self._layers[0] is not model or self._layers[2] != changes:
            from ..models.adapters import tuner_layers  # models.adapters imports engine.config

            layers = tuner_layers(model)
            self._layers = (model, [m.__dict__ for m in layers], changes, _homes(model, layers))
            self._switches = None
        _, dicts, _, (children, names, layers) = self._layers
        if not dicts:
            return False
        now = [list(map(dict.get, dicts, itertools.repeat(a))) for a in LORA_SWITCHES]  # compared by value, in C
        placed = all(map(operator.is_, map(dict.get, children, names), layers))  # no LoRA layer unloaded
        if placed and (self._switches is None or now == self._switches):
            if self._switches is None:
                self._switches = copy.deepcopy(now)  # a list or a dict may change in place
            return False
        self._switches = copy.deepcopy(now)
        self.switch_changes += 1
        log.info("the policy's LoRA switches changed (disable_adapter, set_adapter, merge_adapter, set_scale, "
                 "unload or merge_and_unload): a weight change; cached KV of the old state is not used again")
        self.bump(None, None)
        # unloaded: listed again at the next step; else kept (its switches read as they are now)
        self._layers = (model, dicts, self._changes, (children, names, layers)) if placed else None
        return True

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


def _homes(model, layers: list) -> tuple[list, list, list]:
    """(each LoRA layer's parent's ``_modules`` dict, its name there, the layer): ``watch`` checks it is still there."""
    want = {id(m) for m in layers}
    home = {id(c): (children(p), n) for p in model.modules() for n, c in children(p).items() if id(c) in want}
    return [home[id(m)][0] for m in layers], [home[id(m)][1] for m in layers], list(layers)
