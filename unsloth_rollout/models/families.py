"""The family registry: one ``FamilySpec`` per ``model_type`` the engine serves or knowingly refuses.

Every fact about a family that code acts on lives here: whether it takes images, how its positions and
image attention work, how its processor outputs pack across prompts, why it is refused. The loader,
the processor, the engine's inputs and runner and the test builders read ``family_of(config)``; no
other module keeps a list of families or tests ``model_type``.

A family is listed as served only once the test matrix (tests/test_families.py, tests/test_vlm_families.py)
proves it against HF ``generate()`` and a teacher-forced forward in mixed-length batches with prefix
sharing and preemption. Anything else is refused at load, by name, with this list; a user who wants to
try an unlisted family anyway passes ``allow_unverified_family=True`` and still gets the engine's
per-forward cache-use guard (attention.py).

Example::

    >>> from unsloth_rollout.models.families import FAMILIES, family_of
    >>> FAMILIES["gemma3"].bidirectional_images
    True
    >>> family_of(policy.config).vlm
    False
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping


@dataclass(frozen=True)
class FamilySpec:
    """What the engine knows about one ``model_type`` (see the module docstring)."""

    # transformers' ``config.model_type``.
    model_type: str
    # What was verified (or why it is refused), in the words the README table shows.
    summary: str
    # Takes images: loaded with AutoModelForImageTextToText and a processor; prompts may carry pixels.
    vlm: bool = False
    # 3-D M-RoPE positions from the model's get_rope_index; decode positions add the row's rope delta.
    mrope: bool = False
    # The engine expands each image placeholder itself from image_grid_thw; else the family's processor does.
    grid_images: bool = False
    # Image tokens attend bidirectionally within their image in prefill (one block per run of image tokens).
    bidirectional_images: bool = False
    # Processor outputs a packed prefill concatenates: key -> its image dimension (None: the default rules).
    pack_dims: Mapping[str, int] | None = None
    # Its processor is or wraps PixtralProcessor, which imports without torchvision only via a stand-in.
    pixtral_processor: bool = False
    # Processor used when AutoProcessor fails: "image_only" (Qwen-VL without video), "pixtral", None (PIL).
    processor_fallback: str | None = None
    # Attention features the engine reproduces (sliding windows, soft-capping ...): the masks read the config.
    attention: str = ""
    # Why the engine cannot serve this family exactly; None when it serves it.
    refused: str | None = None
    # In the registry; False for an unlisted family served on request, whose facts come from its config only.
    listed: bool = True

    @property
    def served(self) -> bool:
        return self.listed and self.refused is None


def _spec(model_type: str, summary: str, **facts) -> tuple[str, FamilySpec]:
    if "pack_dims" in facts:  # frozen all the way down: a spec is shared by every engine
        facts["pack_dims"] = MappingProxyType(dict(facts["pack_dims"]))
    return model_type, FamilySpec(model_type, summary, **facts)


_QWEN_VL = dict(vlm=True, mrope=True, grid_images=True, processor_fallback="image_only")

FAMILIES: Mapping[str, FamilySpec] = MappingProxyType(dict([
    # Text families.
    _spec("llama", "Llama 2/3.x, TinyLlama, SmolLM (full attention)"),
    _spec("mistral", "Mistral 7B (sliding window on every layer)", attention="sliding window on every layer"),
    _spec("qwen2", "Qwen2 / Qwen2.5 (optional sliding-window layers)", attention="optional sliding-window layers"),
    _spec("qwen3", "Qwen3 (q/k norm; optional sliding-window layers)", attention="optional sliding-window layers"),
    _spec("qwen3_moe", "Qwen3-MoE (sparse experts)"),
    _spec("gemma2", "Gemma 2 (alternating sliding/full layers, attention and final logit soft-capping)",
          attention="alternating sliding/full layers; attention soft-capping (in transformers' eager attention)"),
    _spec("gemma3_text", "Gemma 3 text (5:1 sliding/full layers, dual RoPE bases, query_pre_attn_scalar)",
          attention="5:1 sliding/full layers"),
    _spec("phi3", "Phi-3 / Phi-3.5 mini (fused qkv and gate_up projections, sliding window)",
          attention="sliding window"),
    # Vision-language families.
    _spec("qwen2_vl", "Qwen2-VL (M-RoPE)", **_QWEN_VL),
    _spec("qwen2_5_vl", "Qwen2.5-VL (M-RoPE, windowed vision attention)", **_QWEN_VL),
    _spec("gemma3", "Gemma 3 (image tokens attend bidirectionally within each image; sliding/full layers)",
          vlm=True, bidirectional_images=True, attention="5:1 sliding/full layers"),
    _spec("llava", "Llava (CLIP features replace the <image> tokens; 1-D positions)", vlm=True,
          pixtral_processor=True),  # Llava folders of Pixtral checkpoints use PixtralProcessor
    _spec("qwen3_vl", "Qwen3-VL (interleaved M-RoPE, deepstack visual features)", **_QWEN_VL),
    # Mistral 3 pads each prompt's images to its largest and crops them back by image_sizes.
    _spec("mistral3", "Mistral 3 / Mistral Small 3.1 (Pixtral vision tower at native resolution, image_sizes; "
                      "sliding window)", vlm=True, pack_dims={"pixel_values": 0, "image_sizes": 0},
          pixtral_processor=True, processor_fallback="pixtral", attention="sliding window"),
    # Idefics3's crops are one fixed size, counted by pixel_attention_mask.
    _spec("idefics3", "Idefics3 (SigLIP crops + global view, pixel_attention_mask, pixel-shuffle connector)",
          vlm=True, pack_dims={"pixel_values": 1, "pixel_attention_mask": 1}),
    # Families Unsloth trains that the engine knowingly cannot serve yet.
    _spec("mllama", "Llama 3.2 Vision", vlm=True,
          refused="Llama 3.2 Vision attends to image features through cross-attention layers, which need a "
                  "cross-attention KV cache per sequence that the engine does not keep"),
    _spec("gemma3n", "Gemma 3n", vlm=True,
          refused="Gemma 3n shares KV between layers (and uses AltUp/per-layer inputs); the engine's cache keeps "
                  "one KV per layer"),
    _spec("gpt_oss", "gpt-oss",
          refused="gpt-oss adds attention sinks to the softmax, which the engine's attention does not reproduce"),
    _spec("llama4", "Llama 4", vlm=True,
          refused="Llama 4 uses chunked attention on most layers, which the engine's masks do not express"),
]))


class UnsupportedModelError(ValueError):
    """The engine cannot (yet) serve this model family exactly; the message lists what it serves."""


def family_of(config: Any) -> FamilySpec:
    """The registry's spec for ``config.model_type``; for an unlisted family, a spec with only what its config
    shows (a vision tower: a VLM) and ``listed=False``. ``config`` may also be a model_type string."""
    model_type = config if isinstance(config, str) else getattr(config, "model_type", None) or "<unknown>"
    spec = FAMILIES.get(model_type)
    if spec is not None:
        return spec
    vlm = not isinstance(config, str) and getattr(config, "vision_config", None) is not None
    return FamilySpec(model_type, "unverified", vlm=vlm, listed=False)


def is_vlm_config(config: Any) -> bool:
    """True when ``config`` describes a vision-language model (a listed VLM family, or any vision tower).

    Example::

        >>> is_vlm_config(AutoConfig.from_pretrained("path/to/qwen2_5_vl"))
        True
    """
    return family_of(config).vlm


def served_families(vlm: bool | None = None) -> tuple[str, ...]:
    """The model_types the engine serves (``vlm``: only the vision-language or only the text ones)."""
    return tuple(t for t, s in FAMILIES.items() if s.served and (vlm is None or s.vlm == vlm))


def supported_families() -> dict[str, str]:
    """model_type -> what was verified, for every served family."""
    return {t: FAMILIES[t].summary for t in served_families()}


def text_dims(text_config: Any) -> tuple[int, int, int]:
    """(layers, KV heads, head dim) of a decoder config: the shape of its KV cache per token."""
    layers = text_config.num_hidden_layers
    heads = text_config.num_attention_heads
    kv = getattr(text_config, "num_key_value_heads", None) or heads
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // heads
    return layers, kv, head_dim


def check_supported(config: Any, allow_unverified: bool = False) -> str:
    """Return the config's model_type if the engine serves it; raise UnsupportedModelError otherwise."""
    spec = family_of(config)
    if spec.served:
        return spec.model_type
    listing = ("text: " + ", ".join(sorted(served_families(vlm=False))) + "; vision-language: "
               + ", ".join(sorted(served_families(vlm=True))))
    if spec.refused is not None:
        raise UnsupportedModelError(
            f"model_type {spec.model_type!r} is not supported by the rollout engine: {spec.refused}. "
            f"Supported families: {listing}.")
    if allow_unverified:
        return spec.model_type
    raise UnsupportedModelError(
        f"model_type {spec.model_type!r} has not been verified exact in the rollout engine (greedy parity with HF "
        f"generate() and logprob parity with a teacher-forced forward in mixed-length batches). Supported "
        f"families: {listing}. To try it anyway, pass allow_unverified_family=True (load_model / EngineConfig); "
        f"the engine still refuses any model whose attention bypasses its KV cache.")
