"""Decode throughput of the rollout engine at fixed batch sizes, and the memory bandwidth it achieves.

For each batch size B the engine runs B distinct text prompts of ``--prompt-len`` tokens twice: once to
``--short`` new tokens and once to ``--short + --decode`` new tokens (EOS ignored). Both runs pay the same
prefill, so the difference in wall time is the time of ``B x --decode`` decode tokens alone:

    decode tok/s  = B * decode / (t_long - t_short)
    step time     = (t_long - t_short) / decode
    bytes / step  = text weights read once (decoder + lm_head, LoRA included)
                    + the KV history each sequence attends to (mean context over the timed steps)
    bandwidth     = bytes / step / step time, also as % of the nominal 4.3 TB/s and of a measured copy

    python benchmarks/gpu/decode_sweep.py --model DIR [--batches 1,64,256] [--load-in-4bit]
        [--decode-backend workspace,compiled] [--hf-batches 1,64] [--json OUT]

``--decode-backend`` is ``DecodeConfig.backend``, or several separated by commas, each run on the same loaded
model in turn (``compiled@1``: with ``DecodeConfig.layers_per_call=1``; "compiled": the compiled step, compiled at
engine start; "graph": it replayed as CUDA graphs; the old names "static" and "graphs" are accepted). The JSON has
one entry per backend under ``runs``, each with the backend that ran, its warm-up and its recompiles, so the eager
and compiled sweeps of one model compare side by side. ``--hf-batches`` also
times HF ``generate()`` (the same model, prompts and difference of two runs) at those batch sizes.

The model is loaded as the bench loads it (LoRA r=16 on vision and language layers, random non-zero B).
Runs on CPU too (slowly; use a tiny model and small batches there).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

import torch

from unsloth_rollout import EngineConfig, GenerationRequest, RolloutEngine, SamplingParams, load_model
from unsloth_rollout.engine.config import DecodeConfig
from unsloth_rollout.bench.harness import copy_bandwidth_gbs, machine_info, text_weights
from unsloth_rollout.testing.oracles import perturb_lora
from unsloth_rollout.engine.config import parse_bytes
from unsloth_rollout.engine.kv_cache import KVCache
from unsloth_rollout.models.families import text_dims

NOMINAL_HBM_BYTES_PER_S = 4.3e12  # H200: a device-to-device copy measured about this (read + write)


def requests(policy, batch: int, prompt_len: int, new_tokens: int, seed: int) -> list[GenerationRequest]:
    rng = random.Random(seed)
    special = set(policy.tokenizer.all_special_ids)
    pool = [i for i in range(min(len(policy.tokenizer), 2000)) if i not in special]
    sp = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True, temperature=1.0, seed=seed)
    return [GenerationRequest(input_ids=[rng.choice(pool) for _ in range(prompt_len)], sampling=sp)
            for _ in range(batch)]


def timed_generate(engine, reqs) -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = engine.generate(reqs, timeout=600)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    want = reqs[0].sampling.max_new_tokens
    short = [len(o.output_ids) for o in outs if len(o.output_ids) != want]
    if short:
        raise RuntimeError(f"{len(short)} outputs stopped early (ignore_eos should run them to {want})")
    return dt


def hf_generate_time(policy, batch: int, prompt_len: int, new_tokens: int) -> float:
    """HF ``generate()`` on the same prompts (equal lengths: no padding), greedy, EOS ignored (min_new_tokens)."""
    reqs = requests(policy, batch, prompt_len, new_tokens, seed=batch)
    ids = torch.tensor([r.input_ids for r in reqs], device=policy.device)
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
              pad_token_id=policy.tokenizer.pad_token_id)
    with torch.no_grad():
        policy.model.generate(input_ids=ids[:1, :8], attention_mask=torch.ones_like(ids[:1, :8]), max_new_tokens=2,
                              do_sample=False, pad_token_id=policy.tokenizer.pad_token_id)  # warm-up
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = policy.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kw)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    if out.shape[1] != prompt_len + new_tokens:
        raise RuntimeError(f"HF generate() returned {out.shape[1] - prompt_len} new tokens, asked {new_tokens}")
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--model", required=True, help="model folder")
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--short", type=int, default=8, help="new tokens of the reference run")
    ap.add_argument("--decode", type=int, default=128, help="extra decode steps timed")
    ap.add_argument("--lora-rank", type=int, default=16, help="0 = no LoRA")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--load-in-4bit", action="store_true")
    ap.add_argument("--kv-cache-memory-bytes", type=parse_bytes, default=16 << 30, help="e.g. 16GiB")
    ap.add_argument("--decode-backend", default="auto",
                    help="auto|workspace|compiled|gather|graph (compiled, replayed as CUDA graphs), or several "
                         "separated by commas (each a run)")
    ap.add_argument("--passes", type=int, default=1,
                    help="sweep the batches this many times per backend (a later pass: what runs once compiles and "
                         "caches have settled; each row records its pass)")
    ap.add_argument("--hf-batches", default="", help="also time HF generate() at these batch sizes, e.g. 1,64")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    batches = [int(b) for b in args.batches.split(",")]
    policy = load_model(args.model, backend="transformers", dtype=args.dtype, load_in_4bit=args.load_in_4bit,
                        lora={"r": args.lora_rank, "random_state": 0} if args.lora_rank else None)
    if args.lora_rank:
        perturb_lora(policy.model, std=0.02, seed=0)
    policy.inference()
    device = policy.device
    wbytes, _, _ = text_weights(policy)
    kv_tok = KVCache.bytes_per_token(*text_dims(policy.text_config), policy.dtype)
    copy_gbs = copy_bandwidth_gbs(device, nbytes=1 << 30) if device.type == "cuda" else copy_bandwidth_gbs(device)
    report = {"model": args.model, "dtype": str(policy.dtype).replace("torch.", ""), "load_in_4bit": args.load_in_4bit,
              "lora_rank": args.lora_rank, "machine": machine_info(device), "weight_bytes_per_step": wbytes,
              "kv_bytes_per_token": kv_tok, "copy_bandwidth_gbs": copy_gbs,
              "nominal_bandwidth_gbs": NOMINAL_HBM_BYTES_PER_S / 1e9, "prompt_len": args.prompt_len,
              "decode_steps_timed": args.decode, "runs": []}

    def row_for(b, t_short, t_long):
        dt = max(t_long - t_short, 1e-9)
        step = dt / args.decode
        step_bytes = wbytes + b * (args.prompt_len + args.short + args.decode / 2) * kv_tok  # mean context
        bw = step_bytes / step
        return {"batch": b, "t_short_s": t_short, "t_long_s": t_long, "decode_tokens_per_s": b * args.decode / dt,
                "step_ms": step * 1e3, "bytes_per_step": step_bytes, "achieved_gbs": bw / 1e9,
                "pct_of_nominal": 100 * bw / NOMINAL_HBM_BYTES_PER_S, "pct_of_copy": 100 * bw / (copy_gbs * 1e9),
                "peak_memory_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None}

    def show(name, row):
        print(f"{name:>10} batch {row['batch']:4d}: {row['decode_tokens_per_s']:10.1f} tok/s  step {row['step_ms']:7.2f} ms"
              f"  {row['achieved_gbs']:8.1f} GB/s = {row['pct_of_nominal']:5.1f}% of 4.3 TB/s"
              + (f"  peak {row['peak_memory_bytes'] / 2**30:.1f} GiB" if row["peak_memory_bytes"] else ""), flush=True)

    def dump():
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump(report, f, indent=2)

    for spec in args.decode_backend.split(","):
        t0 = time.perf_counter()
        backend, _, per_call = spec.partition("@")  # compiled@1: one decoder layer per compiled call
        backend = {"static": "compiled", "graphs": "graph"}.get(backend, backend)  # the old names
        decode = DecodeConfig(backend=backend, layers_per_call=int(per_call) if per_call else None)
        engine = RolloutEngine(policy, EngineConfig(kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                                                    max_num_seqs=max(batches), decode=decode))
        st = engine.stats()
        run = {"decode_backend_requested": spec, "decode_layers_per_call": st.get("decode_layers_per_call"),
               "decode_backend": (st.get("decode_backend")
                                  + (f"@{per_call}" if per_call else "")),
               "engine_start_s": time.perf_counter() - t0, "decode_warmup_s": st.get("decode_warmup_s"),
               "results": []}
        report["runs"].append(run)
        try:
            timed_generate(engine, requests(policy, min(batches), args.prompt_len, 4, seed=99))  # warm-up
            for p in range(args.passes):
                for b in batches:
                    if device.type == "cuda":
                        torch.cuda.reset_peak_memory_stats(device)
                    r0 = engine.stats().get("decode_recompiles")
                    t_short = timed_generate(engine, requests(policy, b, args.prompt_len, args.short, seed=b))
                    t_long = timed_generate(engine, requests(policy, b, args.prompt_len, args.short + args.decode,
                                                             seed=b))
                    row = row_for(b, t_short, t_long)
                    r1 = engine.stats().get("decode_recompiles")
                    row.update({"pass": p + 1, "recompiles": None if r0 is None else r1 - r0})
                    run["results"].append(row)
                    show(f"{run['decode_backend']}#{p + 1}", row)
            st = engine.stats()
            run.update(decode_recompiles=st.get("decode_recompiles"), decode_eager_steps=st.get("decode_eager_steps"),
                       decode_backend_fallback=st.get("decode_backend_fallback"),
                       **{k: v for k, v in st.items() if k.startswith("decode_graph")})
        finally:
            engine.shutdown()
            dump()
        del engine
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.hf_batches:
        run = {"decode_backend": "hf-generate", "results": []}
        report["runs"].append(run)
        for b in [int(x) for x in args.hf_batches.split(",")]:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            t_short = hf_generate_time(policy, b, args.prompt_len, args.short)
            t_long = hf_generate_time(policy, b, args.prompt_len, args.short + args.decode)
            run["results"].append(row_for(b, t_short, t_long))
            show("hf", run["results"][-1])
            dump()
    return 0


if __name__ == "__main__":
    sys.exit(main())
