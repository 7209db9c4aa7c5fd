"""The project's one logger factory: ``get_logger(name)``, robust to libraries that rebuild ``logging``'s tree.

AReaL's ``getLogger`` replaces ``logging.Logger.manager`` (and the root it hangs loggers on) on every call, so
after ``import areal`` the name ``"unsloth_rollout"`` maps to a fresh logger object: handlers a user attached
before (or after) are no longer on the object the project's modules hold. ``get_logger`` returns a
``ProjectLogger`` that, whenever it logs, first puts the project's logger objects back into the live tree
(merging in any handler or level a user set on a fresh object meanwhile), so a handler on
``logging.getLogger("unsloth_rollout")`` sees every project message whatever was imported when. Project loggers
hang below the ``logging`` module's own root, where ``logging.basicConfig`` puts its handler.

Example::

    from unsloth_rollout.logs import get_logger
    logger = get_logger(__name__)        # "unsloth_rollout.engine.core", ...
    logger.warning("preempted %d sequences", n)
"""

from __future__ import annotations

import logging
import threading

ROOT = "unsloth_rollout"

_lock = threading.RLock()
_owned: dict[str, logging.Logger] = {}  # the project's logger objects by name (the ones handlers live on)
_synced_manager = None  # the logging manager _owned was last registered in


def _project(name: str) -> bool:
    return name == ROOT or name.startswith(ROOT + ".")


def _merge(owned: logging.Logger, fresh: logging.Logger) -> None:
    """What a user set on a fresh object for one of our names, onto our object (the latest setting wins)."""
    for h in fresh.handlers:
        if h not in owned.handlers:
            owned.addHandler(h)
    if fresh.level != logging.NOTSET:
        owned.setLevel(fresh.level)
    if not fresh.propagate:
        owned.propagate = False


def _parent_of(manager, name: str) -> logging.Logger:
    head = name
    while "." in head:
        head = head.rpartition(".")[0]
        found = manager.loggerDict.get(head)
        if isinstance(found, logging.Logger):
            return found
    return logging.root  # the module's root: where basicConfig / dictConfig put the user's handlers


def sync() -> None:
    """Register the project's loggers in the live logging tree (a no-op unless someone replaced the tree)."""
    global _synced_manager
    manager = logging.Logger.manager
    if manager is _synced_manager:
        return
    with _lock:
        manager = logging.Logger.manager
        for name, obj in list(manager.loggerDict.items()):  # loggers others made for our names since the last sync
            if _project(name) and isinstance(obj, logging.Logger) and obj is not _owned.setdefault(name, obj):
                _merge(_owned[name], obj)
        for name in sorted(_owned):
            manager.loggerDict[name] = _owned[name]
        for name, obj in manager.loggerDict.items():  # parent pointers into the live tree, ours included
            if _project(name) and isinstance(obj, logging.Logger):
                obj.parent = _parent_of(manager, name)
        manager._clear_cache()
        _synced_manager = manager


def _object(name: str) -> logging.Logger:
    sync()
    obj = _owned.get(name)
    if obj is None:
        with _lock:
            obj = logging.getLogger(name)
            _owned[name] = obj
            obj.parent = _parent_of(logging.Logger.manager, name)
    return obj


class ProjectLogger(logging.LoggerAdapter):
    """A ``logging.Logger`` look-alike that always logs through the project's own logger object for its name.

    Every ``Logger`` method and attribute works (``warning``, ``isEnabledFor``, ``addHandler``, ``handlers`` ...).
    """

    def __init__(self, name: str):
        self._name = name
        self.extra = None

    @property
    def logger(self) -> logging.Logger:
        return _object(self._name)

    @property
    def name(self) -> str:
        return self._name

    def process(self, msg, kwargs):
        return msg, kwargs

    def __getattr__(self, attr):  # addHandler, handlers, level, propagate, filters ...: the real logger's
        if attr.startswith("__") or attr in ("_name", "extra"):  # not set yet (unpickling): no recursion
            raise AttributeError(attr)
        return getattr(self.logger, attr)

    def __repr__(self) -> str:
        return f"<ProjectLogger {self._name} ({logging.getLevelName(self.getEffectiveLevel())})>"


def get_logger(name: str = ROOT) -> ProjectLogger:
    """The project's logger for ``name`` (a module name under ``unsloth_rollout``, or the package's own)."""
    if not _project(name):
        raise ValueError(f"name: project loggers live under {ROOT!r}, got {name!r}")
    return ProjectLogger(name)


def keep_across(rebuild):
    """``rebuild`` (a function that replaces the logging tree, e.g. AReaL's ``getLogger``) wrapped so the project's
    loggers are re-registered before and after each call: nothing a user set in between is lost."""
    if getattr(rebuild, "_keeps_project_loggers", False):
        return rebuild

    def wrapped(*args, **kwargs):
        sync()
        try:
            return rebuild(*args, **kwargs)
        finally:
            sync()

    wrapped.__wrapped__ = rebuild
    wrapped.__doc__ = rebuild.__doc__
    wrapped._keeps_project_loggers = True
    return wrapped


_object(ROOT).addHandler(logging.NullHandler())  # a library's default: silent until the application configures
