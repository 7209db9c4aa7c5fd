"""Seeded, realistic request sets for the benchmark: same requests, same seeds for every backend.

Lengths are drawn, not fixed. Prompt text lengths are lognormal; each sample gets its own output
budget ``max_new_tokens`` drawn from a lognormal capped at ``--max-new-tokens``. A random-weight
model almost never samples EOS, so this per-sample budget stands in for the random lengths EOS
gives a real policy (EOS still stops a sample when it is sampled, unless ``ignore_eos``).
VLM workloads attach one random image per prompt with its width and height drawn.

Example::

    wl = build_workload(policy, "grpo", prompts=4, group=2, max_new_tokens=32, seed=0)
    wl.requests[0].prompt_ids, wl.requests[0].max_new_tokens, wl.summary()
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import numpy as np

WORKLOADS = ("grpo", "chat", "long-gen")  # and, in the CLI, "trl" and "long" (bench/trl.py, bench/long.py)


@dataclass(frozen=True)
class WorkloadShape:
    """How one workload kind draws its lengths.

    Prompt text tokens ~ lognormal(median ``prompt_median``, sigma ``prompt_sigma``) clipped to
    ``prompt_range``; per-sample output budget ~ lognormal(median ``output_median_frac`` x
    max_new_tokens, sigma ``output_sigma``) clipped to [1, max_new_tokens]; an image on a prompt with
    probability ``image_prob`` (VLMs only), sides uniform in ``image_side``.
    """

    prompts: int
    group: int
    max_new_tokens: int
    prompt_median: float
    prompt_sigma: float
    prompt_range: tuple[int, int]
    output_median_frac: float
    output_sigma: float
    image_prob: float
    image_side: tuple[int, int]


# Defaults sized so that `python -m unsloth_rollout.bench` takes a few minutes on 2 CPU cores.
SHAPES = {
    # GRPO: few prompts, a group of samples each, widely varying response lengths.
    "grpo": WorkloadShape(prompts=16, group=8, max_new_tokens=128, prompt_median=48, prompt_sigma=0.6,
                          prompt_range=(8, 384), output_median_frac=0.45, output_sigma=0.7, image_prob=1.0,
                          image_side=(56, 336)),
    # Chat: many distinct prompts, one sample each, longer prompts, half of them with an image.
    "chat": WorkloadShape(prompts=64, group=1, max_new_tokens=128, prompt_median=160, prompt_sigma=0.8,
                          prompt_range=(16, 1536), output_median_frac=0.4, output_sigma=0.8, image_prob=0.5,
                          image_side=(56, 448)),
    # Long generations: long prompts and long outputs (near the cap), every backend.
    "long-gen": WorkloadShape(prompts=4, group=4, max_new_tokens=512, prompt_median=1024, prompt_sigma=0.3,
                              prompt_range=(256, 4096), output_median_frac=0.8, output_sigma=0.25, image_prob=1.0,
                              image_side=(112, 448)),
}


@dataclass
class BenchRequest:
    """One sample to generate: an expanded prompt (one image pad per merged patch), its image, its budget."""

    index: int
    prompt_index: int
    sample_index: int
    prompt_ids: list[int]
    image: object | None  # PIL image
    max_new_tokens: int
    seed: int


@dataclass
class Workload:
    kind: str
    prompts: int
    group: int
    max_new_tokens: int
    temperature: float
    ignore_eos: bool
    seed: int
    requests: list[BenchRequest] = field(default_factory=list)
    eos_ids: list[int] = field(default_factory=list)
    image_token_id: int | None = None

    def groups(self) -> list[list[BenchRequest]]:
        out: dict[int, list[BenchRequest]] = {}
        for r in self.requests:
            out.setdefault(r.prompt_index, []).append(r)
        return list(out.values())

    def summary(self) -> dict:
        plen = np.array([len(r.prompt_ids) for r in self.requests[:: max(1, self.group)]])
        budget = np.array([r.max_new_tokens for r in self.requests])
        imgs = [r.image.size for r in self.requests[:: max(1, self.group)] if r.image is not None]
        return {
            "kind": self.kind, "prompts": self.prompts, "group": self.group, "requests": len(self.requests),
            "max_new_tokens": self.max_new_tokens, "temperature": self.temperature, "top_p": 1.0, "top_k": None,
            "ignore_eos": self.ignore_eos, "seed": self.seed,
            "prompt_tokens_mean": float(plen.mean()), "prompt_tokens_min": int(plen.min()),
            "prompt_tokens_max": int(plen.max()),
            "sample_budget_mean": float(budget.mean()), "sample_budget_min": int(budget.min()),
            "sample_budget_max": int(budget.max()),
            "images": len(imgs), "image_sizes": [list(s) for s in imgs],
            "lengths": "prompt text ~ lognormal, per-sample max_new_tokens ~ lognormal capped at max_new_tokens "
                       "(stands in for EOS, which random weights rarely sample)",
        }


def _lognormal(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, round(math.exp(rng.gauss(math.log(median), sigma))))))


def _random_image(rng: random.Random, side: tuple[int, int]):
    from PIL import Image

    w, h = rng.randint(*side), rng.randint(*side)
    nrng = np.random.default_rng(rng.getrandbits(32))
    # Smooth random colour field plus noise: a real-looking amount of detail for the image processor.
    base = nrng.integers(0, 256, size=(max(1, h // 16), max(1, w // 16), 3), dtype=np.uint8)
    img = Image.fromarray(base).resize((w, h), Image.BILINEAR)
    arr = np.asarray(img, dtype=np.int16) + nrng.integers(-12, 13, size=(h, w, 3))
    return Image.fromarray(arr.clip(0, 255).astype(np.uint8))


def _text_token_pool(tokenizer) -> list[int]:
    """Ordinary BPE tokens (no added/special tokens) to draw prompt text from."""
    special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    return [i for i in range(len(tokenizer)) if i not in special]


def expand_image_pads(ids: list[int], image_token_id: int, num_pads: list[int]) -> list[int]:
    """Replace the k-th image placeholder with ``num_pads[k]`` copies (what Qwen-VL processors do)."""
    out, k = [], 0
    for t in ids:
        if t == image_token_id:
            out.extend([t] * num_pads[k])
            k += 1
        else:
            out.append(t)
    if k != len(num_pads):
        raise ValueError(f"prompt has {k} image placeholders, expected {len(num_pads)}")
    return out


def image_inputs(processor, images: list):
    """pixel_values and image_grid_thw for ``images`` from the model's own image processor."""
    enc = processor.image_processor(images=images, return_tensors="pt")
    return enc["pixel_values"], enc["image_grid_thw"]


