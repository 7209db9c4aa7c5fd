"""Driving an engine the way the tests need: sequences straight into an ``EngineCore`` stepped to the end, and
arrivals mid-decode with a forced preemption on a ``RolloutEngine``.

Example::

    core = engine_core(policy, kv_tokens=256, decode=DecodeConfig(backend="workspace"))
    seqs = add_sequences(core, prompts, max_new=[8] * len(prompts), temperature=0)
    step_until_idle(core, max_steps=2000)
    outs, stats = run_staggered(engine, early=[req_a, req_b], late=[req_c])
"""

from __future__ import annotations

import time

from ..engine.config import EngineConfig
from ..engine.core import EngineCore
from ..engine.kv_cache import KVCache
from ..models.families import text_dims


def engine_core(policy, kv_tokens: int | None = None, budget: int = 64 << 20, block_size: int = 16,
                **config) -> EngineCore:
    """An ``EngineCore`` (seed 0) whose KV pool holds ``kv_tokens`` positions (None: ``budget`` bytes), with the
    other ``EngineConfig`` settings given."""
    per_token = KVCache.bytes_per_token(*text_dims(policy.text_config), policy.dtype)
    kv_bytes = per_token * kv_tokens if kv_tokens else budget
    return EngineCore(policy, EngineConfig(kv_cache_memory_bytes=kv_bytes, block_size=block_size, **config), seed=0)


def add_sequences(core, prompts: list[list[int]], max_new: list[int], n: int = 1, seed_by_prompt: bool = False,
                  **sampling) -> list:
    """One ``Sequence`` per (prompt, sample) added to ``core``, request ids ``r0, r1, ...``, ``ignore_eos`` set;
    ``seed_by_prompt``: prompt i samples with seed i. ``sampling``: other ``SamplingParams`` fields."""
    from ..engine import SamplingParams
    from ..engine.inputs import PreparedPrompt
    from ..engine.sequence import Sequence

    seqs = []
    for i, ids in enumerate(prompts):
        seed = {"seed": i} if seed_by_prompt else {}
        sp = SamplingParams(max_new_tokens=max_new[i], n=n, ignore_eos=True, **seed, **sampling)
        prompt = PreparedPrompt(ids)
        seqs += [Sequence(f"r{i}", j, prompt, sp) for j in range(n)]
    for s in seqs:
        core.add(s)
    return seqs


def step_until_idle(core, max_steps: int, after_step=None) -> int:
    """Step ``core`` until its scheduler has no work; ``after_step()`` runs after each step (a per-step check).
    AssertionError after ``max_steps`` (a stuck scheduler fails the test instead of hanging it)."""
    steps = 0
    while core.scheduler.has_work():
        core.step()
        steps += 1
        if after_step is not None:
            after_step()
        assert steps < max_steps
    return steps


def run_staggered(engine, early: list, late: list, timeout: float = 300, preempt: bool = True):
    """Submit ``early``, wait until the engine decodes, then submit ``late`` (arrivals mid-decode); with
    ``preempt``, once those decode too, preempt everything running (KV freed, recomputed when readmitted).
    Returns (outputs per request in order, the engine's stats at the end)."""
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
