"""The bitwise on-policy mode through TRL's GRPOTrainer (trl 1.16) with ``rollout_func``: TRL's own recompute of the
behaviour logprobs equals the engine's, so ``sampling/sampling_logp_difference/max`` is 0 and the importance ratios
are exactly 1 at every step, the weights updated in between: a text model, and Qwen2.5-VL with images and LoRA on
its vision tower.

Oracle: TRL's importance-sampling branch (its recompute through the model's fused LM head, which the hook runs under
the mode: trl/bitwise.py) and its logged metric. With the mode off on TRL's side only, the metric is not 0.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("trl")
pytestmark = pytest.mark.trl
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from unsloth_rollout import EngineConfig, RolloutEngine, bitwise, load_model  # noqa: E402
from unsloth_rollout.kernels import batch_invariant  # noqa: E402
from unsloth_rollout.testing.tiny import tiny_model_path  # noqa: E402
from unsloth_rollout.testing.toy import random_images  # noqa: E402
from unsloth_rollout.testing.trl_toy import grpo_config, toy_reward  # noqa: E402
from unsloth_rollout.trl import rollout_func  # noqa: E402

if not batch_invariant.available():
    pytest.skip("no C++ compiler for the mode's kernels", allow_module_level=True)

PROMPTS = ["Hi.", "Describe the picture in a few words please.", "What is two plus two?",
           "Tell me a very long story about a cat and a dog."]


def _train(tmp_path, trainer_side: bool, monkeypatch, arch: str = "qwen2", **config):
    from datasets import Dataset
    from trl import GRPOTrainer

    if not trainer_side:  # the engine under the mode, TRL's recompute as TRL computes it
        monkeypatch.setattr("unsloth_rollout.trl.rollout.use_bitwise_recompute", lambda trainer, policy: None)
    lora = {"r": 4, "random_state": 0, "finetune_vision_layers": arch != "qwen2"}
    policy = load_model(str(tiny_model_path(arch)), backend="transformers", lora=lora)
    bitwise.enable(policy)
    engine = RolloutEngine(policy, EngineConfig(kv_cache_memory_bytes=8 << 20), seed=0)
    lora0 = {n: p.detach().clone() for n, p in policy.model.named_parameters() if "lora_B" in n}
    cols = {"prompt": [[{"role": "user", "content": t}] for t in PROMPTS]}
    if policy.is_vlm:  # one image per prompt, LoRA on the vision tower too
        cols["images"] = [[im] for im in random_images(len(PROMPTS), seed=2)]
    ds = Dataset.from_dict(cols)
    tr = GRPOTrainer(model=policy.model, processing_class=policy.processor or policy.tokenizer,
                     reward_funcs=toy_reward(engine.eos_ids),
                     args=grpo_config(str(tmp_path), 3, num_generations=3, prompts_per_step=2, max_completion_length=8,
                                      temperature=0.8, **config),
                     train_dataset=ds, rollout_func=rollout_func(engine))
    try:
        tr.train()
    finally:
        engine.shutdown()
    changed = max((p - lora0[n]).abs().max().item() for n, p in policy.model.named_parameters() if n in lora0)
    logged = {k: [h[k] for h in tr.state.log_history if k in h]
              for k in ("sampling/sampling_logp_difference/max", "sampling/importance_sampling_ratio/min",
                        "sampling/importance_sampling_ratio/max")}
    return logged, changed


@pytest.mark.parametrize("arch", ["qwen2", "qwen2_5_vl"])
def test_trls_recompute_equals_the_engines_logprobs_at_every_step(tmp_path, monkeypatch, arch):
    """On GRPOConfig's default precision (bf16 autocast): the mode's recompute runs in float32 inside it."""
    logged, changed = _train(tmp_path, True, monkeypatch, arch)
    assert changed > 1e-3  # the optimizer moved the weights between steps
    assert logged["sampling/sampling_logp_difference/max"] == [0.0, 0.0, 0.0]
    assert logged["sampling/importance_sampling_ratio/min"] == logged["sampling/importance_sampling_ratio/max"] == [
        1.0, 1.0, 1.0]


def test_without_the_mode_on_trls_side_the_difference_is_not_zero(tmp_path, monkeypatch):
    """A float32 trainer (bf16=False) without the mode: its recompute is within float32 noise, not equal."""
    logged, _ = _train(tmp_path, False, monkeypatch, bf16=False)
    diffs = logged["sampling/sampling_logp_difference/max"]
    assert len(diffs) == 3 and all(0 < d < 1e-4 for d in diffs), diffs
