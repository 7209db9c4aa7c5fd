"""The ``unsloth`` backend string, parsed without AReaL's grammar (which knows only sglang/vllm until install()).

Example::

    >>> parse_unsloth_backend("unsloth:d1")
    UnslothBackendSpec(name=None, dp=1, tp=1, pp=1)
    >>> parse_unsloth_backend("unsloth:d2").dp   # two data-parallel replicas (see distributed.py)
    2
"""

from __future__ import annotations

import re
from dataclasses import dataclass

BACKEND_NAME = "unsloth"

_SPEC = re.compile(r"^\s*unsloth\s*(?:\[\s*(?P<name>[A-Za-z_][A-Za-z0-9_]*)\s*\])?\s*:"
                   r"\s*(?P<dims>(?:[dtp]\s*[1-9][0-9]*\s*)+)$")
_DIM = re.compile(r"([dtp])\s*([1-9][0-9]*)")


@dataclass(frozen=True)
class UnslothBackendSpec:
    name: str | None
    dp: int
    tp: int = 1
    pp: int = 1


def is_unsloth_backend(spec) -> bool:
    """True when a backend string (``rollout.backend`` / ``actor.backend``) names the unsloth backend."""
    return isinstance(spec, str) and spec.strip().startswith(BACKEND_NAME) and (
        spec.strip()[len(BACKEND_NAME):].lstrip()[:1] in ("[", ":"))


def parse_unsloth_backend(spec: str) -> UnslothBackendSpec:
    """Parse ``"unsloth:d1"`` / ``"unsloth[rollout]:d1"``; raise ValueError naming the field otherwise."""
    m = _SPEC.match(spec or "")
    if m is None:
        raise ValueError(f"backend: expected 'unsloth:d<N>' (e.g. 'unsloth:d1'), got {spec!r}")
    dims = {k: int(v) for k, v in _DIM.findall(m.group("dims"))}
    out = UnslothBackendSpec(m.group("name"), dims.get("d", 1), dims.get("t", 1), dims.get("p", 1))
    if out.tp != 1 or out.pp != 1:
        from .distributed import SUPPORTED_SHAPES, UnsupportedParallelismError

        raise UnsupportedParallelismError(f"backend: {spec!r} asks for tensor/pipeline parallelism inside a "
                                          f"replica; the unsloth backend runs {SUPPORTED_SHAPES}")
    return out
