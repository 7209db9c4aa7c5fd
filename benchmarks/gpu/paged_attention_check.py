"""The paged decode attention kernel on a GPU: correct against float64 and SDPA, and how long it takes.

``unsloth_rollout/engine/decode/paged_attention.py`` (Triton, split-KV over the pool's block tables) at Qwen2.5-VL-3B's
text attention shape (16 query heads, 2 KV heads, head dim 128, 36 layers; pages of 16 tokens, the engine's
default block size):

- correctness: float32, bfloat16 and float16, rows of mixed lengths (1 .. 1500 and a padded row of length 0) in a
  scrambled pool, plain, with a sliding window and with a softcap, against the float64 reference over the gathered
  keys (``paged_attention.reference``) and against SDPA over the same keys with the engine's decode mask
  (``ForwardContext.additive_mask``; SDPA has no softcap, so not there);
- timing (bfloat16), at batch 1 / 64 / 256 and contexts 128 .. 2048 (every row that long), the block table as wide
  as the longest context (what a CUDA graph per batch bucket would use): the kernel launched eagerly and replayed
  from a CUDA graph, against SDPA over a persistent workspace ``[B, KV, L, D]`` (what the compiled step reads,
  query heads of a KV head as query rows: the engine's decode path), eager and replayed, and against a gather of
  the pool into that layout plus SDPA (the gather step). Per layer call, in microseconds, with the step's 36
  layers and the kernel's read bandwidth derived.

    python benchmarks/gpu/paged_attention_check.py [--json OUT.json]
    python benchmarks/gpu/paged_attention_check.py --dry-run      # no GPU: small shapes under the interpreter

``--dry-run`` runs the same code at small shapes under Triton's interpreter on CPU (bfloat16 skipped: numpy has
none; no CUDA graphs; timings meaningless): a check of the script itself. Exits 1 when a correctness check fails.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

if "--dry-run" in sys.argv:  # before torch._dynamo imports triton: the interpreter is read then
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from unsloth_rollout.engine.attention import ForwardContext  # noqa: E402
from unsloth_rollout.engine.decode import paged_attention as pa  # noqa: E402
from unsloth_rollout.engine.decode.graph import capture_cuda  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, LAYERS = 16, 2, 128, 36  # Qwen2.5-VL-3B's text attention
PAGE = 16
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def pool_case(lengths, width, dtype, device, seed=0):
    """(k pool, v pool [slots, KV, D], q [B, H, D], block tables [B, width] int32, lengths [B] int32): each row's
    blocks scattered over the pool (a random permutation), the rest of its table the scratch block."""
    g = torch.Generator(device=device).manual_seed(seed)
    need = [-(-n // PAGE) for n in lengths]
    nblocks = sum(need) + 4
    slots = (nblocks + 1) * PAGE  # one scratch block past the usable ones, as KVCache holds it
    kp = torch.randn(slots, KV_HEADS, HEAD_DIM, generator=g, device=device).to(dtype)
    vp = torch.randn(slots, KV_HEADS, HEAD_DIM, generator=g, device=device).to(dtype)
    order = torch.randperm(nblocks, generator=torch.Generator().manual_seed(seed))
    table = torch.full((len(lengths), width), nblocks, dtype=torch.int32)
    at = 0
    for i, n in enumerate(need):
        table[i, :n] = order[at:at + n].to(torch.int32)
        at += n
    q = torch.randn(len(lengths), HEADS, HEAD_DIM, generator=g, device=device).to(dtype)
    return kp, vp, q, table.to(device), torch.tensor(lengths, dtype=torch.int32, device=device)


def gathered(pool, table, key_len):
    """The pool's keys of each row's positions 0 .. key_len-1 as ``[B, KV, L, D]`` (the gather step's copy)."""
    pos = torch.arange(key_len, device=table.device)
    slots = table.long()[:, pos // PAGE] * PAGE + pos % PAGE
    return pool[slots].permute(0, 2, 1, 3)


def sdpa_rows(q, keys, values, mask):
    """The engine's decode SDPA: the query heads of a KV head as query rows of that head (attention.py)."""
    b, h, d = q.shape
    out = F.scaled_dot_product_attention(q.view(b, KV_HEADS, h // KV_HEADS, d), keys, values, attn_mask=mask)
    return out.reshape(b, h, d)


def check_correctness(device, dry: bool) -> list[dict]:
    lengths = [1, 15, 16, 17, 100, 0] if dry else [1, 15, 16, 17, 3 * 16 + 7, 700, 1500, 33, 0]
    width = -(-max(lengths) // PAGE) + 2
    rows = []
    dtypes = (torch.float32, torch.float16) if dry else (torch.float32, torch.bfloat16, torch.float16)
    for dtype in dtypes:
        for window, softcap in ((None, None), (40, None), (None, 20.0), (64, 5.0)):
            kp, vp, q, table, lens = pool_case(lengths, width, dtype, device, seed=len(rows))
            scale = HEAD_DIM ** -0.5
            t = time.perf_counter()
            out, lse = pa.paged_decode_attention(q, kp, vp, table, lens, scale, page=PAGE, window=window,
                                                 softcap=softcap, num_splits=pa.splits_for(len(lengths), KV_HEADS))
            secs = time.perf_counter() - t
            ref, ref_lse = pa.reference(q, kp, vp, table, lens, scale, page=PAGE, window=window, softcap=softcap)
            real = lens.cpu() > 0
            err = (out.cpu().double() - ref).abs()
            bound = TOL[dtype] * (1 + ref.abs())
            row = dict(dtype=str(dtype).removeprefix("torch."), window=window, softcap=softcap,
                       max_abs_vs_float64=err.max().item(), tolerance=TOL[dtype],
                       lse_max_abs=(lse.cpu().double()[real] - ref_lse[real]).abs().max().item(),
                       padded_rows_zero=bool((out.cpu()[~real] == 0).all()), finite=bool(torch.isfinite(out).all()),
                       first_call_s=round(secs, 3))
            ok = bool((err <= bound).all()) and row["lse_max_abs"] <= 1e-4 and row["padded_rows_zero"] and row["finite"]
            if softcap is None:  # SDPA over the gathered keys with the engine's mask (query at position n - 1)
                key_len = width * PAGE
                mask = ForwardContext.decode(lens.long() - 1, key_len).additive_mask(window, dtype)
                sd = sdpa_rows(q, gathered(kp, table, key_len), gathered(vp, table, key_len), mask)
                d = (out[real] - sd[real]).abs().float()
                row["max_abs_vs_sdpa"] = d.max().item()
                ok = ok and row["max_abs_vs_sdpa"] <= 2 * TOL[dtype] * (1 + sd[real].abs().float().max().item())
            row["ok"] = ok
            rows.append(row)
            print(f"correctness {row['dtype']:8s} window={window} softcap={softcap}: "
                  f"{'ok' if ok else 'FAILED'} (vs float64 {row['max_abs_vs_float64']:.2e}"
                  + (f", vs SDPA {row['max_abs_vs_sdpa']:.2e}" if "max_abs_vs_sdpa" in row else "") + ")", flush=True)
    return rows


def timed(fn, iters: int, cuda: bool) -> float:
    """Microseconds per call of ``fn`` (after two warm-up calls), by CUDA events on a GPU."""
    fn()
    fn()
    if not cuda:
        t = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t) / iters * 1e6
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters * 1e3


def replayed(fn, iters: int) -> float:
    """Microseconds per replay of ``fn`` recorded as a CUDA graph (as the graph step records: decode/graph.py)."""
    g, _ = capture_cuda(fn)
    return timed(g.replay, iters, True)


def check_timing(device, dry: bool, batches, contexts, iters: int) -> list[dict]:
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    width = -(-max(contexts) // PAGE)  # as wide as the longest context: one table shape for every context
    rows = []
    for b in batches:
        for ctx_len in contexts:
            lengths = [ctx_len] * b
            kp, vp, q, table, lens = pool_case(lengths, width, dtype, device, seed=b + ctx_len)
            splits = pa.splits_for(b, KV_HEADS)
            ws_k, ws_v = gathered(kp, table, ctx_len).contiguous(), gathered(vp, table, ctx_len).contiguous()
            mask = ForwardContext.decode(lens.long() - 1, ctx_len).additive_mask(None, dtype)

            def paged():
                return pa.paged_decode_attention(q, kp, vp, table, lens, page=PAGE, num_splits=splits, check=False)

            def workspace():
                return sdpa_rows(q, ws_k, ws_v, mask)

            def gather():
                return sdpa_rows(q, gathered(kp, table, ctx_len), gathered(vp, table, ctx_len), mask)

            n = 1 if dry else iters
            row = dict(batch=b, context=ctx_len, table_width_blocks=width, splits=splits,
                       paged_us=timed(paged, n, cuda), workspace_sdpa_us=timed(workspace, n, cuda),
                       gather_sdpa_us=timed(gather, n, cuda))
            if cuda:
                row["paged_graph_us"] = replayed(paged, n)
                row["workspace_sdpa_graph_us"] = replayed(workspace, n)
                kv_bytes = 2 * b * ctx_len * KV_HEADS * HEAD_DIM * kp.element_size()
                row["paged_graph_GBps"] = kv_bytes / (row["paged_graph_us"] * 1e-6) / 1e9
                row["paged_graph_step_ms"] = row["paged_graph_us"] * LAYERS / 1e3
                row["workspace_sdpa_graph_step_ms"] = row["workspace_sdpa_graph_us"] * LAYERS / 1e3
            assert torch.allclose(paged()[0].float(), workspace().float(), atol=5e-2, rtol=5e-2), (b, ctx_len)
            rows.append(row)
            print("timing " + " ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
                  flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", help="write the results here")
    p.add_argument("--dry-run", action="store_true",
                   help="small shapes under Triton's interpreter on CPU (set before torch imports triton)")
    p.add_argument("--batches", default="1,64,256")
    p.add_argument("--contexts", default="128,512,1024,2048")
    p.add_argument("--iters", type=int, default=50)
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.dry_run
    if not cuda and not args.dry_run:
        print("no CUDA device: run with --dry-run for the interpreter check")
        if args.json:
            Path(args.json).write_text(json.dumps({"cuda": False}))
        return 0
    if not pa.available():
        print("the paged kernel cannot run here (triton not importable, or no CUDA device and no interpreter)")
        return 1
    device = torch.device("cuda" if cuda else "cpu")
    batches = [1, 3] if args.dry_run else [int(x) for x in args.batches.split(",")]
    contexts = [70] if args.dry_run else [int(x) for x in args.contexts.split(",")]
    import triton

    out = dict(device=torch.cuda.get_device_name(0) if cuda else f"cpu ({platform.processor() or 'interpreter'})",
               torch=torch.__version__, triton=triton.__version__, interpreter=pa.interpreted(),
               shape=dict(heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, layers=LAYERS, page=PAGE))
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = False
    t = time.perf_counter()
    out["correctness"] = check_correctness(device, args.dry_run)
    out["timing"] = check_timing(device, args.dry_run, batches, contexts, args.iters)
    out["ok"] = all(r["ok"] for r in out["correctness"])
    out["seconds"] = round(time.perf_counter() - t, 1)
    print(f"{'all correctness checks passed' if out['ok'] else 'CORRECTNESS FAILED'} in {out['seconds']} s")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1, default=lambda x: None if isinstance(x, float)
                                              and not math.isfinite(x) else str(x)))
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
