"""A prompt's forward inputs beyond its token ids: positions, vision tensors, image blocks, packing rules.

The runner (runner.py) asks ``PromptVision`` for what a forward needs besides the tokens and the cache:
position ids (1-D, or M-RoPE [3, B, L] for Qwen-VL: text position + the row's rope delta in all three
sections while decoding), the prompt's vision inputs on the device, the image-block ids of families whose
image tokens attend bidirectionally (the prefill mask's business, attention.py), and whether a prompt's
vision inputs may share a packed prefill. Each family's facts come from the registry (models/families.py).
"""

from __future__ import annotations

import inspect

import torch

from ..models.families import UnsupportedModelError, family_of
from .inputs import mm_token_type_ids


def image_block_ids(input_ids: torch.Tensor, image_token_id: int) -> torch.Tensor | None:
    """[B, L] id of the image each token belongs to (-1: text): one id per run of consecutive image tokens,
    as Gemma 3's ``get_block_sequence_ids_for_mask`` numbers them. None when there is no image token."""
    is_image = input_ids == image_token_id
    if not bool(is_image.any()):
        return None
    prev = torch.nn.functional.pad(is_image, (1, 0), value=False)[:, :-1]
    ids = torch.cumsum((is_image & ~prev).int(), dim=1) - 1
    return torch.where(is_image, ids, torch.full_like(ids, -1))


def concat_vision_inputs(mms: list[dict], dims: dict | None) -> dict:
    """One forward's vision inputs from several prompts' (in prompt order). Qwen-VL: flat patches and grid
    rows; one-image-per-row pixels: along rows (equal shapes, else it raises and the prompts run alone);
    ``dims`` (``FamilySpec.pack_dims``): each key along its image dimension, the trailing (spatial) dimensions
    zero-padded to the largest, as the family's processor pads the images of one batch."""
    keys = set(mms[0])
    if any(set(m) != keys for m in mms):
        raise ValueError("prefill_packed: prompts with different vision inputs")
    out = {}
    for k in keys:
        ts = [m[k] for m in mms]
        d = (dims or {}).get(k, 0)
        if dims is not None and k not in dims:
            raise ValueError(f"prefill_packed: no image dimension known for {k!r}")
        if dims is not None and ts[0].dim() > d + 1:  # pad the dimensions after the image one to a common size
            size = [max(t.shape[j] for t in ts) for j in range(d + 1, ts[0].dim())]
            padded = []
            for t in ts:
                pad = []
                for j in reversed(range(d + 1, t.dim())):
                    pad += [0, size[j - d - 1] - t.shape[j]]
                padded.append(torch.nn.functional.pad(t, pad) if any(pad) else t)
            ts = padded
        out[k] = torch.cat(ts, dim=d)
    return out


def _find_rope_index(base_model):
    for obj in (getattr(base_model, "model", None), base_model):
        fn = getattr(obj, "get_rope_index", None)
        if fn is not None:
            return fn
    return None


