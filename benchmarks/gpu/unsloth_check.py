"""What the engine does with models loaded by Unsloth itself, on a CUDA machine with unsloth installed.

    python benchmarks/gpu/unsloth_check.py [--json OUT] [--size small]

``import unsloth`` comes first (as Unsloth asks: it patches transformers at import), so this runs in its own
process, never inside the test suite. Three checks, each recorded whatever its outcome (the exit code is 1 if
any did not hold):

- ``text_fast_path``: ``load_model(backend="unsloth")`` on a Qwen2 text model loads through
  ``FastLanguageModel``, whose CUDA inference forward (``LlamaModel_fast_forward``) indexes ``past_key_values``
  and keeps its own KV buffers. Holds if ``RolloutEngine`` refuses it with ``CacheBypassError`` naming
  ``backend="transformers"``, or serves it within the bf16 bounds below. A ``TypeError`` (or any other error)
  does not hold.
- ``auto_backend``: ``load_model(backend="auto")`` on the same folder with unsloth importable on CUDA loads
  transformers + PEFT (logged), and the engine serves it within the bf16 bounds.
- ``vision``: ``load_model(backend="unsloth")`` on a Qwen2.5-VL (``FastVisionModel``, LoRA r=8 on vision and
  language layers): the engine serves it, and every output token's logprob matches the trainer's
  teacher-forced forward of the same Unsloth model.

"Matches": in fp32 (``--dtype float32``, the default; TF32 off) within 1e-4, tests/test_gpu.py's bound. In bf16
within 0.1 (max) / 0.02 (mean), or, where the model's own rounding is larger than that, no more than 1.25x the
drift of the same model loaded with ``backend="transformers"`` in the same run (recorded as ``baseline``).
If Unsloth refuses fp32, the check is recorded in bf16.

Models: random-weight ``small`` builds (head_dim 64, like real checkpoints; Unsloth's Triton kernels are
written for such head sizes), made under ``--models`` the first time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import unsloth  # noqa: F401  (first: Unsloth patches transformers when imported)
import torch

from unsloth_rollout import (CacheBypassError, EngineConfig, GenerationRequest, RolloutEngine, SamplingParams,
                             load_model)
from unsloth_rollout.models import loader
from unsloth_rollout.testing.oracles import perturb_lora, teacher_forced_logprobs
from unsloth_rollout.testing.tiny import build_tiny_model
from unsloth_rollout.testing.toy import random_images

BF16_MAX, BF16_MEAN = 0.1, 0.02
FP32_MAX = 1e-4
MAX_NEW = 12
DEVICE = "cuda"
DTYPE = torch.float32
FALLBACKS: list[str] = []
WORDS = "the cat sat on a warm mat while two dogs ran past the red barn and a bird sang".split()


def requests(policy, n: int) -> list[GenerationRequest]:
    images = random_images(2 * n, 0)
    reqs = []
    for i in range(n):
        sp = (SamplingParams(max_new_tokens=MAX_NEW, temperature=0) if i % 2 == 0
              else SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, seed=i))
        text = " ".join(WORDS[i:] + WORDS[:i])[: 20 + 7 * i]
        if policy.is_vlm:
            k = i % 3
            msgs = [{"role": "user", "content": [{"type": "image"}] * k + [{"type": "text", "text": text}]}]
            reqs.append(GenerationRequest(messages=msgs, images=images[2 * i: 2 * i + k], sampling=sp))
        else:
            reqs.append(GenerationRequest(input_ids=policy.tokenizer.encode(text), sampling=sp))
    return reqs


def serve_and_compare(policy, n: int = 6) -> dict:
    """Run n requests in one batch; compare every output logprob with the teacher-forced forward."""
    engine = RolloutEngine(policy, EngineConfig(kv_cache_memory_bytes=256 << 20), seed=0)
    try:
        reqs = requests(policy, n)
        engine.pause()
        futs = [engine.submit(r) for r in reqs]
        engine.resume()
        outs = [f.result(timeout=300)[0] for f in futs]
        diffs = []
        for req, out in zip(reqs, outs):
            prompt = engine.prepare(req)
            ref, _ = teacher_forced_logprobs(policy, out.prompt_ids, out.output_ids, 1.0, prompt.pixel_values,
                                             prompt.image_grid_thw)
            got = torch.tensor(out.output_logprobs)
            diffs.append((got - ref.float().cpu()).abs())
        d = torch.cat(diffs)
        st = engine.stats()
        mx, mean = d.max().item(), d.mean().item()
        bounds = mx <= FP32_MAX if policy.dtype == torch.float32 else (mx <= BF16_MAX and mean <= BF16_MEAN)
        return {"served": True, "dtype": str(policy.dtype), "tokens": int(d.numel()), "max_diff": mx,
                "mean_diff": mean, "within_bounds": bool(bounds), "decode_backend": st.get("decode_backend")}
    finally:
        engine.shutdown()


def matches(rec: dict, path: str) -> bool:
    """Within the dtype's bounds; in bf16, else within 1.25x of the transformers-backend drift (recorded)."""
    if rec["within_bounds"] or "float32" in rec["dtype"]:
        return rec["within_bounds"]
    base = load_unsloth_or_bf16(path, "transformers")
    rec["baseline"] = serve_and_compare(base)
    del base
    return rec["max_diff"] <= 1.25 * rec["baseline"]["max_diff"] and rec["mean_diff"] <= 1.25 * rec["baseline"]["mean_diff"]


