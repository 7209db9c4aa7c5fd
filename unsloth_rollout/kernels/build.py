"""Build the engine's C++ CPU kernels (``csrc/``) once per machine, outside the request path.

``build_library(name)`` compiles ``csrc/<name>.cpp`` with the system C++ compiler (``$CXX``, else ``g++`` or
``c++``) as ``-O3 -march=native -fopenmp``, linked to the GNU OpenMP runtime torch loaded (so the kernel's
threads are torch's thread team, not a second one), into ``~/.cache/unsloth_rollout/kernels``
(``UNSLOTH_ROLLOUT_KERNEL_DIR``), named by a hash of the source, the flags, the compiler's version, the CPU and
the runtime: a changed source, compiler or machine builds anew, and concurrent builders each write a file of
their own and rename it into place. The compiler runs with fixed arguments; no request data reaches it.
A source that registers a torch op (``torch_headers=True``) also includes torch's C++ headers and links its
libraries; torch's version and location are then part of the key, and so are the libraries it links (``link``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Callable

import torch

log = logging.getLogger(__name__)

_CSRC = Path(__file__).with_name("csrc")
_FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17")


def openmp_runtime() -> str | None:
    """The GNU OpenMP runtime torch loaded, to link against: the kernel's threads are torch's team, not a second
    one (other wheels, e.g. sentencepiece, load GNU OpenMP copies of their own under other names)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libgomp" in line.rsplit("/", 1)[-1]}
    except OSError:
        return None
    # site-packages: torch/lib or torch.libs; resolved, as the maps are (a virtualenv reached through a symlink)
    root = os.path.realpath(os.path.dirname(os.path.dirname(torch.__file__)))
    mine = sorted(p for p in paths if os.path.realpath(p).startswith(os.path.join(root, "torch")))
    return mine[0] if mine else None


def _cpu_id() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features", "CPU part"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor()


def _cache_dir() -> Path:
    d = os.environ.get("UNSLOTH_ROLLOUT_KERNEL_DIR")
    return Path(d) if d else Path.home() / ".cache" / "unsloth_rollout" / "kernels"


def _torch_flags() -> tuple[list[str], str]:
    """Compiler flags for a source that includes torch's C++ headers and links its libraries, and what in them
    names the torch it is built against (part of the library's key)."""
    from torch.utils.cpp_extension import include_paths

    lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", 1))
    flags = [*(f"-I{p}" for p in include_paths()), f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-w", f"-L{lib}",
             "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{lib}"]
    return flags, f"{torch.__version__} {torch.__file__} {abi}"


def build_library(name: str, *, torch_headers: bool = False, link: tuple[Path, ...] = (),
                  flags: tuple[str, ...] = ()) -> Path:
    """The path of ``csrc/<name>.cpp`` built as a shared library (built now if this machine has none yet).
    ``torch_headers``: the source includes torch's C++ API (a torch op registration), built against this
    process's torch; ``link``: libraries built here that it calls into (their paths are part of its key);
    ``flags``: compiler flags of this library beyond the common ones (part of its key)."""
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++ / c++ / $CXX) on PATH")
    gomp = openmp_runtime()
    if gomp is None:
        raise RuntimeError("torch did not load GNU OpenMP (libgomp) in this process")
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
    source = _CSRC / f"{name}.cpp"
    src = source.read_bytes()
    extra, torch_id = _torch_flags() if torch_headers else ([], "")
    deps = [str(p) for p in link]
    for d in deps:
        extra += [d, f"-Wl,-rpath,{os.path.dirname(d)}"]
    parts = [src, " ".join(_FLAGS + tuple(flags)).encode(), version.encode(), _cpu_id().encode(),
             platform.machine().encode(), gomp.encode()]
    if torch_id or deps:
        parts += [torch_id.encode(), " ".join(deps).encode()]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    out = _cache_dir() / f"{name}-{key}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
        try:
            cmd = [cxx, *_FLAGS, *flags, str(source), "-o", tmp, *extra, gomp, f"-Wl,-rpath,{os.path.dirname(gomp)}"]
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            if r.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed: {r.stderr.strip()[-2000:]}")
            os.replace(tmp, out)  # atomic: a concurrent process sees the whole library or none
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return out


class LazyLibrary:
    """A kernel library built and loaded on its first use, once per process (``load``: build it, bind its
    functions, return it). ``get()`` is the library, or None where ``load`` raised (no compiler, a failed build);
    ``error`` says why, and a warning names ``what`` falls back to (``unavailable``)."""

    def __init__(self, load: Callable[[], object], what: str, unavailable: str):
        self._load, self.what, self.unavailable = load, what, unavailable
        self._lock = threading.Lock()
        self.lib = None
        self.error: str | None = None
        self.tried = False

    def get(self):
        if self.tried:
            return self.lib
        with self._lock:
            if not self.tried:
                try:
                    self.lib = self._load()
                except Exception as e:  # noqa: BLE001 - the caller's fallback (``unavailable``) serves
                    self.error = f"{type(e).__name__}: {e}"
                    log.warning("%s unavailable (%s); %s", self.what, self.error, self.unavailable)
                self.tried = True
        return self.lib
