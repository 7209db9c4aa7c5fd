"""The graph step: the compiled step recorded once per shape as a CUDA graph and replayed whole.

The compiled step (decode/compiled.py) still launches every kernel from Python: on an H200 a 36-layer 3B step
costs ~40 ms of launches whatever the batch (benchmarks/gpu/README.md), while its bytes would take ~2 ms. This
step records that step once per shape and replays it:

- A graph per (batch bucket, key bucket): the batch is padded to ``BATCH_BUCKETS`` and the key length to a
  multiple of ``KEY_BUCKET`` (masked positions: zero weight), so a run records a bounded set of graphs. The step's
  small inputs (token ids, positions, lengths, write slots, key positions) live in buffers owned by the graph and
  are copied in before each replay; the KV pool and the workspace rows are the engine's own tensors, written and
  read in place by the replay.
- Nothing the graph read may have moved: a replay happens only while the signature it was recorded under holds
  (the compiled step's state key and the weights clock's change count, the addresses and shapes of the pool
  and workspace tensors, and the address of every parameter). A change (the workspace grew, an adapter was
  switched, ``weights_changed``, a parameter given new memory) drops every graph; the next steps record again.
  In-place updates (an optimizer step) keep addresses and are read by the replay as by the compiled step. A
  module replaced by another must be announced with ``weights_changed``, as for every decode step.
- A replay runs no Python: a forward hook or pre-hook on a decoder layer or any module in one, or a global module
  hook, would not be called. Steps while one exists run the compiled step unrecorded (which calls it).
- Checked before trusted: a graph's first ``CHECK_REPLAYS`` replays are compared with the same step run
  without the graph on the same inputs (it writes the same K/V to the same places). Any difference (a value the
  recording baked in, an op that read host state) switches graphs off for the engine, logged and counted in
  ``stats()["decode_graphs_disabled"]``; the step's result is the unrecorded one. Capture errors do the same.

Off by default: no GPU measurement of it is recorded yet (``bash benchmarks/gpu/device_check.sh captured`` makes
one). On a CPU the capture is replaced by a stand-in that re-runs the recorded function on the graph's buffers, which
exercises everything but the CUDA recording itself.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from ...logs import get_logger
from .. import internals
from .compiled import CompiledStep
from .step import DecodeRows, DecodeStep
from .trust import hooks_now
from .units import layer_hooked

log = get_logger("unsloth_rollout")

KEY_BUCKET = 128  # key lengths padded to a multiple of this: ~1 graph per 128 positions of context per bucket
CHECK_REPLAYS = 2  # replays of each graph compared with the unrecorded step before it is trusted
MAX_GRAPHS = 64  # recorded graphs kept (least recently used dropped first)
ALLOW_STAND_IN = False  # tests: run the CPU stand-in of the recording on a CPU device


class _Replayed:
    """A CPU stand-in for ``torch.cuda.CUDAGraph``: ``replay`` re-runs the recorded function into ``out``."""

    def __init__(self, fn):
        self.fn = fn

    def replay(self) -> None:
        self.out.copy_(self.fn())


def capture_stand_in(fn, pool=None):
    g = _Replayed(fn)
    g.out = fn()
    return g, g.out


def capture_cuda(fn, pool=None):
    """Record ``fn`` as a CUDA graph: one run on a side stream first (lazy kernel loads, workspace allocations),
    then the recording. Both runs write the same K/V to the same places as the step itself."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=pool):
        out = fn()
    return g, out


def check_device(device: torch.device) -> None:
    """The graph step records CUDA graphs: refused by name on another device (tests may allow the stand-in)."""
    if device.type != "cuda" and not ALLOW_STAND_IN:
        raise ValueError(f"decode backend 'graph' needs a CUDA device (this model is on {device}); leave the "
                         "decode backend 'auto' or choose 'compiled'")


