"""The compiled step: each unit of decoder layers one call of one compiled graph, for every batch and context.

The eager decode is dispatch-bound on small-hidden models: a step is hundreds of Python module calls (36 layers
x 7 projections x base + LoRA A + LoRA B, norms, rotary, attention, cache writes), each a few microseconds of
Python and dispatcher, while the arithmetic is near zero. This step runs the same model forward with its decoder
layers through ``torch.compile``, with shapes that never force a recompile as sequences grow:

- The model's forward runs eager outside its decoder layers (embedding, rotary, final norm, head: a few ops), and
  its decoder layers run in units of consecutive layers of one kind (``DecodeConfig.layers_per_call``;
  decode/units.py), each unit one call of one compiled function with the layers as an argument. Parameters are
  graph inputs (dynamo's ``inline_inbuilt_nn_modules``) and each layer gets its own pool and workspace tensors
  (``LayerView``), so one graph serves all units of a size and kind: warm-up compiles a unit or two, whatever
  the depth. Parameters are never baked: an optimizer step that updates the LoRA weights in place is seen by the
  next step.
- The KV history lives in the decode workspace rows (decode/workspace.py, filled once when a sequence joins,
  outside the graph); each step the graph writes the new token into the paged pool and into its row in place,
  and attention reads the view ``ws[:B, :, :L]``: no gather, no Python per row or per layer inside the step.
- Per-step metadata (token ids, positions incl. M-RoPE deltas, write slots, lengths) goes in as small tensors;
  the batch, the context length and the workspace's own row count / capacity are marked dynamic, so one graph
  serves every batch size >= 2 (a batch of one is padded to two: dynamo specializes size-1 dimensions) and
  every context length. On CUDA the batch is also padded to a bucket (``BATCH_BUCKETS``) and the key length
  to a multiple of 16 (of 128 under the graph step: a bounded set of graphs, decode/graph.py).
- The graph is compiled at engine start (``warm``, time in ``stats()["decode_warmup_s"]``), once per process for
  engines whose layers have one signature (``_signature``; they share the region, decode/trust.py); compiles
  after that are counted (``stats()["decode_recompiles"]``); a step that traced a new graph is checked, as
  warm-up's was, by the same step run eager through the cache-use guard.
- Rows that read a shared prompt (decode/shared_prompts.py) read it inside the graph where the CPU kernel serves
  them (``reads_shared``): the store, each row's entry and each entry's length are tensor inputs (each layer gets
  its store through ``ForwardContext.shared_kv``), in a graph of their own, compiled before the first such step
  as warm-up compiles the plain one (``warm_shared``); the trust state says which a step runs, so steps without an
  entry pay nothing for it.
- Dynamo's guards (~150 us a layer call) are checked on the steps after the model may have changed; the other
  steps call trusted copies of the region (decode/trust.py).

Which steps it serves is decode/choose.py's ``choose_step``. The arithmetic is the eager workspace step's (same
attention function, same masks, same view code, checked by the cache-use guard in the engine's probe); only the
kernels differ (inductor's fused elementwise ops).
"""

from __future__ import annotations

import copy
import time

import torch

from ...logs import get_logger
from .. import internals
from ..attention import ATTN_NAME, CTX_KWARG, ForwardContext, set_current
from .shared_prompts import CompiledSharedPrompts, step_tensors
from .step import DecodeContext, DecodeRows, DecodeStep, step_inputs, write_slots
from .trust import LayerTrust, region_for
from .units import Hooked, Lead, Ungrouped, decoder_layers, layer_hooked, plan_units, units_call
from .views import CompiledView, LayerView, mark_step
from .workspace import DecodeWorkspace

log = get_logger("unsloth_rollout")

BATCH_BUCKETS = (2, 4, 8, 16, 32, 64, 128, 256)


