"""The bitwise on-policy mode: the engine's logprobs equal the trainer's recompute bit for bit.

By default the engine's logprobs are within ~1e-5 of a trainer's forward in float32: a decode step (one row over a KV
cache), a packed prefill and a trainer's padded batch forward sum in different orders. Under this mode both sides run
the same batch-invariant ops (``kernels/batch_invariant.py``: linear layers including LoRA A/B, norms, activations,
the log-softmax, and one attention that reads each query's keys one at a time in key order), so a token's logprob is
a function of the weights and the tokens before it alone, whichever forward computes it: ``torch.equal`` holds
between what the engine returns and ``log_softmax(logits / T)`` of the trainer's forward under the mode, and
importance ratios on the first PPO epoch are exactly 1. It is possible because the sampler and the trainer share
one model object in one process; it costs speed (``python -m unsloth_rollout.bench --backends engine,engine-bitwise``).

The switch is on the policy, so the engine and every trainer door read one setting:

- ``enable(policy)`` before the engine is built: its decode steps run eager over the workspace rows (the compiled
  step, the CPU decode kernel and the shared-prompt split are turned off: ``engine/decode/choose.py``'s "auto" picks
  the eager step, and an explicit compiled setting is refused by name), and every engine forward and the sampler's log-softmax run under the mode.
- ``mode(policy)``: a trainer's forward, ``with bitwise.mode(policy): logits = policy.model(...).logits``; the text
  decoder attends through this module's attention (registered in transformers as ``ATTN_NAME``) and every op runs
  batch-invariant. ``token_logprobs`` is the recompute, ``log_softmax(logits / T)[token]`` under the mode.
- AReaL's colocated train engine (``unsloth:d1``, its ``compute_logp`` and loss forwards) and TRL's ``GRPOTrainer``
  through ``rollout_func`` (its recompute, so ``sampling/sampling_logp_difference`` is 0) enter it themselves.

Only forward values are made invariant: gradients use plain formulas (within float32 tolerance of the default
forward's). Backward passes run outside the mode. Any op the mode cannot make invariant raises ``BitwiseModeError``
naming it (a model family it does not cover is refused, never served approximately); float32 on CPU only (the GPU
version, Triton kernels with fixed tiles in bf16, needs a device).

Example::

    from unsloth_rollout import bitwise
    bitwise.enable(policy)
    engine = RolloutEngine(policy)
    out = engine.generate([request])[0]
    ids = torch.tensor([out.prompt_ids + out.output_ids])
    with bitwise.mode(policy):
        logits = policy.model(input_ids=ids).logits[0, len(out.prompt_ids) - 1:-1]
        lp = bitwise.token_logprobs(logits, ids[0, len(out.prompt_ids):], temperature=1.0)
    assert torch.equal(lp, torch.tensor(out.output_logprobs))
"""

from __future__ import annotations

import contextlib

import torch

from .errors import BitwiseModeError
from .kernels import batch_invariant
from .kernels.batch_invariant import InvariantOps

__all__ = ["ATTN_NAME", "BitwiseModeError", "attend", "disable", "enable", "enabled",
           "engine_ops", "log_softmax", "mode", "ops", "position_ids", "token_logprobs"]

ATTN_NAME = "unsloth_rollout_bitwise"

# Attention-function arguments whose arithmetic the mode's attention does not compute.
_UNSUPPORTED_KWARGS = ("s_aux", "sinks", "attention_chunk_size", "position_bias")


def check(policy) -> None:
    """Raise ``BitwiseModeError`` unless the mode can run ``policy``: float32 weights on CPU, the kernels built."""
    if policy.device.type != "cpu":
        raise BitwiseModeError(f"the bitwise on-policy mode runs on CPU only (the model is on {policy.device}); the "
                               "GPU version (Triton kernels with fixed tiling) needs a device")
    if policy.dtype != torch.float32:
        raise BitwiseModeError(f"the bitwise on-policy mode runs float32 models only (this one is {policy.dtype})")
    if not batch_invariant.available():
        raise BitwiseModeError(f"the bitwise on-policy mode's CPU kernels could not be built: "
                               f"{batch_invariant.build_error()}")


def enable(policy) -> None:
    """Turn the mode on for ``policy``: engines built on it from now on, and the trainer doors, run under it."""
    check(policy)
    policy.bitwise = True