class GraphStep(DecodeStep):
    """Graphs of one ``CompiledStep``; a step they cannot serve runs the compiled step unrecorded."""

    name = "graph"

    def __init__(self, compiled: CompiledStep, capture=None):
        self.compiled = compiled
        self.capture = capture or (capture_cuda if compiled.device.type == "cuda" else capture_stand_in)
        self.graphs: OrderedDict = OrderedDict()  # (batch, key length) -> [graph, inputs, out, checks left]
        self.signature = None
        self.pool = torch.cuda.graph_pool_handle() if compiled.device.type == "cuda" else None
        self.disabled: str | None = None
        self.params: list = []  # (module, parameter name) of every parameter, and their addresses when recorded
        self.ptrs: list[int] = []
        self.captures = self.replays = self.invalidations = 0
        self.hook_mark, self.hook_found = None, False  # what ``hooked`` last saw
        self.hooked_steps = 0  # steps run unrecorded because a hook was there

    def arrange(self, keys, lengths, block_tables, hint=None) -> list[int]:
        raise NotImplementedError("the graph step runs over the compiled step's rows")

    def run(self, rows: DecodeRows) -> torch.Tensor:
        """Logits [B, V] of an arranged step: replayed (or recorded now) where a graph serves it, else compiled."""
        st, n = self.compiled, len(rows.tokens)
        args = st.prepare(rows)
        logits = self.replay(args) if st.warm_graphs is not None else None
        if logits is None:
            logits = st.execute(args)
        st.finish()
        return logits[:n]

    def replay(self, args):
        """The step replayed from a recorded graph (or recorded now); None: the caller runs it as usual."""
        st, before = self.compiled, internals.compiled_graphs()
        try:
            logits = self.step(args, args[0].shape[0])
        except Exception as e:  # noqa: BLE001  (the usual path runs the step again: same K/V, same places)
            self._disable(f"{type(e).__name__}: {e}"[:400])
            return None
        if logits is not None and internals.compiled_graphs() > before:  # a trace while recording: a recompile
            self.graphs.clear()
            logits = st.retraced(args, internals.compiled_graphs() - before)
        return logits

    def _signature(self, args) -> tuple:
        tensors = [args[5][0], args[6][0], args[7][0], args[8][0]]  # pool and workspace (all layers move together)
        return (self.compiled.state(args[9] is not None), tuple((t.data_ptr(), tuple(t.shape)) for t in tensors))

    def _weights_moved(self) -> bool:
        """Whether a parameter now lives at another address than when the graphs were recorded (``p.data = ...``,
        a new Parameter assigned, ``load_state_dict(assign=True)``): a graph would read the old memory. One
        ``getattr`` per parameter a step (~0.2 ms on 36 layers); a replaced module is the caller's to announce
        (``weights_changed``), as for every decode step."""
        now = [getattr(m, n).data_ptr() for m, n in self.params]
        if self.params and now == self.ptrs:
            return False
        model = self.compiled.context.policy.model
        self.params = [(m, n) for m in model.modules() for n, _ in m.named_parameters(recurse=False)]
        self.ptrs = [getattr(m, n).data_ptr() for m, n in self.params]
        return True

    def hooked(self) -> bool:
        """Whether a decoder layer, a module in one, or every module (a global hook) has a forward hook or pre-hook.
        Looked for again when one may have come (``hooks_now``: torch's hook-handle counter, the global dicts' sizes)
        and on every step while one is there (~1k modules at 36 layers: only then)."""
        mark = hooks_now(())
        if mark != self.hook_mark or self.hook_found:
            self.hook_mark = mark
            self.hook_found = layer_hooked([m for layer in self.compiled.layers for m in layer.modules()])
        return self.hook_found

    def step(self, args, n: int):
        if self.disabled is not None:
            return None
        if self.hooked():  # the compiled step, unrecorded, calls the hook
            self.hooked_steps += 1
            return None
        sig = self._signature(args)
        if self._weights_moved() or sig != self.signature:
            if self.graphs:
                self.invalidations += 1
            self.graphs.clear()
            self.signature = sig
        key = (args[0].shape[0], args[4].shape[0])
        entry = self.graphs.get(key)
        if entry is None:
            return self._record(key, args, n)
        self.graphs.move_to_end(key)
        graph, inputs, out, checks = entry
        for dst, src in zip(inputs, args[:5]):
            dst.copy_(src)
        graph.replay()
        self.replays += 1
        logits = out[:n].clone()
        if checks:
            entry[3] -= 1
            ref = self.compiled.call(args)[:n]  # the same step unrecorded: the same K/V to the same places
            if not torch.equal(ref, logits):
                diff = (ref.float() - logits.float()).abs().max().item()
                self._disable(f"a replay differed from the unrecorded step by {diff:.3g} (batch {key[0]}, "
                              f"key length {key[1]})")
                return ref
        return logits

    def _record(self, key, args, n: int):
        inputs = [a.clone() for a in args[:5]]
        full = (*inputs, *args[5:])
        ref = self.compiled.call(full)[:n].clone()  # this step's result (compiles here if a shape is new)
        try:
            graph, out = self.capture(lambda: self.compiled.call(full), self.pool)
        except Exception as e:  # noqa: BLE001  (an op that cannot be recorded: the compiled step goes on)
            self._disable(f"recording failed: {type(e).__name__}: {e}"[:400])
            return ref
        if len(self.graphs) >= MAX_GRAPHS:
            self.graphs.popitem(last=False)
        self.graphs[key] = [graph, inputs, out, CHECK_REPLAYS]
        self.captures += 1
        return ref

    def _disable(self, why: str) -> None:
        log.warning("decode CUDA graphs switched off: %s; decode steps run the compiled step unrecorded", why)
        self.disabled = why
        self.graphs.clear()

    def stats(self) -> dict:
        return dict(decode_graph_captures=self.captures, decode_graph_replays=self.replays,
                    decode_graph_invalidations=self.invalidations, decode_graphs_disabled=self.disabled)
