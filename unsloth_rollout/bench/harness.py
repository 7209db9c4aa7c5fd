"""Run backends on one workload and measure them: throughput, TTFT, peak memory, logprob drift, roofline.

Example::

    report = run_bench("tiny-lm", workload="grpo", prompts=2, group=2, max_new_tokens=8,
                       backends=["engine", "hf-batched"])
    report["results"][0]["output_tokens_per_s"], report["results"][0]["logprob_drift"]
"""

from __future__ import annotations

import contextlib
import gc
import os
import platform
import sys
import threading
import time
import traceback

import numpy as np
import torch

from ..logs import get_logger
from .backends import ALIASES, BACKENDS, BenchContext, spread
from ..testing.oracles import perturb_lora, teacher_forced
from ..testing.toy import model_path
from .workloads import Workload, build_workload, image_inputs

logger = get_logger("unsloth_rollout.bench")

# ============================================================================ measurements
class PeakMemory:
    """Peak memory above the starting level while the block runs: CUDA max_memory_allocated, or on CPU
    the process RSS sampled every few milliseconds by a thread (psutil), else ru_maxrss."""

    def __init__(self, device: torch.device, interval: float = 0.005):
        self.device = device
        self.interval = interval
        self.peak_bytes: int | None = None

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return self
        try:
            import psutil
        except ImportError:
            import resource

            self._ru = resource
            self.base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            return self
        self._ru = None
        self._proc = psutil.Process()
        self.base = self._proc.memory_info().rss
        self._max = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True, name="bench-rss")
        self._thread.start()
        return self

    def _poll(self):
        while not self._stop.wait(self.interval):
            self._max = max(self._max, self._proc.memory_info().rss)

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device) - self.base
        elif self._ru is not None:
            self.peak_bytes = self._ru.getrusage(self._ru.RUSAGE_SELF).ru_maxrss * 1024 - self.base
        else:
            self._stop.set()
            self._thread.join()
            self._max = max(self._max, self._proc.memory_info().rss)
            self.peak_bytes = self._max - self.base
        return False


def language_model(policy) -> torch.nn.Module:
    base = policy.base_model
    inner = getattr(base, "model", base)
    return getattr(inner, "language_model", inner)


def text_weights(policy) -> tuple[int, int, int]:
    """(bytes, decoder parameters, lm_head parameters) of the text weights one forward reads: decoder layers,
    norms and lm_head with their LoRA, not the embedding table (only a few rows of it are gathered) nor the
    vision tower."""
    lm = language_model(policy)
    embed = lm.get_input_embeddings() if hasattr(lm, "get_input_embeddings") else None
    skip = {id(p) for p in embed.parameters()} if embed is not None else set()
    head = getattr(policy.base_model, "lm_head", None)
    head_ids = {id(p) for p in head.parameters()} if head is not None else set()
    seen, nbytes, decoder, lm_head = set(), 0, 0, 0
    for mod in [lm] + ([head] if head is not None else []):
        for p in mod.parameters():
            if id(p) in skip or id(p) in seen:
                continue
            seen.add(id(p))
            nbytes += p.numel() * p.element_size()
            if id(p) in head_ids:
                lm_head += p.numel()
            else:
                decoder += p.numel()
    return nbytes, decoder, lm_head


