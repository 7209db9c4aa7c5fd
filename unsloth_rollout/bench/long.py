"""``--workload long``: decode cost as the context grows, and where a decode step's time goes.

For each decode backend (engine/decode/) and each context length, ``batch`` sequences with distinct
random prompts of that many tokens are prefilled and take one warm-up decode step (their rows join the decode
workspace). Then ``steps`` decode steps of every configuration are timed interleaved (one step of each in
turn, so load changes on a shared machine hit all alike); the median step gives decode tok/s.

Per configuration it also records:

- ``kv_bytes_per_step``: the keys and values the step's attention must read (batch x context x bytes per
  token), and ``kv_read_ms``: this machine reading exactly those tensors once (``torch.sum`` over each layer's
  K and V as the step attends to them), the floor of any decode that reads the history once.
- one step under torch's profiler: ops that read the paged pool through an index (the per-step KV-history
  copy of the ``gather`` backend) are counted, and the step is split into the model forward
  (``ModelRunner.decode``), sampling (``Sampler.__call__``) and the rest (bookkeeping).

Per backend the report gives decode tok/s at the shortest context over decode tok/s at the longest
(``ratio``), beside what a decode that reads each row's history once would give: the shortest step plus the
difference of the measured one-pass reads (``read_once_ratio``). A step that copies the history (``gather``)
stands out from one that only reads it.

    python -m unsloth_rollout.bench --workload long --json benchmarks/cpu/long.json
    PYTHONPATH=$PWD python benchmarks/profile_decode.py --json benchmarks/cpu/long.json   (the same run)
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch

from ..engine.config import DECODE_BACKENDS

LONG_DEFAULTS = {"batch": 32, "contexts": (256, 2048), "steps": 16, "backends": ("workspace", "gather")}


def pool_index_ops(prof, pool_rows: int) -> int:
    """Ops of a profiled step that read the paged pool through an index (a KV-history gather)."""
    return sum(1 for e in prof.events()
               if e.name in ("aten::index_select", "aten::gather", "aten::index", "aten::take")
               and any(isinstance(sh, list) and len(sh) == 3 and sh[0] == pool_rows for sh in e.input_shapes))


class Timed:
    """Wraps a bound method, accumulating its wall time."""

    def __init__(self, obj, name):
        self.obj, self.name, self.fn, self.total = obj, name, getattr(obj, name), 0.0
        setattr(obj, name, self)

    def __call__(self, *a, **k):
        t = time.perf_counter()
        try:
            return self.fn(*a, **k)
        finally:
            self.total += time.perf_counter() - t

    def restore(self):
        setattr(self.obj, self.name, self.fn)


# Decode backends of this workload: the engine's (DecodeConfig.backend: "auto", the default, and the variants but
# the CUDA-only graph and paged steps), each also with every row holding its whole history (``<backend>-whole-rows``:
# DecodeConfig.shared_prompt=False), to compare with ``--group``. "static" is the old name of "compiled".
WHOLE_ROWS = "-whole-rows"
BACKENDS = tuple(b for b in DECODE_BACKENDS if b not in ("graph", "paged"))
ALIASES = {"static": "compiled"}


def backend_spec(backend: str) -> tuple[str, bool, int | None]:
    """(decode backend, whole rows, decoder layers per compiled call) of ``<backend>[-whole-rows][@<layers>]``
    (``auto@1``: the default backend with DecodeConfig.layers_per_call=1)."""
    name, _, per_call = backend.partition("@")
    base = name.removesuffix(WHOLE_ROWS)
    return ALIASES.get(base, base), name.endswith(WHOLE_ROWS), int(per_call) if per_call else None


def _known(backend: str) -> bool:
    try:
        name, _, per_call = backend_spec(backend)
    except ValueError:  # @ not followed by an integer
        return False
    return name in BACKENDS and (per_call is None or per_call >= 1)


def setup(policy, backend: str, context: int, batch: int, steps: int, seed: int, group: int = 1,
          min_prefix: int | None = None):
    """An engine core with ``batch`` random prompts of ``context`` tokens prefilled and joined: distinct, or
    ``batch / group`` prompts sampled ``group`` times each (a GRPO group: the samples share the prompt's KV)."""
    from ..engine.config import DecodeConfig, EngineConfig, SamplingParams
    from ..engine.core import EngineCore
    from ..engine.inputs import PreparedPrompt
    from ..engine.kv_cache import KVCache
    from ..models.families import text_dims
    from ..engine.sequence import Sequence

    per_token = KVCache.bytes_per_token(*text_dims(policy.text_config), policy.dtype)
    kv_bytes = int(per_token * batch * (context + steps + 64) * 1.1)
    name, whole, per_call = backend_spec(backend)
    decode = DecodeConfig(backend=name, shared_prompt=not whole, shared_prompt_min_tokens=min_prefix,
                          layers_per_call=per_call)
    core = EngineCore(policy, EngineConfig(kv_cache_memory_bytes=kv_bytes, max_num_seqs=batch, decode=decode),
                      seed=seed)
    g = torch.Generator().manual_seed(seed)
    vocab = len(policy.tokenizer)
    ids = None
    for i in range(batch):  # random prompts (shared by ``group`` samples), sampled at T=1, never stopping early
        if i % group == 0:
            ids = torch.randint(100, min(vocab, 5000), (context,), generator=g).tolist()
        sp = SamplingParams(max_new_tokens=steps + 16, temperature=1.0, seed=i, ignore_eos=True)
        core.add(Sequence(f"p{i // group}", i % group, PreparedPrompt(ids), sp))
    while any(s.num_cached == 0 for s in core.sequences()):
        core.step()  # prefills
    core.step()  # warm-up decode: the rows join the workspace (filled from the pool once)
    if len(core.scheduler.running) != batch:
        raise RuntimeError(f"long workload: {len(core.scheduler.running)} of {batch} sequences decoding "
                           "(KV budget too small?)")
    return core


def kv_read_ms(core, reps: int = 5) -> float:
    """Best time to read once, per layer, the keys and values a decode step of ``core`` attends to."""
    running = core.scheduler.running
    b = len(running)
    n = max(s.num_cached for s in running) + 1
    ws = core.runner.decode_steps.workspace
    if ws is not None and ws.has_shared:  # the rows' own positions, and each shared prompt once
        s_own = max(ws.own_lengths) + 1
        store = ws.store
        views = [t[:b, :, :s_own] for t in ws.k + ws.v] + [t[:len(store.lengths), :, :max(store.lengths)]
                                                           for t in store.k + store.v]
    elif ws is not None and ws.k:
        views = [t[:b, :, :n] for t in ws.k + ws.v]
    else:  # gather: the pool rows of the batch (as contiguous reads; the gather itself copies them)
        views = [t[: b * n] for t in core.kv.k + core.kv.v]
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        for v in views:
            v.sum()
        best = min(best, time.perf_counter() - t)
    return 1000 * best


def attended_positions(core) -> int:
    """Positions of K/V history one decode step's attention reads, padding included: rows x (longest + 1), or
    with shared prompts the rows' own positions plus each shared prompt once."""
    ws, running = core.runner.decode_steps.workspace, core.scheduler.running
    b = len(running)
    if ws is not None and ws.has_shared:
        return b * (max(ws.own_lengths) + 1) + len(ws.store.lengths) * max(ws.store.lengths)
    return b * (max(s.num_cached for s in running) + 1)


def profiled_step(core) -> dict:
    """One step under torch's profiler: pool-index ops, and the step split into forward / sampler / the rest."""
    fwd, smp = Timed(core.runner, "decode"), Timed(core, "sampler")
    rows = core.kv.k[0].shape[0]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        t1 = time.perf_counter()
        core.step()
        step_s = time.perf_counter() - t1
    fwd.restore()
    smp.restore()
    other = step_s - fwd.total - smp.total
    return {"profiled_step_ms": 1000 * step_s, "pool_index_ops_per_step": pool_index_ops(prof, rows),
            "forward_share": fwd.total / step_s, "sampler_share": smp.total / step_s,
            "bookkeeping_share": other / step_s, "sampler_plus_bookkeeping_share": (smp.total + other) / step_s}


def timed_shares(core, n: int) -> dict:
    """Sampler and sampler + bookkeeping (all but the forward) shares of ``n`` plain (unprofiled) steps: the
    median over the steps of each step's own share."""
    fwd, smp = Timed(core.runner, "decode"), Timed(core, "sampler")
    sampler, rest = [], []
    for _ in range(n):
        f0, s0 = fwd.total, smp.total
        t = time.perf_counter()
        core.step()
        step = time.perf_counter() - t
        sampler.append((smp.total - s0) / step)
        rest.append((step - (fwd.total - f0)) / step)
    fwd.restore()
    smp.restore()
    return {"sampler_share_unprofiled": statistics.median(sampler),
            "sampler_plus_bookkeeping_share_unprofiled": statistics.median(rest)}


def logprob_drift(policy, core, k: int) -> float | None:
    """Max |logprob returned - teacher-forced log_softmax| over the first ``k`` sequences' outputs so far."""
    from ..testing.oracles import teacher_forced

    worst = None
    for seq in core.sequences()[:k]:
        if not seq.output_ids:
            continue
        lp, _ = teacher_forced(policy, seq.prompt.prompt_ids, seq.output_ids, temperature=seq.sampling.temperature)
        d = (lp - torch.tensor(seq.output_logprobs, dtype=lp.dtype)).abs().max().item()
        worst = d if worst is None else max(worst, d)
    return worst


def run_long(model: str = "small-vlm", batch: int = 32, contexts=(256, 2048), steps: int = 16,
             backends=("workspace", "gather"), lora: int = 16, seed: int = 0, drift_samples: int = 2,
             progress: bool = True, group: int = 1, min_prefix: int | None = None) -> dict:
    """Run the long-context decode measurement; returns the report dict that ``--json`` writes."""
    from ..engine.kv_cache import KVCache
    from ..models.families import text_dims
    from ..models import load_model
    from ..testing.oracles import perturb_lora
    from .harness import cpu_pressure, machine_info, model_path

    contexts = sorted({int(c) for c in contexts})
    if len(contexts) < 2 or contexts[0] < 1:
        raise ValueError(f"--contexts needs two or more distinct positive lengths, got {contexts}")
    if batch < 1 or steps < 2:
        raise ValueError(f"--batch must be >= 1 and --steps >= 2, got --batch {batch}, --steps {steps}")
    bad = [b for b in backends if not _known(b)]
    if bad:
        raise ValueError(f"--backends for --workload long: decode backends {', '.join(BACKENDS)}, each also as "
                         f"<backend>{WHOLE_ROWS} and <backend>@<decoder layers per compiled call>; got {bad}")
    if group < 1 or batch % group:
        raise ValueError(f"--group for --workload long must divide --batch {batch}, got {group}")
    path = model_path(model)
    torch.manual_seed(seed)
    policy = load_model(path, backend="transformers", lora={"r": lora, "random_state": seed} if lora else None)
    if lora:
        perturb_lora(policy.model, std=0.02, seed=seed)
    policy.inference()
    per_token = KVCache.bytes_per_token(*text_dims(policy.text_config), policy.dtype)
    load0 = os.getloadavg()
    configs = [(b, c) for b in backends for c in contexts]
    cores = {}
    for cfg in configs:
        if progress:
            print(f"[long] prefilling {batch} x {cfg[1]} tokens ({cfg[0]}) ...", file=sys.stderr, flush=True)
        cores[cfg] = setup(policy, cfg[0], cfg[1], batch, steps, seed, group, min_prefix)
    attended = {cfg: attended_positions(core) for cfg, core in cores.items()}  # what the first timed step reads
    times = {cfg: [] for cfg in configs}
    for _ in range(steps):
        for cfg in configs:
            t = time.perf_counter()
            cores[cfg].step()
            times[cfg].append(time.perf_counter() - t)
    rows = []
    for cfg in configs:
        backend, ctx = cfg
        med = statistics.median(times[cfg])
        core = cores[cfg]
        r = {"backend": backend, "context": ctx, "batch": batch, "steps": steps, "step_ms_median": 1000 * med,
             "step_ms_all": [round(1000 * x, 2) for x in times[cfg]], "decode_tok_s": batch / med,
             "kv_bytes_per_step": per_token * attended[cfg], "kv_read_ms": kv_read_ms(core),
             "shared_prefix_steps": ws.shared_steps if (ws := core.runner.decode_steps.workspace) else 0}
        r.update(profiled_step(core))
        r.update(timed_shares(core, 8))
        r["logprob_drift"] = logprob_drift(policy, core, drift_samples) if drift_samples else None
        r["drift_samples_checked"] = min(drift_samples, len(core.sequences()))
        rows.append(r)
        del cores[cfg], core
    summary = {}
    for backend in backends:
        by = {r["context"]: r for r in rows if r["backend"] == backend}
        short, long_ = by[contexts[0]], by[contexts[-1]]
        floor_ms = short["step_ms_median"] + max(0.0, long_["kv_read_ms"] - short["kv_read_ms"])
        summary[backend] = {
            "ratio": short["decode_tok_s"] / long_["decode_tok_s"],
            "read_once_ratio": floor_ms / short["step_ms_median"],
            "excess_ms": long_["step_ms_median"] - floor_ms,
        }
    return {
        "command": (f"python -m unsloth_rollout.bench --workload long --model {model} --batch {batch} "
                    f"--contexts {','.join(map(str, contexts))} --steps {steps} "
                    f"--backends {','.join(backends)} --lora-rank {lora} --seed {seed}"
                    + (f" --group {group}" if group > 1 else "")
                    + (f" --shared-prefix-min-tokens {min_prefix}" if min_prefix is not None else "")),
        "model": model, "lora_rank": lora, "group": group, "shared_prefix_min_tokens": min_prefix,
        "machine": machine_info(policy.device),
        "kv_bytes_per_token": per_token, "contexts": contexts,
        "loadavg_before": list(load0), "loadavg_after": list(os.getloadavg()), "cpu_pressure_after": cpu_pressure(),
        "rows": rows, "summary": summary,
    }


def markdown(report: dict) -> str:
    c0, c1 = report["contexts"][0], report["contexts"][-1]
    m = report["machine"]
    lines = [
        f"Model `{report['model']}` (LoRA r={report['lora_rank']}), workload `long`: {report['rows'][0]['batch']} "
        f"sequences decoding at once, "
        + (f"{report['rows'][0]['batch'] // report['group']} random prompts x {report['group']} samples each (a GRPO "
           "group: the samples share the prompt's KV)" if report.get("group", 1) > 1 else "distinct random prompts")
        + f" of {', '.join(map(str, report['contexts']))} tokens, "
        f"{report['rows'][0]['steps']} timed decode steps each (interleaved), sampled at temperature 1, "
        f"{report['kv_bytes_per_token']} KV bytes per token.",
        f"Machine: {m.get('cpu')} ({m.get('cores')} cores, {m.get('threads')} torch threads), torch {m.get('torch')}, "
        f"transformers {m.get('transformers')}.",
        "",
        "| decode backend | context | decode tok/s | step (ms) | KV read per step | one pass over that KV (ms) "
        "| pool-index ops / step | sampler + bookkeeping | logprob drift |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["rows"]:
        lines.append(f"| {r['backend']} | {r['context']} | {r['decode_tok_s']:.1f} | {r['step_ms_median']:.1f} | "
                     f"{r['kv_bytes_per_step'] / 2**20:.1f} MiB | {r['kv_read_ms']:.1f} | "
                     f"{r['pool_index_ops_per_step']} | {r['sampler_plus_bookkeeping_share_unprofiled']:.1%} | "
                     f"{'n/a' if r['logprob_drift'] is None else format(r['logprob_drift'], '.1e')} |")
    lines.append("")
    for backend, s in report["summary"].items():
        lines.append(f"- {backend}: decode tok/s at {c0} / at {c1} = {s['ratio']:.2f}x; a step that only adds one "
                     f"pass over the extra KV would be {s['read_once_ratio']:.2f}x; this step spends "
                     f"{s['excess_ms']:.1f} ms beyond that.")
    lines.append("")
    lines.append("one pass over that KV = torch.sum over each layer's keys and values as the step attends to them, "
                 "best of 5: the floor of any decode that reads each row's history once. pool-index ops = ops "
                 "that read the paged pool through an index inside one step (the gather backend's per-step copy). "
                 "logprob drift = max |logprob returned - log_softmax of a teacher-forced forward over prompt + "
                 "output| over the first sequences of each configuration.")
    return "\n".join(lines) + "\n"
