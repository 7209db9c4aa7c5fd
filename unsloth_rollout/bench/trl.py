"""``--workload trl``: one GRPO step's generation phase in TRL's real GRPOTrainer, engine vs TRL's generate.

Two GRPOTrainers on the same policy, same GRPOConfig (num_generations = --group, max_completion_length =
--max-new-tokens, one generation batch of --prompts x --group completions), same chat prompts with one
image each; one uses ``rollout_func=unsloth_rollout.trl.rollout_func(engine)``, the other TRL's own
padded ``model.generate()`` path. Each is timed over ``trainer._generate(prompts)``, the call TRL's
``_generate_and_score_completions`` makes (tokenization, generation, decoding, length metrics).

Example::

    python -m unsloth_rollout.bench --workload trl --prompts 16 --group 8 \\
        --json benchmarks/trl/bench_small_vlm_16x8.json
"""

from __future__ import annotations

import os
import random
import tempfile
import time

import numpy as np
import torch

from .workloads import SHAPES, _lognormal, _random_image, _text_token_pool


def _dataset(policy, prompts: int, seed: int):
    """Chat prompts (text drawn like the grpo workload's) each with one image of drawn size."""
    shape = SHAPES["grpo"]
    rng = random.Random(seed)
    pool = _text_token_pool(policy.tokenizer)
    rows = []
    for _ in range(prompts):
        n = _lognormal(rng, shape.prompt_median, shape.prompt_sigma, *shape.prompt_range)
        text = policy.tokenizer.decode([rng.choice(pool) for _ in range(n)])
        image = _random_image(rng, shape.image_side) if policy.is_vlm else None
        rows.append(([{"role": "user", "content": text}], image))
    return rows


def _generation_prompts(rows, group: int):
    """What GRPOTrainer hands ``_generate``: each prompt ``group`` times, images put into the messages."""
    from trl.data_utils import prepare_multimodal_messages

    out = []
    for messages, image in rows:
        prompt = prepare_multimodal_messages(messages, images=[image]) if image is not None else messages
        out.extend([prompt] * group)
    return out


def _time_generate(trainer, prompts) -> tuple[float, list[list[int]]]:
    if not hasattr(trainer, "_generate"):
        raise RuntimeError("this TRL's GRPOTrainer has no _generate(prompts); the trl bench needs trl 1.16")
    trainer.model.train()
    t0 = time.perf_counter()
    res = trainer._generate(prompts)
    wall = time.perf_counter() - t0
    return wall, res[1]