class PromptVision:
    """Positions and vision inputs of one policy's prompts (see the module docstring)."""

    def __init__(self, policy, device: torch.device):
        self.policy = policy
        self.device = device
        cfg = policy.config
        self.family = family_of(cfg)
        self.image_token_id = getattr(cfg, "image_token_id", None)
        # M-RoPE (Qwen-VL): the model computes 3-D positions with get_rope_index; other VLMs use 1-D positions.
        self._rope_index = _find_rope_index(policy.base_model) if policy.is_vlm else None
        self.mrope = self._rope_index is not None
        if self.family.listed and self.family.mrope != self.mrope:  # the registry and the model disagree
            raise UnsupportedModelError(
                f"model_type {self.family.model_type!r}: the family registry says M-RoPE={self.family.mrope} but "
                f"the model {'has no' if self.family.mrope else 'has a'} get_rope_index; its positions would be "
                "wrong")
        # Image tokens that attend bidirectionally within their image in prefill (Gemma 3's token_type_ids).
        self.bidirectional = self.family.bidirectional_images

    def mrope_positions(self, ids: list[int], grid: torch.Tensor | None) -> tuple[torch.Tensor, int]:
        """[3, 1, L] M-RoPE positions of a prompt and its rope delta."""
        t = torch.tensor([ids], device=self.device)
        if grid is None:
            pos = torch.arange(len(ids), device=self.device).view(1, 1, -1).expand(3, 1, -1)
            return pos, 0
        kwargs = {"image_grid_thw": grid.to(self.device), "attention_mask": torch.ones_like(t)}
        params = inspect.signature(self._rope_index).parameters
        if "mm_token_type_ids" in params:
            kwargs["mm_token_type_ids"] = mm_token_type_ids(t, self.policy.config)
        pos, delta = self._rope_index(t, **kwargs)
        return pos, int(delta.view(-1)[0])

    def prompt_inputs(self, ids: list[int], prompt):
        """(position_ids [1, L] or M-RoPE [3, 1, L], rope_delta, vision inputs) of one prompt."""
        pixel_values = getattr(prompt, "pixel_values", None)
        image_grid_thw = getattr(prompt, "image_grid_thw", None)
        extra = getattr(prompt, "extra", None)
        delta = 0
        mm = {}
        if self.mrope:
            position_ids, delta = self.mrope_positions(ids, image_grid_thw)
        else:
            position_ids = torch.arange(len(ids), device=self.device).unsqueeze(0)
        if pixel_values is not None:
            mm = {"pixel_values": pixel_values.to(self.device, self.policy.dtype)}
            if image_grid_thw is not None:
                mm["image_grid_thw"] = image_grid_thw.to(self.device)
            for k, v in (extra or {}).items():
                if isinstance(v, torch.Tensor):
                    v = v.to(self.device, self.policy.dtype) if v.is_floating_point() else v.to(self.device)
                mm[k] = v
        return position_ids, delta, mm

    def decode_positions(self, lens_t: torch.Tensor, deltas: list[int]) -> torch.Tensor:
        """Positions [B, 1] (M-RoPE: [3, B, 1]) of a decode step's new tokens; ``lens_t``: tokens cached per row."""
        b = lens_t.shape[0]
        pos = lens_t.view(b, 1)
        if self.mrope:
            pos = (pos + torch.tensor(deltas, device=self.device).view(b, 1)).unsqueeze(0).expand(3, b, 1)
        return pos

    def image_blocks(self, input_ids: torch.Tensor) -> torch.Tensor | None:
        """Image-block ids for the prefill mask of families whose image tokens attend bidirectionally."""
        if self.bidirectional and self.image_token_id is not None:
            return image_block_ids(input_ids, self.image_token_id)
        return None

    def can_pack(self, prompt) -> bool:
        """Whether a prompt may share a packed prefill forward: text, or images of a family whose vision inputs
        concatenate across prompts in prompt order: Qwen-VL (flat patches + one grid row per image), one
        ``[C, H, W]`` image per row and nothing else (Gemma 3, Llava), or a family with ``pack_dims`` whose
        processor outputs all have a known image dimension (Mistral 3, Idefics3). Other prompts prefill alone."""
        pixels = getattr(prompt, "pixel_values", None)
        if pixels is None:
            return True
        extra = getattr(prompt, "extra", None) or {}
        rule = self.family.pack_dims
        if rule is not None:
            return set(extra) | {"pixel_values"} <= set(rule)
        if extra:
            return False
        return getattr(prompt, "image_grid_thw", None) is not None or pixels.dim() == 4

    def pack(self, vision: list[dict]) -> dict:
        """One packed forward's vision inputs from its prompts' (``prompt_inputs``' third value, in order)."""
        if not vision:
            return {}
        dims = self.family.pack_dims
        return concat_vision_inputs(vision, None if dims is None else dict(dims))
