"""When the compiled step may skip dynamo's guards (decode/compiled.py).

Dynamo checks a compiled region's guards on every call: for a LoRA decoder layer ~800 of them (each module's
hooks, type, parameters, attributes), ~150 us a call, ~5 ms of a 36-layer decode step. So the layer region exists
twice. The *guarded* copy checks everything, and while it runs, ``TaggedInductor`` records which compiled graph
served each unit of layers (decode/units.py). The *trusted* copies, one per graph (each its own code object, so
its entries never serve another region), keep only ``LEAN_GUARDS``: the shapes' symbolic relations, the global
autograd state, and which inputs are one tensor (a graph traced with one tensor for two inputs reads it for both).

``LayerTrust`` decides which runs. A guarded step runs first, then whenever the model may have changed:
- the state the step was traced under moves (``CompiledStep.state``: the model, its training mode, adapters, the
  attention kernel, grad / inference mode), or the engine's weight clock moves (every change of the policy's
  weights or adapters goes through ``RolloutEngine.weights_changed``);
- a module of a decoder layer got or lost an instance ``forward``, a forward hook or a pre-hook, or a global
  forward hook came or went (checked every step in ~30 us for 36 LoRA layers; the guarded region guards on
  hooks, which dynamo by default does not: ``internals.guards_on_hooks``);
- every ``TRUST_STEPS``-th step regardless.
A trusted step that raises (inductor's input asserts, kept on: a parameter given data of another size or layout, a
replaced module with other shapes) runs again as a guarded step, which retraces for the change.
Layers that dynamo compiled apart (a sliding-window layer and a full one) never share a trusted copy, and a
layer that did not run as exactly one graph (a graph break, an eager fallback) makes every step guarded.
A trusted copy whose own trace differs from the graph it copies (a value the guarded graph takes as an input,
baked in by the copy) is never used (``_copy``). PEFT's switches (``disable_adapter`` and the like) bump the
engine's clock by themselves (``WeightsClock.watch``). What trusted steps assume: nothing else about a decoder
layer changes without ``weights_changed``.

The region itself (the guarded function, its backend, the trusted copies) is a ``Region`` shared by every engine
whose layers have one signature (``region_for``: model class, config, dtypes, device, adapters, compile mode, unit
size, attention path, key alignment and batch padding): a second engine on the same model, or on another model of
one architecture, starts on graphs already compiled. Sharing changes nothing dynamo checks: a guarded step of any
engine runs a graph only where its guards pass for that engine's layers, and each engine vouches for its own layers.
A region that has compiled ``SHARED_GRAPHS`` graphs (dynamo stops compiling a code object past its recompile limit),
or holds a graph whose trusted copy traced differently, is not handed to new engines; an engine that cannot trust
its steps in a shared region moves to one of its own (``LayerTrust.vouch``). Which graph a call ran is recorded per
thread (engines step in threads of their own).
"""

from __future__ import annotations

import itertools
import threading
import types

import torch

from .. import internals

TRUST_STEPS = 256  # trusted steps between two guarded ones, even when nothing says the model changed
SHARED_GRAPHS = 7  # guarded graphs at which new engines get a region of their own: one engine on a real model
# compiles up to 6 (layers with and without LoRA, a shorter last unit, with and without shared prompts), and dynamo
# stops compiling a code object past 8
LEAN_GUARDS = frozenset({"SHAPE_ENV", "GRAD_MODE", "GLOBAL_STATE", "TORCH_FUNCTION_STATE", "DEFAULT_DEVICE",
                         "DETERMINISTIC_ALGORITHMS", "DUPLICATE_INPUT"})
