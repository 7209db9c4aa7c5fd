"""Shared helpers of the test_areal_* files: the teacher-forced oracle and small VLM inputs."""

from __future__ import annotations

import base64
import io

import numpy as np
import torch

from unsloth_rollout.testing.oracles import teacher_forced
from unsloth_rollout.testing.scripted import ForcedOutput  # noqa: F401  (the test_areal_* files import it from here)

IMAGE_TOKEN = "<|vision_start|><|image_pad|><|vision_end|>"


def teacher_forced_logprobs(policy, prompt_ids, output_ids, temperature: float, pixel_values=None,
                            image_grid_thw=None) -> torch.Tensor:
    """The oracle: one plain HF forward of prompt + output; ``log_softmax(logits / T)`` of each output token."""
    return teacher_forced(policy, prompt_ids, output_ids, temperature, pixel_values=pixel_values,
                          image_grid_thw=image_grid_thw)[0]


def random_image(seed: int, size: int = 56):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((size, size, 3)) * 255).astype("uint8"))


def png_data_url(seed: int, size: int = 56) -> str:
    buf = io.BytesIO()
    random_image(seed, size).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def vlm_item(policy, i: int) -> dict:
    """A VisionRLVRWorkflow data item: chat-templated text with one image placeholder, plus the image."""
    text = policy.tokenizer.apply_chat_template([{"role": "user", "content": IMAGE_TOKEN + f"What is shape {i}?"}],
                                                tokenize=False, add_generation_prompt=True)
    return {"messages": text, "images": [random_image(100 + i)]}
