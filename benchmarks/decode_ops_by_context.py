"""Which ops of a decode step grow with the context: the bench's long-workload engines (``--workload long``'s
setup: ``batch`` distinct random prompts of each context length, prefilled and decoding) stepped in turn in one
process, each step under torch's profiler; per op, the mean self time a step at each context and the growth.

    PYTHONPATH=$PWD python benchmarks/decode_ops_by_context.py --contexts 256,2048 --rounds 8

(Compiled graphs are named per context bucket, so a graph's own wrapper rows appear under different names at
each context; the ops inside them keep their names.)
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import torch

from unsloth_rollout.bench.harness import model_path
from unsloth_rollout.bench.long import setup
from unsloth_rollout.models import load_model
from unsloth_rollout.testing.oracles import perturb_lora


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="small-vlm")
    p.add_argument("--contexts", default="256,2048")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--backend", default="auto")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--top", type=int, default=12)
    a = p.parse_args()
    ctxs = [int(c) for c in a.contexts.split(",")]
    torch.manual_seed(0)
    policy = load_model(model_path(a.model), backend="transformers", lora={"r": a.lora_rank, "random_state": 0})
    perturb_lora(policy.model, std=0.02, seed=0)
    policy.inference()
    cores = {c: setup(policy, a.backend, c, a.batch, a.rounds + 8, 0) for c in ctxs}
    for c in ctxs:
        cores[c].step()  # one more step each before timing
    total = {c: collections.Counter() for c in ctxs}
    wall = {c: [] for c in ctxs}
    for _ in range(a.rounds):
        for c in ctxs:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                t = time.perf_counter()
                cores[c].step()
                wall[c].append(time.perf_counter() - t)
            for e in prof.key_averages():
                total[c][e.key] += e.self_cpu_time_total / a.rounds / 1000
    lo, hi = ctxs[0], ctxs[-1]
    print(f"{a.model}, batch {a.batch}, decode backend {a.backend}, {a.rounds} profiled steps per context")
    print("step (ms, median, profiled): " + ", ".join(f"{c}: {1000 * statistics.median(wall[c]):.1f}" for c in ctxs))
    print(f"| op | ms a step at {lo} | at {hi} | growth |\n|---|---:|---:|---:|")
    keys = sorted(set(total[lo]) | set(total[hi]), key=lambda k: -(total[hi][k] - total[lo][k]))
    for k in keys[:a.top]:
        print(f"| {k[:70]} | {total[lo][k]:.2f} | {total[hi][k]:.2f} | {total[hi][k] - total[lo][k]:+.2f} |")


if __name__ == "__main__":
    main()
