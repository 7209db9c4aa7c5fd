"""A toy GRPO run with TRL's real GRPOTrainer generating through the engine (tests and the committed curve).

The task: the toy reward (``unsloth_rollout.testing.toy.target_token_fraction``, the fraction of
completion tokens in a fixed block of ids, ~0.1 for a random policy) on chat prompts with an image each.

    python -m unsloth_rollout.trl.toy --steps 30 --out benchmarks/trl/grpo_reward_curve

writes ``.json`` (per-step mean reward, TRL's logged |sampling - recomputed| logprob difference, the
engine versions each step sampled with) and ``.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from ..testing.trl_toy import grpo_config, toy_dataset, toy_reward


def run_toy_grpo(model: str = "tiny-vlm", steps: int = 30, out: str | None = None, seed: int = 0,
                 lr: float = 3e-2, output_dir: str | None = None) -> dict:
    """Train ``steps`` GRPO steps; returns the record (and writes ``out``.json / .png when given)."""
    import tempfile

    import torch
    from trl import GRPOTrainer

    from .. import EngineConfig, RolloutEngine, load_model
    from ..testing.toy import model_path
    from . import rollout_func

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    torch.manual_seed(seed)
    path = model_path(model)
    policy = load_model(path, backend="transformers", lora={"r": 8, "lora_alpha": 16, "finetune_vision_layers": True,
                                                            "random_state": seed})
    engine = RolloutEngine(policy, EngineConfig(kv_cache_memory_bytes=32 << 20, max_model_len=512), seed=seed)
    rf = rollout_func(engine)
    ds = toy_dataset(16, "image" if policy.is_vlm else None, seed)
    output_dir = output_dir or tempfile.mkdtemp(prefix="unsloth_rollout_trl_")
    trainer = GRPOTrainer(model=policy.model, processing_class=policy.processor or policy.tokenizer,
                          reward_funcs=toy_reward(engine.eos_ids),
                          # a float32 trainer: its recompute of every sampled token is the record's exactness check
                          args=grpo_config(output_dir, steps, lr=lr, seed=seed, bf16=False),
                          train_dataset=ds, rollout_func=rf)
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    logs = [h for h in trainer.state.log_history if "reward" in h]
    rewards = [float(h["reward"]) for h in logs]
    record = {
        "command": f"python -m unsloth_rollout.trl.toy --model {model} --steps {steps} --seed {seed}",
        "model": f"{model}: random Qwen2.5-VL (unsloth_rollout.testing.tiny), LoRA r=8 incl. vision tower",
        "trainer": "trl 1.16 GRPOTrainer, rollout_func=unsloth_rollout.trl.rollout_func(engine), CPU fp32",
        "reward": "fraction of completion tokens in unsloth_rollout.testing.toy.TOY_TARGET_IDS",
        "settings": {"num_generations": 8, "prompts_per_step": 4, "max_completion_length": 8, "lr": lr},
        "steps": [int(h["step"]) for h in logs], "mean_reward": rewards,
        "sampling_logp_difference_max": [float(h.get("sampling/sampling_logp_difference/max", float("nan")))
                                         for h in logs],
        "rollout_global_steps": [h["global_step"] for h in rf.history],
        "rollout_versions": [h["versions"] for h in rf.history],
        "start_mean_reward": float(np.mean(rewards[:3])), "end_mean_reward": float(np.mean(rewards[-5:])),
        "wall_s": round(wall, 1),
    }
    engine.shutdown()
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n")
        from ..testing.figures import plot_reward_curve

        plot_reward_curve(rewards, Path(out).with_suffix(".png"),
                          "TRL GRPOTrainer + unsloth_rollout engine, tiny VLM on CPU")
    return record


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m unsloth_rollout.trl.toy", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-vlm")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=3e-2)
    p.add_argument("--out", default=None, help="path prefix for .json and .png")
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    rec = run_toy_grpo(args.model, args.steps, args.out, args.seed, args.lr)
    print(f"mean reward {rec['start_mean_reward']:.3f} -> {rec['end_mean_reward']:.3f} in {args.steps} steps "
          f"({rec['wall_s']} s); max |sampling - TRL recomputed logprob| "
          f"{max(rec['sampling_logp_difference_max']):.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
