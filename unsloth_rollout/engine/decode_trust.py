"""When the captured decode step may skip dynamo's guards (``decode_static.py``).

Dynamo checks a compiled region's guards on every call: for a LoRA decoder layer ~800 of them (each module's
hooks, type, parameters, attributes), ~150 us a call, ~5 ms of a 36-layer decode step. So the layer region exists
twice. The *guarded* copy checks everything, and while it runs, ``TaggedInductor`` records which compiled graph
served each layer. The *trusted* copies, one per graph (each its own code object, so its entries never serve
another region), keep only ``LEAN_GUARDS``: the shapes' symbolic relations and the global autograd state.

``LayerTrust`` decides which runs. A guarded step runs first, then whenever the model may have changed:
- the state the step was traced under moves (``StaticDecode._key``: the model, its training mode, adapters, the
  attention kernel, grad / inference mode), or the engine's weight clock moves (every change of the policy's
  weights or adapters goes through ``RolloutEngine.weights_changed``, engine/weights.py);
- a module of a decoder layer got or lost an instance ``forward``, a forward hook or a pre-hook, or a global
  forward hook came or went (checked every step in ~30 us for 36 LoRA layers; the guarded region guards on
  hooks, which dynamo by default does not: ``torch._dynamo.config.skip_nnmodule_hook_guards``);
- a decoder layer's parameter or buffer, or a submodule holding any, was replaced or removed, or one of its
  tensors changed dtype, device, size or stride (``param.data = ...``): identity checks and dynamo's C++
  ``TensorGuards``, ~0.3 ms a step for 36 LoRA layers. This check stands in for inductor's per-input size asserts, which the
  compiled graphs leave out (~1 ms a step) where ``TensorGuards`` exists;
- every ``TRUST_STEPS``-th step regardless.
Layers that dynamo compiled apart (a sliding-window layer and a full one) never share a trusted copy, and a
layer that did not run as exactly one graph (a graph break, an eager fallback) makes every step guarded.
What trusted steps assume: no other attribute a layer's forward reads (e.g. PEFT's ``scaling``) changes without
``weights_changed``.
"""

from __future__ import annotations

import itertools
import operator
import types

import torch
from torch.utils.hooks import RemovableHandle

TRUST_STEPS = 256  # trusted steps between two guarded ones, even when nothing says the model changed
LEAN_GUARDS = frozenset({"SHAPE_ENV", "GRAD_MODE", "GLOBAL_STATE", "TORCH_FUNCTION_STATE", "DEFAULT_DEVICE",
                         "DETERMINISTIC_ALGORITHMS"})
_copies = itertools.count()

try:  # dynamo's own C++ tensor check (dtype, device, dispatch keys, sizes, strides), ~0.1 us a tensor
    from torch._C._dynamo.guards import TensorGuards
except ImportError:  # pragma: no cover - another torch: inductor's size asserts stay on instead
    TensorGuards = None


def lean_guards(entries) -> list[bool]:
    """``guard_filter_fn`` of the trusted copies: keep only the guards in ``LEAN_GUARDS``."""
    return [e.guard_type in LEAN_GUARDS for e in entries]


def region_copy(fn, tag: str):
    """``fn`` under a code object of its own: dynamo keeps compiled entries per code object, so a copy's
    entries (and their guards) never serve, or are served by, another region."""
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{tag}_{next(_copies)}")
    return types.FunctionType(code, fn.__globals__, code.co_name)


def tagged_backend(mode):
    """Inductor (``mode`` applied), with every graph it compiles numbered and each call's number appended to
    ``backend.ran``. None where this torch has no such backend class (then every step is guarded)."""
    base = getattr(torch, "_TorchCompileInductorWrapper", None)
    if base is None:
        return None

    # The trusted copies check the decoder layers' tensors themselves (LayerTrust._unchanged), so the graph's
    # own per-input size asserts (~40 a layer call, ~1 ms of a 36-layer step) are off where that check exists.
    options = {"size_asserts": False} if TensorGuards is not None else None

    class TaggedInductor(base):
        def __init__(self):
            super().__init__(mode, options, None)
            self.__name__ = "inductor"
            self.count, self.ran = 0, []

        def __call__(self, gm, example_inputs):
            fn, gid = super().__call__(gm, example_inputs), self.count
            self.count += 1

            def run(*args):
                self.ran.append(gid)
                return fn(*args)
            run._boxed_call = getattr(fn, "_boxed_call", False)
            return run

    try:
        return TaggedInductor()
    except Exception:  # noqa: BLE001 - an inductor wrapper this code does not know: no trusted copies
        return None


def _forwards(dicts: list) -> list:
    """Each module's instance ``forward`` (None: its class's), in C: ~20 us for 2k modules."""
    return list(map(dict.get, dicts, itertools.repeat("forward")))


def _hooks_now(hooked: list) -> tuple:
    """What says whether a hook came or went: torch's hook-handle counter (every ``register_*hook`` call takes
    the next id), the sizes of the hook dicts that held hooks when vouched for, and the global hook dicts."""
    g = torch.nn.modules.module
    return (RemovableHandle.next_id, tuple(len(h) for h in hooked), len(g._global_forward_hooks),
            len(g._global_forward_pre_hooks))


