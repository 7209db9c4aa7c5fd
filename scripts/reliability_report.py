#!/usr/bin/env python
"""Render RELIABILITY.md's figure tables from the recorded reliability JSONs.

Reads ``benchmarks/reliability/{load,faults,fuzz,grpo}_{ci,full}.json`` (written by the tests; refresh them with
``bash scripts/record_figures.sh`` and ``bash scripts/record_figures.sh -m slow``) and rewrites every block of
RELIABILITY.md between ``<!-- figures:NAME -->`` and ``<!-- /figures:NAME -->``. Everything outside the markers
is left as it is; running it twice changes nothing.

    python scripts/reliability_report.py            # rewrite RELIABILITY.md
    python scripts/reliability_report.py --check    # exit 1 if RELIABILITY.md is not what the JSONs give

A row whose figure no JSON holds is left out; a figure one variant lacks is shown as "n/a". A missing JSON file
or marker is an error naming it.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import re
import statistics
import sys
import textwrap

ROOT = pathlib.Path(__file__).resolve().parent.parent
AREAS = ("load", "faults", "fuzz", "grpo")
VARIANTS = ("ci", "full")
NA = "n/a"


class Missing(Exception):
    """A figure the JSON does not hold."""


def get(d: dict, *path):
    for key in path:
        if not isinstance(d, dict) or key not in d:
            raise Missing(".".join(map(str, path)))
        d = d[key]
    return d


def count(n) -> str:
    return f"{int(round(n)):,}"


def table(header: list[str], rows: list[tuple[str, callable]], data: list[dict]) -> str:
    """Markdown table; each row is (label, fn(json) -> cell). Rows no variant holds are dropped."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for label, fn in rows:
        cells = []
        for d in data:
            try:
                cells.append(fn(d))
            except Missing:
                cells.append(None)
        if all(c is None for c in cells):
            continue
        lines.append("| " + " | ".join([label] + [NA if c is None else c for c in cells]) + " |")
    return "\n".join(lines)


def wrap(text: str) -> str:
    return textwrap.fill(text, width=115, break_long_words=False, break_on_hyphens=False)


def wrap_source(area: str, data: list[dict]) -> str:
    return wrap(source_line(area, data))


def source_line(area: str, data: list[dict]) -> str:
    parts = []
    for v, d in zip(VARIANTS, data):
        bits = [f"written {d['written']}"] if "written" in d else []
        load = d.get("machine", {}).get("load_avg_1m")
        if load is not None:
            bits.append(f"1-minute load average {load:.2f}")
        parts.append(f"`{area}_{v}.json` ({', '.join(bits) or 'no date recorded'})")
    return "From " + " and ".join(parts) + "."


# ---- load ----

def load_block(ci: dict, full: dict) -> str:
    def rss(d):
        after = get(d, "rss_after_round_mib")
        b = get(d, "rss_baseline_round")
        return f"{after[b]:.1f} → {after[-1]:.1f} MiB"

    rounds_b = {d.get("rss_baseline_round") for d in (ci, full)} - {None}
    base_round = "/".join(str(b + 1) for b in sorted(rounds_b)) or "?"  # rss_baseline_round is an index
    rows = [
        ("requests", lambda d: count(get(d, "requests"))),
        ("complete / lost / 5xx / 4xx", lambda d: " / ".join(
            count(get(d, k)) for k in ("completed", "lost", "http_5xx", "http_4xx"))),
        ("latency p50 / p99 / max", lambda d: " / ".join(
            f"{get(d, k):.2f} s" for k in ("latency_p50_s", "latency_p99_s", "latency_max_s"))),
        ("throughput (clients on the same cores)",
         lambda d: f"{get(d, 'requests_per_s'):.0f} req/s, {count(get(d, 'generated_tokens'))} tokens"),
        ("wall time", lambda d: f"{get(d, 'wall_s'):.1f} s"),
        (f"server RSS after round {base_round} (the test's baseline) → last round", rss),
        ("KV blocks free / total at the end", lambda d: f"{get(d, 'kv_blocks_free')} / {get(d, 'kv_blocks_total')}"),
        ("greedy (prompt, output) pairs checked by the oracle", lambda d: count(get(d, "oracle_checked_pairs"))),
    ]
    head = ["", f"CI ({ci.get('rounds', '?')} rounds)", f"full ({full.get('rounds', '?')} rounds)"]
    out = [table(head, rows, [ci, full]), "", wrap(source_line("load", [ci, full]))]
    rounds = []
    for v, d in (("CI", ci), ("full", full)):
        walls = d.get("round_wall_s")
        if walls:
            rounds.append(f"{v}: slowest round {max(walls):.2f} s, median round {statistics.median(walls):.2f} s")
    if rounds:
        out += ["", wrap("Round wall times (`round_wall_s`): " + "; ".join(rounds) + ".")]
    return "\n".join(out)


