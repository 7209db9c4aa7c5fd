"""One declaration of the settings every path of the real-weights GRPO run shares, and its per-step record."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

PATHS = ("trl-generate", "trl-engine", "areal-engine")
# Llama-family attention and MLP projections (the checkpoint's decoder layers).
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj")


@dataclass
class RunSettings:
    """The settings the three runs share (the CLI's flags are built from these fields).

    Args:
        model: a Hugging Face model folder, or ``real:<name>`` for a checkpoint of ``unsloth_rollout.testing.real``.
        steps: GRPO optimizer steps (one generation batch each).
        prompts_per_step: distinct prompts per step.
        group: samples per prompt (TRL ``num_generations``, AReaL ``gconfig.n_samples``).
        max_new_tokens: completion budget (TRL ``max_completion_length``, AReaL ``gconfig.max_new_tokens``).
        temperature: sampling temperature (the trainer's logprobs are taken at the same temperature).
        lr: Adam learning rate (constant, no warm-up).
        lora_r: LoRA rank on every attention and MLP projection.
        lora_alpha: LoRA alpha.
        lora_layers: LoRA on the top N decoder layers only (0: all): the backward then stops N layers down,
            which on 2 CPU cores is most of a step's cost.
        seed: seed of the LoRA initialisation, the prompt order and the samplers.
        rows: distinct prompts in the dataset (cycled in one seeded order, never reshuffled).
        oracle_samples: samples per step also checked against a teacher-forced fp32 forward of each alone
            (spread over the prompts; default: every sample of a step, prompts_per_step x group), plus the
            sample whose behaviour and trainer logprobs differ most.
        threads: torch threads (0: leave torch's default).
        bitwise: 1: the trl-engine path under the bitwise on-policy mode (unsloth_rollout/bitwise.py), whose
            logprob_diff_max is then 0 at every step; the other paths refuse it.
    """

    model: str = "real:smollm2-135m-instruct"
    steps: int = 30
    prompts_per_step: int = 4
    group: int = 8
    max_new_tokens: int = 16
    temperature: float = 1.0
    lr: float = 5e-4
    lora_r: int = 16
    lora_alpha: int = 32
    lora_layers: int = 10
    seed: int = 0
    rows: int = 16
    oracle_samples: int = 32
    threads: int = 0
    bitwise: int = 0

    def __post_init__(self):
        if self.lora_layers < 0:
            raise ValueError(f"lora_layers must be >= 0, got {self.lora_layers}")
        for name in ("steps", "prompts_per_step", "group", "max_new_tokens", "lora_r", "lora_alpha", "rows"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.group < 2:
            raise ValueError(f"group must be >= 2 (GRPO compares samples of one prompt), got {self.group}")
        if self.rows % self.prompts_per_step:
            raise ValueError(f"rows ({self.rows}) must be a multiple of prompts_per_step ({self.prompts_per_step}) "
                             "so that every path sees the same prompts at every step")
        if not self.lr > 0 or not self.temperature > 0:
            raise ValueError(f"lr and temperature must be > 0, got lr={self.lr}, temperature={self.temperature}")

    def lora_targets(self, num_layers: int) -> list[str] | None:
        """PEFT target_modules for ``lora_layers`` (None: every projection of every layer)."""
        if not self.lora_layers or self.lora_layers >= num_layers:
            return None
        return [f"layers.{i}.{proj}" for i in range(num_layers - self.lora_layers, num_layers) for proj in PROJECTIONS]

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class StepRecord:
    """What one GRPO step of one path recorded."""

    step: int  # 1-based optimizer step
    mean_reward: float  # mean reward of the step's prompts_per_step x group samples
    generation_s: float  # wall seconds producing the samples (the trainer's generation call)
    train_s: float  # wall seconds of the rest of the step: rewards, logprob recompute, loss, backward, optimizer
    logprob_diff_max: float | None  # max |behaviour logprob - trainer's recomputed| over the step's sampled tokens
    # (behaviour: the engine's, or for TRL's own generate HF generate's log_softmax(logits / T))
    oracle_diff_max: float | None = None  # max |behaviour logprob - teacher-forced fp32 forward| (checked rows)
    trainer_drift_max: float | None = None  # max |trainer recomputed - teacher-forced| (the same checked rows)
    checked_diff_max: float | None = None  # max |behaviour - trainer recomputed| on the checked rows
    hf_forced_diff_max: float | None = None  # max |HF generate's own logprob of the same tokens - teacher-forced|
    checked_rows: int = 0  # rows checked against the teacher-forced forward this step
    check_s: float = 0.0  # wall seconds of the oracle check (not in generation_s or train_s)
    completion_tokens_mean: float | None = None  # mean completion length in tokens (EOS included)
    versions: list[int] = field(default_factory=list)  # weight versions stamped on the step's sampled tokens


def num_layers(path: str) -> int:
    from transformers import AutoConfig

    return int(AutoConfig.from_pretrained(path).num_hidden_layers)


def resolve_model(model: str) -> str:
    """``real:<name>`` -> the converted checkpoint folder (downloaded and converted on first use)."""
    if model.startswith("real:"):
        from ...testing.real import real_checkpoint_path

        return str(real_checkpoint_path(model[len("real:"):]))
    return model