def load_unsloth_or_bf16(path: str, backend: str):
    """The model in --dtype, or in bf16 where the loader refuses that dtype (recorded by the caller)."""
    try:
        policy = load_model(path, backend=backend, dtype=DTYPE, device=DEVICE, lora={"r": 8})
    except Exception as e:  # noqa: BLE001  (e.g. Unsloth insisting on half precision)
        if DTYPE == torch.bfloat16:
            raise
        FALLBACKS.append(f"{backend} refused {DTYPE}: {type(e).__name__}: {e}"[:300])
        policy = load_model(path, backend=backend, dtype=torch.bfloat16, device=DEVICE, lora={"r": 8})
    perturb_lora(policy.model, std=0.05, seed=0)
    return policy


def model_class(policy) -> str:
    m = policy.model
    return type(getattr(getattr(m, "base_model", m), "model", m)).__name__


def check_text_fast_path(path: str) -> dict:
    policy = load_unsloth_or_bf16(path, "unsloth")
    rec = {"backend": policy.backend, "model_class": model_class(policy)}
    try:
        rec.update(serve_and_compare(policy))
        rec["holds"] = matches(rec, path)
    except CacheBypassError as e:
        rec.update(served=False, refused="CacheBypassError", message=str(e)[:400])
        rec["holds"] = 'backend="transformers"' in str(e) or "backend='transformers'" in str(e)
    return rec


def check_auto_backend(path: str) -> dict:
    chosen = loader.resolve_backend("auto", False, "qwen2")[0]
    policy = load_unsloth_or_bf16(path, "auto")
    rec = {"resolved": chosen, "backend": policy.backend}
    rec.update(serve_and_compare(policy))
    rec["holds"] = policy.backend == "transformers" and matches(rec, path)
    return rec


def check_vision(path: str) -> dict:
    policy = load_unsloth_or_bf16(path, "unsloth")
    rec = {"backend": policy.backend, "model_class": model_class(policy)}
    rec.update(serve_and_compare(policy))
    rec["holds"] = matches(rec, path)
    return rec


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--models", default=os.environ.get("MODELS", "/tmp/models"))
    ap.add_argument("--size", default="small")
    ap.add_argument("--checks", default="text_fast_path,auto_backend,vision")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--json", default=None)
    ap.add_argument("--cpu-dry-run", action="store_true", help="run the checks on CPU (exercises this script only: "
                    "Unsloth's CPU backend has no fast path and no vision models)")
    args = ap.parse_args(argv)
    global DEVICE, DTYPE
    DEVICE = "cpu" if args.cpu_dry_run else "cuda"
    DTYPE = getattr(torch, args.dtype)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # fp32 means fp32
    if not torch.cuda.is_available() and not args.cpu_dry_run:
        print("no CUDA device: nothing to check (Unsloth's fast path exists only on CUDA)")
        return 0
    import unsloth as u

    report = {"unsloth": getattr(u, "__version__", "?"), "torch": torch.__version__, "checks": {}}
    paths = {a: str(build_tiny_model(a, args.size, out=os.path.join(args.models, f"{a}-{args.size}")))
             for a in ("qwen2", "qwen2_5_vl")}
    checks = {"text_fast_path": (check_text_fast_path, "qwen2"), "auto_backend": (check_auto_backend, "qwen2"),
              "vision": (check_vision, "qwen2_5_vl")}
    ok = True
    for name in args.checks.split(","):
        fn, arch = checks[name]
        t0 = time.perf_counter()
        try:
            rec = fn(paths[arch])
        except Exception as e:  # recorded: a TypeError here is the bug this check exists for
            rec = {"holds": False, "error": f"{type(e).__name__}: {e}"[:600],
                   "traceback": traceback.format_exc()[-3000:]}
        rec["seconds"] = round(time.perf_counter() - t0, 1)
        if FALLBACKS:
            rec["dtype_fallback"] = list(FALLBACKS)
            FALLBACKS.clear()
        report["checks"][name] = rec
        ok &= bool(rec.get("holds"))
        brief = {k: v for k, v in rec.items() if k != "traceback"}
        print(f"{name}: {'HOLDS' if rec.get('holds') else 'DOES NOT HOLD'} {json.dumps(brief)}", flush=True)
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump(report, f, indent=2)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
