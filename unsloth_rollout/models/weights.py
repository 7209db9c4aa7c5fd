"""Every in-place change of the policy's one weight copy, in one module; the caller then calls
``engine.weights_changed()`` (``grep -rn "weights_changed(" unsloth_rollout`` lists every site).

- ``load_adapter`` / ``unload_adapter``: LoRA adapters served by name (the PEFT work is models/adapters.py);
- ``read_base_weights`` + ``load_base_weights``: a saved model's base weights (AReaL's ``/areal_update_weights``,
  the server's ``load_weights_from_disk``), checked before anything is copied;
- ``load_checkpoint``: a trainer's checkpoint (``ColocatedTrainEngine.load``).

An optimizer step changes the same tensors in place too; its caller says so with ``engine.set_version(v)``.
Every tensor is copied into the live parameter, so the engine and the optimizer keep holding the same tensors.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..errors import InvalidRequestError
from . import adapters


# ============================================================================ adapters served by name
def load_adapter(policy, name: str, path: str, max_rank: int, max_loras: int | None = None,
                 replace: bool = False) -> bool:
    """Serve the PEFT adapter folder ``path`` to requests that name ``name``; refused with InvalidRequestError
    (``lora_name`` / ``lora_path``) before anything changes: a bad name, a name loaded already (unless
    ``replace``), more than ``max_loras`` adapters, or what ``adapters.read_adapter`` refuses. ``replace``: swap a
    loaded adapter's weights (a refused replacement leaves the old one serving; one that fails after the old
    weights went leaves neither, and ``name`` is no longer in ``policy.adapter_paths``). Returns True when
    ``policy.model`` became another object (a PEFT wrapper came or went: every KV is stale), False when only
    ``name``'s weights changed. Call holding the engine's step lock."""
    if not isinstance(name, str) or not name or name == adapters.BASE:
        raise InvalidRequestError("lora_name", f"invalid adapter name {name!r}")
    loaded = policy.adapter_paths
    replacing = name in loaded
    if replacing and not replace:
        raise InvalidRequestError("lora_name", f"The lora adapter '{name}' has already been loaded.")
    if not replacing and max_loras is not None and len(loaded) >= max_loras:
        raise InvalidRequestError("lora_name", f"{len(loaded)} adapters are loaded, max_loras is "
                                               f"{max_loras}: unload one first")
    if replacing:  # refuse a bad replacement before the old adapter goes
        adapters.read_adapter(policy, path, max_rank)
    with policy.lock:
        before = policy.model
        if replacing:
            adapters.unload_adapter(policy, name)
        try:
            adapters.load_adapter(policy, name, path, max_rank)
        except Exception:
            loaded.pop(name, None)  # the old weights are gone too
            raise
        loaded[name] = path
        return policy.model is not before


def unload_adapter(policy, name: str) -> bool:
    """Stop serving adapter ``name`` (InvalidRequestError when it is not loaded). Returns True when
    ``policy.model`` became another object (the last served adapter of a policy wrapped only for them)."""
    if name not in policy.adapter_paths:
        raise InvalidRequestError("lora_name", f"adapter {name!r} is not loaded")
    with policy.lock:
        before = policy.model
        adapters.unload_adapter(policy, name)
        del policy.adapter_paths[name]
        return policy.model is not before


# ============================================================================ base weights and checkpoints
def base_weights(policy, field: str, refuse_own_adapter: bool = False) -> dict[str, torch.nn.Parameter]:
    """The policy's base weights under their checkpoint names (a LoRA layer's ``base_layer`` weight under the plain
    layer's name; tied weights under each name), LoRA weights left out: what a full-weight update may write.

    Refused (``InvalidRequestError`` naming ``field``): 4-bit weights (no exact in-place copy), and with
    ``refuse_own_adapter`` a policy that runs an adapter of its own (merged weights written under it would not be
    the weights the sender has)."""
    base = policy.base_model
    if any(getattr(p, "quant_state", None) is not None for p in base.parameters()):
        raise InvalidRequestError(field, "full-weight updates are not supported for 4-bit models")
    if refuse_own_adapter and hasattr(policy.model, "peft_config") and not getattr(policy, "serving_wrapper", False):
        raise InvalidRequestError(field, "the served policy runs a LoRA adapter of its own: full-weight updates "
                                         "would be applied under it; sync the adapter with /v1/load_lora_adapter")
    return {n.replace(".base_layer.", "."): p for n, p in base.named_parameters(remove_duplicate=False)
            if ".lora_" not in n and "modules_to_save" not in n}


@dataclass
class BaseWeights:
    """A checkpoint read and checked against the served model (``read_base_weights``), before anything is copied."""

    path: str  # where it was read from
    targets: dict  # checkpoint name -> the live parameter (``base_weights``): every base weight, LoRA left out
    source: dict  # the checkpoint's state dict, by the same names


def read_base_weights(policy, path: str) -> BaseWeights:
    """The base weights of the save_pretrained folder at ``path``, read with the model's own class (transformers'
    key mappings apply); refused (``model_path``) for a 4-bit model, an unreadable folder, a missing weight or a
    shape that differs."""
    targets = base_weights(policy, "model_path")
    try:
        fresh = type(policy.base_model).from_pretrained(path, dtype=policy.dtype)
    except Exception as e:
        raise InvalidRequestError("model_path", f"cannot load a checkpoint from {path!r}: {e}") from None
    source = fresh.state_dict()
    missing = [n for n in targets if n not in source]
    if missing:
        raise InvalidRequestError("model_path", f"the checkpoint at {path!r} lacks {len(missing)} weight(s), "
                                                f"e.g. {missing[0]!r}")
    for n, p in targets.items():
        t = source[n]
        if t.shape != p.shape:
            raise InvalidRequestError("model_path", f"{n}: checkpoint shape {tuple(t.shape)} != {tuple(p.shape)}")
    return BaseWeights(path, targets, source)


def load_base_weights(policy, weights: BaseWeights) -> int:
    """Copy checked ``weights`` into the live parameters (LoRA weights untouched); returns the tensor count."""
    with policy.lock, torch.no_grad():
        for n, p in weights.targets.items():
            p.copy_(weights.source[n].to(p.device, p.dtype))
        policy.clear_rope_deltas()
    return len(weights.targets)


def write_base_tensors(policy, targets: dict[str, torch.nn.Parameter], pairs) -> int:
    """Copy received ``(name, tensor)`` pairs into the live parameters ``targets`` (from ``base_weights``, checked
    by the caller for name, dtype and shape); returns how many were written. The weight-transfer receiver's write."""
    with policy.lock, torch.no_grad():
        for name, t in pairs:
            targets[name].copy_(t)
        policy.clear_rope_deltas()
    return len(pairs)


def load_checkpoint(policy, path: str) -> None:
    """Copy a checkpoint ``ColocatedTrainEngine.save`` wrote into the live parameters: the PEFT adapter
    (``adapter_model.safetensors``) of a PEFT model, else every ``*.safetensors`` tensor the model has."""
    from safetensors.torch import load_file

    model = policy.model
    if hasattr(model, "peft_config"):
        from peft.utils import set_peft_model_state_dict

        file = os.path.join(path, "adapter_model.safetensors")
        if not os.path.isfile(file):
            raise FileNotFoundError(f"path: no adapter_model.safetensors in {path!r}")
        with policy.lock, torch.no_grad():
            set_peft_model_state_dict(model, load_file(file, device=str(policy.device)))
        return
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"path: no *.safetensors in {path!r}")
    params = dict(model.state_dict())
    with policy.lock, torch.no_grad():
        for f in files:
            for k, v in load_file(os.path.join(path, f)).items():
                if k in params:
                    params[k].copy_(v)
