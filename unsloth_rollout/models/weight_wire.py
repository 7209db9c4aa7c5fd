"""The wire of a full-weight transfer over gloo: a trainer (rank 0) broadcasts named tensors to the server (rank 1).

vLLM's NCCL weight-transfer engine (``vllm.distributed.weight_transfer``) meets its trainer in a stateless group:
a ``TCPStore`` hosted by the trainer at ``master_address:master_port`` (vLLM's ``StatelessProcessGroup``), outside
``torch.distributed``'s global world, and every tensor travels by ``broadcast`` from rank 0. This module is the
same protocol with gloo as the transport, so it runs on CPU: the server's receiver
(``serve.weight_transfer``) and the trainer-side shim (``testing.trl_cpu``) both use it, and nothing here imports
fastapi or vLLM. The packed and one-by-one layouts below serve any group with ``broadcast`` and ``device`` (the
NCCL group of ``nccl_wire`` too): buffers are made on the group's device.

"Packed" is vLLM's wire layout (``packed_tensor.py``): tensors are flattened to bytes and concatenated into one
buffer per broadcast, a buffer closing as soon as it holds more than ``buffer_size_bytes``; both ends compute
the same split from the same (name, dtype, shape) list, so only the bytes travel.

Example::

    group = GlooTransferGroup("10.0.0.5", 51216, rank=0, world_size=2)      # the trainer; the server joins as 1
    packed_broadcast_producer(iter(model.named_parameters()), group, src=0, post_iter_func=lambda item: item[1])
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

DEFAULT_PACKED_BUFFER_SIZE_BYTES = 1 << 30  # vLLM's default (1 GiB); both ends must agree
DEFAULT_PACKED_NUM_BUFFERS = 2  # accepted for vLLM's signature; gloo on CPU has no streams to overlap
DEFAULT_TIMEOUT_S = 600.0


class GroupHandle:
    """What trainers reach through ``communicator.group``: TRL's ``close_communicator`` sets ``store`` and
    ``socket`` to None to let the rendezvous go (as on vLLM's ``StatelessProcessGroup``)."""

    def __init__(self, store):
        self.store = store
        self.socket = None


class GlooTransferGroup:
    """A two-ended gloo group for weight transfer, shaped like vLLM's ``PyNcclCommunicator`` (``broadcast``,
    ``rank``, ``world_size``, ``group``; ``device``, ``wait`` and ``abort`` as ``nccl_wire.NcclTransferGroup``).
    Rank 0 hosts the rendezvous store; the constructor returns once every rank has joined (or raises after
    ``timeout_s``)."""

    device = torch.device("cpu")

    def __init__(self, master_address: str, master_port: int, rank: int, world_size: int,
                 timeout_s: float = DEFAULT_TIMEOUT_S):
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore(master_address, int(master_port), int(world_size), is_master=rank == 0,
                              timeout=timeout, wait_for_workers=False)
        # A prefix of our own: the store may be shared with nothing else, but keys stay readable in a dump.
        self.process_group = dist.ProcessGroupGloo(dist.PrefixStore("unsloth_rollout/weight_transfer", store),
                                                   int(rank), int(world_size), timeout)
        self.rank, self.world_size = int(rank), int(world_size)
        self.group = GroupHandle(store)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, stream=None) -> None:
        """Broadcast ``tensor`` (a contiguous CPU tensor) from rank ``src`` of this group, in place on the others."""
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = int(src), 0
        self.process_group.broadcast([tensor], opts).wait()

    def wait(self, timeout_s: float) -> None:
        """Nothing is left in flight: each gloo broadcast returns complete (or raises after the group's timeout)."""

    def abort(self) -> None:
        """Nothing to abort: a failed gloo broadcast has already raised."""


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().view(torch.uint8).view(-1)


def packed_broadcast_producer(iterator: Iterator[tuple[str, torch.Tensor]], group, src: int,
                              post_iter_func: Callable[[tuple[str, torch.Tensor]], torch.Tensor],
                              buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES,
                              num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS) -> None:
    """Send every tensor of ``iterator`` in packed buffers (vLLM's ``packed_nccl_broadcast_producer`` signature).

    Each tensor's bytes are copied as it is yielded: a sender may change a tensor after yielding it (TRL's PEFT
    sync unmerges the adapter in place once the last merged weight is yielded), and a buffer of views would then
    send what the tensor became, not what was yielded."""
    parts, size = [], 0
    for item in iterator:
        flat = _as_bytes(post_iter_func(item)).to(group.device, copy=True)
        parts.append(flat)
        size += flat.numel()
        if size > buffer_size_bytes:
            group.broadcast(torch.cat(parts), src=src)
            parts, size = [], 0
    if parts:
        group.broadcast(torch.cat(parts), src=src)


def packed_broadcast_consumer(metadata: list[tuple[str, list[int], torch.dtype]], group, src: int,
                              post_unpack_func: Callable[[list[tuple[str, torch.Tensor]]], None],
                              buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES) -> None:
    """Receive the tensors ``metadata`` announces, split as the producer packed them; hand each buffer's
    ``[(name, tensor)]`` to ``post_unpack_func`` (the tensors are views of a fresh buffer)."""
    chunk, size = [], 0

    def flush():
        buf = torch.empty(size, dtype=torch.uint8, device=group.device)
        group.broadcast(buf, src=src)
        pieces = buf.split([n for _, _, _, n in chunk]) if chunk else []
        post_unpack_func([(name, piece.view(dtype).view(shape)) for (name, shape, dtype, _), piece
                          in zip(chunk, pieces)])

    for name, shape, dtype in metadata:
        nbytes = math.prod(shape) * dtype.itemsize
        chunk.append((name, list(shape), dtype, nbytes))
        size += nbytes
        if size > buffer_size_bytes:
            flush()
            chunk, size = [], 0
    if chunk:
        flush()


def broadcast_one_by_one_consumer(metadata: list[tuple[str, list[int], torch.dtype]], group, src: int,
                                  post_unpack_func: Callable[[list[tuple[str, torch.Tensor]]], None]) -> None:
    """The unpacked layout (vLLM's ``packed=False``): one broadcast per tensor, in its own dtype."""
    for name, shape, dtype in metadata:
        t = torch.empty(shape, dtype=dtype, device=group.device)
        group.broadcast(t, src=src)
        post_unpack_func([(name, t)])


def broadcast_one_by_one_producer(iterator: Iterator[tuple[str, torch.Tensor]], group, src: int) -> None:
    for _, tensor in iterator:
        group.broadcast(tensor.detach().to(group.device).contiguous(), src=src)
