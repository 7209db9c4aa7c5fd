"""The trainer's side of the bitwise on-policy mode, as tests and the bench run it: one padded batch forward of every
sample's prompt + output through ``policy.model`` and ``log_softmax(logits / T)[token]``, under the mode or not.

Example::

    lps = trainer_logprobs(policy, outputs, temperatures=[1.0] * len(outputs))
    assert all(torch.equal(lp, torch.tensor(o.output_logprobs)) for lp, o in zip(lps, outputs))
"""

from __future__ import annotations

import contextlib

import torch

from .. import bitwise
from ..engine.inputs import mm_token_type_ids
from ..models.families import family_of


def trainer_logprobs(policy, outputs, temperatures, vision: list | None = None, padding: str = "right",
                     on: bool = True) -> list[torch.Tensor]:
    """Each output's ``log_softmax(logits / T)[token]`` from one batch forward over all of them (``padding`` "right",
    as AReaL's batches, or "left", as TRL's prompts), with ``bitwise.mode`` (``on=False``: the plain forward, whose
    logprobs differ in the last bits). ``vision[i]``: output i's Qwen-VL ``pixel_values`` / ``image_grid_thw`` (None:
    text). Returns one float32 tensor per output."""
    rows = [list(o.prompt_ids) + list(o.output_ids) for o in outputs]
    width = max(map(len, rows))
    pad = [width - len(r) for r in rows]
    if padding == "left":
        ids = [[0] * p + r for r, p in zip(rows, pad)]
        mask = [[0] * p + [1] * len(r) for r, p in zip(rows, pad)]
    else:
        ids = [r + [0] * p for r, p in zip(rows, pad)]
        mask = [[1] * len(r) + [0] * p for r, p in zip(rows, pad)]
    dev = policy.device
    ids_t, mask_t = torch.tensor(ids, device=dev), torch.tensor(mask, device=dev)
    kw = {"input_ids": ids_t, "attention_mask": mask_t, "use_cache": False}
    vis = [v for v in (vision or []) if v is not None]
    if vis:
        kw["pixel_values"] = torch.cat([v["pixel_values"] for v in vis]).to(dev, policy.dtype)
        kw["image_grid_thw"] = torch.cat([v["image_grid_thw"] for v in vis]).to(dev)
        kw["mm_token_type_ids"] = mm_token_type_ids(ids_t, policy.config)
    if not family_of(policy.config).mrope:
        kw["position_ids"] = bitwise.position_ids(mask_t)
    with policy.lock, torch.no_grad():
        was_training = policy.model.training
        policy.model.eval()
        policy.clear_rope_deltas()
        try:
            with bitwise.mode(policy) if on else contextlib.nullcontext():
                logits = policy.model(**kw).logits
        finally:
            policy.clear_rope_deltas()
            if was_training:
                policy.model.train()
    out = []
    for i, o in enumerate(outputs):
        start = (pad[i] if padding == "left" else 0) + len(o.prompt_ids)
        n = len(o.output_ids)
        lg = logits[i, start - 1:start - 1 + n]
        if on:
            out.append(bitwise.token_logprobs(lg, ids_t[i, start:start + n], temperatures[i]).cpu())
        else:
            lp = torch.log_softmax(lg.float() / temperatures[i], dim=-1)
            out.append(lp.gather(-1, ids_t[i, start:start + n].unsqueeze(-1)).squeeze(-1).cpu())
    return out


def unequal(outputs, logprobs) -> list[tuple[int, float]]:
    """(index, max |difference|) of each output whose logprobs are not bit for bit ``logprobs[i]``."""
    bad = []
    for i, (o, lp) in enumerate(zip(outputs, logprobs)):
        got = torch.tensor(o.output_logprobs, dtype=torch.float32)
        if not torch.equal(got, lp):
            bad.append((i, (got - lp).abs().max().item() if got.shape == lp.shape else float("inf")))
    return bad
