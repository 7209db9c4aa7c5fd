"""``UnslothConfig``: the backend's own options, next to AReaL's (as ``sglang:`` / ``vllm:`` sit there).

In YAML::

    rollout: {backend: "unsloth:d1", ...}
    actor:   {backend: "unsloth:d1", use_lora: true, lora_rank: 16, ...}
    unsloth:
      load_in_4bit: true
      finetune_vision_layers: true
      engine:                       # EngineConfig, the same fields as the Python API
        kv_cache_memory_bytes: 4294967296

Example::

    config, _ = load_expr_config(["--config", "tiny_cpu_grpo.yaml"], UnslothPPOConfig)
    config.unsloth.engine             # -> EngineConfig
"""

from __future__ import annotations

from dataclasses import dataclass, field

from areal.api.cli_args import GRPOConfig

from ..engine import EngineConfig


@dataclass
class UnslothConfig:
    """Loading, LoRA placement and engine sizing for the ``unsloth`` backend."""

    model_backend: str = field(default="auto", metadata={"help": "load_model backend: auto | unsloth | transformers"})
    load_in_4bit: bool = field(default=False, metadata={"help": "bitsandbytes NF4 base weights (LoRA stays in dtype)"})
    max_seq_length: int | None = field(default=None, metadata={"help": "Unsloth max_seq_length"})
    finetune_vision_layers: bool = field(default=True, metadata={"help": "LoRA on the vision tower too"})
    finetune_language_layers: bool = True
    finetune_attention_modules: bool = True
    finetune_mlp_modules: bool = True
    lora_dropout: float = 0.0
    random_state: int | None = field(default=None, metadata={"help": "seed for the LoRA initialisation"})
    seed: int | None = field(default=None, metadata={"help": "rollout sampler seed (None: the experiment seed)"})
    dist_timeout_s: float = field(default=7200.0, metadata={
        "help": "unsloth:dN: process-group timeout (a replica that hangs this long fails the job; a dead one "
                "fails it at once)"})
    engine: EngineConfig = field(default_factory=EngineConfig,
                                 metadata={"help": "RolloutEngine settings (EngineConfig, as in the Python API)"})

    def load_options(self) -> dict:
        """``load_model`` keyword arguments (the LoRA rank/alpha/targets come from ``actor``)."""
        lora = {"finetune_vision_layers": self.finetune_vision_layers,
                "finetune_language_layers": self.finetune_language_layers,
                "finetune_attention_modules": self.finetune_attention_modules,
                "finetune_mlp_modules": self.finetune_mlp_modules, "lora_dropout": self.lora_dropout}
        if self.random_state is not None:
            lora["random_state"] = self.random_state
        return {"backend": self.model_backend, "load_in_4bit": self.load_in_4bit,
                "max_seq_length": self.max_seq_length, "lora": lora}

    def engine_options(self) -> dict:
        """``EngineConfig`` keyword arguments (of the nested ``engine`` section)."""
        from dataclasses import fields

        return {f.name: getattr(self.engine, f.name) for f in fields(EngineConfig)}


@dataclass
class UnslothPPOConfig(GRPOConfig):
    """AReaL's GRPO/PPO config plus an ``unsloth:`` section."""

    unsloth: UnslothConfig = field(default_factory=UnslothConfig)