def run_trl_bench(model: str = "small-vlm", prompts: int = 16, group: int = 8, max_new_tokens: int = 128,
                  lora: int = 16, seed: int = 0, temperature: float = 1.0, repeats: int = 1,
                  kv_cache_memory_bytes: int = 1 << 30, progress: bool = True) -> dict:
    """Returns the report dict (``--json``): per backend wall seconds, output tokens/s, and the ratio."""
    import sys

    import transformers
    import trl
    from trl import GRPOTrainer

    from ..engine import EngineConfig, RolloutEngine
    from ..models import load_model
    from ..trl import rollout_func
    from ..testing.trl_toy import grpo_config
    from ..testing.oracles import perturb_lora
    from .harness import cpu_pressure, machine_info, model_path

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    torch.manual_seed(seed)
    path = model_path(model)
    lora_opts = {"r": lora, "finetune_vision_layers": True, "random_state": seed} if lora else None
    policy = load_model(path, backend="transformers", lora=lora_opts)
    if lora:
        perturb_lora(policy.model, std=0.02, seed=seed)
    engine = RolloutEngine(policy, EngineConfig(kv_cache_memory_bytes=kv_cache_memory_bytes), seed=seed)
    rows = _dataset(policy, prompts, seed)
    gen_prompts = _generation_prompts(rows, group)
    out_dir = tempfile.mkdtemp(prefix="unsloth_rollout_trl_bench_")

    from datasets import Dataset

    ds = Dataset.from_dict({"prompt": [m for m, _ in rows]})
    trainers = {}
    for name, rf in (("engine", rollout_func(engine)), ("trl-generate", None)):
        # float32 trainers: TRL's generate runs in the trainer's precision, the engine in the model's own
        args = grpo_config(out_dir, 1, num_generations=group, prompts_per_step=prompts,
                           max_completion_length=max_new_tokens, temperature=temperature, seed=seed, bf16=False)
        trainers[name] = GRPOTrainer(model=policy.model, processing_class=policy.processor or policy.tokenizer,
                                     reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=args,
                                     train_dataset=ds, rollout_func=rf)
    # warm both paths on one group (first-call costs: engine thread, kernels, processor)
    for tr in trainers.values():
        _time_generate(tr, gen_prompts[:group][:2])
    runs: dict[str, list[dict]] = {k: [] for k in trainers}
    for rep in range(repeats):
        for name, tr in trainers.items():
            if progress:
                print(f"[trl bench] run {rep + 1}/{repeats}: {name} ...", file=sys.stderr, flush=True)
            wall, completions = _time_generate(tr, gen_prompts)
            toks = sum(len(c) for c in completions)
            runs[name].append({"wall_s": wall, "output_tokens": toks, "output_tokens_per_s": toks / wall,
                               "completions": len(completions), "cpu_pressure_pct": cpu_pressure()})
            if progress:
                print(f"[trl bench]   {wall:.1f} s, {toks} tokens, {toks / wall:.1f} tok/s", file=sys.stderr,
                      flush=True)
    engine.shutdown()
    results = []
    for name, rs in runs.items():
        best = min(rs, key=lambda r: r["wall_s"])
        results.append({"backend": name, **best, "runs_wall_s": [r["wall_s"] for r in rs]})
    eng = results[0]
    for r in results:
        r["engine_speedup"] = r["wall_s"] / eng["wall_s"]
    pc = policy.processor or policy.tokenizer
    plens = [len(pc.apply_chat_template([p], add_generation_prompt=True, tokenize=True, return_dict=True)
                 ["input_ids"][0]) for p in gen_prompts[::group]]
    return {
        "command": (f"python -m unsloth_rollout.bench --workload trl --model {model} --prompts {prompts} "
                    f"--group {group} --max-new-tokens {max_new_tokens} --lora-rank {lora} --seed {seed} "
                    f"--repeats {repeats}"),
        "what": "wall time of GRPOTrainer._generate(prompts) for one generation batch: rollout_func=engine vs "
                "TRL's own padded model.generate() path (use_vllm=False)",
        "model": model, "model_path": path, "is_vlm": policy.is_vlm, "lora_rank": lora,
        "workload": {"prompts": prompts, "group": group, "completions": prompts * group,
                     "max_completion_length": max_new_tokens, "temperature": temperature, "seed": seed,
                     "prompt_tokens_mean": float(np.mean(plens)),
                     "image_sizes": [list(im.size) for _, im in rows if im is not None]},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__},
        "machine": machine_info(policy.device), "repeats": repeats, "results": results,
        "ratio_engine_vs_trl_generate": results[1]["wall_s"] / eng["wall_s"],
    }


def markdown(report: dict) -> str:
    w = report["workload"]
    lines = [f"TRL GRPOTrainer generation phase, model `{report['model']}` (LoRA r={report['lora_rank']}), "
             f"{w['prompts']} prompts x {w['group']} generations, max_completion_length {w['max_completion_length']}, "
             f"temperature {w['temperature']}, trl {report['versions']['trl']}.", "",
             "| generation path | wall (s) | output tokens | output tok/s | engine speedup |",
             "|---|---:|---:|---:|---:|"]
    for r in report["results"]:
        lines.append(f"| {r['backend']} | {r['wall_s']:.1f} | {r['output_tokens']} | {r['output_tokens_per_s']:.1f} "
                     f"| {r['engine_speedup']:.2f}x |")
    lines.append("")
    lines.append(f"Engine / TRL generate: {report['ratio_engine_vs_trl_generate']:.2f}x faster.")
    return "\n".join(lines) + "\n"
