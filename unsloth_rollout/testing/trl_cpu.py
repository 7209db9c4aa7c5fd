"""Run TRL 1.16's ``AsyncGRPOTrainer`` on a CPU machine without vLLM, for tests against ``unsloth-rollout serve``.

TRL's async GRPO talks to the server over HTTP only (its rollout worker posts ``/v1/completions`` from a spawned
process; adapter syncs are ``/pause``, ``/v1/load_lora_adapter``, ``/resume``), but three of its guards assume
a CUDA machine with vLLM installed. ``allow_async_grpo_on_cpu()`` lifts exactly those, and nothing on the
server's side of the wire:

- ``AsyncRolloutWorker.__init__`` refuses to start unless ``vllm`` is importable (the worker never imports it);
- the trainer's MFU probe calls ``torch.cuda.get_device_name`` (a metric only);
- the loss forward runs FlashAttention-3 from the kernels hub (``flash_attn_varlen_func``); here the same
  function is computed with torch SDPA, causal per packed segment (bottom-right aligned, as flash-attn's).

Example::

    restore = allow_async_grpo_on_cpu()
    try:
        AsyncGRPOTrainer(model=path, args=AsyncGRPOConfig(vllm_server_base_url=base, ...), ...).train()
    finally:
        restore()
"""

from __future__ import annotations

import types

import torch


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None,
                           softmax_scale=None, causal=True, window_size=(-1, -1), softcap=None, **_):
    """flash-attn's varlen attention on CPU: ``q`` [Tq, H, D], ``k``/``v`` [Tk, Hkv, D], segments by ``cu_seqlens``."""
    out = torch.empty_like(q)
    groups = q.shape[1] // k.shape[1]
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for i in range(len(cq) - 1):
        qs, ks = q[cq[i]:cq[i + 1]], k[ck[i]:ck[i + 1]]
        vs = v[ck[i]:ck[i + 1]]
        lq, lk = qs.shape[0], ks.shape[0]
        ks, vs = ks.repeat_interleave(groups, dim=1), vs.repeat_interleave(groups, dim=1)
        qi = torch.arange(lq).unsqueeze(1) + (lk - lq)
        kj = torch.arange(lk).unsqueeze(0)
        allowed = kj <= qi if causal else torch.ones(lq, lk, dtype=torch.bool)
        if window_size and window_size[0] >= 0:
            allowed &= kj >= qi - window_size[0]
        scale = softmax_scale if softmax_scale is not None else qs.shape[-1] ** -0.5
        scores = torch.einsum("qhd,khd->hqk", qs.float(), ks.float()) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        scores = scores.masked_fill(~allowed, float("-inf"))
        out[cq[i]:cq[i + 1]] = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), vs.float()).to(q.dtype)
    return out


def allow_async_grpo_on_cpu():
    """Lift TRL async GRPO's three CUDA / vLLM-install guards (see the module docstring); returns ``restore()``."""
    import trl.experimental.async_grpo.async_grpo_trainer as trainer_mod
    import trl.experimental.async_grpo.async_rollout_worker as worker_mod
    import trl.experimental.async_grpo.packing as packing_mod

    saved = [(worker_mod, "is_vllm_available", worker_mod.is_vllm_available),
             (trainer_mod, "get_peak_flops_per_device", trainer_mod.get_peak_flops_per_device),
             (packing_mod, "_flash_attn", packing_mod._flash_attn)]
    worker_mod.is_vllm_available = lambda: True
    trainer_mod.get_peak_flops_per_device = lambda *a, **k: None  # MFU metrics off, as on an unknown device
    kernel = types.SimpleNamespace(flash_attn_varlen_func=flash_attn_varlen_func)
    packing_mod._flash_attn = lambda: kernel

    def restore():
        for mod, name, value in saved:
            setattr(mod, name, value)

    return restore
