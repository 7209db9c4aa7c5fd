"""TRL's GRPOTrainer generating through a RolloutEngine over the very model it trains.

One line on the user's existing TRL (or Unsloth-patched TRL) GRPO script::

    from unsloth_rollout.trl import rollout_func

    trainer = GRPOTrainer(model=model, processing_class=processor, reward_funcs=..., args=GRPOConfig(...),
                          train_dataset=ds, rollout_func=rollout_func(engine))   # or rollout_func(policy)

It uses TRL's documented ``rollout_func=`` hook: each group of ``num_generations`` identical prompts is
one engine request with ``n=num_generations`` (one shared prefill), sampled with the trainer's
``max_completion_length`` / temperature / top_p / top_k / min_p / repetition_penalty / generation_kwargs,
stopping at the trainer's EOS ids. Completion ids and the engine's behaviour logprobs go back to TRL, and
its importance-sampling correction and ``sampling/*`` logging run on them. The engine's version follows
``trainer.state.global_step`` (bumped after every optimizer step by a callback); no weights move. With
``GRPOTrainer(tools=[...])``, TRL's tool loop generates every post-tool turn through the engine as well
(``EngineGeneration``, what the hook puts at ``trainer.vllm_generation``). When the policy's bitwise on-policy mode is
on (``unsloth_rollout/bitwise.py``), TRL's recompute of the logprobs runs under it too (``trl/bitwise.py``): its
``sampling/sampling_logp_difference`` is 0.

Importing ``unsloth_rollout`` does not import this module or trl.
"""

from .rollout import EngineGeneration, EngineRollout, EngineVersionCallback, rollout_func, sampling_params_from_trainer

__all__ = ["EngineGeneration", "EngineRollout", "EngineVersionCallback", "rollout_func", "sampling_params_from_trainer"]
