"""Processor loading for Qwen2-VL / Qwen2.5-VL that works with or without torchvision.

transformers' ``Qwen2VLProcessor`` and ``Qwen2_5_VLProcessor`` insist on a video processor, and
the video processor needs torchvision, which the CPU install leaves out (a torchvision wheel beside
a CPU-only torch cannot import). Where torchvision imports, ``load_processor`` returns the stock
processor from ``AutoProcessor`` (its image processor then resizes with torchvision, so pixel values
differ slightly from the PIL path: train on ``policy.processor``). Otherwise the image-only subclasses
below drop the video part and use the PIL image processor; they load standard processor folders and
save folders that standard loaders still recognise.

Example::

    >>> from unsloth_rollout.models.processor import load_processor
    >>> proc = load_processor("path/to/qwen2_5_vl")          # None for a text-only model
    >>> text = proc.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    >>> batch = proc(text=[text], images=[image], return_tensors="pt")
"""

from __future__ import annotations

import json
import os
from typing import Any

from transformers import AutoConfig, AutoProcessor, AutoTokenizer
from transformers.models.qwen2_5_vl.processing_qwen2_5_vl import Qwen2_5_VLProcessor
from transformers.models.qwen2_vl.processing_qwen2_vl import Qwen2VLProcessor
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
from transformers.processing_utils import ProcessorMixin

from ..logs import get_logger
from .families import family_of

try:  # transformers >= 5.17 splits the PIL and torchvision image processors
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil as QwenVLPilImageProcessor,
    )
except ImportError:  # older releases: the plain class is the PIL one
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import (
        Qwen2VLImageProcessor as QwenVLPilImageProcessor,
    )

logger = get_logger("unsloth_rollout")

__all__ = [
    "QwenVLPilImageProcessor",
    "Qwen2VLImageOnlyProcessor",
    "Qwen2_5_VLImageOnlyProcessor",
    "Qwen3VLImageOnlyProcessor",
    "load_processor",
]

# Files whose "processor_class" names the processor that saved the folder.
_PROCESSOR_CLASS_FILES = ("processor_config.json", "preprocessor_config.json", "tokenizer_config.json")


class _ImageOnlyMixin:
    """Shared body of the image-only processors; mixed in before the transformers class."""

    # The transformers class this one stands in for; written to saved folders.
    _standard_class: type[ProcessorMixin]
    # transformers 4.x reads the sub-processors from this list (5.x reads the __init__ signature).
    attributes = ["image_processor", "tokenizer"]

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        # Same token bookkeeping as the parent __init__, which we skip because it wants a video processor.
        self.image_token = getattr(tokenizer, "image_token", None) or "<|image_pad|>"
        self.video_token = getattr(tokenizer, "video_token", None) or "<|video_pad|>"
        self.image_token_id = getattr(tokenizer, "image_token_id", None) or tokenizer.convert_tokens_to_ids(
            self.image_token
        )
        self.video_token_id = getattr(tokenizer, "video_token_id", None) or tokenizer.convert_tokens_to_ids(
            self.video_token
        )
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    def __call__(self, images=None, text=None, videos=None, **kwargs):
        # Without this check videos would be dropped silently (there is no video processor to run).
        if videos is not None:
            raise ValueError(f"{type(self).__name__} handles images only; `videos` needs torchvision")
        return super().__call__(images=images, text=text, **kwargs)

    @classmethod
    def _get_arguments_from_pretrained(cls, pretrained_model_name_or_path, processor_dict=None, **kwargs):
        # Load the PIL image processor explicitly: AutoImageProcessor may pick a torchvision class.
        image_processor = QwenVLPilImageProcessor.from_pretrained(pretrained_model_name_or_path, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(pretrained_model_name_or_path, **kwargs)
        return [image_processor, tokenizer]

    def save_pretrained(self, save_directory, *args, **kwargs):
        files = super().save_pretrained(save_directory, *args, **kwargs)
        # Name the standard class, as real Qwen folders do: for a class name it does not know,
        # AutoProcessor silently returns a bare tokenizer instead of failing.
        for name in _PROCESSOR_CLASS_FILES:
            _rename_processor_class(os.path.join(save_directory, name), self._standard_class.__name__)
        return files


class Qwen2VLImageOnlyProcessor(_ImageOnlyMixin, Qwen2VLProcessor):
    """``Qwen2VLProcessor`` without the video processor (no torchvision needed).

    Example::

        >>> proc = Qwen2VLImageOnlyProcessor.from_pretrained("path/to/qwen2_vl")
        >>> proc(text=["<|vision_start|><|image_pad|><|vision_end|>hi"], images=[img], return_tensors="pt")
    """

    _standard_class = Qwen2VLProcessor


class Qwen2_5_VLImageOnlyProcessor(_ImageOnlyMixin, Qwen2_5_VLProcessor):
    """``Qwen2_5_VLProcessor`` without the video processor (no torchvision needed)."""

    _standard_class = Qwen2_5_VLProcessor


class Qwen3VLImageOnlyProcessor(_ImageOnlyMixin, Qwen3VLProcessor):
    """``Qwen3VLProcessor`` without the video processor (no torchvision needed)."""

    _standard_class = Qwen3VLProcessor

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, chat_template=chat_template, **kwargs)
        self.vision_start_token = getattr(tokenizer, "vision_start_token", None) or "<|vision_start|>"
        self.vision_end_token = getattr(tokenizer, "vision_end_token", None) or "<|vision_end|>"
        self.vision_start_token_id = tokenizer.convert_tokens_to_ids(self.vision_start_token)
        self.vision_end_token_id = tokenizer.convert_tokens_to_ids(self.vision_end_token)


