"""The package's layering, read from source: front ends import nothing from the bench or from each other, the
shared test fixtures (``unsloth_rollout.testing``) sit below every front end, and no module is an alias of another."""

from __future__ import annotations

from unsloth_rollout.testing.imports import PACKAGE_ROOT, import_graph

FRONT_ENDS = ("areal", "serve", "trl")


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _edges(graph, src, dst):
    return sorted((m, t) for m, targets in graph.items() for t in targets
                  if _package(m) in src and _package(t) in dst and _package(m) != _package(t))


def test_front_ends_import_nothing_from_the_bench_or_each_other():
    graph = import_graph()
    assert _edges(graph, ("areal", "trl"), ("bench",)) == []
    assert _edges(graph, ("areal",), ("trl",)) == [] and _edges(graph, ("trl",), ("areal",)) == []


def test_the_test_fixtures_sit_below_the_front_ends():
    assert [e for e in _edges(import_graph(), ("testing",), FRONT_ENDS + ("bench",))] == []


def test_no_module_is_an_alias_of_another():
    aliases = [str(p.relative_to(PACKAGE_ROOT.parent)) for p in PACKAGE_ROOT.rglob("*.py")
               if "sys.modules[__name__]" in p.read_text() or "_sys.modules[__name__]" in p.read_text()]
    assert aliases == []
