"""vLLM's NCCL weight-transfer wire without vLLM: the server joins a trainer's group as vLLM's worker does.

vLLM's NCCL weight-transfer engine (``vllm/distributed/weight_transfer/nccl_engine.py`` and ``nccl_common.py``),
which TRL 1.16's ``VLLMClient`` drives from the trainer (``trainer_init``, then ``packed_nccl_broadcast_producer``),
meets its workers in a ``StatelessProcessGroup`` (``vllm/distributed/utils.py``) and a ``PyNcclCommunicator``
(``vllm/distributed/device_communicators/pynccl.py``). The wire, read from that source:

1. the trainer (rank 0) hosts a ``TCPStore`` at ``master_address:master_port`` and waits until ``world_size``
   members have counted themselves in; each worker connects as a client (``wait_for_workers``: it counts itself);
2. the trainer pickles its NCCL unique id (a ctypes ``ncclUniqueId`` of vLLM's ``pynccl_wrapper``, 128 bytes) into
   the store under ``broadcast_from/0/0``;
3. every rank calls ``ncclCommInitRank(world_size, id, rank)`` on its device and runs one warm-up all-reduce
   (one float32 zero, sum), which the other ranks must match;
4. every tensor then travels by ``ncclBroadcast`` from rank 0: packed, as uint8 buffers (``weight_wire``'s split,
   vLLM's ``packed_tensor.py``), or one by one in each tensor's dtype.

``NcclTransferGroup.join`` is the worker's end of 1-3 over libnccl through ctypes (the library torch's CUDA build
loads), and ``broadcast`` is 4 on the caller's current stream. The unique id is never unpickled: its opcodes are
parsed and must spell ctypes' reconstructor, that one class and its 128 bytes, so a store value is never run as code. ``NcclTransferGroup.host``
is the trainer's end (vLLM's ``trainer_init``), for a trainer without vLLM installed (the GPU check).

Example::

    group = NcclTransferGroup.join("10.0.0.5", 51216, rank=1, world_size=2, device=torch.device("cuda", 0))
    packed_broadcast_consumer(metadata, group, 0, write)      # models.weight_wire, as over gloo
    group.wait(timeout_s=600)                                  # the received bytes are in place
"""

from __future__ import annotations

import ctypes
import datetime
import os
import socket
import time

import torch
import torch.distributed as dist

from .weight_wire import GroupHandle

UNIQUE_ID_KEY = "broadcast_from/0/0"  # StatelessProcessGroup.broadcast_obj's first key from rank 0
_NCCL_SUM = 0


class NcclUniqueId(ctypes.Structure):
    """NCCL's ``ncclUniqueId`` (vLLM's ``pynccl_wrapper.ncclUniqueId`` has the same single field)."""

    _fields_ = [("internal", ctypes.c_byte * 128)]


def _nccl_dtypes() -> dict:
    table = {torch.int8: 0, torch.uint8: 1, torch.int32: 2, torch.int64: 4, torch.float16: 6, torch.float32: 7,
             torch.float64: 8, torch.bfloat16: 9}
    for name, code in (("float8_e4m3fn", 10), ("float8_e5m2", 11)):  # NCCL >= 2.24
        if hasattr(torch, name):
            table[getattr(torch, name)] = code
    return table


class UniqueIdError(ValueError):
    """A value under the trainer's unique-id key that is not a pickled ``ncclUniqueId``."""


# Opcodes a pickled ncclUniqueId is made of (protocols 3-5: Python's default is 4 or 5): the two globals, an empty dict, the id's bytes, the
# tuples around them, one REDUCE, and the framing / memo bookkeeping. Anything else is refused before it is read.
_ID_OPCODES = {"PROTO", "FRAME", "GLOBAL", "STACK_GLOBAL", "SHORT_BINUNICODE", "BINUNICODE", "MEMOIZE", "BINPUT",
               "LONG_BINPUT", "PUT", "BINGET", "LONG_BINGET", "GET", "EMPTY_DICT", "SHORT_BINBYTES", "BINBYTES",
               "MARK", "TUPLE", "TUPLE2", "REDUCE", "STOP"}
