"""AReaL's private names, in one place: each with the AReaL version it was checked against.

The backend hooks into AReaL without editing its files, which means using a few names AReaL does not
promise to keep (``_x``). Every such use goes through this module, so an AReaL upgrade is one file to
re-check: ``check_all()`` resolves every symbol, and a missing one raises ``ArealCompatError`` naming the
symbol, the version it was checked against and the installed version (never an ``AttributeError`` deep in
a trainer step).

Example::

    from unsloth_rollout.areal import compat
    ensure = compat.ENSURE_MESSAGE_DICT_LIST.get()   # areal.experimental.openai.client._ensure_message_dict_list
    compat.check_all()                               # ArealCompatError if this AReaL lacks any of them
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

CHECKED_AGAINST = "1.0.4"


class ArealCompatError(RuntimeError):
    """An AReaL private name the unsloth backend relies on is missing from the installed AReaL."""


def installed_version() -> str:
    try:
        from importlib.metadata import version

        return version("areal")
    except Exception:  # noqa: BLE001 - a source checkout without metadata
        return "unknown"


@dataclass(frozen=True)
class Private:
    """One AReaL private name: ``"module:Attr.attr"``, the version it was checked against, and why we use it."""

    path: str  # "areal.module.path:Name" or "areal.module.path:Class._method"
    checked: str  # the AReaL version this use was read against
    why: str  # what the backend needs it for (one line)

    @property
    def module(self) -> str:
        return self.path.split(":", 1)[0]

    @property
    def attrs(self) -> list[str]:
        return self.path.split(":", 1)[1].split(".")

    @property
    def name(self) -> str:
        """The last attribute (the method name when the symbol is a class member)."""
        return self.attrs[-1]

    def _missing(self, detail: str) -> ArealCompatError:
        return ArealCompatError(f"areal {installed_version()} has no {self.module}.{'.'.join(self.attrs)} "
                                f"(the unsloth backend uses it for: {self.why}; checked against areal "
                                f"{self.checked}): {detail}")

    def owner(self):
        """The object holding the symbol (the module, or the class for ``Class._method``)."""
        try:
            obj = importlib.import_module(self.module)
        except ImportError as e:
            raise self._missing(f"cannot import {self.module} ({e})") from e
        for a in self.attrs[:-1]:
            if not hasattr(obj, a):
                raise self._missing(f"{a!r} not found")
            obj = getattr(obj, a)
        return obj

    def get(self):
        """The symbol itself; ``ArealCompatError`` when this AReaL lacks it."""
        owner = self.owner()
        if not hasattr(owner, self.name):
            raise self._missing(f"{self.name!r} not found")
        return getattr(owner, self.name)


_V = CHECKED_AGAINST
# ---------------------------------------------------------------- agent workflows (agent_server.py)
ENSURE_MESSAGE_DICT_LIST = Private("areal.experimental.openai.client:_ensure_message_dict_list", _V,
                                   "messages as ArealOpenAI records them in an InteractionWithTokenLogpReward")
PROXY_EXECUTOR = Private("areal.experimental.openai.proxy.workflow:_get_executor", _V,
                         "the process pool AReaL's proxy runs subprocess agents in")
PROXY_WRAP_RUN = Private("areal.experimental.openai.proxy.workflow:_wrap_run", _V,
                         "running one subprocess agent with OPENAI_BASE_URL / OPENAI_API_KEY set")
# ---------------------------------------------------------------- the InferenceEngine (inference_engine.py)
RESOLVE_WORKFLOW = Private("areal.infra.remote_inf_engine:RemoteInfEngine._resolve_workflow", _V,
                           "AReaL's own workflow resolution (instance / class / 'module.Class', group_size)")
RESOLVE_SHOULD_ACCEPT_FN = Private("areal.infra.remote_inf_engine:RemoteInfEngine._resolve_should_accept_fn", _V,
                                   "AReaL's own should_accept_fn resolution")
WRAP_OPENAI_AGENT = Private("areal.infra.remote_inf_engine:RemoteInfEngine._wrap_openai_agent", _V,
                            "the hook _resolve_workflow calls for agent workflows (overridden by the engine)")
DISPATCHER = Private("areal.infra.workflow_executor:BatchTaskDispatcher", _V,
                     "the thread pair behind WorkflowExecutor, woken when the weight version moves")
# ---------------------------------------------------------------- install() (backend.py)
ALLOCATION_MODE = Private("areal.api.alloc_mode:_AllocationMode", _V,
                          "the SPMD launchers' allocation_mode parser (sizes an 'unsloth:dN' job)")
TRAINING_ALLOCATIONS = Private("areal.api.alloc_mode:_AllocationMode._get_training_allocations", _V,
                               "which allocations count as trainer processes (unsloth added)")
TRAINER_HOOKS = tuple(Private(f"areal.trainer.rl_trainer:PPOTrainer.{m}", _V, why) for m, why in (
    ("_init_scheduler", "no scheduler in process"),
    ("_create_train_engine", "the UnslothPPOActor on the shared model"),
    ("_init_rollout", "the UnslothInferenceEngine on the actor's model"),
    ("_save_initial_lora_weights", "nothing to preload: the engine shares the model"),
    ("_validate_cfg", "the backend's own config checks"),
    ("_ensure_proxy_started", "agent workflows served in process, no proxy workers"),
))
# Instance attributes (set in AReaL's __init__ methods, so only checkable on a live object), per areal version.
INSTANCE_ATTRS = {
    "WorkflowExecutor._dispatcher": _V,  # None until initialize(); read by executor_dispatcher()
    "BatchTaskDispatcher._input_cv": _V,  # the producer's un-timed wait; read by dispatcher_input_cv()
    "PPOTrainer._proxy_started": _V,  # set instead of starting AReaL's proxy workers (backend.py)
}
TRAINER_PROXY_STARTED_ATTR = "_proxy_started"

ALL = (ENSURE_MESSAGE_DICT_LIST, PROXY_EXECUTOR, PROXY_WRAP_RUN, RESOLVE_WORKFLOW, RESOLVE_SHOULD_ACCEPT_FN,
       WRAP_OPENAI_AGENT, DISPATCHER, ALLOCATION_MODE, TRAINING_ALLOCATIONS, *TRAINER_HOOKS)


def trainer_hook(name: str) -> Private:
    """The ``PPOTrainer`` private method ``name`` as a checked symbol (KeyError for one not listed here)."""
    for p in TRAINER_HOOKS:
        if p.name == name:
            return p
    raise KeyError(f"PPOTrainer.{name} is not a hook listed in unsloth_rollout.areal.compat")


def executor_dispatcher(executor):
    """``WorkflowExecutor._dispatcher`` (None before AReaL starts it); ArealCompatError when the attribute is gone."""
    if not hasattr(executor, "_dispatcher"):
        raise DISPATCHER._missing("WorkflowExecutor has no '_dispatcher' attribute")
    return executor._dispatcher


def dispatcher_input_cv(dispatcher):
    """The condition AReaL's dispatcher thread waits on (``_input_cv``), or None where this AReaL has none."""
    return getattr(dispatcher, "_input_cv", None)


def check_all() -> None:
    """Resolve every private name listed here; the first missing one raises ArealCompatError."""
    for p in ALL:
        p.get()


def keep_project_loggers() -> None:
    """AReaL's ``getLogger`` rebuilds the stdlib's logger tree on every call; re-register the project's loggers
    around each call (``unsloth_rollout.logs``) so handlers a user put on ``unsloth_rollout`` keep working.
    The AReaL front end's own messages (``unsloth_rollout.areal.*``) print as AReaL's do: INFO, to stdout."""
    import logging
    import sys

    from areal.utils import logging as areal_logging

    from ..logs import get_logger, keep_across, sync

    areal_logging.getLogger = keep_across(areal_logging.getLogger)
    sync()
    log = get_logger("unsloth_rollout.areal")
    if not any(getattr(h, "_areal_style", False) for h in log.handlers):
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter(areal_logging.LOG_FORMAT_PLAIN, areal_logging.DATE_FORMAT))
        handler._areal_style = True
        log.addHandler(handler)
        if log.level == logging.NOTSET:
            log.setLevel(areal_logging.LOGLEVEL)


keep_project_loggers()
