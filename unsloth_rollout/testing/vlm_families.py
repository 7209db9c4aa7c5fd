"""Tiny random vision-language models of the VLM families the engine serves, from transformers' own classes.

Each is a 3-layer GQA decoder (the same tiny dimensions as ``unsloth_rollout.testing.families``) behind a
2-layer vision tower at a 42-28 px image size, with the family's own processor object built directly
from its PIL ("slow") image processor, so nothing needs torchvision. All share the offline BPE
tokenizer of ``unsloth_rollout.testing.tiny`` plus the family's image tokens, and a small chat template
that renders every ``{"type": "image"}`` part as the family's placeholder, which the processor expands.

Family features switched on at sizes a short prompt reaches:

- ``gemma3``: 9 image tokens per image attending bidirectionally within the image (``token_type_ids``),
  sliding windows of 8 tokens (shorter than one image block plus its neighbours), two RoPE bases.
- ``llava``: CLIP tower, the features of layer -2 without the CLS token replace the ``<image>`` tokens.
- ``qwen3_vl``: interleaved M-RoPE (t/h/w sections 4/2/2 over head_dim 16), deepstack features from both
  vision layers added into the first decoder layers, 1-16 merged tokens per image.
- ``mistral3``: Pixtral tower at native resolution up to 56 px (``image_sizes``; ``[IMG_BREAK]`` per row),
  patch merger, sliding window of 16 tokens on every layer.
- ``idefics3``: images split into 28 px crops plus a global view (``pixel_attention_mask`` pads a prompt's
  images to the same crop count), pixel-shuffle connector, crop-position tags.

Example::

    >>> from unsloth_rollout.testing.vlm_families import vlm_family_path
    >>> path = vlm_family_path("gemma3")     # built once, then reused from the cache
"""

from __future__ import annotations

import json
import pathlib

from ..models.families import served_families
from .tiny import ARCHES

_FORMAT_VERSION = "v2"
_MARKER = "unsloth_rollout_vlm_family.json"

# Chat template: Qwen-style turns; each image part becomes the family's placeholder string (IMAGE).
_TEMPLATE = (
    "{%- for m in messages -%}{{ '<|im_start|>' + m.role + '\\n' }}"
    "{%- if m.content is string -%}{{ m.content }}{%- else -%}{%- for p in m.content -%}"
    "{%- if p.type == 'image' or p.type == 'image_url' -%}{{ 'IMAGE' }}"
    "{%- elif p.type == 'text' -%}{{ p.text }}{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{ '<|im_end|>\\n' }}{%- endfor -%}{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}")

# family -> (image placeholder in the template, {special-token attribute: token} added to the tokenizer)
_TOKENS = {
    "gemma3": ("<start_of_image>", {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                                    "image_token": "<image_soft_token>"}),
    "llava": ("<image>", {"image_token": "<image>"}),
    "qwen3_vl": ("<|vision_start|><|image_pad|><|vision_end|>", {}),
    "mistral3": ("[IMG]", {"image_token": "[IMG]", "image_break_token": "[IMG_BREAK]",
                           "image_end_token": "[IMG_END]"}),
    "idefics3": ("<image>", {"image_token": "<image>", "fake_image_token": "<fake_token_around_image>",
                             "global_image_token": "<global-img>", "end_of_utterance_token": "<end_of_utterance>"}),
}
# Plain added tokens some processors write (Idefics3's crop-position tags).
_EXTRA_TOKENS = {"idefics3": [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]}
# The registry's served VLMs, in its order, but those testing.tiny builds (Qwen2-VL, Qwen2.5-VL).
VLM_FAMILIES = tuple(f for f in served_families(vlm=True) if f not in ARCHES)
if set(VLM_FAMILIES) != set(_TOKENS):  # every served VLM has a tiny builder, and nothing else does
    raise RuntimeError(f"testing.vlm_families builds {sorted(_TOKENS)}; the registry serves {sorted(VLM_FAMILIES)}")

_TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=4096, initializer_range=0.15)


def vlm_family_path(family: str, seed: int = 0) -> pathlib.Path:
    """Path of the cached tiny VLM ``family`` model, building it first (atomically) if needed."""
    if family not in _TOKENS:
        raise ValueError(f"family must be one of {VLM_FAMILIES}, got {family!r}")
    from .tiny import _cache_root, cached_build

    path = _cache_root() / "vlm_families" / f"{family}-s{seed}-{_FORMAT_VERSION}"
    return cached_build(path, _MARKER, lambda tmp: _write(tmp, family, seed))


def _tokenizer(family: str):
    from transformers import AddedToken

    from .tiny import _build_tokenizer

    tok = _build_tokenizer(746)
    placeholder, named = _TOKENS[family]
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in dict.fromkeys(named.values())],
                   special_tokens=True)
    tok._set_model_specific_special_tokens(named)  # tokenizer.image_token / boi_token ..., saved with it
    if family in _EXTRA_TOKENS:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in _EXTRA_TOKENS[family]])
    tok.chat_template = _TEMPLATE.replace("IMAGE", placeholder)
    return tok


def _gemma3(tok, common):
    from transformers import Gemma3Config, Gemma3TextConfig, SiglipVisionConfig
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
    from transformers.models.gemma3.processing_gemma3 import Gemma3Processor

    text = Gemma3TextConfig(
        **_TEXT, **common, head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                image_size=42, patch_size=7)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=9,
                          boi_token_index=tok.boi_token_id, eoi_token_index=tok.convert_tokens_to_ids(tok.eoi_token),
                          image_token_index=tok.image_token_id, initializer_range=0.15, tie_word_embeddings=False)
    image_processor = Gemma3ImageProcessorPil(size={"height": 42, "width": 42})
    processor = Gemma3Processor(image_processor=image_processor, tokenizer=tok, chat_template=tok.chat_template,
                                image_seq_length=9)
    return config, processor


