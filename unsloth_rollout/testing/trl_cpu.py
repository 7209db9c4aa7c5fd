"""Run TRL 1.16's ``AsyncGRPOTrainer`` and ``GRPOTrainer(vllm_mode="server")`` on a CPU machine without vLLM, for
tests against ``unsloth-rollout serve``.

TRL's async GRPO talks to the server over HTTP only (its rollout worker posts ``/v1/completions`` from a spawned
process; adapter syncs are ``/pause``, ``/v1/load_lora_adapter``, ``/resume``), but three of its guards assume
a CUDA machine with vLLM installed. ``allow_async_grpo_on_cpu()`` lifts exactly those, and nothing on the
server's side of the wire:

- ``AsyncRolloutWorker.__init__`` refuses to start unless ``vllm`` is importable (the worker never imports it);
- the trainer's MFU probe calls ``torch.cuda.get_device_name`` (a metric only);
- the loss forward runs FlashAttention-3 from the kernels hub (``flash_attn_varlen_func``); here the same
  function is computed with torch SDPA, causal per packed segment (bottom-right aligned, as flash-attn's).

``allow_grpo_server_mode_on_cpu()`` does the same for ``GRPOTrainer(use_vllm=True, vllm_mode="server")``, whose
weight sync joins vLLM's NCCL weight-transfer engine: TRL's ``VLLMClient.init_communicator`` refuses a non-CUDA
device and both the client and ``VLLMGeneration`` refuse to start without vLLM installed. It lifts those two
install checks and replaces only the trainer's end of the wire with the gloo equivalent (``models.weight_wire``,
what a server started with ``--weight-transfer-config '{"backend": "gloo"}'`` receives): the rendezvous in
``init_communicator`` and the packed broadcast ``update_named_params`` calls. TRL still walks, names, merges
(PEFT) and announces the weights, posts every route, and generates over HTTP unchanged.

``allow_grpo_server_mode_without_vllm()`` is for a CUDA trainer without vLLM installed, against a server started
with ``--weight-transfer-config '{"backend": "nccl"}'``: TRL's client runs as shipped (its ``init_communicator``,
CUDA check and ``init_info`` included) and only the three vLLM functions it calls are supplied: ``get_ip``,
``trainer_init`` (``models.nccl_wire``'s trainer end of vLLM's NCCL rendezvous) and the packed broadcast producer.

Example::

    restore = allow_async_grpo_on_cpu()
    try:
        AsyncGRPOTrainer(model=path, args=AsyncGRPOConfig(vllm_server_base_url=base, ...), ...).train()
    finally:
        restore()
"""

from __future__ import annotations

import atexit
import os
import socket
import threading
import types
from concurrent.futures import Future

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


def _ip_towards(host: str) -> str:
    """This machine's address on the route to ``host`` (what the server dials for the rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((socket.gethostbyname(host or "127.0.0.1"), 1))  # UDP: nothing is sent
        return s.getsockname()[0]


def vllm_get_ip() -> str:
    """vLLM's ``get_ip``, the address a server dials to reach this trainer: ``$VLLM_HOST_IP``, else this machine's
    address on its default route, else loopback (a machine without a network)."""
    ip = os.environ.get("VLLM_HOST_IP")
    if ip:
        return ip
    try:
        return _ip_towards("8.8.8.8")
    except OSError:
        return "127.0.0.1"


def _gloo_init_communicator(self, device=0):
    """TRL 1.16's ``VLLMClient.init_communicator`` with gloo for NCCL: the same server_info check, init_info
    (trainer rank 0, workers from rank_offset 1, packed; plus ``backend: "gloo"``, which the server requires) and
    concurrent POST; the group is ``GlooTransferGroup``."""
    from ..models.weight_wire import GlooTransferGroup

    if self.get_server_info()["weight_transfer_config"] is None:
        raise RuntimeError(f"The vLLM server at {self.base_url} has no weight-transfer engine. Restart it with "
                           """`--weight-transfer-config '{"backend": "gloo"}'`.""")
    world_size = self.get_world_size() + 1
    init_info = {"backend": "gloo", "master_address": _ip_towards(self.host), "master_port": self.group_port,
                 "rank_offset": 1, "world_size": world_size, "packed": True}
    # The group's constructor waits for the server; a daemon thread, so a server that refuses (400) is reported
    # at once instead of after the rendezvous timeout.
    joined: Future = Future()

    def join():
        try:
            joined.set_result(GlooTransferGroup(init_info["master_address"], self.group_port, 0, world_size))
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            joined.set_exception(e)

    threading.Thread(target=join, name="trl-gloo-rendezvous", daemon=True).start()
    self._post(f"{self.base_url}/init_weight_transfer_engine", json={"init_info": init_info})
    self.communicator = joined.result()
    atexit.register(self.close_communicator)


def _patch(items):
    """Set ``(owner, name, value)`` attributes; returns ``restore()``, which puts back (or deletes) each one."""
    missing = object()
    saved = [(owner, name, getattr(owner, name, missing)) for owner, name, _ in items]
    for owner, name, value in items:
        setattr(owner, name, value)

    def restore():
        for owner, name, value in saved:
            if value is missing:
                delattr(owner, name)
            else:
                setattr(owner, name, value)

    return restore


def _nccl_trainer_init(init_info):
    """vLLM's ``trainer_init`` without vLLM: rank 0 of the NCCL group, on the current CUDA device."""
    from ..models.nccl_wire import NcclTransferGroup

    return NcclTransferGroup.host(init_info["master_address"], init_info["master_port"], init_info["world_size"],
                                  device=torch.device("cuda", torch.cuda.current_device()))


def allow_grpo_server_mode_without_vllm():
    """Let TRL's ``GRPOTrainer(use_vllm=True, vllm_mode="server")`` on a CUDA trainer sync weights over NCCL with
    vLLM not installed (see the module docstring); returns ``restore()``."""
    import trl.generation.vllm_client as client_mod
    import trl.generation.vllm_generation as generation_mod

    from ..models.weight_wire import packed_broadcast_producer

    def available(*a, **k):
        return True

    return _patch([(client_mod, "is_vllm_available", available), (generation_mod, "is_vllm_available", available),
                   (client_mod, "get_ip", vllm_get_ip), (client_mod, "_HAS_STATEFUL_TRAINER_ENGINE", True),
                   (client_mod, "open_trainer_endpoint", _nccl_trainer_init),
                   (client_mod, "packed_nccl_broadcast_producer", packed_broadcast_producer)])


def allow_grpo_server_mode_on_cpu():
    """Let ``GRPOTrainer(use_vllm=True, vllm_mode="server")`` sync weights over gloo (see the module docstring);
    returns ``restore()``."""
    import trl.generation.vllm_client as client_mod
    import trl.generation.vllm_generation as generation_mod

    from ..models.weight_wire import packed_broadcast_producer

    def available(*a, **k):
        return True

    # _HAS_STATEFUL_TRAINER_ENGINE: vLLM >= 0.28's trainer path in TRL, a packed broadcast from rank 0 over the
    # communicator.
    return _patch([(client_mod, "is_vllm_available", available), (generation_mod, "is_vllm_available", available),
                   (client_mod.VLLMClient, "init_communicator", _gloo_init_communicator),
                   (client_mod, "_HAS_STATEFUL_TRAINER_ENGINE", True),
                   (client_mod, "packed_nccl_broadcast_producer", packed_broadcast_producer)])
