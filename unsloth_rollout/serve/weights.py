"""Full-model weight updates from disk (AReaL's ``/areal_update_weights``): copy a saved checkpoint into the
served policy in place, between engine steps. ``base_weights`` (models/weights.py) is what any full-weight update
may write (the broadcast transfer in ``weight_transfer.py`` too).

Example::

    n = load_weights_from_disk(engine, "/ckpt/step-100")   # a save_pretrained folder of the same model
"""

from __future__ import annotations


from ..logs import get_logger
from ..models import weights as policy_weights
from ..models.weights import base_weights  # noqa: F401  (re-exported: weight_transfer.py imports it from here)

logger = get_logger("unsloth_rollout.serve")


def load_weights_from_disk(engine, path: str, mode: str = "abort") -> int:
    """Copy every base weight of the checkpoint at ``path`` into ``engine.policy``; returns the tensor count.

    LoRA weights of the policy are left alone (LoRA layers' ``base_layer`` weights are updated). The
    checkpoint is read and checked by ``models/weights.py`` (the model's own class: transformers' key mappings
    apply), then copied in place there. With ``mode="abort"`` (as vLLM's AReaL endpoint does), in-flight
    requests are aborted (they return their partial output; AReaL resubmits); with ``mode="keep"`` they stop at
    a step boundary and continue on the new weights (their cached positions recomputed). Either way the prefix
    cache is dropped (``engine.weights_changed()``); a pause anyone else holds stays in place.
    """
    policy = engine.policy
    checked = policy_weights.read_base_weights(policy, path)  # refused here, before any request is touched
    engine.pause(mode, holder="load_weights")
    try:
        n = policy_weights.load_base_weights(policy, checked)
        engine.weights_changed()
    finally:
        engine.resume(holder="load_weights")
    logger.info("unsloth_rollout: loaded %d weights from %s", n, path)
    return n
