"""Decode attention on CPU, per layer: SDPA with the engine's mask vs the engine's kernel (engine/decode/cpu_kernel.py)
vs one plain read of the same keys and values (``torch.sum``, the floor of any attention that reads them once).

Each shape holds ``layers`` layers of K/V, walked in turn as a decode step walks its layers, so the history is
not cache-resident (as in a real step). Every row attends over its whole ``keys`` (the KV view is strided: rows
of a workspace with spare capacity). Figures are medians of ``--repeats`` passes over all layers, in us a layer:

    PYTHONPATH=$PWD python benchmarks/cpu_attention_kernel.py --json benchmarks/cpu/cpu_attention_kernel.json

Shapes: ``captured`` is the 36-layer bench's (``python -m unsloth_rollout.bench.captured``: batch 64, 2 KV heads x
2 query heads each, head dim 16, 272 keys); ``long`` is ``--workload long``'s 2048-token step (small-vlm: batch
32, 2 KV heads x 4, head dim 64, 8 layers).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from unsloth_rollout.engine.decode import cpu_kernel
from unsloth_rollout.engine.attention import ForwardContext

SHAPES = {"captured": dict(batch=64, kv_heads=2, group=2, head_dim=16, keys=272, layers=36),
          "long": dict(batch=32, kv_heads=2, group=4, head_dim=64, keys=2049, layers=8)}


def measure(batch, kv_heads, group, head_dim, keys, layers, repeats):
    g = torch.Generator().manual_seed(0)
    cap = keys + 32
    ks = [torch.randn(batch, kv_heads, cap, head_dim, generator=g)[:, :, :keys] for _ in range(layers)]
    vs = [torch.randn(batch, kv_heads, cap, head_dim, generator=g)[:, :, :keys] for _ in range(layers)]
    qs = [torch.randn(batch, kv_heads * group, 1, head_dim, generator=g) for _ in range(layers)]
    lengths = torch.full((batch,), keys - 1)
    ctx = ForwardContext.decode(lengths, keys)
    mask = ctx.additive_mask(None, torch.float32)
    lo, hi = ctx.key_range(None)
    b, h, d = batch, kv_heads * group, head_dim

    def sdpa(i):
        return torch.nn.functional.scaled_dot_product_attention(qs[i].reshape(b, kv_heads, group, d), ks[i], vs[i],
                                                                attn_mask=mask)

    def kernel(i):
        return cpu_kernel.decode_attention(qs[i], ks[i], vs[i], lo, hi, None)[0]

    def read(i):
        return ks[i].sum() + vs[i].sum()

    diff = max((kernel(i) - sdpa(i)).abs().max().item() for i in range(layers))
    fns = {"sdpa": sdpa, "kernel": kernel, "read": read}
    per = {n: [] for n in fns}
    for _ in range(repeats):
        for n, fn in fns.items():  # interleaved, so load changes hit all three alike
            t = time.perf_counter()
            for i in range(layers):
                fn(i)
            per[n].append((time.perf_counter() - t) / layers * 1e6)
    med = {n: statistics.median(v) for n, v in per.items()}
    return {"us_per_layer": med, "kernel_vs_sdpa": med["kernel"] / med["sdpa"],
            "kernel_vs_read": med["kernel"] / med["read"], "max_abs_diff_vs_sdpa": diff,
            "kv_bytes_per_layer": 2 * batch * kv_heads * keys * head_dim * 4}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    if not cpu_kernel.available():
        raise SystemExit(f"the kernel is not available here: {cpu_kernel.build_error()}")
    rep = {"command": f"PYTHONPATH=$PWD python benchmarks/cpu_attention_kernel.py --repeats {a.repeats}",
           "torch": torch.__version__, "threads": torch.get_num_threads(), "loadavg_before": os.getloadavg()}
    for name, shape in SHAPES.items():
        rep[name] = dict(shape=shape, **measure(**shape, repeats=a.repeats))
        r = rep[name]["us_per_layer"]
        print(f"{name:9s} sdpa {r['sdpa']:8.0f} us  kernel {r['kernel']:8.0f} us  read {r['read']:8.0f} us  "
              f"kernel/sdpa {rep[name]['kernel_vs_sdpa']:.2f}  kernel/read {rep[name]['kernel_vs_read']:.2f}  "
              f"max|diff| {rep[name]['max_abs_diff_vs_sdpa']:.1e}")
    rep["loadavg_after"] = os.getloadavg()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rep, f, indent=1)


if __name__ == "__main__":
    main()