_IMAGE_ONLY_PROCESSORS: dict[str, type[ProcessorMixin]] = {
    "qwen2_vl": Qwen2VLImageOnlyProcessor,
    "qwen2_5_vl": Qwen2_5_VLImageOnlyProcessor,
    "qwen3_vl": Qwen3VLImageOnlyProcessor,
}


def ensure_pixtral_importable() -> None:
    """Make ``PixtralProcessor`` (Pixtral, Mistral 3) importable without torchvision.

    transformers 5.x's ``processing_pixtral`` imports one helper, ``get_resize_output_image_size``, from the
    torchvision image-processor module whenever PIL is present; without torchvision that import fails and
    the processor cannot be built at all, although it needs nothing from torchvision. The PIL module has the
    same function; this registers a module holding just that function under the torchvision module's
    name. A no-op where the real module imports."""
    import importlib
    import sys
    import types

    name = "transformers.models.pixtral.image_processing_pixtral"
    if name in sys.modules:
        return
    try:
        importlib.import_module(name)
        return
    except ModuleNotFoundError as e:
        if e.name is None or not e.name.startswith("torchvision"):
            raise
    from transformers.models.pixtral import image_processing_pil_pixtral as pil

    stand_in = types.ModuleType(name)
    stand_in.get_resize_output_image_size = pil.get_resize_output_image_size
    stand_in.__doc__ = "unsloth_rollout stand-in (torchvision is not installed): the PIL module's resize helper"
    sys.modules[name] = stand_in


