"""One door for AReaL: no import circle in the adapter package, AReaL's private names only in ``areal/compat.py``
(each with the version it was checked against), and a named error when the installed AReaL lacks one."""

from __future__ import annotations

import pytest

pytest.importorskip("areal")

from unsloth_rollout.areal import compat  # noqa: E402
from unsloth_rollout.testing.imports import cycles, import_graph, private_uses  # noqa: E402


def _areal(module: str) -> bool:
    return module == "areal" or module.startswith("areal.")


def test_the_areal_package_has_no_import_circle():
    assert cycles(import_graph(), within="unsloth_rollout.areal") == []


def test_the_import_graph_sees_a_lazy_import_circle(tmp_path):
    """The oracle for the test above: a circle closed only by an import inside a function is found."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .b import f\n")
    (pkg / "b.py").write_text("def f():\n    from .a import g\n")
    assert cycles(import_graph(pkg), within="pkg") == [["pkg.a", "pkg.b", "pkg.a"]]


def test_areal_private_names_are_used_only_through_compat(tmp_path):
    assert private_uses(_areal, exclude=("unsloth_rollout.areal.compat",)) == []
    pkg = tmp_path / "pkg"  # the oracle: both kinds of use are found
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "m.py").write_text("from areal.x import _y, Cls\n\ndef f():\n    return Cls._hook\n")
    assert private_uses(_areal, root=pkg) == [("pkg/m.py", 1, "areal.x._y"), ("pkg/m.py", 4, "areal.x.Cls._hook")]


def test_every_private_name_resolves_on_the_installed_areal():
    compat.check_all()
    assert compat.ALL and all(p.checked == compat.CHECKED_AGAINST == "1.0.4" for p in compat.ALL)
    assert all(v == "1.0.4" for v in compat.INSTANCE_ATTRS.values())


def test_a_missing_private_name_is_a_named_error(monkeypatch):
    from areal.api import alloc_mode

    from unsloth_rollout.areal import backend

    monkeypatch.delattr(alloc_mode, "_AllocationMode")
    with pytest.raises(compat.ArealCompatError, match=r"areal\.api\.alloc_mode\._AllocationMode.*areal 1\.0\.4"):
        compat.ALLOCATION_MODE.get()
    with pytest.raises(compat.ArealCompatError, match="_AllocationMode"):
        backend._patch_launcher_allocation()
    gone = compat.Private("areal.no_such_module:thing", "1.0.4", "a test")
    with pytest.raises(compat.ArealCompatError, match="cannot import areal.no_such_module"):
        gone.get()


def test_a_missing_trainer_hook_is_a_named_error(monkeypatch):
    from areal.trainer.rl_trainer import PPOTrainer

    monkeypatch.delattr(PPOTrainer, "_init_scheduler")
    with pytest.raises(compat.ArealCompatError, match=r"PPOTrainer\._init_scheduler.*no scheduler in process"):
        compat.trainer_hook("_init_scheduler").get()