def disable(policy) -> None:
    """Turn the mode off for ``policy`` (engines built while it was on refuse to run from then on)."""
    policy.bitwise = False


def enabled(policy) -> bool:
    return bool(getattr(policy, "bitwise", False))


def ops() -> InvariantOps:
    """The op mode alone (a thread-local ``TorchDispatchMode``): what the engine's forwards run under."""
    return InvariantOps()


@contextlib.contextmanager
def mode(policy):
    """A trainer's forward under the mode: ``policy``'s text decoder attends through this module's attention, every
    op runs batch-invariant in float32 (a surrounding autocast is switched off inside), and ``policy.lock`` is held
    (no engine step runs meanwhile)."""
    check(policy)
    register()
    cfg = policy.text_config
    with policy.lock:
        saved = cfg._attn_implementation_internal
        cfg._attn_implementation_internal = ATTN_NAME
        try:
            # float32 whatever autocast the trainer runs under (TRL's GRPOConfig defaults to bf16 mixed precision):
            # the engine's forwards run in the model's own dtype, and the mode's ops compute float32 only.
            with torch.autocast(policy.device.type, enabled=False), InvariantOps():
                yield
        finally:
            cfg._attn_implementation_internal = saved


def log_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The mode's log-softmax (``x - logsumexp(x)``, fixed order): the engine's sampler calls it under the mode."""
    return batch_invariant.log_softmax(x, dim)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``log_softmax(logits / T)[token]`` in float32 under the mode: what the engine returns for ``tokens`` sampled
    after these logits. ``logits`` ``[..., V]``, ``tokens`` ``[...]``."""
    with InvariantOps():
        x = logits.float()
        lp = torch.log_softmax(x if temperature == 1.0 else x / temperature, dim=-1)
        return lp.gather(-1, tokens.unsqueeze(-1).to(lp.device, torch.long)).squeeze(-1)


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions of a padded batch counted over its real tokens (a left-padded row's first token at 0), as the engine
    places them: a trainer's forward under the mode passes these for models with 1-D positions."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


# ================================================================== the one attention
def attend(query, key, value, mask, scaling, softcap=None, causal: bool = False) -> torch.Tensor:
    """Attention output ``[B, Q, H, D]`` of queries ``[B, H, Q, D]`` over keys / values ``[B, KV, L, D]``: each query's
    attended keys (``mask`` True, broadcastable to ``[B, H, Q, L]``; without one, ``j <= i`` when ``causal``, else all)
    one at a time in key order (``batch_invariant.attention``). The engine's attention calls it under the mode with
    the mask of its own bookkeeping, the trainer's forward through ``attention_function``."""
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    out, _ = batch_invariant.attention(query, key, value, mask, scale, softcap, causal)
    return out.transpose(1, 2).contiguous()


def attention_function(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                       **kwargs):
    """transformers' attention-function signature over ``attend`` (registered as ``ATTN_NAME``): the mask is the
    boolean one transformers' ``sdpa_mask`` builds, None meaning causal as in transformers' SDPA path."""
    for name in _UNSUPPORTED_KWARGS:
        if kwargs.get(name) is not None:
            raise BitwiseModeError(f"{type(module).__name__} passes '{name}' to its attention function; the bitwise "
                                   "on-policy mode's attention does not compute it")
    if dropout:
        raise BitwiseModeError(f"{type(module).__name__}: attention dropout {dropout} in training mode makes the "
                               "trainer's forward random; set attention_dropout to 0")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(query.shape[2] > 1 and attention_mask is None and causal)
    return attend(query, key, value, attention_mask, scaling, kwargs.get("softcap"), causal), None


_registered = False


def register() -> None:
    """Register ``attention_function`` (and transformers' boolean SDPA masks) under ``ATTN_NAME``."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_NAME, attention_function)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)
    _registered = True


# ================================================================== the engine's side
def engine_ops(policy, on: bool):
    """What an engine forward runs under: ``ops()`` for an engine built under the mode, else nothing; an engine whose
    policy's mode changed since it was built is refused (its decode variant was chosen for the other setting)."""
    if enabled(policy) != on:
        raise BitwiseModeError(f"the bitwise on-policy mode was turned {'on' if enabled(policy) else 'off'} after this "
                               "engine was built; build the engine after bitwise.enable(policy)")
    return InvariantOps() if on else contextlib.nullcontext()
