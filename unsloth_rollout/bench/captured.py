"""The compiled vs the eager decode step on a deep dispatch-bound model, beside HF ``generate()`` in the same process.

The model is ``--workload overhead``'s: ``--model``'s config (tiny-lm: hidden 64) at ``layers`` decoder
layers (36: Qwen2.5-3B's depth), random weights, LoRA r=``lora`` on every projection, so a step is dispatch,
not arithmetic. ``batch`` sequences with distinct random prompts of ``context`` tokens decode ``steps`` steps
(contexts grow by ``steps`` tokens), sampled at T=1 without EOS.

- HF: ``generate()`` on the whole batch (``min_new_tokens == max_new_tokens``, DynamicCache) for ``1 + steps``
  new tokens; its decode step = the median interval between consecutive calls of a stopping criterion that
  only reads the clock (generate calls it once per step, after the step's forward and sampling), so the prefill
  is not in it. (Before 2026-12-02 it was (time for 1 + steps tokens - time for 1 token) / steps, which a
  disturbed prefill could make negative.)
- each engine decode backend: an ``EngineCore`` built (``warmup_s``: its construction, which compiles the
  compiled step), the prompts prefilled, then ``steps`` decode steps timed; recompiles = torch._dynamo graphs
  compiled after construction. ``<backend>@<n>``: with ``DecodeConfig.layers_per_call=n`` (``auto@1``:
  the default with one decoder layer per compiled call, engine/decode/units.py).

Rounds alternate HF and the backends so load changes on a shared machine hit all alike; figures are medians.

    python -m unsloth_rollout.bench.captured --layers 36 --json benchmarks/cpu/captured.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def hf_step_ms(policy, prompts, steps: int) -> float:
    from transformers import StoppingCriteria, StoppingCriteriaList

    class Clock(StoppingCriteria):  # called once per generated token, after that step's forward and sampling
        def __init__(self):
            self.times = []

        def __call__(self, input_ids, scores, **kwargs):
            self.times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    ids = torch.tensor(prompts)
    clock = Clock()
    with torch.inference_mode():
        policy.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=1 + steps,
                              min_new_tokens=1 + steps, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                              stopping_criteria=StoppingCriteriaList([clock]))
    gaps = [b - a for a, b in zip(clock.times, clock.times[1:])]  # the first call follows the prefill
    assert len(gaps) == steps, (len(clock.times), steps)
    return 1000 * statistics.median(gaps)


def engine_run(policy, backend: str, context: int, batch: int, steps: int, seed: int) -> dict:
    from .long import setup

    g0 = _graphs()
    t = time.perf_counter()
    core = setup(policy, backend, context, batch, steps, seed)  # built (and warmed), prefilled, one decode step
    built_s = time.perf_counter() - t
    st = core.runner.decode_steps.compiled
    g1 = _graphs()
    trust = st.trust if st is not None else None
    g, tr = (trust.guarded_steps, trust.trusted_steps) if trust is not None else (0, 0)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - t)
    out = {"step_ms": 1000 * statistics.median(times), "setup_s": built_s,
           "warmup_s": st.warmup_s if st is not None else 0.0,
           "graphs_at_warmup": g1 - g0, "recompiles_after_warmup": _graphs() - g1,
           "eager_steps": st.eager_steps if st is not None else None, "ran": core.runner.decode_steps.backend,
           "layers_per_call": getattr(st, "unit_size", None),
           "guarded_steps": trust.guarded_steps - g if trust is not None else None,
           "trusted_steps": trust.trusted_steps - tr if trust is not None else None}
    del core
    return out


def run(model="tiny-lm", layers=8, batch=64, context=256, steps=32, backends=("workspace", "compiled"),
        rounds=2, lora=8, seed=0) -> dict:
    from .harness import machine_info
    from .overhead import deep_policy

    policy = deep_policy(model, layers, lora, seed)
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(100, min(len(policy.tokenizer), 5000), (batch, context), generator=g).tolist()
    load0 = os.getloadavg()
    per = {"hf": [], **{b: [] for b in backends}}
    for rnd in range(rounds):
        per["hf"].append({"step_ms": hf_step_ms(policy, prompts, steps)})
        for b in backends:
            per[b].append(engine_run(policy, b, context, batch, steps, seed))
            print(f"[captured] round {rnd} {b}: {per[b][-1]}", file=sys.stderr, flush=True)
        print(f"[captured] round {rnd} hf: {per['hf'][-1]}", file=sys.stderr, flush=True)
    hf = statistics.median(r["step_ms"] for r in per["hf"])
    summary = {"hf": {"step_ms": hf}}
    for b in backends:
        rs = per[b]
        summary[b] = {"step_ms": statistics.median(r["step_ms"] for r in rs),
                      "vs_hf": statistics.median(r["step_ms"] for r in rs) / hf,
                      "warmup_s_first": rs[0]["warmup_s"], "warmup_s_max": max(r["warmup_s"] for r in rs),
                      "recompiles_after_warmup": sum(r["recompiles_after_warmup"] for r in rs),
                      "ran": sorted({r.get("ran") for r in rs}), "layers_per_call": rs[0].get("layers_per_call")}
    return {"command": (f"python -m unsloth_rollout.bench.captured --model {model} --layers {layers} --batch {batch} "
                        f"--context {context} --steps {steps} --backends {','.join(backends)} --rounds {rounds} "
                        f"--lora-rank {lora} --seed {seed}"),
            "machine": machine_info(policy.device), "loadavg_before": list(load0),
            "loadavg_after": list(os.getloadavg()), "rounds": per, "summary": summary}


def markdown(rep: dict) -> str:
    m = rep["machine"]
    lines = [f"`{rep['command']}`", "",
             f"Machine: {m.get('cpu')} ({m.get('cores')} cores, {m.get('threads')} torch threads), torch "
             f"{m.get('torch')}; shared with other jobs (load average {rep['loadavg_before'][0]:.1f} before, "
             f"{rep['loadavg_after'][0]:.1f} after): absolute times are noisy, ratios are within one process.", "",
             "| decode | step (ms, median) | vs HF generate | warm-up (s, first / max) | recompiles after warm-up |",
             "|---|---:|---:|---:|---:|"]
    for name, s in rep["summary"].items():
        if name == "hf":
            lines.append(f"| HF generate() | {s['step_ms']:.1f} | 1.00x | - | - |")
        else:
            label = f"engine {name}" if not name.startswith("auto") else f"engine default (auto: {'/'.join(s['ran'])})"
            if s.get("layers_per_call"):
                label += f", {s['layers_per_call']} layer{'s' if s['layers_per_call'] > 1 else ''} per compiled call"
            lines.append(f"| {label} | {s['step_ms']:.1f} | {s['vs_hf']:.2f}x | {s['warmup_s_first']:.1f} / "
                         f"{s['warmup_s_max']:.1f} | {s['recompiles_after_warmup']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-lm")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--backends", default="workspace,compiled")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--lora-rank", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    rep = run(a.model, a.layers, a.batch, a.context, a.steps, tuple(a.backends.split(",")), a.rounds, a.lora_rank,
              a.seed)
    md = markdown(rep)
    print(md)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rep, f, indent=1)
        with open(a.json[:-5] + ".md", "w") as f:
            f.write(md)


if __name__ == "__main__":
    main()
