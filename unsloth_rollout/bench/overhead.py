"""``--workload overhead``: what the engine's threads cost its own decode steps and the trainer beside it.

On CPU each OS thread that runs parallel torch ops has its own OpenMP team, and two teams in one process
fight for the cores even while one sleeps (engine/worker.py). This workload measures, in one process, on a
random Qwen2 built from ``--model``'s config with ``--layers`` decoder layers (default: tiny-lm's hidden size
64 at Qwen2.5-3B's depth of 36, where a step is dispatch, not arithmetic) and LoRA on every projection:

- decode step, ``batch`` sequences: ``EngineCore.step()`` driven by hand on the main thread (the reference),
  ``RolloutEngine.generate()`` (the engine's own stepping for a waiting caller) and ``agenerate`` from an
  event loop (stepped by the engine's worker thread, the event loop's thread having freed its team);
- a trainer step (forward + backward, ``train_batch`` x ``train_tokens`` tokens): with no engine (before it
  is built and after ``shutdown()``), with the engine alive after ``generate()`` and after ``agenerate()``,
  and a control: beside a thread that ran one forward and then blocks (an engine thread that kept its OpenMP
  team while idle).

Rounds run interleaved (one measurement of each kind in turn), so load changes on a shared machine hit all
alike; each figure is the median over rounds of the per-round median. Each ratio is a step's time over its
reference (decode on the main thread; a trainer step with no engine): 1.00 means the engine's threads cost
nothing. The control ratio says whether the effect the engine avoids shows on this machine at all.

    python -m unsloth_rollout.bench --workload overhead --json benchmarks/cpu/overhead.json
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import threading
import time

import torch

OVERHEAD_DEFAULTS = {"layers": 36, "batch": 64, "steps": 12, "train_batch": 8, "train_tokens": 128, "rounds": 3,
                     "lora": 8}


def deep_policy(model: str, layers: int, lora: int, seed: int):
    """``model``'s tokenizer and config with ``layers`` decoder layers, random weights, random non-zero LoRA."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from ..models import load_model
    from ..models.families import is_vlm_config
    from ..testing.oracles import perturb_lora
    from .harness import model_path

    path = model_path(model)
    cfg = AutoConfig.from_pretrained(path)
    if is_vlm_config(cfg):
        raise ValueError(f"--workload overhead needs a text model (--model tiny-lm / small-lm); {model!r} is a VLM")
    cfg.num_hidden_layers = layers
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = [cfg.layer_types[0]] * layers
    torch.manual_seed(seed)
    net = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    policy = load_model(net, tokenizer=AutoTokenizer.from_pretrained(path),
                        lora={"r": lora, "random_state": seed} if lora else None)
    if lora:
        perturb_lora(policy.model, std=0.02, seed=seed)
    policy.inference()
    return policy


class DecodeSteps:
    """Wraps ``core.step`` and keeps the wall time of each step that prefilled nothing (a decode step)."""

    def __init__(self, core):
        self.core, self.fn, self.times = core, core.step, []
        core.step = self

    def __call__(self):
        before = self.core.stats["prefill_tokens"]
        t = time.perf_counter()
        n = self.fn()
        if n and self.core.stats["prefill_tokens"] == before:
            self.times.append(time.perf_counter() - t)
        return n

    def take(self) -> float:
        """Median decode step (ms) since the last take."""
        times, self.times = self.times, []
        if not times:
            raise RuntimeError("overhead workload: no decode step was timed")
        return 1000 * statistics.median(times)


def engine_threads() -> int:
    """Live engine worker threads."""
    from ..engine.worker import WORKER_NAME

    return sum(1 for t in threading.enumerate() if t.name == WORKER_NAME and t.is_alive())