def matmul_peak_gflops(device: torch.device, n: int = 1024, reps: int = 5) -> float:
    """The machine's achievable matmul rate (fp32 n x n x n, best of ``reps``): the compute roof."""
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    best = float("inf")
    for _ in range(reps + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        torch.mm(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best / 1e9


def copy_bandwidth_gbs(device: torch.device, nbytes: int = 128 << 20, reps: int = 5) -> float:
    """The machine's achievable memory bandwidth: a large tensor copy (read + write), best of ``reps``."""
    a = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    b = torch.empty_like(a)
    best = float("inf")
    for _ in range(reps + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        b.copy_(a)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t)
    del a, b
    return 2 * nbytes / best / 1e9


class ForwardCounter:
    """Counts forwards of the text model (each reads every weight once) and the token positions they run
    (padding included: it costs the same compute)."""

    def __init__(self, module: torch.nn.Module):
        self.count = 0
        self.tokens = 0
        self._h = module.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        self.count += 1
        x = kwargs.get("inputs_embeds")
        if x is None:
            x = kwargs.get("input_ids")
        if x is None and args:
            x = args[0]
        if isinstance(x, torch.Tensor) and x.dim() >= 2:
            self.tokens += x.shape[0] * x.shape[1]

    def remove(self):
        self._h.remove()


def teacher_forced_logprobs(policy, wl: Workload, req, output_ids: list[int]) -> list[float]:
    """log_softmax(logits / T)[token] for each output token, from one forward over prompt + output."""
    vision = {}
    if req.image is not None:
        pv, grid = image_inputs(policy.processor, [req.image])
        vision = {"pixel_values": pv, "image_grid_thw": grid}
    return teacher_forced(policy, req.prompt_ids, output_ids, wl.temperature, **vision)[0].tolist()


def logprob_drift(policy, wl: Workload, samples, k: int) -> tuple[float | None, int]:
    """Max |returned logprob - teacher-forced logprob| over ``k`` samples spread over the run."""
    with_lp = [s for s in samples if s.logprobs is not None and s.output_ids]
    if not with_lp or k <= 0:
        return None, 0
    by_index = {r.index: r for r in wl.requests}
    worst = 0.0
    chosen = [with_lp[i] for i in spread(len(with_lp), k)]
    for s in chosen:
        ref = teacher_forced_logprobs(policy, wl, by_index[s.index], s.output_ids)
        worst = max(worst, float(np.max(np.abs(np.asarray(s.logprobs[: len(ref)]) - np.asarray(ref)))))
    return worst, len(chosen)


def machine_info(device: torch.device) -> dict:
    import transformers

    try:
        import peft

        peft_v = peft.__version__
    except ImportError:
        peft_v = None
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    info = {"cpu": cpu, "cores": os.cpu_count(), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "transformers": transformers.__version__, "peft": peft_v, "python": platform.python_version(),
            "platform": platform.platform(), "device": str(device)}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    with contextlib.suppress(Exception):
        info["load_average"] = list(os.getloadavg())
    return info


# ============================================================================ the run
def _percentile(xs, q):
    return float(np.percentile(xs, q)) if len(xs) else None


def cpu_pressure() -> float | None:
    """Share of the last 10 s in which runnable tasks waited for a CPU (Linux PSI), in percent."""
    try:
        with open("/proc/pressure/cpu") as f:
            return float(f.readline().split()[1].split("=")[1])
    except (OSError, IndexError, ValueError):
        return None


def _run_backend(name: str, ctx: BenchContext, lm, roof: dict, drift_samples: int, progress: bool,
                 desc: str) -> dict:
    """One timed run of one backend: its result row (raises when the backend fails)."""
    from tqdm.auto import tqdm

    policy, wl = ctx.policy, ctx.workload
    device = policy.device
    backend = BACKENDS[name]()
    requests = wl.requests
    gc.collect()
    cpu0 = time.process_time()
    with PeakMemory(device) as mem:
        backend.setup(ctx)
        backend.warmup(ctx)
        counter = ForwardCounter(lm)
        try:
            total = min(len(requests), ctx.hf_sequential_max) if name == "hf-sequential" else len(requests)
            with tqdm(total=total, desc=desc, unit="seq", file=sys.stderr, disable=not progress, leave=True,
                      dynamic_ncols=True) as bar:
                cpu0 = time.process_time()
                t0 = time.perf_counter()
                out = backend.run(ctx, requests, t0, bar)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                wall = time.perf_counter() - t0
                cpu = time.process_time() - cpu0
        finally:
            counter.remove()
            backend.teardown(ctx)
    run_idx = {s.index for s in out.samples}
    out_tokens = sum(len(s.output_ids) for s in out.samples)
    prompt_tokens = sum(len(r.prompt_ids) for r in requests if r.index in run_idx)
    ttfts = out.ttft_override or [s.first_token_time - t0 for s in out.samples if s.first_token_time is not None]
    drift, checked = logprob_drift(policy, wl, out.samples, drift_samples)
    bw = roof["weight_bytes_per_forward"] * counter.count / wall / 1e9
    gflops = 2 * (roof["decoder_params"] * counter.tokens + roof["lm_head_params"] * out_tokens) / wall / 1e9
    return {
        "backend": name, "output_tokens_per_s": out_tokens / wall, "prompt_tokens_per_s": prompt_tokens / wall,
        "ttft_p50_s": _percentile(ttfts, 50), "ttft_p99_s": _percentile(ttfts, 99),
        "ttft_estimated": out.ttft_override is not None,
        "peak_memory_bytes": mem.peak_bytes, "logprob_drift": drift, "ratio_vs_engine": None,
        "drift_samples_checked": checked, "requests": len(requests), "requests_run": len(out.samples),
        "output_tokens": out_tokens, "prompt_tokens": prompt_tokens, "wall_s": wall, "cpu_s": cpu,
        "cpu_pressure_pct": cpu_pressure(), "forwards": counter.count, "tokens_forwarded": counter.tokens,
        "achieved_weight_bandwidth_gbs": bw, "bandwidth_fraction": bw / roof["copy_bandwidth_gbs"],
        "achieved_weight_gflops": gflops, "compute_fraction": gflops / roof["matmul_peak_gflops"], "lora": _lora_cell(backend, ctx.lora_rank, policy.is_vlm),
        "notes": out.notes, **out.extra,
    }


def run_bench(model: str = "small-vlm", workload: str = "grpo", prompts: int | None = None, group: int | None = None,
              max_new_tokens: int | None = None, backends: list[str] | None = None, lora: int = 16,
              seed: int = 0, temperature: float = 1.0, ignore_eos: bool = False, kv_cache_memory_bytes: int = 1 << 30,
              hf_sequential_max: int = 24, hf_batch_groups: int = 1, drift_samples: int = 8, repeats: int = 1,
              model_backend: str = "transformers", dtype: str | None = None, load_in_4bit: bool = False,
              progress: bool = True) -> dict:
    """Run ``backends`` on one seeded workload; returns the report dict that ``--json`` writes.

    ``repeats > 1`` runs the backends round-robin that many times and keeps each backend's fastest run
    (the one least disturbed by other processes); every run's output tokens/s is kept in ``runs``.
    """
    from ..models import load_model

    names = list(dict.fromkeys(ALIASES.get(b, b) for b in (backends or BACKENDS)))
    unknown = [b for b in names if b not in BACKENDS]
    if unknown:
        raise ValueError(f"--backends: unknown backend(s) {unknown}; known: {', '.join(BACKENDS)}")
    if lora < 0:
        raise ValueError(f"--lora-rank must be >= 0 (0 = no LoRA), got {lora}")
    if repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {repeats}")
    path = model_path(model)
    torch.manual_seed(seed)
    policy = load_model(path, backend=model_backend, lora={"r": lora, "random_state": seed} if lora else None,
                        dtype=dtype, load_in_4bit=load_in_4bit)
    if lora:
        perturb_lora(policy.model, std=0.02, seed=seed)
    policy.inference()
    wl = build_workload(policy, workload, prompts, group, max_new_tokens, temperature, ignore_eos, seed)
    ctx = BenchContext(policy, wl, lora, kv_cache_bytes=kv_cache_memory_bytes,
                       hf_sequential_max=hf_sequential_max, hf_batch_groups=hf_batch_groups)
    device = policy.device
    wbytes, decoder_params, head_params = text_weights(policy)
    roof = {"weight_bytes_per_forward": wbytes, "decoder_params": decoder_params, "lm_head_params": head_params,
            "copy_bandwidth_gbs": copy_bandwidth_gbs(device), "matmul_peak_gflops": matmul_peak_gflops(device)}
    report = {"model": model, "model_path": path, "is_vlm": policy.is_vlm, "lora_rank": lora,
              "dtype": str(policy.dtype).replace("torch.", ""), "load_in_4bit": load_in_4bit,
              "machine": machine_info(device), "workload": wl.summary(), "repeats": repeats, "results": [],
              "skipped": [], "roofline": roof}
    runnable = []
    for name in names:
        backend = BACKENDS[name]()
        reason = backend.unavailable(ctx)
        if reason:
            entry = {"backend": name, "reason": reason}
            if lora and policy.is_vlm and backend.lora_note:
                entry["lora"] = backend.lora_note
            report["skipped"].append(entry)
        else:
            runnable.append(name)
    lm = language_model(policy)
    best: dict[str, dict] = {}
    runs: dict[str, list[float]] = {}
    failed: dict[str, str] = {}
    for rep in range(repeats):
        for name in runnable:
            if name in failed:
                continue
            desc = f"{name:>15}" + (f" [{rep + 1}/{repeats}]" if repeats > 1 else "")
            try:
                row = _run_backend(name, ctx, lm, roof, drift_samples if rep == 0 else 0, progress, desc)
            except Exception as e:  # noqa: BLE001  (one backend failing must not lose the others' figures)
                traceback.print_exc()
                failed[name] = f"failed: {type(e).__name__}: {e}"
                continue
            runs.setdefault(name, []).append(row["output_tokens_per_s"])
            if name not in best:
                best[name] = row
            elif row["output_tokens_per_s"] > best[name]["output_tokens_per_s"]:
                row["logprob_drift"] = best[name]["logprob_drift"]  # checked on the first run
                row["drift_samples_checked"] = best[name]["drift_samples_checked"]
                best[name] = row
    for name in runnable:
        if name in best:
            best[name]["runs_output_tokens_per_s"] = runs[name]
            report["results"].append(best[name])
        else:
            report["skipped"].append({"backend": name, "reason": failed[name]})
    report["failed"] = sorted(failed)
    eng = best.get("engine")
    for r in report["results"]:
        if eng is not None and r["output_tokens_per_s"] > 0:
            r["ratio_vs_engine"] = eng["output_tokens_per_s"] / r["output_tokens_per_s"]
        # Medians over the repeats, and the median of the per-round ratios (a round's backends ran back to back,
        # under the same load): the figures that compare backends on a shared, noisy machine.
        mine = r.get("runs_output_tokens_per_s") or [r["output_tokens_per_s"]]
        r["median_output_tokens_per_s"] = float(np.median(mine))
        if eng is not None:
            e_runs = eng.get("runs_output_tokens_per_s") or [eng["output_tokens_per_s"]]
            r["median_ratio_vs_engine"] = float(np.median(e_runs)) / max(float(np.median(mine)), 1e-9)
            rounds = [a / b for a, b in zip(e_runs, mine) if b > 0]
            r["median_round_ratio_vs_engine"] = float(np.median(rounds)) if rounds else None
    report["machine"]["load_average_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    return report


def _lora_cell(backend, lora: int, is_vlm: bool) -> str:
    if not lora:
        return "off"
    if backend.lora_note and is_vlm:
        return f"r={lora}, language only ({backend.lora_note})"
    return f"r={lora}" + (" (vision + language)" if is_vlm else "")
