"""The package's import graph read from source (every ``import``, including ones inside functions), for layout tests.

Reading the source instead of importing catches the lazy imports that hide circles until a rare code path runs.

Example::

    graph = import_graph()                              # {"unsloth_rollout.areal.backend": {...}, ...}
    assert not cycles(graph, within="unsloth_rollout.areal")
    private_uses(lambda mod: mod.startswith("areal"))  # [(file, line, "areal.x._name"), ...]
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parents[1]  # .../unsloth_rollout


def _modules(root: Path = PACKAGE_ROOT) -> dict[str, Path]:
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _absolute(module: str, path: Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imported_names(module: str, path: Path) -> list[tuple[int, str]]:
    """``(line, dotted name)`` for every name ``path`` imports, relative imports made absolute."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(module, path, node)
            out += [(node.lineno, f"{base}.{a.name}" if base else a.name) for a in node.names]
    return out


def import_graph(root: Path = PACKAGE_ROOT) -> dict[str, set[str]]:
    """Module -> the package modules it imports (``from .x import name`` counts as importing ``x``)."""
    mods = _modules(root)
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        for _, name in imported_names(mod, path):
            target = name
            while target and target not in mods:  # "pkg.mod.func" -> "pkg.mod"
                target = target.rpartition(".")[0]
            if target and target != mod and not mod.startswith(target + "."):  # a package's own __init__ is not a circle
                graph[mod].add(target)
    return graph


def cycles(graph: dict[str, set[str]], within: str = "") -> list[list[str]]:
    """The import circles among modules named ``within*`` (each listed once, as a path back to its start)."""
    nodes = {m for m in graph if m.startswith(within)}
    found, seen = [], set()

    def visit(node, stack, on_stack):
        for nxt in sorted(graph[node] & nodes):
            if nxt in on_stack:
                circle = stack[stack.index(nxt):] + [nxt]
                key = frozenset(circle)
                if key not in seen:
                    seen.add(key)
                    found.append(circle)
            elif nxt not in done:
                visit(nxt, stack + [nxt], on_stack | {nxt})
        done.add(node)

    done: set[str] = set()
    for start in sorted(nodes):
        if start not in done:
            visit(start, [start], {start})
    return found


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_uses(external, root: Path = PACKAGE_ROOT, exclude: tuple[str, ...] = ()) -> list[tuple[str, int, str]]:
    """``(file, line, name)`` for each ``_private`` name taken from a module ``external(module)`` accepts: imported
    (``from areal.x import _y``) or read off an imported name (``RemoteInfEngine._resolve_workflow``)."""
    out = []
    for mod, path in _modules(root).items():
        if mod in exclude:
            continue
        rel = str(path.relative_to(root.parent))
        local: dict[str, str] = {}  # names bound by imports from external modules -> what they are
        for line, name in imported_names(mod, path):
            base, _, last = name.rpartition(".")
            if base and external(base) and _private(last):
                out.append((rel, line, name))
            if external(name) or (base and external(base)):
                local[last] = name
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in local
                    and _private(node.attr)):
                out.append((rel, node.lineno, f"{local[node.value.id]}.{node.attr}"))
    return out