def run_overhead(model: str = "tiny-lm", layers: int = 36, batch: int = 64, steps: int = 12, train_batch: int = 8,
                 train_tokens: int = 128, rounds: int = 3, lora: int = 8, seed: int = 0, progress: bool = True) -> dict:
    """Run the measurement; returns the report dict that ``--json`` writes."""
    from ..engine.config import EngineConfig, SamplingParams
    from ..engine.engine import RolloutEngine
    from ..engine.inputs import PreparedPrompt
    from ..engine.kv_cache import KVCache
    from ..engine.request import GenerationRequest
    from ..models.families import text_dims
    from ..engine.sequence import Sequence
    from .harness import cpu_pressure, machine_info

    for name, v, lo in (("--layers", layers, 1), ("--batch", batch, 1), ("--steps", steps, 2),
                        ("--train-batch", train_batch, 1), ("--train-tokens", train_tokens, 2),
                        ("--repeats", rounds, 1)):
        if v < lo:
            raise ValueError(f"{name} must be >= {lo} for --workload overhead, got {v}")
    policy = deep_policy(model, layers, lora, seed)
    vocab = min(len(policy.tokenizer), policy.text_config.vocab_size)
    g = torch.Generator().manual_seed(seed)
    train_ids = torch.randint(100, vocab, (train_batch, train_tokens), generator=g)
    runs = iter(range(1 << 30))

    def requests():
        k = next(runs)  # fresh prompts every run: no prefix-cache hits, the same work each time
        return [GenerationRequest(input_ids=torch.randint(100, vocab, (16,), generator=g).tolist(),
                                  sampling=SamplingParams(max_new_tokens=steps + 1, temperature=1.0, seed=i,
                                                          ignore_eos=True), request_id=f"r{k}-{i}")
                for i in range(batch)]

    def train_ms(n: int = 3) -> float:
        times = []
        for _ in range(n):
            t = time.perf_counter()
            with policy.lock, policy.training():
                policy.model(input_ids=train_ids, labels=train_ids).loss.backward()
            times.append(time.perf_counter() - t)
            for p in policy.trainable_parameters():
                p.grad = None
        return 1000 * statistics.median(times)

    def say(msg):
        if progress:
            print(f"[overhead] {msg}", file=sys.stderr, flush=True)

    load0 = os.getloadavg()
    train_ms(1)  # warm-up: autograd, allocator
    say(f"{layers} layers, batch {batch}: trainer steps with no engine ...")
    rows = {k: [] for k in ("main_step_ms", "generate_step_ms", "worker_step_ms", "train_no_engine_ms",
                            "train_after_generate_ms", "train_after_agenerate_ms", "train_beside_idle_thread_ms")}
    rows["train_no_engine_ms"].append(train_ms())
    per_token = KVCache.bytes_per_token(*text_dims(policy.text_config), policy.dtype)
    engine = RolloutEngine(policy, EngineConfig(kv_cache_memory_bytes=int(per_token * batch * (steps + 40) * 1.2),
                                                max_num_seqs=batch, prefix_cache=False), seed=seed)
    timer = DecodeSteps(engine.core)
    engine.generate(requests())  # warm-up
    timer.take()
    threads_after_generate, threads_after_agenerate = [], []

    async def agenerate_all(reqs):
        return await asyncio.gather(*(engine.agenerate(r) for r in reqs))

    for r in range(rounds):
        say(f"round {r + 1}/{rounds}: decode on the main thread, in generate(), on the worker; trainer steps ...")
        for q in requests():
            engine.core.add(Sequence(q.request_id, 0, PreparedPrompt(q.input_ids), q.sampling))
        while engine.core.scheduler.has_work():
            engine.core.step()  # by hand, on this thread: the reference
        rows["main_step_ms"].append(timer.take())
        engine.generate(requests())
        rows["generate_step_ms"].append(timer.take())
        threads_after_generate.append(engine_threads())
        rows["train_after_generate_ms"].append(train_ms())
        asyncio.run(agenerate_all(requests()))
        rows["worker_step_ms"].append(timer.take())
        worker = engine.driver.worker
        if worker is not None:
            worker.join(timeout=30)  # it exits once idle
        threads_after_agenerate.append(engine_threads())
        rows["train_after_agenerate_ms"].append(train_ms())
        rows["train_beside_idle_thread_ms"].append(_beside_idle_thread(policy, train_ms))
    engine.shutdown()
    rows["train_no_engine_ms"].append(train_ms())
    med = {k: statistics.median(v) for k, v in rows.items()}
    ratios = {
        "decode_generate_vs_main": med["generate_step_ms"] / med["main_step_ms"],
        "decode_worker_vs_main": med["worker_step_ms"] / med["main_step_ms"],
        "train_after_generate_vs_no_engine": med["train_after_generate_ms"] / med["train_no_engine_ms"],
        "train_after_agenerate_vs_no_engine": med["train_after_agenerate_ms"] / med["train_no_engine_ms"],
        "control_train_beside_idle_thread_vs_no_engine": med["train_beside_idle_thread_ms"]
        / med["train_no_engine_ms"],
    }
    return {
        "command": (f"python -m unsloth_rollout.bench --workload overhead --model {model} --layers {layers} "
                    f"--batch {batch} --steps {steps} --train-batch {train_batch} --train-tokens {train_tokens} "
                    f"--repeats {rounds} --lora-rank {lora} --seed {seed}"),
        "model": model, "layers": layers, "lora_rank": lora, "batch": batch, "steps": steps,
        "train_batch": train_batch, "train_tokens": train_tokens, "rounds": rounds,
        "machine": machine_info(policy.device), "loadavg_before": list(load0), "loadavg_after": list(os.getloadavg()),
        "cpu_pressure_after": cpu_pressure(),
        "medians_ms": med, "per_round_ms": rows, "ratios": ratios,
        "engine_threads_after_generate": threads_after_generate,
        "engine_threads_after_agenerate": threads_after_agenerate,
        "engine_workers_started": engine.driver.workers_started,
    }