_copies = itertools.count()


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
    base = internals.inductor_wrapper()
    if base is None:
        return None

    class TaggedInductor(base):
        def __init__(self):
            super().__init__(mode, None, None)
            self.__name__ = "inductor"
            self.count, self.codes = 0, []
            self.local = threading.local()  # .ran: the graphs this thread's calls ran

        @property
        def ran(self) -> list:
            return self.local.__dict__.setdefault("ran", [])

        @ran.setter
        def ran(self, value: list) -> None:
            self.local.ran = value

        def __call__(self, gm, example_inputs):
            fn, gid = super().__call__(gm, example_inputs), self.count
            self.count += 1
            self.codes.append(gm.code)  # what LayerTrust compares a trusted copy's trace with

            def run(*args):
                self.ran.append(gid)
                return fn(*args)
            internals.boxed_like(run, fn)
            return run

    try:
        return TaggedInductor()
    except Exception:  # noqa: BLE001 - an inductor wrapper this code does not know: no trusted copies
        return None


def _forwards(dicts: list) -> list:
    """Each module's instance ``forward`` (None: its class's), in C: ~20 us for 2k modules."""
    return list(map(dict.get, dicts, itertools.repeat("forward")))


def hooks_now(hooked: list) -> tuple:
    """What says whether a hook came or went: torch's hook-handle counter (every ``register_*hook`` call takes
    the next id), the sizes of the hook dicts that held hooks when vouched for, and the global hook dicts."""
    hooks, pre_hooks = internals.global_hooks()
    return internals.hook_counter(), tuple(len(h) for h in hooked), len(hooks), len(pre_hooks)


class Region:
    """A compiled region of decoder layers: the guarded function, the backend that numbers its graphs, the trusted
    copies per graph, and the graphs whose copy traced differently (never trusted)."""

    def __init__(self, fn, mode):
        self.fn, self.mode = fn, mode
        self.users = 0  # LayerTrusts that took this region
        self.backend = tagged_backend(mode)
        self.guarded = torch.compile(region_copy(fn, "guarded"), dynamic=None,
                                     **({"backend": self.backend} if self.backend is not None else {"mode": mode}))
        self.copies: dict[int, object] = {}  # graph number -> its trusted copy
        self.untrusted: set[int] = set()  # graphs whose trusted copy traced to another graph (LayerTrust._copy)
        self.copy_graphs = 0  # of the backend's graphs, those the trusted copies compiled (each its own code)

    def shareable(self) -> bool:
        """Whether a new engine may take it: every trusted copy traced as its graph, and the guarded function has
        compiled fewer than ``SHARED_GRAPHS`` graphs."""
        return not self.untrusted and (self.backend is None or self.backend.count - self.copy_graphs < SHARED_GRAPHS)


_regions: dict[tuple, Region] = {}
_regions_lock = threading.Lock()


def region_for(fn, mode, signature: tuple) -> Region:
    """The region engines of ``signature`` share (a fresh one where the last is no longer ``shareable``)."""
    key = (fn, mode, signature)
    with _regions_lock:
        region = _regions.get(key)
        if region is None or not region.shareable():
            region = _regions[key] = Region(fn, mode)
        region.users += 1
        return region


def forget_regions() -> None:
    """Engines created after this compile regions of their own, as in a fresh process (the regions held stay with
    the engines that hold them)."""
    with _regions_lock:
        _regions.clear()


