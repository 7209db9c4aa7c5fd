"""CLI: ``python -m unsloth_rollout.bench [--model ...] [--workload ...] [--backends ...] [--json OUT] ...``

With no arguments: the offline ``small`` Qwen2.5-VL with a perturbed LoRA (r=16), a GRPO workload,
every backend that can run here; the table goes to stdout, progress bars to stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import warnings

from .backends import DEFAULT_BACKENDS
from ..testing.toy import MODELS
from .long import LONG_DEFAULTS
from .overhead import OVERHEAD_DEFAULTS
from .workloads import SHAPES, WORKLOADS

from ..engine.config import parse_bytes
from ..engine.decode.choose import COMPILED_MIN_SHARED, EAGER_MIN_SHARED


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m unsloth_rollout.bench",
        description="Throughput, TTFT, peak memory and logprob drift of the rollout engine next to HF generate, "
                    "transformers continuous batching, vLLM and SGLang, on identical seeded requests.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="small-vlm", help=f"one of {', '.join(MODELS)}, or a model folder")
    p.add_argument("--workload", default="grpo", choices=(*WORKLOADS, "trl", "long", "overhead"),
                   help="grpo / chat / long-gen (long prompts and outputs): every backend on one request set; "
                        "trl: one GRPO step's generation phase in TRL's GRPOTrainer, engine vs TRL's generate path; "
                        "long: engine decode tok/s as the context grows (--contexts, --batch, --steps); "
                        "overhead: what the engine's threads cost its decode steps and a trainer beside it "
                        "(--layers, --batch, --steps, --train-batch, --train-tokens, --repeats)")
    g = SHAPES["grpo"]
    p.add_argument("--prompts", type=int, default=None, help=f"distinct prompts (grpo default {g.prompts})")
    p.add_argument("--group", type=int, default=None,
                   help=f"samples per prompt (grpo default {g.group}; --workload long: 1, distinct prompts)")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help=f"cap of the per-sample output budgets (grpo default {g.max_new_tokens})")
    p.add_argument("--backends", default=None,
                   help=f"comma-separated; those that cannot run here are listed with the reason (default "
                        f"{','.join(DEFAULT_BACKENDS)}; also engine-compiled (old name engine-static), the engine "
                        "with the compiled step forced on, engine-eager, the engine with every decode step eager "
                        "(the default, decode backend auto, is compiled on CPU), "
                        "engine-whole-rows, the engine without shared prompts, and engine-bitwise, the engine "
                        "under the bitwise on-policy mode (its row also times a trainer step with and without "
                        "the mode); "
                        "for --workload long the engine's decode backends "
                        f"{','.join(LONG_DEFAULTS['backends'])}; add 'compiled' for the compiled step beside the "
                        "eager ones)")
    p.add_argument("--contexts", default=",".join(map(str, LONG_DEFAULTS["contexts"])),
                   help="--workload long: prompt lengths (tokens) to decode at")
    p.add_argument("--batch", type=int, default=None,
                   help=f"--workload long / overhead: sequences decoding at once (default {LONG_DEFAULTS['batch']} / "
                        f"{OVERHEAD_DEFAULTS['batch']})")
    p.add_argument("--steps", type=int, default=None,
                   help=f"--workload long / overhead: timed decode steps per context / per run (default "
                        f"{LONG_DEFAULTS['steps']} / {OVERHEAD_DEFAULTS['steps']})")
    p.add_argument("--layers", type=int, default=OVERHEAD_DEFAULTS["layers"],
                   help="--workload overhead: decoder layers of the random model built from --model's config")
    p.add_argument("--train-batch", type=int, default=OVERHEAD_DEFAULTS["train_batch"],
                   help="--workload overhead: sequences per trainer step")
    p.add_argument("--train-tokens", type=int, default=OVERHEAD_DEFAULTS["train_tokens"],
                   help="--workload overhead: tokens per sequence of a trainer step")
    p.add_argument("--lora-rank", type=int, default=None,
                   help=f"LoRA rank (random, non-zero B); 0 = no LoRA (default 16; --workload overhead "
                        f"{OVERHEAD_DEFAULTS['lora']})")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="model dtype (default: float32 on CPU, bfloat16 on GPUs that have it)")
    p.add_argument("--load-in-4bit", action="store_true", help="bitsandbytes NF4 base weights (LoRA in --dtype)")
    p.add_argument("--model-backend", default="transformers", choices=["transformers", "unsloth", "auto"],
                   help="how load_model builds the policy every backend shares")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--ignore-eos", action="store_true", help="never stop at EOS (outputs run to their budget)")
    p.add_argument("--kv-cache-memory-bytes", type=parse_bytes, default=1 << 30,
                   help="the engine's KV cache budget in bytes, e.g. 1073741824 or 1GiB")
    p.add_argument("--hf-sequential-max", type=int, default=24,
                   help="hf-sequential runs this many requests (evenly spaced) and reports their rate")
    p.add_argument("--shared-prompt-min-tokens", "--shared-prefix-min-tokens", dest="shared_prompt_min_tokens",
                   type=int, default=None,
                   help=f"--workload long: DecodeConfig.shared_prompt_min_tokens (default: the engine's, "
                        f"{EAGER_MIN_SHARED} with eager steps and with the compiled step on the CPU attention kernel, "
                        f"{COMPILED_MIN_SHARED} with the compiled step without the kernel)")
    p.add_argument("--hf-batch-groups", type=int, default=1, help="GRPO groups per hf-batched generate() call")
    p.add_argument("--drift-samples", type=int, default=8, help="outputs per backend checked against a forward")
    p.add_argument("--repeats", type=int, default=None,
                   help=f"run the backends round-robin N times and keep each one's fastest run (noisy machines; "
                        f"default 1); --workload overhead: interleaved rounds (default {OVERHEAD_DEFAULTS['rounds']})")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--json", dest="json_out", default=None, metavar="OUT")
    p.add_argument("--markdown", dest="markdown_out", default=None, metavar="OUT")
    p.add_argument("--plot", dest="plot_out", default=None, metavar="OUT.png")
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from .harness import run_bench
    from .report import markdown, plot

    if args.threads is not None:
        if args.threads < 1:
            print(f"--threads must be >= 1, got {args.threads}", file=sys.stderr)
            return 2
        torch.set_num_threads(args.threads)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    overhead = args.workload == "overhead"
    if args.lora_rank is None:
        args.lora_rank = OVERHEAD_DEFAULTS["lora"] if overhead else 16
    if args.repeats is None:
        args.repeats = OVERHEAD_DEFAULTS["rounds"] if overhead else 1
    defaults = OVERHEAD_DEFAULTS if overhead else LONG_DEFAULTS
    args.batch = defaults["batch"] if args.batch is None else args.batch
    args.steps = defaults["steps"] if args.steps is None else args.steps
    if overhead:
        return _main_overhead(args)
    if args.workload == "trl":
        return _main_trl(args)
    if args.workload == "long":
        return _main_long(args)
    if args.backends is None:
        args.backends = ",".join(DEFAULT_BACKENDS)
    try:
        report = run_bench(
            model=args.model, workload=args.workload, prompts=args.prompts, group=args.group,
            max_new_tokens=args.max_new_tokens, backends=[b.strip() for b in args.backends.split(",") if b.strip()],
            lora=args.lora_rank, seed=args.seed, temperature=args.temperature, ignore_eos=args.ignore_eos,
            kv_cache_memory_bytes=args.kv_cache_memory_bytes, hf_sequential_max=args.hf_sequential_max,
            hf_batch_groups=args.hf_batch_groups, drift_samples=args.drift_samples, repeats=args.repeats,
            model_backend=args.model_backend, dtype=args.dtype, load_in_4bit=args.load_in_4bit,
            progress=not args.no_progress)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    _report(args, report, markdown(report))
    if args.plot_out:
        os.makedirs(os.path.dirname(os.path.abspath(args.plot_out)), exist_ok=True)
        plot(report, args.plot_out)
    if report.get("failed"):  # a failing backend, the engine included, is a failed run
        print("error: backends failed: " + ", ".join(report["failed"]), file=sys.stderr)
        return 1
    return 0 if report["results"] else 1


def _main_trl(args) -> int:
    from .trl import markdown, run_trl_bench

    g = SHAPES["grpo"]
    report = run_trl_bench(model=args.model, prompts=args.prompts or g.prompts, group=args.group or g.group,
                           max_new_tokens=args.max_new_tokens or g.max_new_tokens, lora=args.lora_rank, seed=args.seed,
                           temperature=args.temperature, repeats=args.repeats,
                           kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                           progress=not args.no_progress)
    _report(args, report, markdown(report))
    return 0


def _main_long(args) -> int:
    from .long import markdown, run_long

    try:
        contexts = [int(c) for c in args.contexts.split(",") if c.strip()]
        backends = [b.strip() for b in (args.backends or ",".join(LONG_DEFAULTS["backends"])).split(",") if b.strip()]
        report = run_long(model=args.model, batch=args.batch, contexts=contexts, steps=args.steps,
                          backends=backends, lora=args.lora_rank, seed=args.seed, drift_samples=args.drift_samples,
                          progress=not args.no_progress, group=args.group or 1,
                          min_prefix=args.shared_prompt_min_tokens)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    _report(args, report, markdown(report))
    return 0


def _main_overhead(args) -> int:
    from .overhead import markdown, run_overhead

    model = "tiny-lm" if args.model == "small-vlm" else args.model  # the CLI's default model is a VLM
    try:
        report = run_overhead(model=model, layers=args.layers, batch=args.batch, steps=args.steps,
                              train_batch=args.train_batch, train_tokens=args.train_tokens, rounds=args.repeats,
                              lora=args.lora_rank, seed=args.seed, progress=not args.no_progress)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    _report(args, report, markdown(report))
    return 0


def _report(args, report: dict, table: str) -> None:
    """Print the table; write the JSON record and the markdown table where asked."""
    print(table)
    if args.json_out:
        _write(args.json_out, json.dumps(report, indent=2) + "\n")
    if args.markdown_out:
        _write(args.markdown_out, table)


def _write(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


if __name__ == "__main__":
    sys.exit(main())
