"""``unsloth:dN``: N colocated data-parallel replicas, one per process, under AReaL's own launchers.

Each process (started by ``torchrun`` or AReaL's SPMD launchers, which run torchrun) holds one
PolicyModel with an UnslothInferenceEngine and a ColocatedTrainEngine on it, on its own device
(``cuda:LOCAL_RANK``, or the CPU). What is shared is only what data parallelism needs:

- the rollout batch is split by AReaL itself: PPOTrainer gives every rank a ``DistributedSampler``
  shard of ``train_dataset.batch_size / N`` prompts, and each rank's WorkflowExecutor waits for
  ``consumer_batch_size / N`` of them. A prompt's ``n_samples`` group is produced by one
  ``GroupedRolloutWorkflow`` on one rank, so groups never straddle ranks and group-level reward /
  advantage normalisation is exact; batch-level normalisation is all-reduced by AReaL's own
  ``Normalization`` over the default (world) group, which is the data-parallel group here;
- the loss of each micro-batch is weighted by its token count over the *global* token count and
  the gradients of the trainable (LoRA) parameters are summed by one all-reduce after backward, so
  every rank takes the same optimizer step as one process over the whole batch;
- every rank then bumps its own engine's version (checked to be equal across ranks).

Supported shapes: ``rollout.backend: "unsloth:dN"`` with ``actor.backend: "unsloth:dN"`` (or
``"fsdp:dN"``), launched as N processes. Tensor / pipeline / context parallelism inside a replica is
refused with ``UnsupportedParallelismError``. A rank that dies makes the collectives of the others
fail (``ReplicaLostError``) and torchrun stop the job.

Example::

    AREAL_SPMD_MODE=1 torchrun --nproc-per-node 2 -m unsloth_rollout.areal.grpo --config cfg.yaml \\
        rollout.backend=unsloth:d2 actor.backend=unsloth:d2
"""

from __future__ import annotations

import datetime
import os
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

SUPPORTED_SHAPES = ("'unsloth:dN' (N data-parallel replicas, one whole model per process: no t/p), with "
                    "actor.backend 'unsloth:dN' (or 'fsdp:dN') of the same N, launched as N processes "
                    "(torchrun --nproc-per-node N, or AReaL's launcher with allocation_mode 'unsloth:dN')")
DEFAULT_TIMEOUT_S = 7200.0  # AReaL's DIST_GROUP_DEFAULT_TIMEOUT


class UnsupportedParallelismError(ValueError):
    """A backend / launch shape the unsloth backend does not run (the message names what it runs)."""


class ReplicaLostError(RuntimeError):
    """A collective between the replicas failed: another rank died or cannot be reached."""