class LayerTrust:
    """Per step: the compiled function each decoder layer calls (``fns``); after a guarded step, ``vouch``."""

    def __init__(self, region: Region, units: list):
        self.units = units  # lists of consecutive decoder layers
        self._use(region)
        self.detached = False  # whether it left a shared region for one of its own (vouch)
        self.moved = False  # True from the move until its graphs and trusted copies are compiled in its own region
        self.graphs = None  # per layer: the graph the last guarded step ran it with (None: not trusted)
        self.state = None  # what the last guarded step ran under
        self.dicts, self.forwards, self.hooked, self.hooks = [], [], [], None  # what _unchanged compares
        self.since = 0  # trusted steps since the last guarded one
        self.guarded_steps = self.trusted_steps = 0
        self.last_trusted = False  # whether the step now running is a trusted one
        self.failed_trusted = 0  # trusted steps that raised and ran again guarded (CompiledStep.execute)

    def fns(self, state) -> tuple[list, list | None, bool]:
        """(the function per layer, a list the guarded step fills with the graphs each layer ran or None, whether
        a function may trace now: then the step marks its dynamic dimensions)."""
        self.last_trusted = False
        if (self.graphs is not None and state == self.state and self.since < TRUST_STEPS and self._unchanged()
                and self.untrusted.isdisjoint(self.graphs)):
            self.last_trusted = True
            self.since += 1
            self.trusted_steps += 1
            fresh = any(g not in self.copies for g in self.graphs)
            self.moved = self.moved and fresh
            return [self._copy(g) for g in self.graphs], None, fresh
        self.guarded_steps += 1
        return [self.guarded] * len(self.units), [None] * len(self.units), True

    def call(self, fn, ran: list | None, i: int, *args, **kwargs):
        if ran is None:
            return fn(*args, **kwargs)
        if self.backend is not None:
            self.backend.ran = []
        # Dynamo does not guard on nn.Module hooks by default (``skip_nnmodule_hook_guards``): one graph would
        # serve a layer with a hook and one without. The guarded region guards on them (read when it traces).
        with internals.guards_on_hooks():
            out = fn(*args, **kwargs)
        ran[i] = tuple(self.backend.ran) if self.backend is not None else ()
        return out

    def _use(self, region: Region) -> None:
        self.region = region
        self.fn, self.backend, self.guarded = region.fn, region.backend, region.guarded
        self.enabled = self.backend is not None
        self.copies, self.untrusted = region.copies, region.untrusted

    def vouch(self, ran: list, state) -> None:
        """After a guarded step: trust its units when every one ran as exactly one compiled graph.

        In a region other engines share, a step whose units cannot be trusted (a graph another engine's history
        made, whose trusted copy traced differently; a region past dynamo's recompile limit, run eager) moves this
        engine to a region of its own, once: its next steps compile there what an engine alone would have compiled
        at start (``moved``: counted as warm-up, not as recompiles)."""
        self.since = 0
        graphs = [g[0] for g in ran] if self.enabled and all(len(g) == 1 for g in ran) else None
        if graphs is not None and self.untrusted.isdisjoint(graphs):
            self.graphs, self.state = graphs, state
            self.dicts = [m.__dict__ for unit in self.units for layer in unit for m in layer.modules()]
            self.forwards = _forwards(self.dicts)
            self.hooked = [h for d in self.dicts for h in internals.hook_dicts(d) if h]
            self.hooks = hooks_now(self.hooked)
            return
        self.graphs, self.state = None, None
        if self.enabled and self.region.users > 1 and not self.detached:
            self.detached = self.moved = True
            self._use(Region(self.fn, self.region.mode))
            self.region.users = 1

    def distrust(self, failed: bool = False) -> None:
        """The next step runs guarded (``failed``: a trusted step raised and runs again guarded)."""
        self.graphs = None
        self.failed_trusted += int(failed)

    def _unchanged(self) -> bool:
        return hooks_now(self.hooked) == self.hooks and _forwards(self.dicts) == self.forwards

    def _copy(self, graph: int):
        """The trusted copy for the layers graph ``graph`` served: compiled at its first call (the same graph,
        so inductor's cache serves it), then called with only ``LEAN_GUARDS`` checked.

        A copy traces afresh, under the values of its first call, and may specialize what the guarded graph
        took as an input: after a value changed once, dynamo recompiles the guarded region with it dynamic (e.g.
        a LoRA layer's float ``scaling`` after ``set_scale``), while the copy would bake in the value it first
        saw and, guards skipped, keep it. So the copy's trace is compared with the graph's; where they differ
        the graph is never trusted (its steps stay guarded; this step's copy ran the values it traced)."""
        fn = self.copies.get(graph)
        if fn is None:
            compiled = torch.compile(region_copy(self.fn, f"trusted{graph}"), backend=self.backend, dynamic=None,
                                     options={"guard_filter_fn": lean_guards})
            codes = self.backend.codes

            def first(*args, **kwargs):
                n = len(codes)
                out = compiled(*args, **kwargs)
                self.region.copy_graphs += len(codes) - n
                if any(c != codes[graph] for c in codes[n:]):
                    self.untrusted.add(graph)
                self.copies[graph] = compiled
                return out
            fn = self.copies[graph] = first
        return fn
