"""The model's own precision for every engine forward, whatever autocast the trainer beside it has turned on.

A trainer in mixed precision turns autocast on in two ways that reach the engine's forwards:

- a context on its own thread (``torch.autocast``, ``accelerator.autocast()``): ``RolloutEngine.generate`` steps on
  the calling thread, so its forwards would run under it (autocast state is per thread: the engine's worker thread
  starts without one);
- a wrapper of a module's ``forward`` that enters autocast on whichever thread calls it: accelerate's
  ``prepare_model`` wraps the ``forward`` of the model it prepares when mixed precision is on (HF ``Trainer`` and
  TRL with ``bf16`` or ``fp16``; TRL's ``GRPOConfig`` defaults to ``bf16=True``, also on CPU).

Under autocast an engine step is not the model's arithmetic: bf16 keys and values meet a float32 KV cache ("expected
scalar type Float but found BFloat16"), a compiled step meets inputs of another dtype than it was traced with, and
logprobs are a bf16 forward's instead of the model's. So ``model_precision``, around each engine step
(``StepDriver.step``) and the engine's construction (its probe and the compiled step's warm-up), turns autocast off
on every device type and gives the caller its state back after; and for that time it runs each such wrapped
``forward`` as the function the wrapper's autocast decorator wraps (torch's decorator in the ``__wrapped__`` chain,
as accelerate builds it), putting the wrapper back after. Wrappers are looked for on the modules outside the
model's layer stacks (the wrappers, backbones and heads a trainer prepares), a few dict lookups a step. The
trainer's own forwards keep their wrapper and their autocast: the scope holds ``policy.lock``, under which an
engine step is the only forward running (the rule the runner's attention switch relies on too).

A wrapper that enters autocast in its own body, without torch's decorator, is not seen here; accelerate's, and any
``forward`` decorated with ``torch.autocast(...)``, are.
"""

from __future__ import annotations

import contextlib
import inspect
import types

import torch

# Every device type with an autocast of its own (torch 2.13 lists these).
AUTOCAST_DEVICES = tuple(d for d in ("cpu", "cuda", "xpu", "mps", "hpu", "mtia", "maia", "xla", "ipu",
                                     "privateuseone") if torch.amp.is_autocast_available(d))
# The code of the function torch's autocast decorator returns (``autocast_decorator.<locals>.decorate_autocast``).
_DECORATED = torch.autocast("cpu", enabled=False)(lambda: None).__code__
_MAX_WRAPPERS = 32  # a __wrapped__ chain longer than this is not followed further


def inner_forward(forward):
    """What ``forward`` runs inside torch's autocast decorator (the innermost one of its ``__wrapped__`` chain),
    bound to the module as ``forward`` was; None when no autocast decorator wraps it."""
    fn, inner = forward, None
    for _ in range(_MAX_WRAPPERS):
        if fn is None:
            break
        if getattr(fn, "__code__", None) is _DECORATED:
            inner = fn.__wrapped__
        fn = getattr(fn, "__wrapped__", None)
    if inner is None:
        return None
    owner = getattr(forward, "__self__", None)
    if owner is not None and inspect.isfunction(inner):  # accelerate decorates ``forward.__func__``, then binds
        return types.MethodType(inner, owner)
    return inner


def autocast_wrappers(model: torch.nn.Module) -> list[tuple]:
    """(module, its forward, what runs instead) for each module outside the layer stacks (``ModuleList``s) whose
    instance ``forward`` enters autocast through torch's decorator."""
    found, todo = [], [model]
    while todo:
        m = todo.pop()
        fwd = m.__dict__.get("forward")
        inner = inner_forward(fwd) if fwd is not None else None
        if inner is not None:
            found.append((m, fwd, inner))
        if not isinstance(m, torch.nn.ModuleList):
            todo.extend(m.children())
    return found


@contextlib.contextmanager
def model_precision(policy):
    """Run the block holding ``policy.lock`` (no other forward runs meanwhile), in the model's own dtype: autocast
    off on every device type and the model's autocast wrappers set aside; both put back on exit.

    Example::

        with model_precision(policy):
            logits = policy.model(input_ids=ids).logits   # float32 for a float32 model, under any trainer
    """
    with contextlib.ExitStack() as stack:
        stack.enter_context(policy.lock)
        for device in AUTOCAST_DEVICES:
            if torch.is_autocast_enabled(device):
                stack.enter_context(torch.autocast(device, enabled=False))
        for module, wrapper, inner in autocast_wrappers(policy.model):
            module.forward = inner
            stack.callback(setattr, module, "forward", wrapper)
        yield