def build_workload(policy, kind: str = "grpo", prompts: int | None = None, group: int | None = None,
                   max_new_tokens: int | None = None, temperature: float = 1.0, ignore_eos: bool = False,
                   seed: int = 0, images: bool | None = None) -> Workload:
    """Draw a workload for ``policy`` (a PolicyModel). ``None`` sizes take the kind's defaults (``SHAPES``).

    ``images``: attach images (default: when the model is a VLM).
    """
    if kind not in SHAPES:
        raise ValueError(f"--workload must be one of {', '.join(WORKLOADS)}, got {kind!r}")
    shape = SHAPES[kind]
    prompts = shape.prompts if prompts is None else prompts
    group = shape.group if group is None else group
    max_new_tokens = shape.max_new_tokens if max_new_tokens is None else max_new_tokens
    for name, v in (("prompts", prompts), ("group", group), ("max_new_tokens", max_new_tokens)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be an integer >= 1, got {v!r}")
    tok = policy.tokenizer
    use_images = policy.is_vlm if images is None else images
    if use_images and not policy.is_vlm:
        raise ValueError("images need a vision-language model")
    image_token_id = getattr(policy.config, "image_token_id", None) if use_images else None
    merge = getattr(getattr(policy.config, "vision_config", None), "spatial_merge_size", 2)
    pool = _text_token_pool(tok)
    rng = random.Random(seed)
    gen_cfg = getattr(policy.base_model, "generation_config", None)
    eos = getattr(gen_cfg, "eos_token_id", None) if gen_cfg is not None else None
    eos_ids = sorted({e for e in (eos if isinstance(eos, (list, tuple)) else [eos]) if isinstance(e, int)}
                     | ({tok.eos_token_id} if tok.eos_token_id is not None else set()))
    wl = Workload(kind, prompts, group, max_new_tokens, temperature, ignore_eos, seed, eos_ids=eos_ids,
                  image_token_id=image_token_id)
    for p in range(prompts):
        n_text = _lognormal(rng, shape.prompt_median, shape.prompt_sigma, *shape.prompt_range)
        text = tok.decode([rng.choice(pool) for _ in range(n_text)])
        image = _random_image(rng, shape.image_side) if use_images and rng.random() < shape.image_prob else None
        content = ([{"type": "image"}] if image is not None else []) + [{"type": "text", "text": text}]
        msgs = [{"role": "user", "content": content if policy.is_vlm else text}]
        rendered = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        ids = tok.encode(rendered, add_special_tokens=False)
        if image is not None:
            _, grid = image_inputs(policy.processor, [image])
            ids = expand_image_pads(ids, image_token_id, [int(g.prod()) // merge**2 for g in grid])
        for g in range(group):
            budget = _lognormal(rng, shape.output_median_frac * max_new_tokens, shape.output_sigma, 1,
                                max_new_tokens)
            wl.requests.append(BenchRequest(len(wl.requests), p, g, ids, image, budget,
                                            seed * 1_000_003 + len(wl.requests)))
    return wl