# ---- faults ----

FAULT_ROWS = [  # (label, [(kind, outcome), ...] joined by " / ")
    ("normal: ok / aborted", [("normal", "ok"), ("normal", "aborted")]),
    ("LoRA: ok / aborted / 404 before load", [("lora", "ok"), ("lora", "aborted"), ("lora", "clean_error")]),
    ("corrupt image → 400", [("corrupt", "clean_error")]),
    ("injected fault → clear error / aborted before prefill", [("fault", "clean_error"), ("fault", "aborted")]),
]
CLIENT_LEFT = [("disconnect", "client_left"), ("timeout", "client_left"), ("storm", "client_left")]


def faults_block(ci: dict, full: dict) -> str:
    def outcomes(pairs):
        return lambda d: " / ".join(count(get(d, "outcomes_by_kind", k, o)) for k, o in pairs)

    def left(d):
        a, b, c = (count(get(d, "outcomes_by_kind", k, o)) for k, o in CLIENT_LEFT)
        return f"{a} + {b} + {c} storm"

    def other(d):  # every outcome no row above shows, so that the outcomes add up to the requests
        shown = {p for _, pairs in FAULT_ROWS for p in pairs} | set(CLIENT_LEFT)
        rest = [f"{k} {o} {count(n)}" for k, outs in get(d, "outcomes_by_kind").items()
                for o, n in outs.items() if (k, o) not in shown]
        return ", ".join(rest) or "none"

    rows = [
        ("requests (incl. storm streams)", lambda d: count(get(d, "requests"))),
        ("lost", lambda d: count(get(d, "lost"))),
        *[(label, outcomes(pairs)) for label, pairs in FAULT_ROWS],
        ("hung up / timed out / storm (client left)", left),
        ("other outcomes (hang-ups and timeouts answered first)", other),
        ("preemptions (KV exhaustion)", lambda d: count(get(d, "preemptions"))),
        ("outputs checked by the oracle (of which LoRA)",
         lambda d: f"{count(get(d, 'oracle_checked_pairs'))} ({count(get(d, 'lora_outputs_checked'))})"),
        ("final weight version", lambda d: count(get(d, "final_weight_version"))),
        ("KV blocks free / total at the end", lambda d: f"{get(d, 'kv_blocks_free')} / {get(d, 'kv_blocks_total')}"),
        ("server RSS start → end", lambda d: f"{get(d, 'rss_before_mib'):.1f} → {get(d, 'rss_after_mib'):.1f} MiB"),
        ("wall time", lambda d: f"{get(d, 'wall_s'):.1f} s"),
    ]
    head = ["", f"CI ({ci.get('chaos_cycles', '?')} chaos cycles)", f"full ({full.get('chaos_cycles', '?')} cycles)"]
    return table(head, rows, [ci, full]) + "\n\n" + wrap_source("faults", [ci, full])


# ---- fuzz ----

def _statuses(d: dict) -> dict[int, int]:
    total: dict[int, int] = {}
    for ep in get(d, "by_endpoint").values():
        for s, n in get(ep, "status_counts").items():
            total[int(s)] = total.get(int(s), 0) + n
    return total


def fuzz_block(ci: dict, full: dict) -> str:
    def statuses(d):
        s = _statuses(d)
        five = sum(n for k, n in s.items() if k >= 500)
        return " / ".join(count(s.get(k, 0)) for k in (200, 400, 404)) + f" / {count(five)}"

    def others(d):  # statuses the 200/400/404/5xx row does not show
        s = {k: n for k, n in _statuses(d).items() if k not in (200, 400, 404) and k < 500}
        return ", ".join(f"{k}: {count(n)}" for k, n in sorted(s.items())) or "none"

    rows = [
        ("requests", lambda d: count(get(d, "requests"))),
        ("200 / 400 / 404 / 5xx", statuses),
        ("other statuses", others),
        ("slowest answer", lambda d: f"{max(get(ep, 'slowest_s') for ep in get(d, 'by_endpoint').values()):.2f} s"),
        ("connections to the SSRF listener", lambda d: count(get(d, "canary_connections"))),
        ("wall time", lambda d: f"{get(d, 'wall_s'):.1f} s"),
    ]
    return table(["", "CI", "full"], rows, [ci, full]) + "\n\n" + wrap_source("fuzz", [ci, full])


# ---- grpo ----

