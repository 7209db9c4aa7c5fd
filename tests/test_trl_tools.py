"""TRL's GRPOTrainer(tools=[...]) through ``rollout_func``: every turn, post-tool turns included, is the engine's.

Oracles: TRL's own parse of each completion (``parse_response`` with the Qwen response template), its tool loop
(which executes the call, then asks ``vllm_generation.generate`` for the turn after the tool result), a
teacher-forced float32 forward of each post-tool turn right after it is generated, and, with a float32 trainer,
TRL's own recomputed logprobs (``sampling/sampling_logp_difference/max`` = max |engine logprob - TRL's forward| over
the model's tokens of every turn). Under GRPOConfig's default precision (``bf16=True``: accelerate wraps the model's
forward in bf16 autocast, also on CPU) the engine still samples, and scores, in the model's float32.
"""

from __future__ import annotations

import os
from typing import Literal

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("llguidance")
pytestmark = pytest.mark.trl
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from unsloth_rollout import EngineConfig, RolloutEngine, load_model  # noqa: E402
from unsloth_rollout.testing.oracles import teacher_forced  # noqa: E402
from unsloth_rollout.trl import rollout_func  # noqa: E402
from unsloth_rollout.testing.trl_toy import grpo_config, toy_dataset, toy_reward  # noqa: E402

TOL = 1e-5
LATER_TOL = 1e-4  # after updates (lr 3e-2) an unlikely token's fp32 logprob carries ~1e-5 noise in both forwards
CALLS: list[str] = []


def flip(side: Literal["heads", "tails"]) -> str:
    """Flip a coin and say whether it landed on the given side.

    Args:
        side: The side to bet on.
    """
    CALLS.append(side)
    return f"{side}: yes"


@pytest.fixture
def qwen_chat_policy(qwen2_dir):
    """The tiny Qwen2 with Qwen2.5's own chat template (TRL knows how to parse its tool calls)."""
    from trl.chat_template_utils import qwen2_5_chat_template

    policy = load_model(qwen2_dir, backend="transformers", lora={"r": 4, "random_state": 0})
    policy.tokenizer.chat_template = qwen2_5_chat_template
    return policy


# (TRL's importance-sampling correction, GRPOConfig precision): a float32 trainer with the correction, whose recompute
# is an exact oracle; GRPOConfig's default precision (bf16 mixed precision) without it.
@pytest.mark.parametrize("importance_sampling,precision", [(True, {"bf16": False}), (False, {})],
                         ids=["fp32-trainer", "trl-default-precision"])
def test_grpo_tool_loop_every_turn_from_the_engine(qwen_chat_policy, tmp_path, monkeypatch, importance_sampling,
                                                   precision):
    from trl import GRPOTrainer

    from unsloth_rollout.trl import EngineGeneration, EngineRollout

    policy = qwen_chat_policy
    # Every turn (first and post-tool), right after it is generated (same weights), against a teacher-forced
    # float32 forward: (output, max |diff|).
    turn_diffs = []
    run, generate = EngineRollout.run, EngineGeneration.generate

    def run_checked(self, requests, expected, trainer):
        outs = run(self, requests, expected, trainer)
        for o in outs:
            ref, _ = teacher_forced(policy, o.prompt_ids, o.output_ids)
            turn_diffs.append((o, (ref - torch.tensor(o.output_logprobs)).abs().max().item()))
        return outs

    def generate_checked(self, prompts, images, num_generations, profiler=None):
        res = generate(self, prompts, images, num_generations, profiler)
        for o, lps in zip(self.rollout.post_tool_outputs[-len(prompts):], res[2]):
            assert [lp[0] for lp in lps] == o.output_logprobs  # TRL's shape: per token, the sampled one's first
        return res

    monkeypatch.setattr(EngineRollout, "run", run_checked)
    monkeypatch.setattr(EngineGeneration, "generate", generate_checked)
    engine = RolloutEngine(policy, EngineConfig(kv_cache_memory_bytes=16 << 20, max_model_len=1024), seed=0)
    rf = rollout_func(engine, tool_choice="required", importance_sampling=importance_sampling)
    CALLS.clear()
    steps, groups, n = 2, 2, 2
    tr = GRPOTrainer(model=policy.model, processing_class=policy.tokenizer, reward_funcs=toy_reward(engine.eos_ids),
                     args=grpo_config(str(tmp_path), steps, num_generations=n, prompts_per_step=groups,
                                      max_completion_length=64, max_tool_calling_iterations=2, **precision),
                     train_dataset=toy_dataset(4, None), rollout_func=rf, tools=[flip])
    generate_calls = []
    hf_generate = policy.model.generate
    policy.model.generate = lambda *a, **k: generate_calls.append(1) or hf_generate(*a, **k)
    try:
        tr.train()
    finally:
        policy.model.generate = hf_generate

    if not precision:  # TRL's default: bf16 mixed precision, accelerate's autocast wrapper on the model's forward
        assert tr.args.bf16 and "forward" in vars(policy.model)
    first = [h for h in rf.history if not h.get("post_tool")]
    post = [h for h in rf.history if h.get("post_tool")]
    assert [h["global_step"] for h in first] == list(range(steps))
    # Every first turn was one schema-valid call of the tool: TRL parsed it and ran it without a failure ...
    assert len(CALLS) == steps * groups * n and set(CALLS) <= {"heads", "tails"}
    log = tr.state.log_history
    assert [h["tools/call_frequency"] for h in log if "tools/call_frequency" in h] == [1.0] * steps
    assert [h["tools/failure_frequency"] for h in log if "tools/failure_frequency" in h] == [0.0] * steps
    # ... and every post-tool turn TRL asked for was generated by the engine (HF generate never ran).
    assert generate_calls == []
    assert sum(h["samples"] for h in post) == len(rf.post_tool_outputs) >= len(CALLS)
    assert sorted({h["global_step"] for h in post}) == list(range(steps))
    suffix = policy.tokenizer.encode("</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert all(o.prompt_ids[-len(suffix):] == suffix for o in rf.post_tool_outputs)  # after the tool result
    post_ids = {id(o) for o in rf.post_tool_outputs}
    assert sum(id(o) in post_ids for o, _ in turn_diffs) == len(rf.post_tool_outputs)
    assert len(turn_diffs) == len(rf.post_tool_outputs) + steps * groups * n
    assert max(d for o, d in turn_diffs if o.output_versions[0] == 0) <= TOL
    assert max(d for _, d in turn_diffs) <= LATER_TOL
    if importance_sampling:
        # TRL's recompute of every model token (first and post-tool turns; tool results masked) == the engine's.
        diffs = [h["sampling/sampling_logp_difference/max"] for h in log
                 if "sampling/sampling_logp_difference/max" in h]
        assert len(diffs) == steps and diffs[0] <= TOL and max(diffs) <= LATER_TOL, diffs
    engine.shutdown()
