"""Datasets for the GRPO entry point, in the shape AReaL's workflows read.

- ``toy_dataset``: offline prompts (with a random image for VLMs) for CPU tests and demos.
- ``geometry3k_rl_dataset``: geometry3k-style data (``problem``, ``images``, ``answer``) turned into
  VisionRLVRWorkflow items (``messages`` as a chat-templated string with the image placeholder,
  ``messages_chat``, ``images``, ``answer``), as ``areal.dataset.geometry3k`` does, without torchvision.

Example::

    ds = toy_dataset(processor, n=16)            # list of dicts
    ds = geometry3k_rl_dataset("hiyouga/geometry3k", "train", processor)
"""

from __future__ import annotations

import io
from typing import Any

IMAGE_TOKEN = "<|vision_start|><|image_pad|><|vision_end|>"
INSTRUCTION = (" You FIRST think about the reasoning process as an internal monologue and then provide the final "
               "answer. The reasoning process MUST BE enclosed within <think> </think> tags. The final answer MUST "
               "BE put in \\boxed{}.")
_TOY_WORDS = ("red", "blue", "green", "circle", "square", "line", "angle", "point", "area", "side")


def _random_image(seed: int, size: int):
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((size, size, 3)) * 255).astype("uint8"))


def toy_dataset(tokenizer, processor=None, n: int = 16, image_size: int = 56, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` short prompts; with a processor each carries one random ``image_size`` square image."""
    items = []
    for i in range(n):
        words = " ".join(_TOY_WORDS[(i + k) % len(_TOY_WORDS)] for k in range(3))
        question = f"Describe the {words} number {i}."
        stop_ids = sorted({tokenizer.eos_token_id, tokenizer.pad_token_id} - {None})
        if processor is None:
            items.append({"messages": [{"role": "user", "content": question}], "stop_ids": stop_ids})
            continue
        text = tokenizer.apply_chat_template([{"role": "user", "content": IMAGE_TOKEN + question}], tokenize=False,
                                             add_generation_prompt=True)
        items.append({
            "messages": text,
            "messages_chat": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": ""}},
                                                           {"type": "text", "text": question}]}],
            "images": [_random_image(seed * 100003 + i, image_size)],
            "stop_ids": stop_ids,
        })
    return items


def _to_pil(image, size: int | None):
    from PIL import Image

    if isinstance(image, dict):  # datasets' Image feature without decoding
        image = Image.open(io.BytesIO(image["bytes"])) if image.get("bytes") else Image.open(image["path"])
    if image.mode != "RGB":
        image = image.convert("RGB")
    if size is not None and image.size != (size, size):
        w, h = image.size
        left, top = max(0, (w - size) // 2), max(0, (h - size) // 2)
        image = image.crop((left, top, left + min(size, w), top + min(size, h))).resize((size, size))
    return image


def geometry3k_rl_dataset(path: str, split: str, processor, image_size: int | None = 448,
                          max_length: int | None = None) -> list[dict[str, Any]]:
    """geometry3k (``problem`` with ``<image>``, ``images``, ``answer``) as VisionRLVRWorkflow items."""
    from datasets import load_dataset

    tokenizer = processor.tokenizer
    items = []
    for sample in load_dataset(path=path, split=split):
        problem = sample["problem"].replace("different", "")
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": problem.replace("<image>", IMAGE_TOKEN) + INSTRUCTION}],
            add_generation_prompt=True, tokenize=False)
        images = [_to_pil(im, image_size) for im in sample["images"]]
        if max_length is not None:
            n = processor(text=[text], images=images, padding=False, return_tensors="pt")["input_ids"].shape[1]
            if n > max_length:
                continue
        items.append({
            "messages": text,
            "messages_chat": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": ""}},
                                                           {"type": "text", "text": problem.replace("<image>", "")
                                                            + INSTRUCTION}]}],
            "images": images,
            "answer": sample["answer"],
        })
    return items