_ID_CLASSES = ("ncclUniqueId", "NcclUniqueId")


def load_unique_id(data: bytes) -> bytes:
    """The 128 id bytes of a pickled ``ncclUniqueId`` (as vLLM's ``broadcast_obj`` stores it); raises
    ``UniqueIdError`` for anything else.

    The value comes from a store any host that reaches the port can write, so it is never unpickled: its opcodes are
    read with ``pickletools.genops`` (a parser that runs nothing) and the stream must be ctypes' reconstructor
    (``_ctypes._unpickle``) applied to an ``ncclUniqueId`` class (vLLM's, SGLang's or ours, by name) and its 128
    bytes."""
    import pickletools

    globals_, strings, payload = [], [], []
    try:
        for op, arg, _ in pickletools.genops(data):
            if op.name not in _ID_OPCODES:
                raise UniqueIdError(f"the trainer's store holds a pickle with {op.name}; expected an ncclUniqueId")
            if op.name in ("SHORT_BINUNICODE", "BINUNICODE"):
                strings.append(arg)
            elif op.name in ("GLOBAL", "STACK_GLOBAL"):
                if op.name == "STACK_GLOBAL" and len(strings) < 2:
                    raise UniqueIdError("the trainer's store holds a malformed pickle")
                module, name = arg.split(" ", 1) if op.name == "GLOBAL" else strings[-2:]
                if (module, name) != ("_ctypes", "_unpickle") and not _is_id_class(module, name):
                    raise UniqueIdError(f"the NCCL unique id in the trainer's store names {module}.{name}; only a "
                                        f"ctypes ncclUniqueId is accepted")
                globals_.append((module, name))
            elif op.name in ("SHORT_BINBYTES", "BINBYTES"):
                payload.append(arg)
    except (ValueError, EOFError) as exc:  # genops' own complaints about a truncated or unknown stream
        if isinstance(exc, UniqueIdError):
            raise
        raise UniqueIdError(f"the trainer's store holds no readable pickle: {exc}") from None
    if len(globals_) != 2 or not _is_id_class(*globals_[1]) or len(payload) != 1 or len(payload[0]) != 128:
        raise UniqueIdError("expected an ncclUniqueId (ctypes' reconstructor, the class and 128 bytes) in the "
                            "trainer's store")
    return bytes(payload[0])


def _is_id_class(module: str, name: str) -> bool:
    return name in _ID_CLASSES and (module.rsplit(".", 1)[-1] == "pynccl_wrapper" or module == __name__)


def dump_unique_id(uid: bytes, module: str = __name__) -> bytes:
    """``pickle.dumps`` of an ``ncclUniqueId`` of class ``module.NcclUniqueId``, written opcode by opcode (protocol
    3): what ``load_unique_id`` and ``pickle.loads`` read back as the same 128 bytes."""
    uid = bytes(uid)
    if len(uid) != 128:
        raise ValueError(f"an NCCL unique id is 128 bytes, got {len(uid)}")
    return (b"\x80\x03" + b"c_ctypes\n_unpickle\n" + b"c" + module.encode() + b"\nNcclUniqueId\n"
            + b"}" + b"C\x80" + uid + b"\x86" + b"\x86" + b"R" + b".")


def join_store(master_address: str, master_port: int, world_size: int, timeout_s: float):
    """Connect to the trainer's ``TCPStore`` as one member of vLLM's ``StatelessProcessGroup``: the client counts
    itself in (the trainer's store constructor waits for ``world_size`` members)."""
    return dist.TCPStore(master_address, int(master_port), int(world_size), is_master=False,
                         timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=True)


def host_store(master_address: str, master_port: int, world_size: int, timeout_s: float):
    """The trainer's side of the same rendezvous (``StatelessProcessGroup.create`` at rank 0): a store served on a
    socket bound to ``master_address:master_port``; returns once ``world_size`` members (itself included) are in."""
    listen = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listen.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listen.bind((master_address, int(master_port)))
    listen.listen()
    store = dist.TCPStore(master_address, int(master_port), int(world_size), is_master=True,
                          timeout=datetime.timedelta(seconds=timeout_s), use_libuv=False,
                          master_listen_fd=listen.fileno())
    listen.detach()  # the store owns the listening socket now (it closes it when it goes)
    return store


