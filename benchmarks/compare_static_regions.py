"""The static decode's two compiled regions beside the eager workspace step, interleaved in one process.

"layer" (the default: one graph shared by every decoder layer) and "model" (the whole forward as one graph),
on ``--workload overhead``'s deep random Qwen2 (tiny-lm's hidden 64, LoRA r=8):

    PYTHONPATH=$PWD python benchmarks/compare_static_regions.py LAYERS BATCH CONTEXT STEPS \
        workspace,static-layer,static-model
"""

import functools
import os
import statistics
import sys
import time

from torch._dynamo.utils import counters

from unsloth_rollout.bench.long import setup
from unsloth_rollout.bench.overhead import deep_policy
from unsloth_rollout.engine import decode_static

layers, batch, ctx, steps = map(int, sys.argv[1:5])
pol = deep_policy("tiny-lm", layers, 8, 0)
init = decode_static.StaticDecode.__init__
cores, info = {}, {}
for name in sys.argv[5].split(","):
    be = "static" if name.startswith("static-") else name
    if be == "static":  # the engine builds StaticDecode with the default region: pick this one
        decode_static.StaticDecode.__init__ = functools.partialmethod(init, region=name.split("-")[1])
    g0, t = counters["stats"]["unique_graphs"], time.perf_counter()
    cores[name] = setup(pol, be, ctx, batch, steps + 8, 0)
    st = cores[name].runner.static
    info[name] = dict(setup_s=round(time.perf_counter() - t, 1), warm_s=round(st.warmup_s, 1) if st else 0,
                      graphs=counters["stats"]["unique_graphs"] - g0)
    print(name, info[name], flush=True)
times = {n: [] for n in cores}
g1 = counters["stats"]["unique_graphs"]
for _ in range(steps):
    for n, c in cores.items():
        t = time.perf_counter()
        c.step()
        times[n].append(1000 * (time.perf_counter() - t))
for n, ts in times.items():
    ts.sort()
    print(f"{n}: median {statistics.median(ts):.1f} min {ts[0]:.1f} p25 {ts[len(ts) // 4]:.1f} ms  {info[n]}")
print("graphs after warm-up", counters["stats"]["unique_graphs"] - g1, "loadavg", os.getloadavg())
