"""Full-model weight updates from disk (AReaL's ``/areal_update_weights``): copy a saved checkpoint into the
served policy in place, between engine steps. ``base_weights`` is what any full-weight update may write (the
broadcast transfer in ``weight_transfer.py`` too).

Example::

    n = load_weights_from_disk(engine, "/ckpt/step-100")   # a save_pretrained folder of the same model
"""

from __future__ import annotations

import logging

import torch

from ..engine import InvalidRequestError

logger = logging.getLogger("unsloth_rollout.serve")


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


def load_weights_from_disk(engine, path: str) -> int:
    """Copy every base weight of the checkpoint at ``path`` into ``engine.policy``; returns the tensor count.

    LoRA weights of the policy are left alone (LoRA layers' ``base_layer`` weights are updated). The
    checkpoint is read with the model's own class, so transformers' key mappings apply. As vLLM's AReaL
    endpoint does, in-flight requests are aborted (they return their partial output; AReaL resubmits) and
    the prefix cache is dropped (``engine.weights_changed()``); a pause anyone else holds stays in place.
    """
    policy = engine.policy
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
    engine.pause("abort", holder="load_weights")
    try:
        with policy.lock, torch.no_grad():
            for n, p in targets.items():
                p.copy_(source[n].to(p.device, p.dtype))
            policy.clear_rope_deltas()
        engine.weights_changed()
    finally:
        engine.resume(holder="load_weights")
    logger.info("unsloth_rollout: loaded %d weights from %s", len(targets), path)
    return len(targets)
