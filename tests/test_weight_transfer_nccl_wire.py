"""The server's end of vLLM's NCCL weight-transfer rendezvous (``models/nccl_wire.py``), checked on CPU.

NCCL itself needs CUDA devices (its broadcasts are checked on a GPU by ``benchmarks/gpu/weight_transfer_check.py``);
what comes before the first NCCL call is plain TCP and pickle, and is checked here against vLLM's trainer end
rewritten from vLLM's source in a separate process: ``StatelessProcessGroup.create`` (a listening socket handed to a
``TCPStore`` master that waits for ``world_size`` members) and ``broadcast_obj`` of a ``PyNcclCommunicator``'s
unique id, a ctypes ``ncclUniqueId`` pickled under vLLM's own module path (a stub of that one module here).
"""

import ctypes
import os
import pickle
import subprocess
import sys

import pytest

from unsloth_rollout.models.nccl_wire import (NcclUniqueId, UniqueIdError, dump_unique_id, join_store, load_unique_id,
                                             receive_unique_id)
from unsloth_rollout.testing.server import free_port

# vllm/distributed/device_communicators/pynccl_wrapper.py: the class the unique id is pickled as.
PYNCCL_WRAPPER = """
import ctypes


class ncclUniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * 128)]
"""

# vLLM's trainer end up to the first NCCL call: StatelessProcessGroup.create(host, port, rank=0, world_size=2), then
# PyNcclCommunicator's group.broadcast_obj(unique_id, src=0); it then waits for the worker's word before closing.
TRAINER = """
import datetime, pickle, socket, sys
import torch.distributed as dist
from vllm.distributed.device_communicators.pynccl_wrapper import ncclUniqueId

host, port, id_hex = sys.argv[1], int(sys.argv[2]), sys.argv[3]
listen_socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
listen_socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
listen_socket.bind((host, port))
listen_socket.listen()
print("listening", flush=True)
store = dist.TCPStore(host_name=host, port=port, world_size=2, is_master=True,
                      timeout=datetime.timedelta(seconds=20), use_libuv=False,
                      master_listen_fd=listen_socket.fileno())
print("members joined", flush=True)
unique_id = ncclUniqueId()
for i, b in enumerate(bytes.fromhex(id_hex)):
    unique_id.internal[i] = b - 256 if b > 127 else b
store.set("broadcast_from/0/0", pickle.dumps(unique_id))
print(store.get("worker_read").decode(), flush=True)
del store  # the store closes the listening socket it was handed (the daemon polls it until then)
listen_socket.detach()
"""


@pytest.fixture(scope="module")
def vllm_stub(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_stub")
    pkg = root / "vllm" / "distributed" / "device_communicators"
    pkg.mkdir(parents=True)
    for d in (root / "vllm", root / "vllm" / "distributed", pkg):
        (d / "__init__.py").write_text("")
    (pkg / "pynccl_wrapper.py").write_text(PYNCCL_WRAPPER)
    (root / "trainer.py").write_text(TRAINER)
    return root


def test_the_server_joins_vllms_rendezvous_and_reads_the_trainers_unique_id(vllm_stub):
    """A worker's join counts as a member (vLLM's trainer store returns from its constructor only then) and the
    unique id read back is the 128 bytes the trainer pickled under vLLM's class."""
    port, uid = free_port(), os.urandom(128)
    trainer = subprocess.Popen([sys.executable, str(vllm_stub / "trainer.py"), "127.0.0.1", str(port), uid.hex()],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env=dict(os.environ, PYTHONPATH=str(vllm_stub)))
    try:
        assert trainer.stdout.readline().strip() == "listening"
        store = join_store("127.0.0.1", port, world_size=2, timeout_s=20)
        assert receive_unique_id(store) == uid
        store.set("worker_read", "worker read the id")
        out, _ = trainer.communicate(timeout=30)
    finally:
        if trainer.poll() is None:
            trainer.kill()
    assert trainer.returncode == 0 and out.splitlines() == ["members joined", "worker read the id"], out


class _Call:
    def __reduce__(self):
        return (os.system, ("touch should-not-exist",))


def test_a_store_value_that_is_not_a_unique_id_is_refused_and_never_run(tmp_path, monkeypatch):
    """The id comes from a store any host that reaches the port can write: only ctypes' reconstructor and the
    ``ncclUniqueId`` class are resolved, so a pickled call is refused by name, not made."""
    monkeypatch.chdir(tmp_path)
    for protocol in range(3, pickle.HIGHEST_PROTOCOL + 1):  # bytes pickle as bytes from protocol 3 on
        with pytest.raises(UniqueIdError, match="posix.system|os.system"):
            load_unique_id(pickle.dumps(_Call(), protocol=protocol))
        with pytest.raises(UniqueIdError, match="expected an ncclUniqueId"):
            load_unique_id(pickle.dumps(b"\x00" * 128, protocol=protocol))
    assert not (tmp_path / "should-not-exist").exists()
    with pytest.raises(UniqueIdError, match="no readable pickle"):
        load_unique_id(b"\x80\x04not a pickle")


@pytest.mark.parametrize("protocol", [3, 4, 5])
def test_the_unique_id_reads_as_pickle_writes_it(protocol):
    """The id parser against the pickle module itself, both ways: every protocol vLLM's ``broadcast_obj`` may use
    reads back as the same 128 bytes, and the hand-written stream ``publish_unique_id`` stores unpickles (as vLLM's
    worker reads it) to the same id."""
    uid = os.urandom(128)
    obj = NcclUniqueId()
    ctypes.memmove(ctypes.addressof(obj), uid, 128)
    assert load_unique_id(pickle.dumps(obj, protocol=protocol)) == uid
    back = pickle.loads(dump_unique_id(uid))
    assert isinstance(back, NcclUniqueId) and bytes(back.internal) == uid
    assert load_unique_id(dump_unique_id(uid)) == uid


def test_our_trainer_end_meets_the_worker_end_as_vllms_does():
    """``host_store`` + ``publish_unique_id`` (the trainer end a CUDA trainer without vLLM uses, as
    ``NcclTransferGroup.host``) against the worker end: the host returns once the worker is in, and the worker reads
    the id the host published."""
    import ctypes
    from concurrent.futures import ThreadPoolExecutor

    from unsloth_rollout.models.nccl_wire import NcclUniqueId, host_store, publish_unique_id

    port, uid = free_port(), NcclUniqueId()
    ctypes.memmove(uid.internal, bytes(range(128)), 128)
    with ThreadPoolExecutor(1) as ex:
        hosted = ex.submit(host_store, "127.0.0.1", port, 2, 60)
        worker = join_store("127.0.0.1", port, world_size=2, timeout_s=60)  # the client retries until it listens
        host = hosted.result(timeout=60)
    publish_unique_id(host, uid)
    assert receive_unique_id(worker) == bytes(range(128))
