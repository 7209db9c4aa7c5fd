"""Decode-step profile: is the KV history copied per step, how does decode cost grow with context, and what
share of a full-batch step is sampling + bookkeeping.

For each decode backend (engine/decode_backend.py) and each context length, ``--batch`` sequences with prompts
of that many tokens are prefilled and take one warm-up decode step (the rows join). Then ``--steps`` decode
steps of every configuration are timed interleaved (one step of each in turn, so load changes on a shared
machine hit all alike); the median step gives decode tok/s. One more step of each runs under torch's profiler: the ops that index into the paged pool (the per-step
KV-history copy of the "gather" backend) are counted, and the step's time is split into the model forward
(``ModelRunner.decode``), sampling (``Sampler.__call__``) and the rest (bookkeeping: arranging rows, stop
checks, appending tokens).

    PYTHONPATH=$PWD python benchmarks/profile_decode.py --model small-vlm --batch 32 --contexts 256,2048 \\
        --json benchmarks/cpu/profile-decode.json

The machine may be shared: compare within one run, as ratios (the script prints the load it saw).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from unsloth_rollout import EngineConfig, SamplingParams, load_model
from unsloth_rollout.bench.harness import _perturb_lora, cpu_pressure, model_path
from unsloth_rollout.engine.core import EngineCore
from unsloth_rollout.engine.inputs import PreparedPrompt
from unsloth_rollout.engine.kv_cache import KVCache
from unsloth_rollout.engine.runner import _text_dims
from unsloth_rollout.engine.sequence import Sequence


def pool_index_ops(prof, pool_rows: int) -> int:
    """Ops of a profiled step that read the paged pool through an index (a KV-history gather)."""
    return sum(1 for e in prof.events()
               if e.name in ("aten::index_select", "aten::gather", "aten::index", "aten::take")
               and any(isinstance(sh, list) and len(sh) == 3 and sh[0] == pool_rows for sh in e.input_shapes))


class Timed:
    """Wraps a bound method, accumulating its wall time."""

    def __init__(self, obj, name):
        self.obj, self.name, self.fn, self.total = obj, name, getattr(obj, name), 0.0
        setattr(obj, name, self)

    def __call__(self, *a, **k):
        t = time.perf_counter()
        try:
            return self.fn(*a, **k)
        finally:
            self.total += time.perf_counter() - t

    def restore(self):
        setattr(self.obj, self.name, self.fn)


def setup(policy, backend: str, context: int, batch: int, steps: int, seed: int) -> EngineCore:
    """An engine core with ``batch`` distinct random prompts of ``context`` tokens prefilled and joined."""
    per_token = KVCache.bytes_per_token(*_text_dims(policy.text_config), policy.dtype)
    kv_bytes = int(per_token * batch * (context + steps + 64) * 1.1)
    core = EngineCore(policy, EngineConfig(kv_cache_memory_bytes=kv_bytes, decode_backend=backend,
                                           max_num_seqs=batch), seed=seed)
    g = torch.Generator().manual_seed(seed)
    vocab = len(policy.tokenizer)
    for i in range(batch):  # distinct random prompts (no prefix sharing), sampled at T=1, never stopping early
        ids = torch.randint(100, min(vocab, 5000), (context,), generator=g).tolist()
        sp = SamplingParams(max_new_tokens=steps + 16, temperature=1.0, seed=i, ignore_eos=True)
        core.add(Sequence(f"p{i}", 0, PreparedPrompt(ids), sp))
    while any(s.num_cached == 0 for s in core.sequences()):
        core.step()  # prefills
    core.step()  # warm-up decode: the rows join the workspace (filled from the pool once)
    assert len(core.scheduler.running) == batch
    return core


def profiled_step(core: EngineCore) -> dict:
    """One step under torch's profiler: pool-index ops, and the step split into forward / sampler / the rest."""
    fwd, smp = Timed(core.runner, "decode"), Timed(core, "sampler")
    rows = core.kv.k[0].shape[0]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        t1 = time.perf_counter()
        core.step()
        step_s = time.perf_counter() - t1
    fwd.restore()
    smp.restore()
    other = step_s - fwd.total - smp.total
    return {"profiled_step_ms": 1000 * step_s, "pool_index_ops_per_step": pool_index_ops(prof, rows),
            "forward_share": fwd.total / step_s, "sampler_share": smp.total / step_s,
            "bookkeeping_share": other / step_s, "sampler_plus_bookkeeping_share": (smp.total + other) / step_s}


