"""Which model families the engine serves exactly, and a named refusal for the rest.

A family is listed here only once the test matrix (tests/test_families.py) proves it against HF
``generate()`` and a teacher-forced forward in mixed-length batches with prefix sharing and
preemption. Anything else is refused at load, by name, with this list; a user who wants to try an
unlisted family anyway passes ``allow_unverified_family=True`` and still gets the engine's per-forward
cache-use guard (attention.py).
"""

from __future__ import annotations

# model_type -> what was verified (shown in the README table).
TEXT_FAMILIES = {
    "llama": "Llama 2/3.x, TinyLlama, SmolLM (full attention)",
    "mistral": "Mistral 7B (sliding window on every layer)",
    "qwen2": "Qwen2 / Qwen2.5 (optional sliding-window layers)",
    "qwen3": "Qwen3 (q/k norm; optional sliding-window layers)",
    "qwen3_moe": "Qwen3-MoE (sparse experts)",
    "gemma2": "Gemma 2 (alternating sliding/full layers, attention and final logit soft-capping)",
    "gemma3_text": "Gemma 3 text (5:1 sliding/full layers, dual RoPE bases, query_pre_attn_scalar)",
    "phi3": "Phi-3 / Phi-3.5 mini (fused qkv and gate_up projections, sliding window)",
}
VLM_FAMILIES = {
    "qwen2_vl": "Qwen2-VL (M-RoPE)",
    "qwen2_5_vl": "Qwen2.5-VL (M-RoPE, windowed vision attention)",
    "gemma3": "Gemma 3 (image tokens attend bidirectionally within each image; sliding/full layers)",
    "llava": "Llava (CLIP features replace the <image> tokens; 1-D positions)",
    "qwen3_vl": "Qwen3-VL (interleaved M-RoPE, deepstack visual features)",
    "mistral3": "Mistral 3 / Mistral Small 3.1 (Pixtral vision tower at native resolution, image_sizes; sliding "
                "window)",
    "idefics3": "Idefics3 (SigLIP crops + global view, pixel_attention_mask, pixel-shuffle connector)",
}
# Families Unsloth trains that the engine knowingly cannot serve yet, with the reason.
REFUSED_FAMILIES = {
    "mllama": "Llama 3.2 Vision attends to image features through cross-attention layers, which need a "
              "cross-attention KV cache per sequence that the engine does not keep",
    "gemma3n": "Gemma 3n shares KV between layers (and uses AltUp/per-layer inputs); the engine's cache keeps "
               "one KV per layer",
    "gpt_oss": "gpt-oss adds attention sinks to the softmax, which the engine's attention does not reproduce",
    "llama4": "Llama 4 uses chunked attention on most layers, which the engine's masks do not express",
}


class UnsupportedModelError(ValueError):
    """The engine cannot (yet) serve this model family exactly; the message lists what it serves."""


def supported_families() -> dict[str, str]:
    return {**TEXT_FAMILIES, **VLM_FAMILIES}


def check_supported(config, allow_unverified: bool = False) -> str:
    """Return the config's model_type if the engine serves it; raise UnsupportedModelError otherwise."""
    model_type = getattr(config, "model_type", None) or "<unknown>"
    if model_type in TEXT_FAMILIES or model_type in VLM_FAMILIES:
        return model_type
    listing = ("text: " + ", ".join(sorted(TEXT_FAMILIES)) + "; vision-language: " + ", ".join(sorted(VLM_FAMILIES)))
    if model_type in REFUSED_FAMILIES:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported by the rollout engine: {REFUSED_FAMILIES[model_type]}. "
            f"Supported families: {listing}.")
    if allow_unverified:
        return model_type
    raise UnsupportedModelError(
        f"model_type {model_type!r} has not been verified exact in the rollout engine (greedy parity with HF "
        f"generate() and logprob parity with a teacher-forced forward in mixed-length batches). Supported "
        f"families: {listing}. To try it anyway, pass allow_unverified_family=True (load_model / EngineConfig); "
        f"the engine still refuses any model whose attention bypasses its KV cache.")
