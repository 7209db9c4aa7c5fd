"""Render a benchmark report (the dict ``--json`` writes) as a Markdown table and a bar chart."""

from __future__ import annotations


def _fmt(v, spec: str, none: str = "-") -> str:
    return none if v is None else format(v, spec)


def _mem(b) -> str:
    if b is None:
        return "-"
    return f"{b / 2**20:.0f} MiB" if b < 2**30 else f"{b / 2**30:.2f} GiB"


def _ttft(row: dict, key: str) -> str:
    """TTFT cell; an estimate (hf-sequential runs a subset and extrapolates) says so."""
    cell = _fmt(row[key], ".2f")
    return f"{cell} (est.)" if row.get("ttft_estimated") and row[key] is not None else cell


def markdown(report: dict) -> str:
    """The results table, skipped backends with their reason, notes and the roofline line."""
    m, w = report["machine"], report["workload"]
    lines = [
        (f"Model `{report['model']}` ({'VLM' if report.get('is_vlm') else 'text'}, LoRA "
         f"{'r=' + str(report['lora_rank']) if report.get('lora_rank') else 'off'}), workload `{w['kind']}`: "
         f"{w['prompts']} prompts x {w['group']} samples, max_new_tokens {w['max_new_tokens']} "
         f"(per-sample budgets mean {w['sample_budget_mean']:.0f}), prompts {w['prompt_tokens_min']}-"
         f"{w['prompt_tokens_max']} tokens (mean {w['prompt_tokens_mean']:.0f}), {w['images']} images, "
         f"temperature {w['temperature']}, seed {w['seed']}."),
        (f"Machine: {m['cpu']} ({m['cores']} cores, {m['threads']} torch threads), device {m['device']}, "
         f"torch {m['torch']}, transformers {m['transformers']}."),
        "",
        ("| backend | output tok/s | prompt tok/s | TTFT p50 (s) | TTFT p99 (s) | peak memory | engine speedup "
         "| logprob drift | weight GB/s | GFLOP/s | LoRA |"),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in report["results"]:
        lines.append(
            f"| {r['backend']} | {_fmt(r['output_tokens_per_s'], '.1f')} | {_fmt(r['prompt_tokens_per_s'], '.1f')} "
            f"| {_ttft(r, 'ttft_p50_s')} | {_ttft(r, 'ttft_p99_s')} | {_mem(r['peak_memory_bytes'])} "
            f"| {_fmt(r['ratio_vs_engine'], '.2f', 'n/a')}x | {_fmt(r['logprob_drift'], '.1e', 'n/a')} "
            f"| {_fmt(r.get('achieved_weight_bandwidth_gbs'), '.2f')} | {_fmt(r.get('achieved_weight_gflops'), '.1f')} "
            f"| {r.get('lora', '-')} |")
    lines.append("")
    lines.append("engine speedup = engine output tok/s / this backend's output tok/s. logprob drift = max |logprob "
                 "returned - log_softmax(logits / T) of a teacher-forced forward| over checked samples "
                 "(n/a: the backend returns no logprobs).")
    roof = report.get("roofline") or {}
    if roof:
        lines.append(
            f"Roofline: each forward reads {roof['weight_bytes_per_forward'] / 2**20:.1f} MiB of text weights "
            f"({(roof['decoder_params'] + roof['lm_head_params']) / 1e6:.1f}M parameters, embeddings and vision tower "
            f"excluded); this machine copies memory at {roof['copy_bandwidth_gbs']:.1f} GB/s and multiplies fp32 "
            f"matrices at {roof['matmul_peak_gflops']:.0f} GFLOP/s. weight GB/s = weight bytes x forwards / wall "
            "time (the bandwidth roof binds small batches); GFLOP/s = 2 x parameters x token positions forwarded "
            "(padding included) / wall time (the compute roof binds large batches).")
        for r in report["results"]:
            if r.get("achieved_weight_bandwidth_gbs") is not None:
                lines.append(f"- {r['backend']}: {r['forwards']} forwards over {r.get('tokens_forwarded', 0)} token "
                             f"positions: {r['achieved_weight_bandwidth_gbs']:.2f} GB/s "
                             f"({100 * r['bandwidth_fraction']:.1f}% of copy bandwidth), "
                             f"{r.get('achieved_weight_gflops', 0):.1f} GFLOP/s "
                             f"({100 * r.get('compute_fraction', 0):.1f}% of matmul peak)")
    pressures = [r["cpu_pressure_pct"] for r in report["results"] if r.get("cpu_pressure_pct") is not None]
    if pressures:
        lines.append("CPU contention at the end of each run (Linux PSI `some avg10`: % of time runnable tasks waited "
                     "for a CPU, this process's own threads included): " + ", ".join(f"{r['backend']} {r['cpu_pressure_pct']:.0f}%"
                                                 for r in report["results"] if r.get("cpu_pressure_pct") is not None)
                     + (". Other processes competed for the CPU: absolute figures are noisy, ratios less so."
                        if max(pressures) > 20 else "."))
    if report.get("repeats", 1) > 1:
        lines.append(f"Each backend ran {report['repeats']} times round-robin; the table keeps its fastest run "
                     "(output tok/s of every run: " + "; ".join(
                         f"{r['backend']} " + ", ".join(f"{x:.0f}" for x in r.get("runs_output_tokens_per_s", []))
                         for r in report["results"]) + ").")
    notes = [(r["backend"], n) for r in report["results"] for n in r.get("notes", [])]
    if notes:
        lines.append("")
        lines.append("Notes:")
        lines.extend(f"- {b}: {n}" for b, n in notes)
    if report.get("skipped"):
        lines.append("")
        lines.append("Not run here:")
        lines.extend(f"- {s['backend']}: {s['reason']}" + (f" (LoRA: {s['lora']})" if s.get("lora") else "")
                     for s in report["skipped"])
    return "\n".join(lines) + "\n"


def plot(report: dict, path: str) -> None:
    """Bar chart of output tokens/s per backend (matplotlib, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["results"]
    names = [r["backend"] for r in rows]
    vals = [r["output_tokens_per_s"] for r in rows]
    fig, ax = plt.subplots(figsize=(max(4.0, 1.4 * len(rows) + 1), 3.6), dpi=120)
    bars = ax.bar(names, vals, color=["#d9822b" if n == "engine" else "#4c72b0" for n in names])
    for b, r in zip(bars, rows):
        label = f"{r['output_tokens_per_s']:.0f}"
        if r.get("ratio_vs_engine") and r["backend"] != "engine":
            label += f"\n(engine {r['ratio_vs_engine']:.1f}x)"
        ax.annotate(label, (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom", fontsize=8)
    w = report["workload"]
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"{report['model']}, {w['kind']}: {w['prompts']}x{w['group']}, max_new_tokens {w['max_new_tokens']}",
                 fontsize=9)
    ax.set_ylim(0, max(vals) * 1.3 if vals else 1)
    ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
