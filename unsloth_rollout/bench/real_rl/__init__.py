"""GRPO on real weights: SmolLM2-135M-Instruct learns a verifiable task, the same run three ways.

TRL's ``GRPOTrainer`` with its own generation, TRL's ``GRPOTrainer`` with
``rollout_func=unsloth_rollout.trl.rollout_func(engine)``, and AReaL's ``PPOTrainer`` with
``rollout.backend: "unsloth:d1"``; same seed, prompts, group size, LoRA, learning rate and steps. Per step:
mean reward, generation and training wall time, max |behaviour logprob - trainer recomputed logprob|.

    python -m unsloth_rollout.bench.real_rl --steps 30 --out benchmarks/real/
"""

from .settings import PATHS, RunSettings, StepRecord
from .task import capital_reward, capital_rows

__all__ = ["PATHS", "RunSettings", "StepRecord", "capital_reward", "capital_rows"]