def launch_world_size() -> int:
    """Processes in this job: the initialized process group, else torchrun's ``WORLD_SIZE`` (1 if unset)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def _extra_dims(parallel) -> dict[str, int]:
    names = {"t": "tensor_parallel_size", "p": "pipeline_parallel_size", "c": "context_parallel_size",
             "e": "expert_parallel_size", "et": "expert_tensor_parallel_size"}
    return {k: int(getattr(parallel, a, 1) or 1) for k, a in names.items() if int(getattr(parallel, a, 1) or 1) != 1}


def check_shapes(rollout_backend: str, rollout_parallel, actor_backend: str, actor_parallel,
                 world_size: int | None = None, fields: tuple[str, str] = ("rollout.backend", "actor.backend")) -> int:
    """Validate ``rollout.backend`` / ``actor.backend`` against the launch; returns N (the replica count).

    Raises ``UnsupportedParallelismError`` naming the field, what was asked and what is supported.
    """
    for field_name, spec, par in ((fields[0], rollout_backend, rollout_parallel),
                                  (fields[1], actor_backend, actor_parallel)):
        extra = _extra_dims(par)
        if extra:
            dims = ", ".join(f"{k}{v}" for k, v in extra.items())
            raise UnsupportedParallelismError(
                f"{field_name}: {spec!r} asks for model parallelism inside a replica ({dims}); the unsloth "
                f"backend runs {SUPPORTED_SHAPES}")
    n, n_actor = int(rollout_parallel.data_parallel_size), int(actor_parallel.data_parallel_size)
    if n != n_actor:
        raise UnsupportedParallelismError(
            f"{fields[1]}: {actor_backend!r} has {n_actor} data-parallel replicas but {fields[0]} "
            f"{rollout_backend!r} has {n}; every replica hosts one actor and one rollout engine, so they must "
            f"match. Supported: {SUPPORTED_SHAPES}")
    world = launch_world_size() if world_size is None else int(world_size)
    if n != world:
        raise UnsupportedParallelismError(
            f"{fields[0]}: {rollout_backend!r} asks for {n} data-parallel replica(s) but this job runs "
            f"{world} process(es) (WORLD_SIZE={world}); launch exactly N processes for 'unsloth:dN' "
            f"(e.g. torchrun --nproc-per-node {n}) or set the backends to 'unsloth:d{world}'. "
            f"Supported: {SUPPORTED_SHAPES}")
    return n


@contextmanager
def _collective(what: str):
    try:
        yield
    except ReplicaLostError:
        raise
    except RuntimeError as e:  # gloo / NCCL errors (DistBackendError, DistNetworkError) are RuntimeErrors
        rank = dist.get_rank() if dist.is_initialized() else -1
        world = dist.get_world_size() if dist.is_initialized() else -1
        raise ReplicaLostError(
            f"unsloth:d{world}: {what} failed on rank {rank} of {world}: another replica died, hung past the "
            f"process-group timeout, or cannot be reached ({type(e).__name__}: {e})") from e


@dataclass
class DataParallel:
    """This process's place among the replicas, and the few collectives the replicas need."""

    rank: int
    world_size: int
    group: object              # the data-parallel group (gloo on CPU, NCCL on CUDA); the world group
    cpu_group: object          # a gloo group for barriers / objects (PPOTrainer's cpu_group)
    device: torch.device
    owns_group: bool = False

    @classmethod
    def init(cls, world_size: int, timeout_s: float | None = None) -> "DataParallel":
        """Join (or start) the default process group of ``world_size`` ranks from torchrun's environment."""
        # AReaL's is_single_controller() is `not AREAL_SPMD_MODE` (areal.utils.environ); read here without
        # importing areal, so a replica can join its group before the heavy imports.
        if os.environ.get("AREAL_SPMD_MODE", "false").lower() not in ("true", "1"):
            raise UnsupportedParallelismError(
                f"unsloth:d{world_size}: data-parallel replicas run in AReaL's SPMD mode; launch with "
                f"AREAL_SPMD_MODE=1 torchrun --nproc-per-node {world_size} ... (python -m "
                f"unsloth_rollout.areal.grpo sets it), or with AReaL's launcher (python -m "
                f"unsloth_rollout.areal.launch local ...)")
        timeout = datetime.timedelta(seconds=float(timeout_s or DEFAULT_TIMEOUT_S))
        cuda = torch.cuda.is_available()
        local_rank = int(os.environ.get("LOCAL_RANK", "0") or 0)
        device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
        owns = False
        if not dist.is_initialized():
            if "MASTER_ADDR" not in os.environ or "RANK" not in os.environ:
                raise UnsupportedParallelismError(
                    f"unsloth:d{world_size}: no torch.distributed environment (RANK, MASTER_ADDR); launch with "
                    f"torchrun --nproc-per-node {world_size} or AReaL's launcher")
            if cuda:
                torch.cuda.set_device(device)
                dist.init_process_group("nccl", timeout=timeout, device_id=device)
            else:
                dist.init_process_group("gloo", timeout=timeout)
            owns = True
        if dist.get_world_size() != world_size:
            raise UnsupportedParallelismError(
                f"rollout.backend: 'unsloth:d{world_size}' asks for {world_size} replicas but the process group "
                f"has {dist.get_world_size()} ranks. Supported: {SUPPORTED_SHAPES}")
        group = dist.group.WORLD
        cpu_group = group if dist.get_backend(group) == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
        return cls(dist.get_rank(), dist.get_world_size(), group, cpu_group, device, owns)

    # ------------------------------------------------------------------ collectives
    def all_reduce_sum(self, value: float, what: str = "loss-weight all-reduce") -> float:
        t = torch.tensor([float(value)], dtype=torch.float64, device=self.device)
        with _collective(what):
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return float(t.item())

    def all_reduce_grads(self, params: list[torch.nn.Parameter]) -> None:
        """Sum the gradients of ``params`` over the replicas, in one flat buffer (None counts as zero).

        The losses were weighted by local tokens / global tokens, so the sum is the gradient of the
        global token-mean loss: the same as one process over the whole batch.
        """
        if not params:
            return
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float()
                          for p in params]).to(self.device)
        with _collective("all-reduce of the LoRA gradients"):
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
        offset = 0
        for p in params:
            n = p.numel()
            g = flat[offset:offset + n].view_as(p).to(p.dtype)
            if p.grad is None:
                p.grad = g.clone()
            else:
                p.grad.copy_(g)
            offset += n

    @torch.no_grad()
    def broadcast_params(self, params: list[torch.nn.Parameter], src: int = 0) -> None:
        """Make every replica start from rank ``src``'s trainable weights (as DDP does at construction)."""
        if not params:
            return
        flat = torch.cat([p.detach().reshape(-1).float() for p in params]).to(self.device)
        with _collective("broadcast of the initial LoRA weights"):
            dist.broadcast(flat, src=src, group=self.group)
        offset = 0
        for p in params:
            n = p.numel()
            p.copy_(flat[offset:offset + n].view_as(p).to(p.dtype))
            offset += n

    def check_lockstep(self, version: int) -> None:
        """Every replica must bump its engine to the same version after the same optimizer step."""
        t = torch.tensor([int(version), -int(version)], dtype=torch.int64, device=self.device)
        with _collective("weight-version check"):
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        hi, lo = int(t[0]), -int(t[1])
        if hi != lo:
            raise RuntimeError(f"unsloth:d{self.world_size}: replicas disagree on the weight version "
                               f"(rank {self.rank} has {version}, the replicas span {lo}..{hi})")

    def destroy(self) -> None:
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self.owns_group = False
