"""Teacher scoring for AReaL: ``InferenceEngine.compute_logp`` on the in-process engine.

AReaL's trainer calls ``teacher.compute_logp(rollout_batch)`` for on-policy distillation: per trajectory dict
(``input_ids`` / ``loss_mask`` ``[B, T]``, optional ``attention_mask``, VLM ``multi_modal_input``), the teacher's
``log p(token_j | tokens_<j)`` at every ``loss_mask`` position, 0 elsewhere, as ``[B, T]`` fp32 tensors.
``RemoteInfEngine.compute_logp`` asks a vLLM server for prompt logprobs; here every row is one prefill-only engine
request (``SamplingParams(max_new_tokens=0, prompt_logprobs=0)``) submitted together, so rows are packed into
shared forwards and identical prefixes hit the prefix cache. Scores are ``log_softmax(raw_logits)`` (T = 1).

Example::

    logps = engine.compute_logp([{"input_ids": ids, "loss_mask": mask}])   # [Tensor(B, T)]
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from ..engine import GenerationRequest, SamplingParams
from ..engine.inputs import PreparedPrompt


def _prepared(ids: list[int], mm: dict | None) -> PreparedPrompt | None:
    """The prompt with the exact vision inputs the trajectory carries (already processed and expanded)."""
    if not mm or mm.get("pixel_values") is None:
        return None
    pixels = mm["pixel_values"]
    grid = mm.get("image_grid_thw")
    digest = hashlib.blake2b(pixels.detach().cpu().contiguous().numpy().tobytes(), digest_size=16)
    if grid is not None:
        digest.update(grid.detach().cpu().contiguous().numpy().tobytes())
    extra = {k: v for k, v in mm.items() if k not in ("pixel_values", "image_grid_thw") and v is not None}
    return PreparedPrompt(prompt_ids=ids, pixel_values=pixels, image_grid_thw=grid,
                          image_hashes=("pixels:" + digest.hexdigest(),), extra=extra)


def compute_logp(rollout_engine, data: list[dict[str, Any]], lora_name: str | None = None) -> list[torch.Tensor]:
    """Per trajectory, ``[B, T]`` logprobs of each token given the ones before it at ``loss_mask`` positions."""
    jobs = []  # (trajectory, row, positions of the active tokens, request)
    for t, traj in enumerate(data):
        input_ids, loss_mask = traj["input_ids"], traj["loss_mask"]
        if input_ids.dim() != 2 or loss_mask.dim() != 2:
            raise ValueError("input_ids and loss_mask must be 2D tensors")
        mms = traj.get("multi_modal_input")
        for i in range(input_ids.shape[0]):
            if int(loss_mask[i].sum()) <= 0:
                continue
            active = torch.arange(input_ids.shape[1])
            if "attention_mask" in traj:
                active = torch.nonzero(traj["attention_mask"][i], as_tuple=False).squeeze(-1).cpu()
            ids = input_ids[i, active].tolist()
            if bool(loss_mask[i, active[0]]):
                raise ValueError(f"loss_mask of trajectory {t} row {i} marks its first token, which has no "
                                 "context to be scored from")
            mm = mms[i] if isinstance(mms, (list, tuple)) and i < len(mms) else None
            req = GenerationRequest(input_ids=ids, sampling=SamplingParams(max_new_tokens=0, prompt_logprobs=0),
                                    lora_name=lora_name, prepared=_prepared(ids, mm))
            jobs.append((t, i, active, req))
    outs = rollout_engine.generate([job[3] for job in jobs]) if jobs else []
    results = [torch.zeros_like(traj["loss_mask"], dtype=torch.float32) for traj in data]
    for (t, i, active, _), out in zip(jobs, outs):
        if out.error or out.prompt_logprobs is None:
            raise RuntimeError(f"compute_logp: trajectory {t} row {i} failed: {out.error}")
        scores = torch.tensor([0.0] + [next(iter(d.values())) for d in out.prompt_logprobs[1:]])
        mask = data[t]["loss_mask"][i, active].bool().cpu()
        row = results[t][i]
        row[active[mask].to(row.device)] = scores[mask].to(row.device)
    return results