def _beside_idle_thread(policy, train_ms) -> float:
    """Trainer step while a second thread that ran one forward blocks (the control: a thread that keeps its
    OpenMP team while idle)."""
    ran, release = threading.Event(), threading.Event()

    def idle():
        with torch.inference_mode():
            policy.model(input_ids=torch.full((8, 4), 100))
        ran.set()
        release.wait()

    t = threading.Thread(target=idle, name="overhead-control", daemon=True)
    t.start()
    ran.wait()
    try:
        return train_ms()
    finally:
        release.set()
        t.join()


def markdown(report: dict) -> str:
    m, med, r = report["machine"], report["medians_ms"], report["ratios"]
    lines = [
        f"Model `{report['model']}` config at {report['layers']} layers (LoRA r={report['lora_rank']}), workload "
        f"`overhead`: decode steps at batch {report['batch']}, trainer steps of {report['train_batch']} x "
        f"{report['train_tokens']} tokens, {report['rounds']} interleaved rounds (medians).",
        f"Machine: {m.get('cpu')} ({m.get('cores')} cores, {m.get('threads')} torch threads), torch {m.get('torch')}; "
        f"load average {report['loadavg_before'][0]:.1f} before, {report['loadavg_after'][0]:.1f} after.",
        "",
        "| measurement | ms | ratio to its reference |",
        "|---|---:|---:|",
        f"| decode step, EngineCore.step() by hand on the main thread (reference) | {med['main_step_ms']:.1f} | 1.00 |",
        f"| decode step, generate() (steps on the calling thread) | {med['generate_step_ms']:.1f} | "
        f"{r['decode_generate_vs_main']:.2f} |",
        f"| decode step, agenerate() (the engine's worker thread) | {med['worker_step_ms']:.1f} | "
        f"{r['decode_worker_vs_main']:.2f} |",
        f"| trainer step, no engine (reference) | {med['train_no_engine_ms']:.1f} | 1.00 |",
        f"| trainer step, engine alive after generate() | {med['train_after_generate_ms']:.1f} | "
        f"{r['train_after_generate_vs_no_engine']:.2f} |",
        f"| trainer step, engine alive after agenerate() | {med['train_after_agenerate_ms']:.1f} | "
        f"{r['train_after_agenerate_vs_no_engine']:.2f} |",
        f"| control: trainer step beside a blocked thread that ran a forward | "
        f"{med['train_beside_idle_thread_ms']:.1f} | {r['control_train_beside_idle_thread_vs_no_engine']:.2f} |",
        "",
        f"Engine worker threads alive after generate(): {report['engine_threads_after_generate']}; after agenerate() "
        f"went idle: {report['engine_threads_after_agenerate']} (workers started: "
        f"{report['engine_workers_started']}).",
    ]
    return "\n".join(lines) + "\n"
