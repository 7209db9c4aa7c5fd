"""Capture what one logger emits inside a block (pytest's caplog sits on the root, which AReaL's loggers bypass).

Example::

    from unsloth_rollout.areal.finite_rewards import logger
    with captured(logger) as messages:
        finite_reward(float("nan"), "my_reward")
    assert any("non-finite reward" in m for m in messages)
"""

from __future__ import annotations

import contextlib
import logging


@contextlib.contextmanager
def captured(logger, level: int = logging.WARNING):
    """The messages (``record.getMessage()``) of records at ``level`` or above that reach ``logger`` in the block;
    the logger's level is lowered to ``level`` for the block if it would drop them."""
    seen: list[str] = []

    class _Handler(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    handler = _Handler(level)
    old_level = logger.level
    if logging.NOTSET < level < logger.getEffectiveLevel():
        logger.setLevel(level)
    logger.addHandler(handler)
    try:
        yield seen
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
