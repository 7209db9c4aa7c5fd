"""The package's layering, checked from the source with ``ast`` (docs/architecture.md, "Layers").

Every import counts, also one inside a function: a lazy import is still a dependency, it only hides a cycle.
The layers, bottom up: ``errors`` < ``models`` < ``engine`` < front ends (serve, areal, trl, bench, testing).
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "unsloth_rollout"
FRONT_ENDS = ("serve", "areal", "trl", "bench", "testing", "cli")
MAX_ENGINE_FILE_LINES = 400
MAX_ROLLOUT_ENGINE_LINES = 250


def _module_name(path: Path) -> str:
    parts = ("unsloth_rollout",) + path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.lru_cache(maxsize=None)
def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules ``name`` imports (a ``from pkg import sub`` of a submodule counts as ``pkg.sub``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")
                up = up[: len(up) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:  # ``import unsloth_rollout.engine.core as x`` or an attribute
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


@functools.lru_cache(maxsize=None)
def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {n: _imports(n, p, set(mods)) for n, p in mods.items()}


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _without_packages(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """A package's ``__init__`` only re-exports: an import of the package stands for the modules it re-exports,
    so ``engine/__init__`` -> ``engine.engine`` -> ``engine.config`` is no cycle of ``engine.engine``."""
    packages = {n for n, p in _modules().items() if p.name == "__init__.py"}

    def expand(t, seen=()):
        if t not in packages:
            return {t}
        return set().union(*(expand(u, seen + (t,)) for u in graph[t] if u not in seen and u.startswith(t + ".")),
                           set())

    return {n: set().union(*(expand(t) for t in ts), set()) - {n} for n, ts in graph.items() if n not in packages}


LAYERS = sorted({_layer(n) for n in _modules()} - {""})

# Rules the package does not meet yet, each with why: expected to fail until it does (strict=False, so the
# case passes as soon as it holds). A rule the package meets is never listed.
PENDING: dict[str, str] = {}  # every rule holds


def _pending(case: str):
    why = PENDING.get(case)
    return pytest.param(case, marks=pytest.mark.xfail(reason=why, strict=False)) if why else case


@pytest.mark.parametrize("layer", [_pending(layer) for layer in LAYERS])
def test_the_package_has_no_import_cycles(layer):
    """One case per top-level module or package: the cycles any of its modules is part of."""
    cycles = [c for c in _cycles(_without_packages(_graph())) if any(_layer(m) == layer for m in c)]
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_the_engine_imports_nothing_above_it():
    bad = sorted(f"{n} imports {t}" for n, ts in _graph().items() if _layer(n) == "engine"
                 for t in ts if _layer(t) in FRONT_ENDS)
    assert not bad, "\n".join(bad)


def test_the_models_layer_does_not_import_the_engine():
    bad = sorted(f"{n} imports {t}" for n, ts in _graph().items() if _layer(n) in ("models", "errors")
                 for t in ts if _layer(t) == "engine")
    assert not bad, "\n".join(bad)


def test_the_models_layer_imports_no_front_end():
    bad = sorted(f"{n} imports {t}" for n, ts in _graph().items() if _layer(n) in ("models", "errors")
                 for t in ts if _layer(t) in FRONT_ENDS)
    assert not bad, "\n".join(bad)


def test_the_errors_module_imports_nothing_of_the_package():
    assert not _graph()["unsloth_rollout.errors"]


def test_the_checker_sees_a_cycle_and_an_upward_import():
    # The rules above must be able to fail: a made-up graph with one of each.
    graph = {"unsloth_rollout.engine.a": {"unsloth_rollout.engine.b"},
             "unsloth_rollout.engine.b": {"unsloth_rollout.engine.a", "unsloth_rollout.serve.x"}}
    assert _cycles(graph) == [["unsloth_rollout.engine.a", "unsloth_rollout.engine.b"]]
    assert _layer("unsloth_rollout.serve.x") in FRONT_ENDS
    # A lazy import inside a function counts, and ``from . import x`` of a submodule names the submodule.
    assert "unsloth_rollout.models.weights" in _graph()["unsloth_rollout.engine.engine"]
    assert "unsloth_rollout.models.adapters" in _graph()["unsloth_rollout.models.weights"]


@pytest.mark.parametrize("name", [_pending(p.name) for p in sorted((ROOT / "engine").glob("*.py"))])
def test_no_engine_file_is_over_400_lines(name):
    n = len((ROOT / "engine" / name).read_text().splitlines())
    assert n <= MAX_ENGINE_FILE_LINES, f"engine/{name} is {n} lines"


def test_rollout_engine_class_is_at_most_250_lines():
    tree = ast.parse((ROOT / "engine" / "engine.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "RolloutEngine")
    lines = cls.end_lineno - cls.lineno + 1
    assert lines <= MAX_ROLLOUT_ENGINE_LINES, f"RolloutEngine is {lines} lines"
