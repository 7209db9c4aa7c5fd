"""Full-model weight updates from disk (AReaL's ``/areal_update_weights``): copy a saved checkpoint into the
served policy in place, between engine steps.

Example::

    n = load_weights_from_disk(engine, "/ckpt/step-100")   # a save_pretrained folder of the same model
"""

from __future__ import annotations

import logging

import torch

from ..engine import InvalidRequestError

logger = logging.getLogger("unsloth_rollout.serve")


def load_weights_from_disk(engine, path: str) -> int:
    """Copy every base weight of the checkpoint at ``path`` into ``engine.policy``; returns the tensor count.

    LoRA weights of the policy are left alone (LoRA layers' ``base_layer`` weights are updated). The
    checkpoint is read with the model's own class, so transformers' key mappings apply. As vLLM's AReaL
    endpoint does, in-flight requests are aborted (they return their partial output; AReaL resubmits) and
    the prefix cache is dropped (``engine.weights_changed()``); a pause anyone else holds stays in place.
    """
    policy = engine.policy
    base = policy.base_model
    if any(getattr(p, "quant_state", None) is not None for p in base.parameters()):
        raise InvalidRequestError("model_path", "weight updates from disk are not supported for 4-bit models")
    try:
        fresh = type(base).from_pretrained(path, dtype=policy.dtype)
    except Exception as e:
        raise InvalidRequestError("model_path", f"cannot load a checkpoint from {path!r}: {e}") from None
    source = fresh.state_dict()
    targets = [(n, p) for n, p in base.named_parameters() if ".lora_" not in n and "modules_to_save" not in n]
    missing = [n.replace(".base_layer.", ".") for n, _ in targets if n.replace(".base_layer.", ".") not in source]
    if missing:
        raise InvalidRequestError("model_path", f"the checkpoint at {path!r} lacks {len(missing)} weight(s), "
                                                f"e.g. {missing[0]!r}")
    for n, p in targets:
        t = source[n.replace(".base_layer.", ".")]
        if t.shape != p.shape:
            raise InvalidRequestError("model_path", f"{n}: checkpoint shape {tuple(t.shape)} != {tuple(p.shape)}")
    engine.pause("abort", holder="load_weights")
    try:
        with policy.lock, torch.no_grad():
            for n, p in targets:
                p.copy_(source[n.replace(".base_layer.", ".")].to(p.device, p.dtype))
            policy.clear_rope_deltas()
        engine.weights_changed()
    finally:
        engine.resume(holder="load_weights")
    logger.info("unsloth_rollout: loaded %d weights from %s", len(targets), path)
    return len(targets)