def load_processor(path: str | os.PathLike, config: Any = None) -> ProcessorMixin | None:
    """Load the multimodal processor of a model folder, or return None for a text-only model.

    Tries ``AutoProcessor`` first. When it raises (typically the torchvision-backed video processor)
    or returns only a tokenizer, falls back to the image-only processor for ``config.model_type``
    and logs one line saying why.

    Example::

        >>> proc = load_processor("path/to/qwen2_5_vl")
        >>> proc.image_processor.merge_size
        2
    """
    path = os.fspath(path)
    if config is None:
        config = AutoConfig.from_pretrained(path)
    family = family_of(config)
    if not family.vlm and not _has_preprocessor_config(path):
        return None
    if family.pixtral_processor:
        ensure_pixtral_importable()

    try:
        processor = AutoProcessor.from_pretrained(path)
    except Exception as exc:  # noqa: BLE001 - any failure here (ImportError, ValueError, OSError...) means "fall back"
        reason, cause = f"AutoProcessor failed with {type(exc).__name__}: {_first_sentence(exc)}", exc
    else:
        if getattr(processor, "image_processor", None) is not None:
            return processor
        reason, cause = f"AutoProcessor returned a {type(processor).__name__} without an image processor", None

    model_type = family.model_type
    if family.processor_fallback == "pixtral":
        # AutoProcessor's lazy PixtralProcessor is a placeholder demanding torchvision; the class itself,
        # imported from its module (ensure_pixtral_importable), runs on the PIL image processor.
        from transformers.models.pixtral.processing_pixtral import PixtralProcessor

        logger.warning("load_processor(%s): %s; using PixtralProcessor with the PIL image processor", path, reason)
        return PixtralProcessor.from_pretrained(path)
    fallback = _IMAGE_ONLY_PROCESSORS[model_type] if family.processor_fallback == "image_only" else None
    if fallback is None:
        processor = _with_pil_image_processor(path, model_type)
        if processor is not None:
            logger.warning("load_processor(%s): %s; using %s with the PIL image processor", path, reason,
                           type(processor).__name__)
            return processor
        raise ValueError(f"cannot load a processor for model_type={model_type!r} from {path}: {reason}") from cause
    logger.warning("load_processor(%s): %s; using %s", path, reason, fallback.__name__)
    return fallback.from_pretrained(path)


def _with_pil_image_processor(path: str, model_type: str | None) -> ProcessorMixin | None:
    """The family's own processor class around its PIL image processor, built from the folder's files.

    Some PIL image processors (Idefics3's in transformers 5.17) are registered as needing torchvision, so
    AutoProcessor refuses them although their module imports and runs without it."""
    import importlib
    import inspect

    if not model_type or not os.path.isfile(os.path.join(path, "processor_config.json")):
        return None
    try:
        proc_mod = importlib.import_module(f"transformers.models.{model_type}.processing_{model_type}")
        pil_mod = importlib.import_module(f"transformers.models.{model_type}.image_processing_pil_{model_type}")
    except ImportError:
        return None
    with open(os.path.join(path, "processor_config.json"), encoding="utf-8") as f:
        data = json.load(f)
    proc_cls = getattr(proc_mod, data.get("processor_class", ""), None)
    pil_cls = next((c for n, c in vars(pil_mod).items() if n.endswith("ImageProcessorPil") and inspect.isclass(c)),
                   None)
    if proc_cls is None or pil_cls is None:
        return None
    kwargs = {k: v for k, v in data.items() if k != "processor_class" and not isinstance(v, dict)}
    template = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(template):
        with open(template, encoding="utf-8") as f:
            kwargs["chat_template"] = f.read()
    return proc_cls(image_processor=pil_cls.from_pretrained(path), tokenizer=AutoTokenizer.from_pretrained(path),
                    **kwargs)


def _has_preprocessor_config(path: str) -> bool:
    # Only local folders are inspected; a hub id without a local folder counts as "no preprocessor".
    names = ("preprocessor_config.json", "processor_config.json")
    return any(os.path.isfile(os.path.join(path, name)) for name in names)


def _first_sentence(exc: BaseException) -> str:
    # transformers' import errors run to several lines of install advice; the first sentence says it all.
    text = str(exc).strip()
    if not text:
        return "(no message)"
    line = text.splitlines()[0]
    return line.split(". ", 1)[0].rstrip(".") + "."


def _rename_processor_class(file: str, class_name: str) -> None:
    if not os.path.isfile(file):
        return
    with open(file, encoding="utf-8") as f:
        data = json.load(f)
    if "processor_class" not in data:
        return
    data["processor_class"] = class_name
    with open(file, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")
