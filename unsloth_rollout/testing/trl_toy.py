"""The TRL toy task's fixtures: chat prompts with an image each, the toy reward over completion ids, and a CPU
``GRPOConfig`` (``unsloth_rollout.trl.toy`` trains on them; TRL tests and the bench's TRL rows use them too).

Example::

    ds = toy_dataset(16, "image")                      # a datasets.Dataset of chat prompts
    trainer = GRPOTrainer(..., reward_funcs=toy_reward(engine.eos_ids), args=grpo_config(out_dir, steps=30),
                          train_dataset=ds, rollout_func=rollout_func(engine))
"""

from __future__ import annotations

from .toy import random_images


def toy_dataset(n: int = 8, image_column: str | None = "image", seed: int = 0):
    """Chat prompts; with ``image_column`` ("image" or "images") one image per row in that column."""
    from datasets import Dataset

    cols: dict = {"prompt": [[{"role": "user", "content": f"Describe picture number {i}."}] for i in range(n)]}
    if image_column == "image":
        cols["image"] = random_images(n, seed)
    elif image_column == "images":
        cols["images"] = [[im] for im in random_images(n, seed)]
    elif image_column is not None:
        raise ValueError(f"image_column must be 'image', 'images' or None, got {image_column!r}")
    return Dataset.from_dict(cols)


def toy_reward(stop_ids):
    """A TRL reward function over completion ids (the trailing stop token not counted)."""
    from .toy import target_token_fraction

    stop = tuple(stop_ids)

    def target_tokens(completions, completion_ids, **kwargs):
        return [target_token_fraction(completion_ids=ids, stop_ids=stop) for ids in completion_ids]

    return target_tokens


def grpo_config(output_dir: str, steps: int, *, lr: float = 3e-2, num_generations: int = 8,
                prompts_per_step: int = 4, max_completion_length: int = 8, seed: int = 0, **overrides):
    """A small CPU GRPOConfig; ``overrides`` are any other GRPOConfig fields.

    Precision is TRL's default (``bf16=True``: bf16 autocast mixed precision, also on CPU), what a user who copies
    TRL's quick start trains with; the engine samples in the model's own dtype under it. Pass ``bf16=False`` for a
    float32 trainer, whose recompute of the sampled tokens is then an exact oracle of the engine's logprobs.
    """
    from trl import GRPOConfig

    kw = dict(output_dir=output_dir, use_cpu=True, num_generations=num_generations,
              per_device_train_batch_size=num_generations * prompts_per_step,
              max_completion_length=max_completion_length,
              max_steps=steps, learning_rate=lr, lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0,
              gradient_checkpointing=False, report_to=[], logging_steps=1, save_strategy="no", seed=seed,
              temperature=1.0, beta=0.0, dataloader_num_workers=0, disable_tqdm=True)
    kw.update(overrides)
    return GRPOConfig(**kw)