class LayerTrust:
    """Per step: the compiled function each decoder layer calls (``fns``); after a guarded step, ``vouch``."""

    def __init__(self, fn, layers: list, mode):
        self.fn, self.layers, self.mode = fn, layers, mode
        self.backend = tagged_backend(mode)
        self.guarded = torch.compile(region_copy(fn, "guarded"), dynamic=None,
                                     **({"backend": self.backend} if self.backend is not None else {"mode": mode}))
        self.enabled = self.backend is not None
        self.copies: dict[int, object] = {}  # graph number -> its trusted copy
        self.graphs = None  # per layer: the graph the last guarded step ran it with (None: not trusted)
        self.state = None  # what the last guarded step ran under
        self.dicts, self.forwards, self.hooked, self.hooks = [], [], [], None  # what _unchanged compares
        self.slots, self.names, self.held = [], [], []
        self.tensors_at, self.pick, self.tensor_guards = [], None, None
        self.since = 0  # trusted steps since the last guarded one
        self.guarded_steps = self.trusted_steps = 0

    def fns(self, state) -> tuple[list, list | None, bool]:
        """(the function per layer, a list the guarded step fills with the graphs each layer ran or None, whether
        a function may trace now: then the step marks its dynamic dimensions)."""
        if self.graphs is not None and state == self.state and self.since < TRUST_STEPS and self._unchanged():
            self.since += 1
            self.trusted_steps += 1
            fresh = any(g not in self.copies for g in self.graphs)
            return [self._copy(g) for g in self.graphs], None, fresh
        self.guarded_steps += 1
        return [self.guarded] * len(self.layers), [None] * len(self.layers), True

    def call(self, fn, ran: list | None, i: int, *args, **kwargs):
        if ran is None:
            return fn(*args, **kwargs)
        if self.backend is not None:
            self.backend.ran = []
        # Dynamo does not guard on nn.Module hooks by default (``skip_nnmodule_hook_guards``): one graph would
        # serve a layer with a hook and one without. The guarded region guards on them (read when it traces).
        with torch._dynamo.config.patch(skip_nnmodule_hook_guards=False):
            out = fn(*args, **kwargs)
        ran[i] = tuple(self.backend.ran) if self.backend is not None else ()
        return out

    def vouch(self, ran: list, state) -> None:
        """After a guarded step: trust its layers when every one ran as exactly one compiled graph."""
        self.since = 0
        if self.enabled and all(len(g) == 1 for g in ran):
            self.graphs, self.state = [g[0] for g in ran], state
            self.dicts = [m.__dict__ for layer in self.layers for m in layer.modules()]
            self.forwards = _forwards(self.dicts)
            self.hooked = [h for d in self.dicts for h in (d["_forward_hooks"], d["_forward_pre_hooks"]) if h]
            self.hooks = _hooks_now(self.hooked)
            self._hold()
        else:
            self.graphs, self.state = None, None

    def _hold(self) -> None:
        """Remember what the layers hold: each parameter and buffer, and each submodule that holds any (by
        identity, in its parent's dict), and the tensors' dtype, device, sizes and strides (dynamo's C++
        ``TensorGuards``). A replaced module on the way to a tensor, or a tensor given data of another shape
        (``param.data = ...``), is seen; an added entry is not read by a traced graph."""
        self.slots, self.names = [], []
        for layer in self.layers:
            for m in layer.modules():
                d = m.__dict__
                for name, child in d["_modules"].items():
                    if child is not None and next(itertools.chain(child.parameters(), child.buffers()), None) is not None:
                        self.slots.append(d["_modules"])
                        self.names.append(name)
                for kind in ("_parameters", "_buffers"):
                    for name in d[kind]:
                        self.slots.append(d[kind])
                        self.names.append(name)
        self.held = list(map(dict.get, self.slots, self.names))
        self.tensors_at = [i for i, t in enumerate(self.held) if isinstance(t, torch.Tensor)]
        at = self.tensors_at  # itemgetter of one index returns the item, not a tuple
        self.pick = operator.itemgetter(*at) if len(at) > 1 else (lambda seq: tuple(seq[i] for i in at))
        tensors = list(self.pick(self.held))
        self.tensor_guards = None
        if TensorGuards is not None:
            self.tensor_guards = TensorGuards(*tensors, dynamic_dims_sizes=[list(t.shape) for t in tensors],
                                              dynamic_dims_strides=[list(t.stride()) for t in tensors])

    def _unchanged(self) -> bool:
        """Nothing a trusted copy cannot see changed: hooks, instance forwards, the submodules / parameters /
        buffers the layers' tensors are reached through, and those tensors' metadata."""
        if _hooks_now(self.hooked) != self.hooks or _forwards(self.dicts) != self.forwards:
            return False
        now = list(map(dict.get, self.slots, self.names))
        if not all(map(operator.is_, now, self.held)):  # one replaced or removed
            return False
        return self.tensor_guards is None or self.tensor_guards.check(*self.pick(now))

    def _copy(self, graph: int):
        """The trusted copy for the layers graph ``graph`` served: compiled at its first call (the same graph,
        so inductor's cache serves it), then called with only ``LEAN_GUARDS`` checked."""
        fn = self.copies.get(graph)
        if fn is None:
            fn = self.copies[graph] = torch.compile(region_copy(self.fn, f"trusted{graph}"), backend=self.backend,
                                                    dynamic=None, options={"guard_filter_fn": lean_guards})
        return fn
