"""TRL's recompute under the bitwise on-policy mode (unsloth_rollout/bitwise.py).

TRL 1.16 scores completions through a fused LM head it installs on the model (``add_fused_lm_head``): ``model(...,
labels=labels, fused_lm_head=True).log_probs``, a chunked online log-sum-exp over vocabulary tiles that multiplies
the logits by ``1 / T``. That is a different sum than any log-softmax the engine can run, so under the mode the hook
puts its own head on top of TRL's (``use_bitwise_recompute``, called by ``EngineRollout`` when the policy's mode is
on): the backbone and the LM head run under ``bitwise.mode``, through TRL's own forward without its fused head, and
``log_probs`` is ``log_softmax(logits / T)[label]`` under the mode, the function the engine's sampler runs. Left-
padded prompts get positions counted over their real tokens, as the engine places them (Qwen-VL's M-RoPE positions
come from the attention mask already). The old and the training forward's logprobs both come from it, so TRL's
``sampling/sampling_logp_difference`` is 0 and the first epoch's importance ratios are exactly 1.
"""

from __future__ import annotations

import types

import torch

from .. import bitwise
from ..models.families import family_of


def use_bitwise_recompute(trainer, policy) -> None:
    """Make ``model(..., fused_lm_head=True)`` of ``policy``'s model (what TRL's GRPOTrainer scores with) compute its
    per-token logprobs and entropies under the bitwise on-policy mode while ``policy``'s mode is on."""
    model = policy.base_model
    previous = model.forward
    if getattr(previous, "_unsloth_rollout_bitwise", False):
        return
    from trl.trainer.utils import FusedCausalLMOutput

    temperature = float(trainer.temperature)
    mrope = family_of(policy.config).mrope

    def forward(self, *args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None,
                **kwargs):
        if not fused_lm_head or not bitwise.enabled(policy):
            return previous(*args, fused_lm_head=fused_lm_head, labels=labels, shift_labels=shift_labels,
                            num_items_in_batch=num_items_in_batch, **kwargs)
        if shift_labels is not None:
            raise bitwise.BitwiseModeError("shift_labels: pre-shifted labels (context or sequence parallelism) are "
                                           "not scored under the bitwise on-policy mode")
        mask = kwargs.get("attention_mask")
        if mask is not None and not mrope and kwargs.get("position_ids") is None:
            kwargs["position_ids"] = bitwise.position_ids(mask)
        kwargs["use_cache"] = False
        with bitwise.mode(policy):
            logits = previous(*args, fused_lm_head=False, **kwargs).logits[:, :-1].float()
            labels = labels[:, 1:].to(logits.device)
            valid = labels != -100
            logp = torch.log_softmax(logits if temperature == 1.0 else logits / temperature, dim=-1)
            log_probs = logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1).masked_fill(~valid, 0.0)
            entropy = (-(logp.exp() * logp).sum(-1)).masked_fill(~valid, 0.0)
        count = valid.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        return FusedCausalLMOutput(loss=-log_probs.sum() / count, log_probs=log_probs, entropy=entropy,
                                   label_mask=valid)

    model.forward = types.MethodType(forward, model)
    model.forward.__func__._unsloth_rollout_bitwise = True