def _llava(tok, common):
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig
    from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil
    from transformers.models.llava.processing_llava import LlavaProcessor

    text = LlamaConfig(**_TEXT, **common)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                              image_size=28, patch_size=7, projection_dim=32)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_id=tok.image_token_id,
                         vision_feature_layer=-2, vision_feature_select_strategy="default",
                         projector_hidden_act="gelu", tie_word_embeddings=False)
    image_processor = LlavaImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tok, chat_template=tok.chat_template,
                               patch_size=7, vision_feature_select_strategy="default", num_additional_image_tokens=1)
    return config, processor


def _qwen3_vl(tok, common):
    from transformers import Qwen3VLConfig, Qwen3VLTextConfig, Qwen3VLVisionConfig

    from ..models.processor import Qwen3VLImageOnlyProcessor, QwenVLPilImageProcessor

    # Interleaved M-RoPE over head_dim 16 (sections t/h/w = 4/2/2); deepstack features from both vision layers.
    text = Qwen3VLTextConfig(**_TEXT, **common, head_dim=16,
                             rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": [4, 2, 2],
                                              "mrope_interleaved": True})
    vision = Qwen3VLVisionConfig(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                                 patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                                 num_position_embeddings=64, deepstack_visual_indexes=[0, 1])
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>",
                                                       "<|vision_end|>")}
    config = Qwen3VLConfig(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                           video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                           vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False)
    # 32-128 px per side: 1-16 merged tokens per image.
    image_processor = QwenVLPilImageProcessor(size={"shortest_edge": 32 * 32, "longest_edge": 96 * 96},
                                              patch_size=16, temporal_patch_size=2, merge_size=2,
                                              image_mean=[0.5] * 3, image_std=[0.5] * 3)
    processor = Qwen3VLImageOnlyProcessor(image_processor=image_processor, tokenizer=tok,
                                          chat_template=tok.chat_template)
    return config, processor


def _mistral3(tok, common):
    from transformers import Mistral3Config, MistralConfig, PixtralVisionConfig
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    from ..models.processor import ensure_pixtral_importable

    ensure_pixtral_importable()
    from transformers.models.pixtral.processing_pixtral import PixtralProcessor

    # A window of 16 on every layer: longer prompts run past it, and the images stay within the 3 layers' reach.
    text = MistralConfig(**_TEXT, **common, sliding_window=16)
    vision = PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                 head_dim=16, image_size=56, patch_size=7)
    config = Mistral3Config(vision_config=vision, text_config=text, image_token_index=tok.image_token_id,
                            spatial_merge_size=2, vision_feature_layer=-1, tie_word_embeddings=False)
    # Native resolution up to 56 px: images of different sizes give different token grids (image_sizes).
    image_processor = PixtralImageProcessorPil(size={"longest_edge": 56}, patch_size={"height": 14, "width": 14})
    processor = PixtralProcessor(image_processor=image_processor, tokenizer=tok, patch_size=7, spatial_merge_size=2,
                                 chat_template=tok.chat_template)
    return config, processor


def _idefics3(tok, common):
    from transformers import Idefics3Config, Idefics3VisionConfig, LlamaConfig
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil
    from transformers.models.idefics3.processing_idefics3 import Idefics3Processor

    text = LlamaConfig(**_TEXT, **common)
    vision = Idefics3VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                  image_size=28, patch_size=7)
    config = Idefics3Config(vision_config=vision, text_config=text, image_token_id=tok.image_token_id, scale_factor=2,
                            tie_word_embeddings=False, pad_token_id=common["pad_token_id"])
    # Images resized to at most 56 px and split into 28 px crops plus a global view: 1-5 crops of 4 tokens each,
    # padded across a prompt's images with pixel_attention_mask.
    image_processor = Idefics3ImageProcessorPil(do_image_splitting=True, size={"longest_edge": 56},
                                                max_image_size={"longest_edge": 28})
    processor = Idefics3Processor(image_processor=image_processor, tokenizer=tok, image_seq_len=4,
                                  chat_template=tok.chat_template)
    return config, processor


_BUILDERS = {"gemma3": _gemma3, "llava": _llava, "qwen3_vl": _qwen3_vl, "mistral3": _mistral3,
             "idefics3": _idefics3}


def _write(path: pathlib.Path, family: str, seed: int) -> None:
    import torch
    import transformers
    from transformers import AutoModelForImageTextToText, GenerationConfig

    from .tiny import _quiet_progress_bars, _round_up

    tok = _tokenizer(family)
    eos, pad = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    common = dict(vocab_size=_round_up(len(tok), 64), bos_token_id=pad, eos_token_id=eos, pad_token_id=pad,
                  tie_word_embeddings=False)
    config, processor = _BUILDERS[family](tok, common)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if not p.any():  # zero-initialised (Gemma 3's image projection): images would not matter
                    p.normal_(0.0, 0.15)
                if "norm" in name:  # norms start at 1 (0 for Gemma's 1+w): perturb them so every parameter matters
                    p.add_(torch.randn_like(p) * 0.1)
    model.generation_config = GenerationConfig(bos_token_id=pad, eos_token_id=[eos, pad], pad_token_id=pad,
                                               do_sample=False)
    with _quiet_progress_bars():
        model.save_pretrained(path)
    processor.save_pretrained(path)
    meta = {"family": family, "seed": seed, "version": _FORMAT_VERSION, "transformers": transformers.__version__,
            "num_parameters": model.num_parameters()}
    (path / _MARKER).write_text(json.dumps(meta, indent=2) + "\n")
