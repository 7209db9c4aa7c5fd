"""One logger factory (``unsloth_rollout.logs``): a handler on the ``unsloth_rollout`` logger sees the project's
messages whatever rebuilt the stdlib's logger tree meanwhile (AReaL's ``getLogger`` does, on every call)."""

from __future__ import annotations

import logging

import pytest

from unsloth_rollout.logs import get_logger, keep_across, sync
from unsloth_rollout.testing.logs import captured
from unsloth_rollout.testing.imports import PACKAGE_ROOT


class _Seen(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(f"{record.name}: {record.getMessage()}")


def _rebuild_tree():
    """What AReaL's getLogger does to the stdlib (the oracle's own copy, so the test does not need AReaL)."""
    logging.Logger.root = logging.RootLogger(logging.WARNING)
    logging.Logger.manager = logging.Manager(logging.Logger.root)


def test_a_handler_on_the_package_logger_survives_a_rebuilt_tree():
    from unsloth_rollout.engine import core

    before, after, later = _Seen(), _Seen(), _Seen()
    tree = logging.Logger.root, logging.Logger.manager
    # The tree as any project log leaves it: a test module collected before this one may have rebuilt it
    # (``import areal`` at collection) with no project message since, so "unsloth_rollout" would be a fresh object.
    sync()
    logging.getLogger("unsloth_rollout").addHandler(before)
    try:
        _rebuild_tree()
        logging.getLogger("unsloth_rollout").addHandler(after)  # a fresh object: the tree was replaced
        core.logger.warning("from core")
        assert before.messages == after.messages == ["unsloth_rollout: from core"]
        assert logging.getLogger("unsloth_rollout").handlers[-2:] == [before, after]  # one object again
        logging.getLogger("unsloth_rollout").addHandler(later)
        keep_across(_rebuild_tree)()  # a rebuild wrapped as AReaL's getLogger is: nothing set before it is lost
        core.logger.warning("again")
        assert later.messages == ["unsloth_rollout: again"] and len(before.messages) == 2
    finally:
        for h in (before, after, later):
            logging.getLogger("unsloth_rollout").removeHandler(h)
        logging.Logger.root, logging.Logger.manager = tree  # the other tests' loggers as they were


def test_a_handler_sees_engine_messages_after_areal_builds_its_backend(qwen2_dir):
    pytest.importorskip("areal")
    from unsloth_rollout import load_model
    from unsloth_rollout.engine import engine as engine_module

    seen = _Seen()
    logging.getLogger("unsloth_rollout").addHandler(seen)
    try:
        import areal  # noqa: F401
        from areal.api.cli_args import InferenceEngineConfig
        from areal.utils import logging as areal_logging

        from unsloth_rollout.areal import UnslothInferenceEngine

        engine = UnslothInferenceEngine(InferenceEngineConfig(backend="unsloth:d1", consumer_batch_size=1),
                                        load_model(qwen2_dir, backend="transformers"),
                                        kv_cache_memory_bytes=8 << 20, max_model_len=128)
        engine.initialize()  # AReaL's getLogger runs here (a new logger tree)
        areal_logging.getLogger("AnyAReaLComponent")
        try:
            engine_module.logger.warning("engine message")
            engine.logger.warning("front-end message")
        finally:
            engine.destroy()
        assert "unsloth_rollout: engine message" in seen.messages
        assert any(m.endswith(": front-end message") and m.startswith("unsloth_rollout.areal.") for m in seen.messages)
    finally:
        logging.getLogger("unsloth_rollout").removeHandler(seen)


def test_level_and_handlers_set_through_the_module_logger_are_the_real_loggers():
    log = get_logger("unsloth_rollout.test_logs_probe")
    with captured(log, logging.INFO) as messages:
        log.info("probe %d", 1)
        log.debug("not shown")
    assert messages == ["probe 1"]
    assert log.name == "unsloth_rollout.test_logs_probe" and logging.getLogger(log.name) is log.logger
    import pickle

    assert pickle.loads(pickle.dumps(log)).logger is log.logger  # AReaL may hand loggers to other processes
    with pytest.raises(ValueError, match="name: project loggers live under 'unsloth_rollout'"):
        get_logger("somebody_else")


def test_every_module_logs_through_the_factory():
    """No module makes its logger with ``logging.getLogger`` (stdlib or AReaL's); logs.py is the one place."""
    import re

    made = re.compile(r"\blogger\s*=\s*[\w.]*getLogger\(")
    offenders = [f"{path.relative_to(PACKAGE_ROOT.parent)}:{n}" for path in PACKAGE_ROOT.rglob("*.py")
                 if path != PACKAGE_ROOT / "logs.py"
                 for n, line in enumerate(path.read_text().splitlines(), 1) if made.search(line)]
    assert offenders == []
