"""Turn a GenerationRequest into prompt token ids plus vision inputs.

Images come as PIL images, bytes, base64 strings (or data URLs) or file paths. Token ids may be
already expanded (AReaL's VisionRLVRWorkflow) or carry one placeholder per image (ArealOpenAI,
hand-written prompts); the engine expands those itself: Qwen-VL from ``image_grid_thw``, every other family
with its own processor (which also returns the family's extra vision inputs: ``image_sizes``,
``pixel_attention_mask`` ..., carried to the prefill forward in ``PreparedPrompt.extra``).
"""

from __future__ import annotations

import base64
import binascii
import copy
import hashlib
import io
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from ..models.families import family_of
from .config import InvalidRequestError
from .mm_cache import ProcessorCache
from .request import GenerationRequest

MAX_IMAGE_PIXELS = 64 * 1024 * 1024
# A string image at least this long is never taken for a file path: it is base64.
PATH_MAX_CHARS = 4096
# Formats PIL may decode from a request. Without a list PIL tries every plugin it has, EPS included, whose
# load() runs Ghostscript on the client's PostScript: a program from the request, evaluated.
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")
# Processor outputs that are not model inputs of the prefill forward (masks and token types the engine
# derives from its own bookkeeping).
_NOT_FORWARDED = ("input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids", "num_crops")


@dataclass
class PreparedPrompt:
    prompt_ids: list[int]
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None
    image_hashes: tuple[str, ...] = ()
    # The family's other vision inputs for the prefill forward, as its processor returns them
    # (image_sizes, pixel_attention_mask, ...).
    extra: dict = field(default_factory=dict)

    @property
    def key(self) -> tuple:
        """Identical prompts (same tokens, same images) share one prefill."""
        return (tuple(self.prompt_ids), self.image_hashes)

    @property
    def num_images(self) -> int:
        return len(self.image_hashes)


def mm_token_type_ids(ids: torch.Tensor, config) -> torch.Tensor:
    """Qwen-VL's per-token modality (0 text, 1 image, 2 video), from which transformers 5 computes M-RoPE
    image positions; a forward without it silently gives image tokens text positions."""
    tt = torch.zeros_like(ids, dtype=torch.int32)
    image, video = getattr(config, "image_token_id", None), getattr(config, "video_token_id", None)
    if image is not None:
        tt[ids == image] = 1
    if video is not None:
        tt[ids == video] = 2
    return tt


def load_image(obj: Any, field: str = "images"):
    """PIL image from a PIL image, bytes, base64 / data URL string or a file path."""
    from PIL import Image

    if isinstance(obj, Image.Image):
        img = obj
    else:
        if isinstance(obj, (bytes, bytearray)):
            data = bytes(obj)
        elif isinstance(obj, str):
            s = obj.strip()
            if s.startswith("data:"):
                _, _, s = s.partition(",")
                data = _b64(s, field)
            elif len(s) < PATH_MAX_CHARS and os.path.isfile(s):
                with open(s, "rb") as f:
                    data = f.read()
            else:
                data = _b64(s, field)
        else:
            raise InvalidRequestError(field, f"{field}: unsupported image type {type(obj).__name__}")
        img = decode_image(data, field)
    if img.mode != "RGB":
        img = img.convert("RGB")
    return img


def decode_image(data: bytes, field: str = "images", max_pixels: int = MAX_IMAGE_PIXELS):
    """PIL image from encoded bytes, in one of IMAGE_FORMATS and at most ``max_pixels``; errors name the field."""
    from PIL import Image

    try:
        img = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)  # reads the header only
    except Image.DecompressionBombError:  # PIL's own ceiling (a header claiming ~10^8+ pixels)
        raise InvalidRequestError(field, f"{field}: image exceeds the limit of {max_pixels} pixels") from None
    except Exception as e:
        raise InvalidRequestError(field, f"{field}: cannot decode image ({type(e).__name__}); supported "
                                         f"formats: {', '.join(IMAGE_FORMATS)}") from None
    if img.width * img.height > max_pixels:
        raise InvalidRequestError(field, f"{field}: image of {img.width}x{img.height} pixels exceeds the limit of "
                                         f"{max_pixels} pixels")
    try:
        img.load()
    except Exception as e:
        raise InvalidRequestError(field, f"{field}: cannot decode image ({type(e).__name__}: {e})") from None
    return img if img.mode == "RGB" else img.convert("RGB")


