"""The toy task every front end's demos and tests share, below the front ends: named tiny models, random images,
and the toy reward (a fixed block of token ids a random policy hits about a tenth of the time).

Example::

    path = model_path("tiny-vlm")                  # built offline on first use
    images = random_images(4, seed=0)              # varied sizes, so prompts differ in length
    url = png_data_url(seeded_image(3, (84, 56)))  # an image for a chat message
    target_token_fraction(completion_ids=[100, 5, 101, 7])   # 0.5
"""

from __future__ import annotations

import base64
import io
import os

import numpy as np

# Named tiny models (family, size) for benches and demos; any other name must be a model folder.
MODELS = {
    "small-vlm": ("qwen2_5_vl", "small"),
    "tiny-vlm": ("qwen2_5_vl", "tiny"),
    "small-lm": ("qwen2", "small"),
    "tiny-lm": ("qwen2", "tiny"),
}

# The toy task's target tokens: a contiguous block of ordinary BPE ids (about a tenth of the tiny
# models' vocabulary, no special or vision tokens), so a random policy starts near 0.1.
TOY_TARGET_IDS = frozenset(range(100, 176))


def model_path(name: str) -> str:
    """A model folder for ``name``: one of MODELS (built offline on first use) or a path."""
    if name in MODELS:
        from .tiny import tiny_model_path

        return str(tiny_model_path(*MODELS[name]))
    if not os.path.isdir(name):
        raise ValueError(f"--model must be one of {', '.join(MODELS)} or a model folder; {name!r} is neither")
    return name


def random_images(n: int, seed: int = 0):
    """``n`` random RGB images of varied sizes (so prompts differ in length)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    sizes = [(64, 48), (40, 90), (56, 56), (30, 70), (84, 28)]
    return [Image.fromarray(rng.integers(0, 255, (*sizes[i % len(sizes)], 3), dtype=np.uint8)) for i in range(n)]


def seeded_image(seed: int, size: tuple[int, int] = (56, 56)):
    """One random RGB image of ``size`` (width, height), the same for the same seed."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8))


def png_data_url(image) -> str:
    """A PIL image (or PNG bytes) as a ``data:image/png;base64,...`` URL, as an OpenAI chat message carries it."""
    if not isinstance(image, (bytes, bytearray)):
        buf = io.BytesIO()
        image.save(buf, format="PNG")
        image = buf.getvalue()
    return "data:image/png;base64," + base64.b64encode(image).decode()


def target_token_fraction(prompt=None, completions=None, prompt_ids=None, completion_ids=None, **data) -> float:
    """Toy reward: the fraction of completion tokens in ``TOY_TARGET_IDS`` (a trailing EOS is not counted).

    Module-level (AReaL runs rewards in a process pool, so they must be picklable), with AReaL's reward signature.

    Example::

        >>> target_token_fraction(completion_ids=[100, 5, 101, 7])
        0.5
    """
    ids = list(completion_ids or [])
    stop = data.get("stop_ids") or ()
    while ids and ids[-1] in stop:
        ids.pop()
    if not ids:
        return 0.0
    return sum(1 for t in ids if t in TOY_TARGET_IDS) / len(ids)
