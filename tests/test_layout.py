"""The package's shape, checked from the source with ``ast`` (docs/architecture.md, "Layers").

Every import counts, also one inside a function: a lazy import is still a dependency, it only hides a cycle.
The layers, bottom up: ``errors`` < ``models`` < ``engine`` < front ends (serve, areal, trl, bench, testing).
Inside the engine, code sits where it belongs, not where a line cap leaves room: the decode variants in one
package behind one interface, the choice among them in one module, no module reaching into another object's
private state, torch's and transformers' private parts in one module (engine/internals.py).
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "unsloth_rollout"
FRONT_ENDS = ("serve", "areal", "trl", "bench", "testing", "cli")
MAX_ROLLOUT_ENGINE_LINES = 250
ENGINE = ROOT / "engine"
DECODE = ENGINE / "decode"


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

@pytest.mark.parametrize("layer", LAYERS)
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


def test_rollout_engine_class_is_at_most_250_lines():
    tree = ast.parse((ROOT / "engine" / "engine.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "RolloutEngine")
    lines = cls.end_lineno - cls.lineno + 1
    assert lines <= MAX_ROLLOUT_ENGINE_LINES, f"RolloutEngine is {lines} lines"


# ============================================================================ the engine's shape
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def _engine_modules() -> list[Path]:
    return sorted(ENGINE.rglob("*.py"))


def _on_self(node: ast.Attribute) -> bool:
    return isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")


def _private(name) -> bool:
    return isinstance(name, str) and name.startswith("_") and not name.startswith("__")


def _defined_privates(paths) -> set[str]:
    """Underscore attributes the project defines: ``self._x = ...``, and the methods, class attributes and fields
    named ``_x`` of its classes."""
    names = set()
    for path in paths:
        for node in ast.walk(_tree(path)):
            if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    for a in ast.walk(t):
                        if isinstance(a, ast.Attribute) and _on_self(a) and _private(a.attr):
                            names.add(a.attr)
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and _private(item.name):
                        names.add(item.name)
                    targets = (item.targets if isinstance(item, ast.Assign) else
                               [item.target] if isinstance(item, ast.AnnAssign) else [])
                    names.update(t.id for t in targets if isinstance(t, ast.Name) and _private(t.id))
    return names


def _private_uses(path: Path, names: set[str] | None) -> list[str]:
    """``obj._x`` and ``getattr(obj, "_x")`` in ``path`` on an object other than ``self`` / ``cls`` (``names``: only
    those attributes; None: any, and imports from a private module such as ``torch._dynamo`` too)."""
    out = []
    for node in ast.walk(_tree(path)):
        attr = None
        if isinstance(node, ast.Attribute) and not _on_self(node):
            attr = node.attr
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) > 1
              and isinstance(node.args[1], ast.Constant)):
            attr = node.args[1].value
        elif isinstance(node, ast.ImportFrom) and names is None and node.module:
            attr = next((p for p in node.module.split(".") if _private(p)), None)
        if _private(attr) and (names is None or attr in names):
            out.append(f"{path.name}:{node.lineno}: {ast.unparse(node)[:80]}")
    return out


def test_no_engine_module_reaches_into_another_object_s_private_state():
    """No module of engine/ reads or writes an underscore attribute the project defines on another object: what a
    part needs is passed to it (the decode variants get a ``DecodeContext``)."""
    names = _defined_privates(sorted(ROOT.rglob("*.py")))
    bad = [use for path in _engine_modules() for use in _private_uses(path, names)]
    assert not bad, "\n".join(bad)


def test_torch_and_transformers_private_parts_go_through_one_module():
    bad = [use for path in _engine_modules() if path.name != "internals.py" for use in _private_uses(path, None)]
    assert not bad, "\n".join(bad)


def test_the_private_state_checker_sees_a_reach_and_leaves_self_alone(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("class A:\n    def __init__(self):\n        self._x = 1\n    def f(self, b):\n"
                   "        return self._x + b._x + getattr(b, '_x') + b._y\n")
    assert _defined_privates([src]) == {"_x"}
    assert len(_private_uses(src, {"_x"})) == 2 and len(_private_uses(src, None)) == 3


def test_the_decode_variants_live_in_one_package():
    """engine/decode/ holds every decode variant, one module each, behind one interface (``DecodeStep``), and
    engine/ holds no ``decode_*`` module outside it."""
    from unsloth_rollout.engine.decode.choose import BACKENDS
    from unsloth_rollout.engine.decode.step import DecodeStep

    assert not sorted(p.name for p in ENGINE.glob("decode_*.py"))
    variants = {}
    for path in sorted(DECODE.glob("*.py")):
        module = __import__(_module_name(path), fromlist=["_"])
        steps = [c for c in vars(module).values() if isinstance(c, type) and issubclass(c, DecodeStep)
                 and c is not DecodeStep and c.__module__ == module.__name__]
        assert len(steps) <= 1, f"{path.name}: {steps}"
        variants.update({c.name: path.name for c in steps})
    assert set(variants) == set(BACKENDS), variants


def test_only_the_choice_module_tells_the_variants_apart():
    """Only engine/decode/choose.py compares anything with a variant's name: the whole choice is read there."""
    from unsloth_rollout.engine.decode.choose import BACKENDS

    bad = []
    for path in _engine_modules():
        if path == DECODE / "choose.py":
            continue
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.Compare):
                consts = [c.value for c in ast.walk(node) if isinstance(c, ast.Constant)]
                if any(c in BACKENDS for c in consts):
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not bad, "\n".join(bad)


def test_the_decode_package_sits_below_the_step_loop():
    """The decode variants know the model, the pool and the attention; never the loop that calls them."""
    above = {f"unsloth_rollout.engine.{m}" for m in ("core", "engine", "scheduler", "worker", "inbox", "runner",
                                                      "streams", "output", "sampler", "stats")}
    bad = sorted(f"{n} imports {t}" for n, ts in _graph().items() if n.startswith("unsloth_rollout.engine.decode")
                 for t in ts if t in above)
    assert not bad, "\n".join(bad)


def test_the_runner_and_the_decode_steps_take_their_config_whole():
    """``ModelRunner`` takes the EngineConfig, the decode variants a ``DecodeContext`` holding the DecodeConfig:
    no setting travels as a loose parameter."""
    import dataclasses
    import inspect

    from unsloth_rollout.engine.config import DecodeConfig, EngineConfig
    from unsloth_rollout.engine.decode.steps import DecodeSteps
    from unsloth_rollout.engine.runner import ModelRunner

    settings = {f.name for cfg in (EngineConfig, DecodeConfig) for f in dataclasses.fields(cfg)} - {"decode"}
    for fn in (ModelRunner.__init__, DecodeSteps.__init__):
        params = set(inspect.signature(fn).parameters)
        assert not params & settings, (fn.__qualname__, params & settings)
    assert "config" in inspect.signature(ModelRunner.__init__).parameters


def test_the_scheduler_decides_and_the_core_runs_the_plan():
    """Block allocation, preemption and the prefix cache's lookups and inserts live with the scheduler: the core
    (under 250 lines, the step and little else) calls none of them."""
    path = ENGINE / "core.py"
    lines = len(path.read_text().splitlines())
    assert lines < 250, f"engine/core.py is {lines} lines"
    decisions = {"allocate", "preempt", "share", "lookup", "insert", "longest_prefix", "evict_for", "drop"}
    bad = [f"core.py:{n.lineno}: {ast.unparse(n)[:80]}" for n in ast.walk(_tree(path))
           if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in decisions]
    assert not bad, "\n".join(bad)
