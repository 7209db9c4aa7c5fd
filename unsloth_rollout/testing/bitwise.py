"""The trainer's side of the bitwise on-policy mode, as tests and the bench run it: one padded batch forward of every
sample's prompt + output through ``policy.model`` and ``log_softmax(logits / T)[token]``, under the mode or not.

Example::

    lps = trainer_logprobs(policy, outputs, temperatures=[1.0] * len(outputs))
    assert all(torch.equal(lp, torch.tensor(o.output_logprobs)) for lp, o in zip(lps, outputs))
"""

from __future__ import annotations

import contextlib
import time

import torch

from .. import bitwise
from ..engine.inputs import mm_token_type_ids
from ..models.families import family_of


@contextlib.contextmanager
def _trainer_forward(policy, on: bool):
    """A trainer's scoring forward of ``policy``: the lock held, no grad, eval mode, fresh rope deltas (all put back
    after), under the bitwise mode when ``on``."""
    with policy.lock, torch.no_grad():
        was_training = policy.model.training
        policy.model.eval()
        policy.clear_rope_deltas()
        try:
            with bitwise.mode(policy) if on else contextlib.nullcontext():
                yield
        finally:
            policy.clear_rope_deltas()
            if was_training:
                policy.model.train()


def trainer_logprobs(policy, outputs, temperatures, vision: list | None = None, padding: str = "right",
                     on: bool = True) -> list[torch.Tensor]:
    """Each output's ``log_softmax(logits / T)[token]`` from one batch forward over all of them (``padding`` "right",
    as AReaL's batches, or "left", as TRL's prompts), with ``bitwise.mode`` (``on=False``: the plain forward, whose
    logprobs differ in the last bits). ``vision[i]``: output i's Qwen-VL ``pixel_values`` / ``image_grid_thw`` (None:
    text), or another family's processor outputs for its prompt, whose sample is then scored in a forward of its
    own (as ``oracles.teacher_forced`` feeds them). Returns one float32 tensor per output."""
    vision = list(vision) if vision is not None else [None] * len(outputs)
    alone = [i for i, v in enumerate(vision) if v is not None and set(v) - {"pixel_values", "image_grid_thw"}]
    if alone:
        batched = [i for i in range(len(outputs)) if i not in alone]
        res = dict(zip(batched, trainer_logprobs(policy, [outputs[i] for i in batched],
                                                 [temperatures[i] for i in batched], [vision[i] for i in batched],
                                                 padding, on) if batched else []))
        for i in alone:
            res[i] = _alone(policy, outputs[i], temperatures[i], vision[i], on)
        return [res[i] for i in range(len(outputs))]
    kw, starts = batch_inputs(policy, outputs, vision, padding)
    ids_t = kw["input_ids"]
    with _trainer_forward(policy, on):
        logits = policy.model(**kw).logits
    out = []
    for i, o in enumerate(outputs):
        start, n = starts[i], len(o.output_ids)
        lg = logits[i, start - 1:start - 1 + n]
        if on:
            out.append(bitwise.token_logprobs(lg, ids_t[i, start:start + n], temperatures[i]).cpu())
        else:
            lp = torch.log_softmax(lg.float() / temperatures[i], dim=-1)
            out.append(lp.gather(-1, ids_t[i, start:start + n].unsqueeze(-1)).squeeze(-1).cpu())
    return out


def batch_inputs(policy, outputs, vision: list | None = None, padding: str = "right") -> tuple[dict, list[int]]:
    """(forward kwargs of one padded batch of every output's prompt + output, where each output's first token sits in
    its row). ``vision`` as in ``trainer_logprobs`` (Qwen-VL pixels only)."""
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
    starts = [(pad[i] if padding == "left" else 0) + len(o.prompt_ids) for i, o in enumerate(outputs)]
    return kw, starts


def train_step_seconds(policy, outputs, temperatures, vision: list | None = None, on: bool = True) -> float:
    """Seconds of one trainer step's forward + backward over ``outputs`` (the loss: minus their summed logprobs, the
    forward under ``bitwise.mode`` or not), in training mode; the gradients are dropped after."""
    kw, starts = batch_inputs(policy, outputs, vision)
    ids = kw["input_ids"]
    with policy.lock, policy.training():
        policy.model.zero_grad(set_to_none=True)
        policy.clear_rope_deltas()
        t0 = time.perf_counter()
        with bitwise.mode(policy) if on else contextlib.nullcontext():
            logits = policy.model(**kw).logits
            loss = logits.new_zeros(())
            for i, o in enumerate(outputs):
                n = len(o.output_ids)
                lg = logits[i, starts[i] - 1:starts[i] - 1 + n].float() / temperatures[i]
                loss = loss - torch.log_softmax(lg, -1).gather(-1, ids[i, starts[i]:starts[i] + n, None]).sum()
        loss.backward()
        seconds = time.perf_counter() - t0
        policy.model.zero_grad(set_to_none=True)
        policy.clear_rope_deltas()
    return seconds


def _alone(policy, output, temperature, mm: dict, on: bool) -> torch.Tensor:
    """One sample's logprobs from a forward of its own with its prompt's processor outputs (per-token ones extended
    over the output as text)."""
    dev = policy.device
    ids = torch.tensor([list(output.prompt_ids) + list(output.output_ids)], device=dev)
    n, k = len(output.prompt_ids), len(output.output_ids)
    kw = {key: v for key, v in mm.items() if key not in ("input_ids", "attention_mask") and v is not None}
    for key in ("token_type_ids", "mm_token_type_ids"):
        if key in kw and kw[key].shape[-1] == n:
            kw[key] = torch.nn.functional.pad(kw[key], (0, k))
    if "pixel_values" in kw:
        kw["pixel_values"] = kw["pixel_values"].to(policy.dtype)
    kw = {key: v.to(dev) if isinstance(v, torch.Tensor) else v for key, v in kw.items()}
    with _trainer_forward(policy, on):
        logits = policy.model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False,
                              **kw).logits[0, n - 1:n - 1 + k]
    if on:
        return bitwise.token_logprobs(logits, ids[0, n:], temperature).cpu()
    lp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return lp.gather(-1, ids[0, n:].unsqueeze(-1)).squeeze(-1).cpu()


def unequal(outputs, logprobs) -> list[tuple[int, float]]:
    """(index, max |difference|) of each output whose logprobs are not bit for bit ``logprobs[i]``."""
    bad = []
    for i, (o, lp) in enumerate(zip(outputs, logprobs)):
        got = torch.tensor(o.output_logprobs, dtype=torch.float32)
        if not torch.equal(got, lp):
            bad.append((i, (got - lp).abs().max().item() if got.shape == lp.shape else float("inf")))
    return bad