def grpo_block(ci: dict, full: dict) -> str:
    rows = [
        ("CPU s/step, first → last quarter (fastest step)", lambda d: (
            f"{get(d, 'cpu_s_per_step_min_first_quarter'):.2f} → {get(d, 'cpu_s_per_step_min_last_quarter'):.2f}"
            f" ({get(d, 'cpu_slowdown_ratio'):.2f}x)")),
        ("CPU s/step, first → last quarter (median)", lambda d: (
            f"{get(d, 'cpu_s_per_step_median_first_quarter'):.2f} → "
            f"{get(d, 'cpu_s_per_step_median_last_quarter'):.2f}")),
        ("wall s/step, first → last quarter (median)", lambda d: (
            f"{get(d, 'wall_s_per_step_median_first_quarter'):.2f} → "
            f"{get(d, 'wall_s_per_step_median_last_quarter'):.2f}")),
        ("RSS median, first → last quarter", lambda d: (
            f"{get(d, 'rss_median_first_quarter_mib'):.1f} → {get(d, 'rss_median_last_quarter_mib'):.1f} MiB"
            f" (max {get(d, 'rss_max_mib'):.1f})")),
        ("steps: warm-up / per quarter", lambda d: f"{get(d, 'warmup_steps')} / {get(d, 'quarter_steps')}"),
        ("mean reward, first 5 → last 5 steps",
         lambda d: f"{get(d, 'mean_reward_first_5'):.2f} → {get(d, 'mean_reward_last_5'):.2f}"),
        ("wall time", lambda d: f"{get(d, 'wall_s'):.1f} s"),
    ]
    head = ["", f"CI ({ci.get('steps', '?')} steps)", f"full ({full.get('steps', '?')} steps)"]
    return table(head, rows, [ci, full]) + "\n\n" + wrap_source("grpo", [ci, full])


# ---- the machine the runs had ----

def machine_block(all_data: dict[str, dict]) -> str:
    machines = [d.get("machine", {}) for d in all_data.values()]
    cpus = sorted({m["cpus"] for m in machines if "cpus" in m})
    py = sorted({m["python"] for m in machines if "python" in m})
    tv = sorted({m["torch"] for m in machines if "torch" in m})
    loads = [m["load_avg_1m"] for m in machines if "load_avg_1m" in m]
    written = sorted(d["written"] for d in all_data.values() if "written" in d)
    parts = []
    if cpus:
        parts.append(f"{'/'.join(map(str, cpus))} CPU cores **shared with other work**")
    if loads:
        parts.append(f"1-minute load average {min(loads):.2f}-{max(loads):.2f} when the figures were written")
    if py or tv:
        parts.append(", ".join([f"python {'/'.join(py)}"] * bool(py) + [f"torch {'/'.join(tv)}"] * bool(tv)))
    text = "Machine for the figures below: " + "; ".join(parts) + "."
    if written:
        text += f" The recorded JSONs were written between {written[0]} and {written[-1]} (machine local time)."
    return wrap(text)


BLOCKS = {
    "machine": lambda a: machine_block(a),
    "load": lambda a: load_block(a["load_ci"], a["load_full"]),
    "faults": lambda a: faults_block(a["faults_ci"], a["faults_full"]),
    "fuzz": lambda a: fuzz_block(a["fuzz_ci"], a["fuzz_full"]),
    "grpo": lambda a: grpo_block(a["grpo_ci"], a["grpo_full"]),
}


def render(doc: str, figures_dir: pathlib.Path) -> str:
    data = {}
    for area in AREAS:
        for v in VARIANTS:
            path = figures_dir / f"{area}_{v}.json"
            if not path.is_file():
                raise SystemExit(f"reliability_report: {path} is missing (run bash scripts/record_figures.sh"
                                 f"{' -m slow' if v == 'full' else ''})")
            data[f"{area}_{v}"] = json.loads(path.read_text())
    for name, fn in BLOCKS.items():
        pattern = re.compile(rf"(<!-- figures:{name} -->\n).*?(<!-- /figures:{name} -->)", re.S)
        if len(pattern.findall(doc)) != 1:
            raise SystemExit(f"reliability_report: the document needs exactly one "
                             f"'<!-- figures:{name} -->' ... '<!-- /figures:{name} -->' block")
        body = fn(data)
        doc = pattern.sub(lambda m: m.group(1) + body + "\n" + m.group(2), doc)
    return doc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--doc", type=pathlib.Path, default=ROOT / "RELIABILITY.md")
    p.add_argument("--figures", type=pathlib.Path, default=ROOT / "benchmarks" / "reliability",
                   help="folder holding {load,faults,fuzz,grpo}_{ci,full}.json")
    p.add_argument("--check", action="store_true", help="only report whether the document is up to date")
    args = p.parse_args(argv)
    old = args.doc.read_text()
    new = render(old, args.figures)
    if args.check:
        if new != old:
            print(f"{args.doc} differs from what {args.figures} gives; run python scripts/reliability_report.py")
            return 1
        return 0
    if new != old:
        args.doc.write_text(new)
    print(f"{args.doc}: {'rewritten' if new != old else 'already up to date'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
