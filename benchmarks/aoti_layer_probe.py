"""Probe: one decode-step decoder layer as an AOTInductor package, against the same layer's dynamo region.

The captured decode (``decode_backend="static"``) runs each decoder layer through one dynamo-compiled region;
the profile in ``benchmarks/cpu/captured.md`` shows ~0.5 ms of per-call overhead a layer (dynamo's guards and
pre-graph bytecode, inductor's Python wrapper). This probe measures what calling the same layer without dynamo
costs: it records one real layer call of a static decode step (``--layers``-deep tiny-lm, LoRA r=8, batch
``--batch``, context ``--context``), exports the layer with its parameters as inputs (``torch.export``,
non-strict, batch / key length / workspace dims dynamic), compiles it with ``aoti_compile_and_package``, and
times, on the same inputs under ``torch.inference_mode``: the dynamo region call and the package call. It checks
that the package writes the new token's K/V into the pool and workspace in place (slots zeroed first) and that
its output matches the eager layer. Not part of the engine: the package saves ~80 us of a layer's ~500 us call
(~3 ms of a 45 ms step at 36 layers, 2 Intel Xeon cores; ``benchmarks/cpu/aoti_layer_probe.json``), for an
export and a 10-50 s compile per layer shape.

    PYTHONPATH=$PWD python benchmarks/aoti_layer_probe.py --layers 36 --batch 64 --context 256
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--json")
    a = ap.parse_args(argv)

    import unsloth_rollout.engine.decode_static as DS
    from unsloth_rollout.bench.long import setup
    from unsloth_rollout.bench.overhead import deep_policy
    from unsloth_rollout.engine.attention import ATTN_NAME, CTX_KWARG, ForwardContext

    policy = deep_policy("tiny-lm", a.layers, 8, 0)
    core = setup(policy, "static", a.context, a.batch, 24, 0)
    st = core.runner.decode_steps.compiled
    seen, region = {}, st._layer_fn

    def record(layer, hidden, *args, **kwargs):
        seen.setdefault("call", (layer, hidden, args, dict(kwargs)))
        return region(layer, hidden, *args, **kwargs)

    st._layer_fn = record
    core.step()
    st._layer_fn = region
    layer, hidden0, args, kwargs = seen["call"]
    cache_key = next(k for k, v in kwargs.items() if isinstance(v, DS.LayerView))
    lv, inner = kwargs[cache_key], core.runner.inner
    fixed = {k: v for k, v in kwargs.items()
             if k not in (cache_key, CTX_KWARG, "position_embeddings", "position_ids")}
    names = [n for n, _ in layer.named_parameters()]

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = layer

        def forward(self, hidden, cos, sin, pos_ids, pk, pv, wk, wv, slots, rows, lengths, k_pos, params):
            kp = k_pos.view(1, -1)
            ctx = ForwardContext("decode", lengths.view(-1, 1), kp, kp <= lengths.view(-1, 1), check=False)
            ctx.inner = inner
            view = DS.LayerView(pk, pv, wk, wv, slots, rows, lengths, k_pos, ctx)
            return torch.func.functional_call(self.layer, dict(zip(names, params)), (hidden,), {
                **fixed, cache_key: view, CTX_KWARG: ctx, "position_embeddings": (cos, sin), "position_ids": pos_ids})

    cos, sin = kwargs["position_embeddings"]
    meta = [t.clone() for t in (hidden0, cos, sin, kwargs["position_ids"])]
    caches = [t.clone() for t in (lv.pk, lv.pv, lv.wk, lv.wv)]
    index = [t.clone() for t in (lv.write_slots, lv.rows, lv.lengths, lv.k_pos)]
    params = [p.detach() for p in layer.parameters()]
    D = torch.export.Dim
    B, K, R, C = D("B", min=2, max=4096), D("K", min=2, max=1 << 16), D("R", min=2, max=1 << 16), D("C", min=4,
                                                                                                  max=1 << 17)
    dyn = ({0: B}, {0: B}, {0: B}, {0: B}, None, None, {0: R, 2: C}, {0: R, 2: C}, {0: B}, {0: B}, {0: B}, {0: K},
           [None] * len(params))
    cfg = core.runner.text_config
    saved = cfg._attn_implementation_internal
    cfg._attn_implementation_internal = ATTN_NAME
    try:
        t = time.perf_counter()
        with torch.no_grad():
            ep = torch.export.export(Layer(), (*meta, *caches, *index, params), dynamic_shapes=dyn, strict=False)
        export_s = time.perf_counter() - t
        t = time.perf_counter()
        pkg = torch._inductor.aoti_compile_and_package(ep)
        compile_s = time.perf_counter() - t
        runner = torch._inductor.aoti_load_package(pkg)

        def zeroed():
            out = [c.clone() for c in caches]
            for c in out[:2]:
                c[index[0]] = 0.0
            for c in out[2:]:
                c[index[1], :, index[2]] = 0.0
            return out

        eager_caches, aoti_caches = zeroed(), zeroed()
        with torch.no_grad():
            want = Layer()(*meta, *eager_caches, *index, params)
            got = runner(*meta, *aoti_caches, *index, params)
        want = want[0] if isinstance(want, tuple) else want
        got = got[0] if isinstance(got, (tuple, list)) else got
        out_diff = (want - got).abs().max().item()
        write_diff = max((x - y).abs().max().item() for x, y in zip(aoti_caches, caches))

        def per_call_us(fn):
            for _ in range(10):
                fn()
            ts = []
            for _ in range(5):
                t = time.perf_counter()
                for _ in range(a.calls // 5):
                    fn()
                ts.append((time.perf_counter() - t) / (a.calls // 5) * 1e6)
            return statistics.median(ts)

        g0 = DS._graphs()
        with torch.inference_mode():
            dynamo_us = per_call_us(lambda: region(layer, hidden0, *args, **kwargs))
            recompiles = DS._graphs() - g0
            aoti_us = per_call_us(lambda: runner(*meta, *aoti_caches, *index, params))
    finally:
        cfg._attn_implementation_internal = saved
    import os

    rep = {"command": f"PYTHONPATH=$PWD python benchmarks/aoti_layer_probe.py --layers {a.layers} --batch {a.batch} "
                      f"--context {a.context}", "loadavg": list(os.getloadavg()), "export_s": export_s,
           "aoti_compile_s": compile_s, "dynamo_region_call_us": dynamo_us,
           "dynamo_recompiles_while_timed": recompiles, "aoti_call_us": aoti_us,
           "layer_calls_per_step": a.layers, "output_max_abs_diff_vs_eager": out_diff,
           "kv_write_max_abs_diff_vs_engine_step": write_diff}
    print(json.dumps(rep, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rep, f, indent=1)
    return rep


if __name__ == "__main__":
    main()