def timed_shares(core: EngineCore, n: int) -> dict:
    """Forward / sampler / rest shares summed over ``n`` plain (unprofiled) steps."""
    fwd, smp = Timed(core.runner, "decode"), Timed(core, "sampler")
    t = time.perf_counter()
    for _ in range(n):
        core.step()
    total = time.perf_counter() - t
    fwd.restore()
    smp.restore()
    return {"sampler_share_unprofiled": smp.total / total,
            "sampler_plus_bookkeeping_share_unprofiled": (total - fwd.total) / total}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="small-vlm")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--contexts", default="256,2048")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--backends", default="workspace,gather")
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    path = model_path(a.model)
    policy = load_model(path, backend="transformers",
                        lora={"r": a.lora_rank, "random_state": a.seed} if a.lora_rank else None)
    if a.lora_rank:
        _perturb_lora(policy, a.seed)
    load0 = os.getloadavg()
    ctxs = [int(x) for x in a.contexts.split(",")]
    configs = [(b, c) for b in a.backends.split(",") for c in ctxs]
    cores = {cfg: setup(policy, cfg[0], cfg[1], a.batch, a.steps, a.seed) for cfg in configs}
    # Interleaved: one step of each configuration in turn, so that load changes hit all of them alike.
    times = {cfg: [] for cfg in configs}
    for _ in range(a.steps):
        for cfg in configs:
            t = time.perf_counter()
            cores[cfg].step()
            times[cfg].append(time.perf_counter() - t)
    rows = []
    for cfg in configs:
        backend, ctx = cfg
        med = statistics.median(times[cfg])
        r = {"backend": backend, "context": ctx, "batch": a.batch, "steps": a.steps, "step_ms_median": 1000 * med,
             "step_ms_all": [round(1000 * x, 2) for x in times[cfg]], "decode_tok_s": a.batch / med}
        r.update(profiled_step(cores[cfg]))
        r.update(timed_shares(cores[cfg], 4))
        rows.append(r)
        print(f"{backend:9s} ctx {ctx:5d} batch {a.batch}: {r['decode_tok_s']:8.1f} tok/s (median step "
              f"{r['step_ms_median']:7.1f} ms)  pool-index ops/step {r['pool_index_ops_per_step']:3d}  "
              f"forward {r['forward_share']:.1%}  sampler {r['sampler_share']:.1%}  "
              f"bookkeeping {r['bookkeeping_share']:.1%}  (unprofiled sampler+bookkeeping "
              f"{r['sampler_plus_bookkeeping_share_unprofiled']:.1%})", flush=True)
        del cores[cfg]
    ratios = {}
    for backend in a.backends.split(","):
        by = {r["context"]: r for r in rows if r["backend"] == backend}
        ratios[backend] = by[min(ctxs)]["decode_tok_s"] / by[max(ctxs)]["decode_tok_s"]
        print(f"{backend}: decode tok/s at ctx {min(ctxs)} / at ctx {max(ctxs)} = {ratios[backend]:.2f}x "
              f"(goal <= 1.5x)")
    out = {"command": "PYTHONPATH=$PWD python benchmarks/profile_decode.py " + " ".join(argv or sys.argv[1:]),
           "model": a.model, "lora_rank": a.lora_rank, "torch_threads": torch.get_num_threads(),
           "loadavg_before": load0, "loadavg_after": os.getloadavg(), "cpu_pressure_after": cpu_pressure(),
           "rows": rows, "slowdown_short_to_long": ratios}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
