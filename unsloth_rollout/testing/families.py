"""Tiny random models of every text family the engine serves, from transformers' own config classes.

Each is 3 layers with grouped-query attention and the family's distinguishing features switched on
at sizes a short prompt reaches: sliding windows of 8 tokens (so mixed-length batches run past
them), Gemma 2's attention and final-logit soft-capping at values that change the logits, Gemma 3's
5:1 local/global layers with two RoPE bases, Phi-3's fused projections, Qwen3-MoE's experts. All
share the offline BPE tokenizer and Qwen chat template of ``unsloth_rollout.testing.tiny``.

Example::

    >>> from unsloth_rollout.testing.families import family_model_path
    >>> path = family_model_path("gemma2")     # built once, then reused from the cache
"""

from __future__ import annotations

import json
import pathlib

from ..models.families import served_families

_FORMAT_VERSION = "f1"
_MARKER = "unsloth_rollout_family.json"

# Features per family, on top of the common tiny dimensions.
_FAMILIES = {
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", {"sliding_window": 8}),
    "qwen2": ("Qwen2Config", {"use_sliding_window": True, "sliding_window": 8,
                              "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}),
    "qwen3": ("Qwen3Config", {"head_dim": 16, "use_sliding_window": True, "sliding_window": 8,
                              "layer_types": ["full_attention", "sliding_attention", "full_attention"]}),
    "qwen3_moe": ("Qwen3MoeConfig", {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
                                      "moe_intermediate_size": 32, "decoder_sparse_step": 1, "norm_topk_prob": True}),
    "gemma2": ("Gemma2Config", {"head_dim": 16, "sliding_window": 8, "query_pre_attn_scalar": 16,
                                "attn_logit_softcapping": 1.0, "final_logit_softcapping": 2.0,
                                "hidden_activation": "gelu_pytorch_tanh"}),
    "gemma3_text": ("Gemma3TextConfig", {"head_dim": 16, "sliding_window": 8, "query_pre_attn_scalar": 16,
                                         "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
                                         "rope_parameters": {
                                             "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                             "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}),
    "phi3": ("Phi3Config", {"sliding_window": 8}),
}
FAMILIES = served_families(vlm=False)  # the registry's text families, in its order
if set(FAMILIES) != set(_FAMILIES):  # every served text family has a tiny builder, and nothing else does
    raise RuntimeError(f"testing.families builds {sorted(_FAMILIES)}; the registry serves {sorted(FAMILIES)}")


def family_model_path(family: str, seed: int = 0) -> pathlib.Path:
    """Path of the cached tiny ``family`` model, building it first (atomically) if needed."""
    if family not in _FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    from .tiny import _cache_root, cached_build

    path = _cache_root() / "families" / f"{family}-s{seed}-{_FORMAT_VERSION}"
    return cached_build(path, _MARKER, lambda tmp: _write(tmp, family, seed))


def family_path(family: str) -> str:
    """The cached tiny model folder of any served family: Qwen2 / Qwen2-VL / Qwen2.5-VL from ``testing.tiny``,
    the other VLMs from ``testing.vlm_families``, the other text families from ``family_model_path``."""
    from .tiny import ARCHES, tiny_model_path
    from .vlm_families import VLM_FAMILIES, vlm_family_path

    if family in ARCHES:
        return str(tiny_model_path(family))
    if family in VLM_FAMILIES:
        return str(vlm_family_path(family))
    return str(family_model_path(family))


def _write(path: pathlib.Path, family: str, seed: int) -> None:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, GenerationConfig

    from .tiny import SPECIAL_TOKENS, _build_tokenizer, _quiet_progress_bars, _round_up, chat_template

    tokenizer = _build_tokenizer(746)
    tokenizer.chat_template = chat_template("qwen2")
    ids = {text: tokenizer.convert_tokens_to_ids(text) for text, _ in SPECIAL_TOKENS}
    cls_name, extra = _FAMILIES[family]
    config = getattr(transformers, cls_name)(
        vocab_size=_round_up(len(tokenizer), 64), hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, initializer_range=0.15,
        bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"],
        tie_word_embeddings=False, **extra)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        # Random norms' weights start at 1 (0 for Gemma's 1+w); perturb them so every parameter matters.
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.add_(torch.randn_like(p) * 0.1)
    model.generation_config = GenerationConfig(
        bos_token_id=ids["<|endoftext|>"], eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]],
        pad_token_id=ids["<|endoftext|>"], do_sample=False)
    with _quiet_progress_bars():
        model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    meta = {"family": family, "seed": seed, "version": _FORMAT_VERSION,
            "transformers": transformers.__version__, "num_parameters": model.num_parameters()}
    (path / _MARKER).write_text(json.dumps(meta, indent=2) + "\n")