def publish_unique_id(store, uid: NcclUniqueId) -> None:
    """Rank 0's ``broadcast_obj`` of its NCCL unique id: pickled, under the key workers read."""
    store.set(UNIQUE_ID_KEY, dump_unique_id(bytes(uid.internal) if isinstance(uid, NcclUniqueId) else uid))


def receive_unique_id(store) -> bytes:
    """The trainer's NCCL unique id from its store (blocks until it is there, up to the store's timeout)."""
    return load_unique_id(store.get(UNIQUE_ID_KEY))


def find_nccl_library() -> str:
    """The libnccl to open: ``$UNSLOTH_ROLLOUT_NCCL_SO``, else the ``nvidia-nccl`` wheel's library next to torch's
    CUDA build, else ``libnccl.so.2`` from the loader's path (torch has usually loaded it by then)."""
    path = os.environ.get("UNSLOTH_ROLLOUT_NCCL_SO")
    if path:
        return path
    try:
        import nvidia.nccl

        for root in nvidia.nccl.__path__:
            candidate = os.path.join(root, "lib", "libnccl.so.2")
            if os.path.exists(candidate):
                return candidate
    except ImportError:
        pass
    return "libnccl.so.2"


class NcclLibrary:
    """The few libnccl entry points the transfer uses, through ctypes (each call releases the GIL)."""

    def __init__(self, path: str | None = None):
        lib = ctypes.CDLL(path or find_nccl_library())
        vp, i, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
        lib.ncclGetErrorString.restype = ctypes.c_char_p
        lib.ncclGetErrorString.argtypes = [i]
        for name, args in (("ncclGetVersion", [ctypes.POINTER(i)]),
                           ("ncclGetUniqueId", [ctypes.POINTER(NcclUniqueId)]),
                           ("ncclCommInitRank", [ctypes.POINTER(vp), i, NcclUniqueId, i]),
                           ("ncclAllReduce", [vp, vp, sz, i, i, vp, vp]),
                           ("ncclBroadcast", [vp, vp, sz, i, i, vp, vp]),
                           ("ncclCommGetAsyncError", [vp, ctypes.POINTER(i)]),
                           ("ncclCommAbort", [vp])):
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = i, args
        self.lib = lib
        self.dtypes = _nccl_dtypes()

    def check(self, result: int, what: str) -> None:
        if result != 0:
            raise RuntimeError(f"NCCL {what} failed: {self.lib.ncclGetErrorString(result).decode()} ({result})")

    def version(self) -> str:
        v = ctypes.c_int()
        self.check(self.lib.ncclGetVersion(ctypes.byref(v)), "ncclGetVersion")
        major, rest = divmod(v.value, 10000)  # NCCL_VERSION_CODE since 2.9: major * 10000 + minor * 100 + patch
        return f"{major}.{rest // 100}.{rest % 100}"

    def unique_id(self) -> NcclUniqueId:
        uid = NcclUniqueId()
        self.check(self.lib.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
        return uid

    def dtype(self, t: torch.dtype) -> int:
        if t not in self.dtypes:
            raise TypeError(f"NCCL cannot broadcast dtype {t}")
        return self.dtypes[t]


class NcclTransferGroup:
    """A trainer-and-workers NCCL group as vLLM's weight transfer builds it, shaped like ``GlooTransferGroup``
    (``broadcast``, ``rank``, ``world_size``, ``device``, ``group``). Build one with ``join`` (a worker: this
    server) or ``host`` (the trainer, rank 0)."""

    def __init__(self, nccl: NcclLibrary, store, unique_id: bytes, rank: int, world_size: int,
                 device: torch.device):
        device = torch.device(device)
        if device.index is None:  # "cuda": the current device, named by index so tensors' devices compare equal
            device = torch.device(device.type, torch.cuda.current_device())
        self.nccl, self.rank, self.world_size, self.device = nccl, int(rank), int(world_size), device
        self.group = GroupHandle(store)
        uid = NcclUniqueId()
        ctypes.memmove(uid.internal, unique_id, len(unique_id))
        comm = ctypes.c_void_p()
        with torch.cuda.device(self.device):
            nccl.check(nccl.lib.ncclCommInitRank(ctypes.byref(comm), self.world_size, uid, self.rank),
                       "ncclCommInitRank")
            self.comm = comm
            warm = torch.zeros(1, dtype=torch.float32, device=self.device)  # PyNcclCommunicator's warm-up
            self._call("ncclAllReduce", warm.data_ptr(), warm.data_ptr(), 1, nccl.dtype(torch.float32), _NCCL_SUM)
            torch.cuda.current_stream(self.device).synchronize()

    @classmethod
    def join(cls, master_address: str, master_port: int, rank: int, world_size: int, device: torch.device,
             timeout_s: float = 600.0, nccl: NcclLibrary | None = None) -> "NcclTransferGroup":
        """A worker's end (``rank`` >= 1): the trainer's store, its unique id, then the communicator."""
        nccl = nccl or NcclLibrary()
        store = join_store(master_address, master_port, world_size, timeout_s)
        return cls(nccl, store, receive_unique_id(store), rank, world_size, device)

    @classmethod
    def host(cls, master_address: str, master_port: int, world_size: int, device: torch.device,
             timeout_s: float = 300.0, nccl: NcclLibrary | None = None) -> "NcclTransferGroup":
        """The trainer's end (rank 0), as vLLM's ``trainer_init``: listen on ``master_address:master_port``, wait
        for the workers, publish the unique id, build the communicator."""
        nccl = nccl or NcclLibrary()
        store = host_store(master_address, master_port, world_size, timeout_s)
        uid = nccl.unique_id()
        publish_unique_id(store, uid)
        return cls(nccl, store, bytes(uid.internal), 0, world_size, device)

    def _call(self, name: str, send: int, recv: int, count: int, dtype: int, arg: int) -> None:
        stream = torch.cuda.current_stream(self.device).cuda_stream
        self.nccl.check(getattr(self.nccl.lib, name)(send, recv, count, dtype, arg, self.comm, stream), name)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, stream=None) -> None:
        """Broadcast ``tensor`` (contiguous, on this group's device) from rank ``src``, enqueued on the current
        stream (``wait`` blocks until it is done)."""
        if tensor.device != self.device or not tensor.is_contiguous():
            raise ValueError(f"NCCL broadcast needs a contiguous tensor on {self.device}, got one on {tensor.device}")
        send = tensor.data_ptr() if src == self.rank else None
        with torch.cuda.device(self.device):
            self._call("ncclBroadcast", send, tensor.data_ptr(), tensor.numel(), self.nccl.dtype(tensor.dtype), src)

    def wait(self, timeout_s: float) -> None:
        """Block until everything enqueued on the current stream is done; after ``timeout_s`` (a trainer gone
        mid-transfer) or an NCCL error, abort the communicator (this group is then unusable) and raise."""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        deadline = time.monotonic() + timeout_s
        state = ctypes.c_int()
        while not event.query():
            self.nccl.check(self.nccl.lib.ncclCommGetAsyncError(self.comm, ctypes.byref(state)),
                            "ncclCommGetAsyncError")
            if state.value not in (0, 7) or time.monotonic() > deadline:  # 7: ncclInProgress
                self.abort()
                reason = self.nccl.lib.ncclGetErrorString(state.value).decode() if state.value not in (0, 7) \
                    else f"no progress in {timeout_s:g} s"
                raise TimeoutError(f"the NCCL weight transfer did not complete ({reason}); the group is closed")
            time.sleep(0.001)

    def abort(self) -> None:
        """Close the communicator without waiting for the peer (what is in flight is dropped)."""
        if self.comm is not None:
            self.nccl.lib.ncclCommAbort(self.comm)
            self.comm = None