def batch_bucket(n: int) -> int:
    """The padded batch of ``n`` rows on CUDA: the next bucket (multiples of 256 past the last)."""
    for b in BATCH_BUCKETS:
        if n <= b:
            return b
    return -(-n // 256) * 256


class CompiledStep(DecodeStep):
    """The compiled decode over a ``DecodeWorkspace``; ``run`` has the eager workspace step's contract."""

    name = "compiled"

    def __init__(self, context: DecodeContext, workspace: DecodeWorkspace, layers_per_call: int,
                 key_align: int | None = None):
        self.context, self.ws = context, workspace
        self.device = context.device
        self.pad_buckets = self.device.type == "cuda"
        # CUDA: key length padded to a multiple of 16 (masked: exact). SDPA's mem-efficient kernel pads an unaligned
        # mask, a branch dynamo guards on: unpadded lengths recompiled as they grew (H200: 2 recompiles per run).
        self.key_align = key_align or (16 if self.device.type == "cuda" else 1)
        self.mode = context.config.compile_mode
        self.layers = decoder_layers(context.policy.model, context.num_layers)
        self.windows = sorted({getattr(l.self_attn, "sliding_window", None) or None for l in self.layers},
                              key=lambda w: -1 if w is None else w)
        self.trusts: dict[int, LayerTrust] = {}  # per unit size: a size planned again keeps its graphs
        self.want = layers_per_call
        self._hooked = False  # one layer per call while a decoder layer has a hook: units come back after
        self._plan(self.want)
        self.warmup_s = 0.0
        self.warm_graphs = None  # graphs counted once warm; compiles past it are recompiles
        self.warm_compiled = 0  # graphs the warm-up compiled
        self.recompiles = 0
        self.steps = 0
        self.eager_steps = 0  # steps this step did not serve (choose_step), run by the eager workspace step
        self._no_store = None  # the shared-prompt stand-ins of steps without a store entry (``shared_inputs``)
        self._shared_warm = None  # the graph over shared prompts: None not yet compiled, True compiled, False failed
        self._warm_size = self.unit_size  # the unit size warm-up compiled

    # ------------------------------------------------------------------ the graph
    def _step(self, input_ids, position_ids, lengths, write_slots, k_pos, pool_k, pool_v, ws_k, ws_v, shared=None,
              check=False):
        """The whole step eager (every layer uncompiled), through the cache-use guard when ``check``."""
        c = self.context
        key_len = k_pos.shape[0]
        kp = k_pos.view(1, -1)
        ctx = ForwardContext("decode", lengths.view(-1, 1), kp, kp <= lengths.view(-1, 1), check=check,
                             lengths=lengths, shared=shared)
        ctx.inner, ctx.kernel = c.inner, c.kernel
        view = CompiledView(c.kv, pool_k, pool_v, ws_k, ws_v, write_slots, lengths, key_len, ctx)
        out = c.policy.model(input_ids=input_ids, position_ids=position_ids, attention_mask=None, use_cache=True,
                             logits_to_keep=1, **{c.cache_arg: view, CTX_KWARG: ctx})
        if check:  # the eager run in warm(): every layer wrote and read through this view
            ctx.verify(c.policy.model, c.num_layers)
        return out.logits[:, -1, :]

    def _plan(self, size: int) -> None:
        """Decoder layers in units of up to ``size`` (decode/units.py), each unit one compiled call; dynamo's
        guards are checked on the steps after a possible change, trusted between (decode/trust.py)."""
        self.unit_size, self.units = size, plan_units(self.layers, size)
        trust = self.trusts.get(size)
        if trust is None:
            region = region_for(units_call, self.mode, self._signature() + (size,))
            trust = self.trusts[size] = LayerTrust(region, [[self.layers[i] for i in u] for u in self.units])
        self.trust = trust
        trust.distrust()  # its first step guarded

    def _signature(self) -> tuple:
        """What engines whose layers may share compiled graphs have in common (decode/trust.py's ``region_for``):
        the model's class and config, its parameters' dtypes, the device, its adapters, the attention path, and the
        shapes its steps take (key alignment, batch padding: graphs traced under other shapes guard on other
        relations)."""
        c = self.context
        m = c.policy.model
        try:
            config = m.config.to_json_string()
        except Exception:  # noqa: BLE001 - a config that does not serialize: this model's own region
            config = id(m)
        peft = getattr(m, "peft_config", None) or {}
        return (type(m), tuple(type(layer) for layer in self.layers), config,
                tuple(sorted({str(p.dtype) for p in m.parameters()})), str(self.device),
                tuple(sorted((k, repr(v)) for k, v in peft.items())), c.inner, c.kernel, self.key_align,
                self.pad_buckets)

    def _step_layers(self, input_ids, position_ids, lengths, write_slots, k_pos, pool_k, pool_v, ws_k, ws_v,
                     shared=None):
        """The model's own forward, eager outside its decoder layers; each unit of layers runs the compiled region.
        ``shared`` (a ``CompiledSharedPrompts``): the rows' shared prompts; ``lengths`` are then the rows' own
        positions."""
        c = self.context
        layers, trust, state = self.layers, self.trust, self.state(shared is not None)
        # ran: None on a trusted step, else filled with the graphs each unit ran; mark: a region may trace now
        # (a trace must keep the batch and the context dynamic; a trusted copy already traced never traces)
        fns, ran, mark = trust.fns(state)
        if mark:
            mark_step((input_ids, position_ids, lengths, write_slots, k_pos, pool_k, pool_v, ws_k, ws_v, shared))
        kp = k_pos.view(1, -1)
        ctx = ForwardContext("decode", lengths.view(-1, 1), kp, kp <= lengths.view(-1, 1), check=False,
                             lengths=lengths, shared=shared)
        ctx.inner, ctx.kernel = c.inner, c.kernel
        for w in self.windows:  # built once per step, outside the region: every layer reads the same masks
            ranges = ctx.key_range(w) if ctx.kernel else ()  # the CPU kernel reads each row's key range
            masks = (ctx.mask(w), ctx.additive_mask(w, c.policy.dtype))  # (they serve shapes it does not take)
            if mark:
                for t in ranges:
                    internals.mark_dynamic(t, 0)
                for m in masks:
                    internals.mark_dynamic(m, 0)
                    internals.mark_dynamic(m, 3)
        view = CompiledView(c.kv, pool_k, pool_v, ws_k, ws_v, write_slots, lengths, k_pos.shape[0], ctx)
        rows = view.rows
        if mark:
            internals.mark_dynamic(rows, 0)
        units = self.units
        if len(units) < len(layers) and layer_hooked(layers):  # a hooked layer must see its own input and output
            raise Hooked("a decoder layer has a forward hook")

        def cache(i, kwargs):  # layer i's own pool and workspace tensors (and its shared-prompt store)
            out = {k: LayerView(pool_k[i], pool_v[i], ws_k[i], ws_v[i], write_slots, rows, lengths, k_pos, ctx)
                   for k, v in kwargs.items() if v is view}
            if shared is not None:  # this layer's store, as a tensor input (not a list index)
                lctx = copy.copy(ctx)
                lctx.shared_kv = (shared.pk[i], shared.pv[i])
                out[CTX_KWARG] = lctx
            return out

        def leader(u, unit):
            fn, mods, lead = fns[u], [layers[i] for i in unit], Lead()

            def forward(hidden_states, *args, **kwargs):
                lead.args, lead.kwargs = args, dict(kwargs)
                if mark:
                    internals.mark_dynamic(hidden_states, 0)
                    for t in kwargs.get("position_embeddings") or ():
                        internals.mark_dynamic(t, 0)
                caches = [cache(i, kwargs) for i in unit]
                lead.out = trust.call(fn, ran, u, mods, caches, hidden_states, *args, **kwargs)
                return lead.out
            return forward, lead

        for u, unit in enumerate(units):
            forward, lead = leader(u, unit)
            layers[unit[0]].forward = forward
            for i in unit[1:]:
                layers[i].forward = lambda h, *a, _lead=lead, **kw: _lead.follow(h, a, kw)
        try:
            out = c.policy.model(input_ids=input_ids, position_ids=position_ids, attention_mask=None,
                                 use_cache=True, logits_to_keep=1, **{c.cache_arg: view, CTX_KWARG: ctx})
        finally:
            for layer in layers:
                del layer.forward
        if ran is not None:
            trust.vouch(ran, state)
        return out.logits[:, -1, :]

    def state(self, shared_step: bool) -> tuple:
        """What a guarded step vouches for: the traced-under key and the weight-change count (every change of
        the policy's weights or adapters goes through ``RolloutEngine.weights_changed``)."""
        clock = self.context.weights_clock
        return self._key() + (shared_step,), (clock.changes if clock is not None else None)

    def _key(self) -> tuple:
        """What the graph was traced under that dynamo's guards would otherwise have to re-check every step."""
        c = self.context
        m = c.policy.model
        peft = getattr(m, "peft_config", None)
        return (id(m), m.training, str(getattr(m, "active_adapter", None)), tuple(sorted(peft or ())),
                tuple(sorted(getattr(c.policy, "served_adapters", None) or ())), c.inner, c.kernel,
                self.reads_shared(), torch.is_inference_mode_enabled(), torch.is_grad_enabled())

    def reads_shared(self) -> bool:
        """Whether steps over shared prompts run in the graph (the CPU kernel, the workspace's shared prompts on):
        such steps pass the store, and run their own graph (compiled before the first of them, ``warm_shared``;
        steps without an entry keep the plain one: no per-step cost for them)."""
        return bool(self.context.kernel) and self.ws.shared_prompts and self._shared_warm is not False

    def shared_inputs(self, b: int) -> CompiledSharedPrompts:
        """A step's shared prompts over ``b`` (padded) rows: the store's tensors, or zero stand-ins (two entries of
        16 positions: no size-1 dimension to specialize) when it holds none. A stand-in per layer and per K / V, as
        the store has: a compiled unit of layers traced with one tensor for two layers' stores would read one
        layer's entries for both."""
        ws, store = self.ws, self.ws.store
        if store.k:
            pk, pv = store.k, store.v
        else:
            if self._no_store is None:
                c = self.context.kv
                self._no_store = [torch.zeros((2, c.num_kv_heads, 16, c.head_dim), dtype=c.dtype, device=c.device)
                                  for _ in range(2 * len(ws.k))]
            pk, pv = self._no_store[0::2], self._no_store[1::2]
        return CompiledSharedPrompts(pk, pv, *step_tensors(ws.row_entry, store.lengths, pk[0].shape[0], b,
                                                           self.device))

    # ------------------------------------------------------------------ a step
    def padded(self, n_rows: int) -> int:
        return batch_bucket(n_rows) if self.pad_buckets else max(n_rows, 2)

    def prepare(self, rows: DecodeRows) -> tuple:
        """The graph's inputs for this step's arranged rows (padded to the batch bucket)."""
        ws, c = self.ws, self.context
        if ws.lengths != list(rows.lengths) or ws.rows != len(rows.tokens):
            raise RuntimeError("decode rows are not arranged: call arrange_decode with this batch first")
        kv = c.kv
        n = len(rows.tokens)
        b = self.padded(n)
        write = write_slots(rows.block_tables, rows.lengths, kv.block_size) + [kv.scratch_slot] * (b - n)
        pad = [0] * (b - n)
        input_ids, pos, lens_t = step_inputs(c, list(rows.tokens) + pad, list(rows.lengths) + pad,
                                             list(rows.deltas) + pad)
        shared = self.shared_inputs(b) if self.reads_shared() and ws.has_shared else None
        held = ws.own_lengths if shared is not None else list(rows.lengths)  # the positions each row holds
        if shared is not None:
            lens_t = torch.tensor(held + pad, device=self.device)
            ws.shared_steps += 1
        key_len = self._key_len(max(held), shared is not None)
        # one spare position: a view never spans the whole capacity (dynamo would guard on that equality)
        if not ws.ensure(b, key_len + 1):  # padded rows write position 0 of spare rows: masked, refilled on join
            raise RuntimeError("compiled decode: the padded batch does not fit the decode workspace budget")
        k_pos = torch.arange(key_len, device=self.device)
        return (input_ids, pos, lens_t, torch.tensor(write, device=self.device), k_pos, kv.k, kv.v, ws.k, ws.v,
                shared)

    def fits(self, n_rows: int, held: int, shared: bool = False) -> bool:
        """Whether the padded batch's rows (``held``: the most positions a row holds; ``shared``: rows read store
        entries) fit the workspace budget (else this step runs eager)."""
        return self.ws.ensure(self.padded(n_rows), self._key_len(held, shared) + 1)

    def _key_len(self, held: int, shared: bool) -> int:
        """Keys a step attends over: the longest row's and its new token's; one more over store entries (a row that
        just joined its entry holds one position of its own: a size-1 dimension would specialize)."""
        return self.aligned(held + (2 if shared else 1))

    def aligned(self, key_len: int) -> int:  # the key length attended over (masked past each row's length)
        return -(-key_len // self.key_align) * self.key_align

    def run(self, rows: DecodeRows) -> torch.Tensor:
        """Logits [B, V] of a decode step whose rows are arranged in the workspace (``arrange``)."""
        args = self.prepare(rows)
        logits = self.execute(args)[: len(rows.tokens)]
        self.finish()
        return logits

    def finish(self) -> None:
        """After a step that wrote one token into every row."""
        self.ws.advance()
        self.steps += 1

    def execute(self, args) -> torch.Tensor:
        """The padded step's logits, compiled; a trusted step that fails runs again guarded, and a step that traced
        a new graph after warm-up is checked eager (``retraced``)."""
        for attempt in (1, 2):
            before = internals.compiled_graphs()
            try:
                logits = self.call(args)
                break
            except Exception:
                if attempt == 2 or not self.trust.last_trusted:
                    if self.warm_graphs is not None and internals.compiled_graphs() > before:
                        self.checked(args)  # a graph traced now failed: CacheBypassError names the layer
                    raise
            # A trusted step failed: inductor's input asserts saw a layer tensor of another size or layout (a
            # parameter given new data, a replaced module, without weights_changed). The step again, guarded:
            # dynamo's guards see the change and retrace (the K/V it writes are the same, to the same places).
            log.info("compiled decode: a trusted step failed; running it guarded", exc_info=True)
            self.trust.distrust(failed=True)
        if self.warm_graphs is not None and internals.compiled_graphs() > before:
            logits = self.retraced(args, internals.compiled_graphs() - before)
        return logits

    def retraced(self, args, traced: int) -> torch.Tensor:
        """A step that traced graphs after start (the model changed): counted as recompiles, run again eager
        through the cache-use guard (same K/V, same places; a layer off the engine's cache: CacheBypassError by
        name), then once more compiled, so its K/V and logits are the compiled graph's as every step's are."""
        if self.trust.moved:  # compiled in the region of its own it just moved to (decode/trust.py): warm-up
            self.warm_compiled += traced
        else:
            self.recompiles += traced
        self.trust.distrust()  # the next step guarded again (it marks what a trace keeps dynamic)
        self.checked(args)
        return self.call(args)

    def checked(self, args) -> torch.Tensor:
        """The step run eager through the cache-use guard (``ForwardContext.verify``: CacheBypassError by name)."""
        return self.call(args, lambda *a: self._step(*a, check=True))

    def call(self, args, fn=None):
        """The step on ``args`` (compiled, or ``fn``), under the engine's attention implementation."""
        cfg = self.context.text_config
        saved = internals.swap_attention(cfg, ATTN_NAME)  # the engine holds policy.lock: nothing else runs now
        set_current(None)
        try:
            if fn is not None:
                return fn(*args)
            try:
                if self._hooked and not layer_hooked(self.layers):
                    log.info("compiled decode: no decoder layer has a hook now; %d layers per call again", self.want)
                    self._hooked = False
                    self._plan(self.want)
                return self._step_layers(*args)
            except Ungrouped as e:  # K/V of this step's layers rewritten below, to the same positions
                self._hooked = isinstance(e, Hooked)  # a hook: until it goes; a loop changing a layer's input: for good
                log.warning("compiled decode: %s; decoder layers run one per compiled call %s", e,
                            "while it stays" if self._hooked else "from now on")
                self._plan(1)
                return self._step_layers(*args)
        finally:
            internals.swap_attention(cfg, saved)

    def warm(self) -> None:
        """Compile the plain step now (a throwaway batch of two rows in a free block), so no request waits on it.
        The step over shared prompts is compiled the same way before the first step that reads one
        (``warm_shared``): most engines never serve one."""
        self._warm_size = self.unit_size
        if self._warm(self.ws, shared=False):
            self.warm_graphs = internals.compiled_graphs()

    def shared_ready(self) -> bool:
        """Whether the graph of steps over shared prompts is compiled (``warm_shared``)."""
        return self._shared_warm is True

    def warm_shared(self) -> bool:
        """Before the first step whose rows read a shared prompt: compile that step's graph as ``warm`` compiles the
        plain one, on a throwaway workspace of two rows (the engine's own holds this step's rows), counted as
        warm-up, not as recompiles. Whether steps over shared prompts may run compiled: False where it cannot run
        now (no free KV block: this step runs eager, the next one tries again) or failed (then such steps run
        eager, as without the CPU kernel). Units of another size than warm-up's (a hooked layer, a changed layer
        loop) compile as their steps run, counted as recompiles, as the plain graph's do; so does a warm-up here
        during which the units changed."""
        if self._shared_warm is not None:
            return self._shared_warm
        if self.unit_size != self._warm_size:
            return True
        ws = self.ws
        spare = DecodeWorkspace(self.context.kv, shared_prompts=True, min_shared_tokens=ws.store.min_tokens)
        spare.store.min_entries = ws.store.min_entries
        self.ws = spare
        compiled_before = self.warm_compiled
        try:
            done = self._warm(spare, shared=True)
        except Exception as e:  # noqa: BLE001 - steps over shared prompts run eager, as without the kernel
            self._shared_warm = False
            log.warning("compiled decode: the step over shared prompts could not be compiled (%s: %s); such steps "
                        "run eager", type(e).__name__, str(e)[:300])
            self.trust.distrust()
            return False
        finally:
            self.ws = ws
            spare.release()
        if self.unit_size != self._warm_size:  # the model changed under the warm-up: its compiles are recompiles
            self.recompiles += self.warm_compiled - compiled_before
            self.warm_compiled = compiled_before
            return True
        if done:
            self._shared_warm = True
        return done

    def _warm(self, ws: DecodeWorkspace, shared: bool) -> bool:
        """The step over two throwaway rows in a free block: eager through the cache-use guard, then guarded (it
        vouches for the layers), then trusted (it compiles the copies); ``shared``: over a stand-in store that no
        row reads. False where no block or too small a budget let it run."""
        c = self.context
        kv = c.kv
        blocks = kv.allocate(1)
        if blocks is None:
            return False
        t, g0 = time.perf_counter(), internals.compiled_graphs()
        try:
            with c.policy.lock, torch.inference_mode(), c.policy.inference():
                keys = [("warm", 0), ("warm", 1)]
                if ws.arrange(keys, [2, 2], [blocks, blocks]) is None:
                    return False  # a workspace budget too small for two rows: every step gathers, eager
                args = self.prepare(DecodeRows([0, 0], [2, 2], [0, 0], [blocks, blocks]))
                if shared:
                    args = args[:-1] + (self.shared_inputs(len(args[0])),)
                ws.lengths = [2, 2]
                self.checked(args)
                for _ in range(2):
                    ws.lengths = [2, 2]
                    self.call(args)
                ws.advance()
        finally:
            ws.arrange([], [], [])
            kv.free(blocks)
        self.warmup_s += time.perf_counter() - t
        self.warm_compiled += internals.compiled_graphs() - g0  # 1 per kind of unit whatever the depth
        return True

    def stats(self) -> dict:
        trusts = self.trusts.values()  # one per unit size the step has run (decode/trust.py)
        return dict(decode_warmup_s=self.warmup_s, decode_recompiles=self.recompiles,
                    decode_eager_steps=self.eager_steps,
                    decode_guarded_steps=sum(t.guarded_steps for t in trusts) if trusts else self.steps,
                    decode_trusted_steps=sum(t.trusted_steps for t in trusts),
                    decode_failed_trusted_steps=sum(t.failed_trusted for t in trusts),
                    decode_prefix_compiled=self.reads_shared(),  # steps over shared prompts run in the graph
                    decode_layers_per_call=self.unit_size)  # decoder layers per compiled call (decode/units.py)