def _b64(s: str, field: str) -> bytes:
    try:
        return base64.b64decode(s, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequestError(field, f"{field}: not a valid base64 image, data URL or file path") from None


def image_hash(img) -> str:
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{img.mode}{img.size}".encode())
    h.update(img.tobytes())
    return h.hexdigest()


def _split_messages(messages: list[dict], is_vlm: bool) -> tuple[list[dict], list[Any]]:
    """Copy messages, pulling inline images out (in order) and leaving {"type": "image"} markers."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages", "messages must be a non-empty list")
    out, images = [], []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise InvalidRequestError(f"messages[{i}]", f"messages[{i}] must be an object with a role")
        m = copy.copy(m)
        content = m.get("content")
        if isinstance(content, list):
            parts, texts = [], []
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "text":
                    parts.append({"type": "text", "text": part.get("text", "")})
                    texts.append(part.get("text", ""))
                elif kind in ("image", "image_url"):
                    if not is_vlm:
                        raise InvalidRequestError(f"messages[{i}].content[{j}]",
                                                  "this model takes no images")
                    src = part.get("image") if kind == "image" else part.get("image_url")
                    if isinstance(src, dict):
                        src = src.get("url")
                    images.append(src)  # None: the next entry of the request's ``images``
                    parts.append({"type": "image"})
                else:
                    raise InvalidRequestError(f"messages[{i}].content[{j}].type",
                                              f"unsupported content part type {kind!r}")
            m["content"] = parts if is_vlm else "".join(texts)
        out.append(m)
    return out, images


class InputPreparer:
    """Tokenize and expand requests for one policy (shared by every front end)."""

    def __init__(self, policy, cache_bytes: int = 0):
        self.policy = policy
        self.cache = ProcessorCache(cache_bytes)  # processor outputs of recent images (mm_cache.py)
        self.tokenizer = policy.tokenizer
        self.processor = policy.processor
        cfg = policy.config
        self.image_token_id = getattr(cfg, "image_token_id", None)
        self.video_token_id = getattr(cfg, "video_token_id", None)
        vis = getattr(cfg, "vision_config", None)
        self.merge_size = getattr(vis, "spatial_merge_size", 2) if vis is not None else 2
        # The engine expands image placeholders from image_grid_thw itself (Qwen-VL); else the processor does.
        self.grid = family_of(cfg).grid_images

    def _token_id(self, token) -> int | None:
        if not isinstance(token, str):
            return None
        tid = self.tokenizer.convert_tokens_to_ids(token)
        return tid if isinstance(tid, int) and tid != self.tokenizer.unk_token_id else None

    def vision_token_ids(self) -> list[int]:
        cfg = self.policy.config
        ids = [getattr(cfg, k, None) for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                                  "vision_end_token_id", "boi_token_id", "eoi_token_id")]
        if self.policy.is_vlm:
            ids.append(self._token_id("<|vision_pad|>"))
            # The processor's own image markers (Pixtral's [IMG_BREAK]/[IMG_END], Idefics3's <global-img> ...).
            for name in ("image_token", "boi_token", "eoi_token", "image_break_token", "image_end_token",
                         "fake_image_token", "global_image_tag", "image_start_token"):
                ids.append(self._token_id(getattr(self.processor, name, None)))
        return sorted({i for i in ids if isinstance(i, int)})

    def render_chat(self, messages: list[dict], tools=None, chat_template_kwargs=None,
                    add_generation_prompt: bool = True) -> tuple[str, list[Any]]:
        msgs, images = _split_messages(messages, self.policy.is_vlm)
        kwargs = dict(chat_template_kwargs or {})
        kwargs.setdefault("add_generation_prompt", add_generation_prompt)
        if tools:
            kwargs["tools"] = tools
        templ = self.processor if self.processor is not None else self.tokenizer
        try:
            text = templ.apply_chat_template(msgs, tokenize=False, **kwargs)
        except Exception as e:
            raise InvalidRequestError("messages", f"messages: chat template failed: {e}") from None
        return text, images

    def prepare(self, req: GenerationRequest) -> PreparedPrompt:
        if (req.input_ids is None) == (req.messages is None):
            raise InvalidRequestError("input_ids", "give exactly one of input_ids or messages")
        images = list(req.images or [])
        if req.messages is not None:
            text, inline = self.render_chat(req.messages, req.tools, req.chat_template_kwargs)
            extra = iter(images)
            merged = [src if src is not None else next(extra, None) for src in inline]
            rest = list(extra)
            if any(m is None for m in merged) or rest:
                raise InvalidRequestError(
                    "images", f"messages have {len(inline)} image part(s) ({sum(s is None for s in inline)} "
                    f"without data) but {len(images)} image(s) were given")
            images = merged
            if images and self.policy.is_vlm and not self.grid:
                return self._with_images_text(text, images)
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        else:
            ids = req.input_ids
            if hasattr(ids, "tolist"):
                ids = ids.tolist()
            if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool)
                                                                for t in ids):
                raise InvalidRequestError("input_ids", "input_ids must be a non-empty list of integers")
            vocab = self.policy.text_config.vocab_size
            bad = next((t for t in ids if t < 0 or t >= vocab), None)
            if bad is not None:
                raise InvalidRequestError("input_ids", f"input_ids holds token id {bad} outside [0, {vocab})")
        if images and not self.policy.is_vlm:
            raise InvalidRequestError("images", "this model takes no images")
        if not self.policy.is_vlm:
            return PreparedPrompt(list(ids))
        return self._with_images(list(ids), images)

    # ------------------------------------------------------------------ families whose processor expands images
    def _load_images(self, images: list[Any]) -> tuple[list, tuple[str, ...]]:
        """The request's images as PIL images, and their content hashes."""
        if self.processor is None:
            raise InvalidRequestError("images", "this model has no image processor")
        pil = [self._image(im, f"images[{i}]") for i, im in enumerate(images)]
        return pil, tuple(image_hash(im) for im in pil)

    def _image(self, obj: Any, field: str):
        """``load_image``, decoding an encoded image once while it is cached. Only what ``load_image`` always
        decodes is cached: bytes, data URLs and strings too long to be a path (a file may change)."""
        if isinstance(obj, (bytes, bytearray)):
            data = bytes(obj)
        elif isinstance(obj, str) and (len(obj.strip()) >= PATH_MAX_CHARS or obj.lstrip().startswith("data:")):
            data = obj.encode()
        else:
            return load_image(obj, field)
        key = ("decoded", hashlib.blake2b(data, digest_size=16).digest())
        return self.cache.get(key, lambda: {"image": load_image(obj, field)})["image"]

    def _process(self, text: str, pil: list, hashes: tuple[str, ...]) -> dict:
        def run():
            try:
                return dict(self.processor(text=[text], images=[pil], return_tensors="pt", add_special_tokens=False))
            except Exception as e:
                raise InvalidRequestError("images", f"images: the processor failed: {e}") from None

        return self.cache.get(("processor", text, hashes), run)

    def _prompt(self, ids: list[int], enc: dict, hashes: tuple[str, ...]) -> PreparedPrompt:
        extra = {k: v for k, v in enc.items() if k not in _NOT_FORWARDED and k != "pixel_values"}
        return PreparedPrompt(ids, enc["pixel_values"], None, hashes, extra)

    def _with_images_text(self, text: str, images: list[Any]) -> PreparedPrompt:
        """Chat text with one placeholder per image: the family's processor expands it, as in training."""
        pil, hashes = self._load_images(images)
        enc = self._process(text, pil, hashes)
        return self._prompt(enc["input_ids"][0].tolist(), enc, hashes)

    def _with_processor(self, ids: list[int], images: list[Any]) -> PreparedPrompt:
        """Token ids holding either one placeholder per image or the processor's full expansion."""
        pil, hashes = self._load_images(images)
        placeholder = getattr(self.processor, "image_token", None)
        placeholder_id = self._token_id(placeholder)
        if placeholder_id is None:
            raise InvalidRequestError("images", "the processor of this model names no image placeholder token")
        # Each image's expansion, as the processor writes it for a lone placeholder.
        segments = [self._process(placeholder, [im], (h,))["input_ids"][0].tolist() for im, h in zip(pil, hashes)]
        enc = self._process(placeholder * len(pil), pil, hashes)
        per_image = [seg.count(self.image_token_id) for seg in segments]
        n_image_tokens = sum(1 for t in ids if t == self.image_token_id)
        n_placeholders = sum(1 for t in ids if t == placeholder_id)
        if n_image_tokens == sum(per_image) and (placeholder_id == self.image_token_id or n_image_tokens):
            expanded = ids
        elif n_placeholders == len(pil):
            expanded, k = [], 0
            for t in ids:
                if t == placeholder_id:
                    expanded.extend(segments[k])
                    k += 1
                else:
                    expanded.append(t)
        else:
            raise InvalidRequestError(
                "input_ids", f"input_ids has {n_image_tokens} image tokens and {n_placeholders} placeholder(s); for "
                f"{len(pil)} image(s) expected {len(pil)} placeholder(s) {placeholder!r} or {sum(per_image)} "
                "expanded image tokens")
        return self._prompt(expanded, enc, hashes)

    def _with_images(self, ids: list[int], images: list[Any]) -> PreparedPrompt:
        if images and not self.grid:
            return self._with_processor(ids, images)
        n_placeholders = sum(1 for t in ids if t == self.image_token_id)
        if not images:
            placeholder_id = self._token_id(getattr(self.processor, "image_token", None))
            n_placeholders += sum(1 for t in ids if t == placeholder_id and t != self.image_token_id)
            if n_placeholders:
                raise InvalidRequestError("images", f"the prompt has {n_placeholders} image token(s) but no image")
            return PreparedPrompt(ids)
        pil, hashes = self._load_images(images)

        def run():
            try:
                return dict(self.processor.image_processor(images=pil, return_tensors="pt"))
            except Exception as e:
                raise InvalidRequestError("images", f"images: the image processor failed: {e}") from None

        enc = self.cache.get(("image_processor", hashes), run)
        grid = enc["image_grid_thw"]
        per_image = [int(g.prod()) // (self.merge_size ** 2) for g in grid]
        total = sum(per_image)
        if n_placeholders == total:
            expanded = ids
        elif n_placeholders == len(pil):
            expanded, k = [], 0
            for t in ids:
                if t == self.image_token_id:
                    expanded.extend([t] * per_image[k])
                    k += 1
                else:
                    expanded.append(t)
        else:
            expanded = self._expand_runs(ids, per_image)
            if expanded is None:
                raise InvalidRequestError(
                    "input_ids", f"input_ids has {n_placeholders} image tokens; for {len(pil)} image(s) expected "
                    f"{len(pil)} placeholder(s) or {total} expanded tokens (or, per image, one or its "
                    f"{per_image} tokens)")
        return PreparedPrompt(expanded, enc["pixel_values"], grid, hashes)

    def _expand_runs(self, ids: list[int], per_image: list[int]) -> list[int] | None:
        """Expand each image's run of image tokens that is a single placeholder; runs already expanded stay.

        Multi-turn prompts built from an earlier turn's (expanded) tokens plus a new turn's text carry
        both kinds. None when the runs do not match the images one to one.
        """
        tok = self.image_token_id
        runs: list[tuple[int, int]] = []  # (start, length)
        i = 0
        while i < len(ids):
            if ids[i] == tok:
                j = i
                while j < len(ids) and ids[j] == tok:
                    j += 1
                runs.append((i, j - i))
                i = j
            else:
                i += 1
        if len(runs) != len(per_image) or any(n not in (1, want) for (_, n), want in zip(runs, per_image)):
            return None
        out, prev = [], 0
        for (start, n), want in zip(runs, per_image):
            out.extend(ids[prev:start])
            out.extend([tok] * want)
            prev = start + n
        out.extend(ids[prev:])
        return out
