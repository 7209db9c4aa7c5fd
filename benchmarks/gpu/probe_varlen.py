"""Probe which paged decode-attention kernel this machine's torch can run, and check it against SDPA.

Decode attention can read a paged KV pool in place through
``torch.nn.attention.varlen.varlen_attn(..., seqused_k=, block_table=)`` (flash attention; newer torch only)
or, failing that, through xformers' paged split-k decode when an xformers wheel is installed. This script
tries each with pages of 16, 64 and 256 tokens, in bf16, with grouped-query heads, ragged lengths and a
scrambled page table, and compares the result with ``scaled_dot_product_attention`` over the same keys
gathered into contiguous tensors.

    python benchmarks/gpu/probe_varlen.py [--json OUT.json]

Prints one line per (kernel, page size): ``ok`` with the largest absolute difference from SDPA, or the
error it raised. Exits 0 in every case (a missing kernel is a finding, not a failure); on a machine with
no CUDA device it says so and writes ``{"cuda": false}``.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import time

import torch
import torch.nn.functional as F

# bf16 flash vs SDPA on the same inputs: both accumulate in fp32, so outputs differ by a few bf16 ulps.
TOLERANCE = 2e-2

HEADS_Q, HEADS_KV, HEAD_DIM = 16, 2, 128  # Qwen2.5-VL-3B's text attention


def _case(page: int, device, seed: int = 0):
    """A decode batch: one query token per sequence over ragged cached lengths in a scrambled page pool."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    lengths = [1, page - 1, page, page + 1, 3 * page + 7, 700, 1500, 33]
    pages_per = [(n + page - 1) // page for n in lengths]
    total_pages = sum(pages_per) + 5  # some pages belong to nobody
    order = torch.randperm(total_pages, generator=g)
    table = torch.zeros(len(lengths), max(pages_per), dtype=torch.int32)
    k = 0
    for i, n in enumerate(pages_per):
        table[i, :n] = order[k:k + n].to(torch.int32)
        k += n
    dt = torch.bfloat16
    kpool = torch.randn(total_pages, page, HEADS_KV, HEAD_DIM, generator=g).to(device, dt)
    vpool = torch.randn(total_pages, page, HEADS_KV, HEAD_DIM, generator=g).to(device, dt)
    q = torch.randn(len(lengths), HEADS_Q, HEAD_DIM, generator=g).to(device, dt)
    return q, kpool, vpool, table.to(device), torch.tensor(lengths, dtype=torch.int32, device=device)


def _reference(q, kpool, vpool, table, lengths):
    """SDPA per sequence over its pages gathered in order (the oracle)."""
    out = []
    for i, n in enumerate(lengths.tolist()):
        page = kpool.shape[1]
        idx = table[i, : (n + page - 1) // page].long()
        k = kpool[idx].reshape(-1, HEADS_KV, HEAD_DIM)[:n]
        v = vpool[idx].reshape(-1, HEADS_KV, HEAD_DIM)[:n]
        rep = HEADS_Q // HEADS_KV
        k = k.repeat_interleave(rep, dim=1).transpose(0, 1).float()
        v = v.repeat_interleave(rep, dim=1).transpose(0, 1).float()
        o = F.scaled_dot_product_attention(q[i].unsqueeze(1).float(), k, v)  # [H, 1, D]
        out.append(o.squeeze(1))
    return torch.stack(out)


def _time(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps


def probe_varlen(page: int, device) -> dict:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError as e:
        return {"ok": False, "error": f"ImportError: {e}"}
    params = inspect.signature(varlen_attn).parameters
    missing = [p for p in ("seqused_k", "block_table") if p not in params]
    if missing:
        return {"ok": False, "error": f"varlen_attn has no {', '.join(missing)} on torch {torch.__version__}"}
    q, kpool, vpool, table, lengths = _case(page, device)
    b = q.shape[0]
    cu_q = torch.arange(b + 1, dtype=torch.int32, device=device)

    def run():
        return varlen_attn(q, kpool, vpool, cu_q, None, 1, int(lengths.max()), seqused_k=lengths,
                           block_table=table, enable_gqa=True)

    try:
        out = run()
    except Exception as e:  # noqa: BLE001 - the probe reports whatever the kernel says
        return {"ok": False, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
    diff = (out.float() - _reference(q, kpool, vpool, table, lengths)).abs().max().item()
    return {"ok": diff <= TOLERANCE, "max_abs_diff": diff, "step_us": _time(run) * 1e6}


def probe_xformers(page: int, device) -> dict:
    try:
        import xformers  # noqa: F401
        from xformers.ops import fmha
        from xformers.ops.fmha.attn_bias import PagedBlockDiagonalPaddedKeysMask
    except ImportError as e:
        return {"ok": False, "error": f"ImportError: {e}"}
    q, kpool, vpool, table, lengths = _case(page, device)
    b = q.shape[0]
    max_pages = table.shape[1]
    try:
        bias = PagedBlockDiagonalPaddedKeysMask.from_seqlens(
            q_seqlen=[1] * b, kv_seqlen=lengths.tolist(), block_tables=table, page_size=page)
        # xformers' paged layout: keys as [1, pages * page, Hkv, G, D] expanded over query-head groups.
        g = HEADS_Q // HEADS_KV
        k = kpool.reshape(1, -1, HEADS_KV, 1, HEAD_DIM).expand(-1, -1, -1, g, -1)
        v = vpool.reshape(1, -1, HEADS_KV, 1, HEAD_DIM).expand(-1, -1, -1, g, -1)
        qq = q.reshape(1, b, HEADS_KV, g, HEAD_DIM)

        def run():
            return fmha.memory_efficient_attention_forward(qq, k, v, attn_bias=bias)

        out = run().reshape(b, HEADS_Q, HEAD_DIM)
    except Exception as e:  # noqa: BLE001
        return {"ok": False, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}",
                "max_pages_per_seq": max_pages}
    diff = (out.float() - _reference(q, kpool, vpool, table, lengths)).abs().max().item()
    return {"ok": diff <= TOLERANCE, "max_abs_diff": diff, "step_us": _time(run) * 1e6}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--json", default=None, help="write the findings here as JSON")
    args = ap.parse_args(argv)
    report: dict = {"torch": torch.__version__, "cuda": torch.cuda.is_available()}
    if not report["cuda"]:
        print(f"torch {torch.__version__}: no CUDA device; nothing to probe")
    else:
        device = torch.device("cuda")
        report["gpu"] = torch.cuda.get_device_name(device)
        report["tolerance"] = TOLERANCE
        for kernel, fn in (("varlen_attn", probe_varlen), ("xformers_paged", probe_xformers)):
            for page in (16, 64, 256):
                r = fn(page, device)
                report[f"{kernel}/page{page}"] = r
                state = f"ok max|diff|={r['max_abs_diff']:.2e} step={r['step_us']:.0f}us" if r.get("ok") else (
                    f"WRONG max|diff|={r['max_abs_diff']:.2e}" if "max_abs_diff" in r else r["error"])
                print(f"{kernel:15s} page {page:3d}: {state}")
        usable = [k for k, v in report.items() if isinstance(v, dict) and v.get("ok")]
        report["usable"] = usable
        print("usable:", ", ".join(usable) or "none (decode keeps the gather path)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
