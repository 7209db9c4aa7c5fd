"""The captured decode step (``decode_backend="static"``, also ``decode_compile=True``, and what the default
``"auto"`` runs on CPU and on CUDA): one compiled graph shared by every decoder layer of a kind, for every batch
and context.

The eager decode is dispatch-bound on small-hidden models: a step is hundreds of Python module calls (36 layers
x 7 projections x base + LoRA A + LoRA B, norms, rotary, attention, cache writes), each a few microseconds of
Python and dispatcher, while the arithmetic is near zero. This backend runs the same model forward with each
decoder layer's forward through ``torch.compile``, with shapes that never force a recompile as sequences grow:

- Region ``"layer"`` (the default): the model's forward runs eager outside its decoder layers (embedding,
  rotary, final norm, head: a few ops), and its decoder layers run in units of up to 4 consecutive layers of
  one kind (``EngineConfig.decode_layers_per_call``; decode_units.py), each unit one call of one compiled
  function with the layers as an argument. Parameters are graph inputs (dynamo's ``inline_inbuilt_nn_modules``)
  and each layer gets its own pool and workspace tensors (``LayerView``), so one graph serves all units of a
  size and kind: warm-up compiles a unit or two, whatever the depth (region ``"model"``, the whole forward as
  one graph, took minutes on a 2-core CPU and grows with depth).

- The KV history lives in the decode workspace rows (``DecodeWorkspace``, filled once when a sequence joins,
  outside the graph); each step the graph writes the new token into the paged pool and into its row in place,
  and attention reads the view ``ws[:B, :, :L]``: no gather, no Python per row or per layer inside the step.
- Per-step metadata (token ids, positions incl. M-RoPE deltas, write slots, lengths) goes in as small tensors;
  the batch, the context length and the workspace's own row count / capacity are marked dynamic, so one graph
  serves every batch size >= 2 (a batch of one is padded to two: dynamo specializes size-1 dimensions) and
  every context length. On CUDA the batch is also padded to a bucket (``BATCH_BUCKETS``) and the key length
  to a multiple of 16 (or of 128 with ``compile_mode="cuda-graphs"``: a bounded set of graphs, decode_graphs.py).
- Parameters are graph inputs (dynamo lifts module parameters), never baked: an optimizer step that updates
  the LoRA weights in place is seen by the next step.
- The graph is compiled at engine start (``warm``, time in ``stats()["decode_warmup_s"]``); compiles after that
  are counted (``stats()["decode_recompiles"]``); a step that traced a new graph is checked, as warm-up's
  was, by the same step run eager through the cache-use guard. Steps the graph does not serve run eager through
  the same workspace rows: rows that name different adapters (PEFT's per-row ``adapter_names`` is Python), and,
  without the CPU kernel, rows that read a GRPO group's shared prompt from a prefix entry (``runner.decode``).
  With it (``prefixed``), such rows hold only their own positions and read their entry inside the graph: the
  prefix store, each row's entry and each entry's length are tensor inputs (each layer gets its store through
  ``ForwardContext.prefix_kv``), in a graph of their own, compiled at warm-up beside the plain one; the trust
  state (``_state``) says which a step runs, so steps without an entry pay nothing for it.
- Dynamo's guards (~150 us a layer call) are checked on the steps after the model may have changed; the other
  steps call trusted copies of the region (``decode_trust.py``).

The arithmetic is the eager workspace decode's (same attention function, same masks, same view code, checked by
the cache-use guard in the engine's probe); only the kernels differ (inductor's fused elementwise ops).
"""

from __future__ import annotations

import copy
import os
import shutil
import time

import torch

from ..logs import get_logger
from .attention import ATTN_NAME, CTX_KWARG, ForwardContext, set_current
from .decode_trust import LayerTrust
from .decode_units import Hooked, Lead, Ungrouped, decoder_layers, layer_hooked, plan_units, unit_size, units_call
from .decode_views import LayerView, StaticView, mark_step, step_prefix

log = get_logger("unsloth_rollout")

BATCH_BUCKETS = (2, 4, 8, 16, 32, 64, 128, 256)


def auto_decode_backend(device: torch.device, workspace_bytes: int | None, policy=None) -> str:
    """What ``decode_backend="auto"`` runs: this captured step on a CPU device where torch.compile finds a C++
    compiler (inductor's CPU code is C++), and on CUDA for transformers + PEFT models in full or half precision
    (measured on an H200: 1.4-2.5x faster than the eager step on a 3B VL, exact within the GPU bounds, no
    recompiles; benchmarks/gpu/README.md). The eager workspace elsewhere: 4-bit weights and models loaded by
    Unsloth on CUDA (neither measured compiled on a GPU yet), other devices, and when the workspace is switched
    off (``decode_workspace_bytes=0``: the step's rows live there)."""
    if workspace_bytes == 0:
        return "workspace"
    if device.type == "cuda":
        if policy is None or getattr(policy, "backend", None) != "transformers" or _quantized(policy.model):
            return "workspace"
        return "static"
    if device.type != "cpu":
        return "workspace"
    if os.environ.get("CXX") or any(shutil.which(c) for c in ("g++", "c++", "clang++")):
        return "static"
    return "workspace"


def _quantized(model) -> bool:
    """bitsandbytes (or any other) quantized linear layers anywhere in the model."""
    return (getattr(getattr(model, "config", None), "quantization_config", None) is not None
            or any("4bit" in type(m).__name__ or "8bit" in type(m).__name__ for m in model.modules()))


def batch_bucket(n: int) -> int:
    """The padded batch of ``n`` rows on CUDA: the next bucket (multiples of 256 past the last)."""
    for b in BATCH_BUCKETS:
        if n <= b:
            return b
    return -(-n // 256) * 256


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


class StaticDecode:
    """The compiled decode over a ``DecodeWorkspace``; ``decode`` has the eager workspace decode's contract."""

    def __init__(self, runner, mode: str | None = None, region: str = "layer", unit: int | None = None):
        self.runner = runner
        self.ws = runner.workspace
        self.device = runner.device
        self.pad_buckets = self.device.type == "cuda"
        # CUDA: key length padded to a multiple of 16 (masked: exact). SDPA's mem-efficient kernel pads an unaligned
        # mask, a branch dynamo guards on: unpadded lengths recompiled as they grew (H200: 2 recompiles per run).
        self.key_align = 16 if self.device.type == "cuda" else 1
        self.graphs = None  # compile_mode="cuda-graphs": the step replayed whole (decode_graphs.py)
        if mode == "cuda-graphs":
            from . import decode_graphs

            if self.device.type != "cuda" and not decode_graphs.ALLOW_STAND_IN:
                raise ValueError("compile_mode='cuda-graphs' needs a CUDA device (this model is on "
                                 f"{self.device}); leave compile_mode unset")
            mode, self.key_align = None, decode_graphs.KEY_BUCKET
            self.graphs = decode_graphs.DecodeGraphs(self)
        # "layer": every decoder layer runs one shared compiled graph (compile time independent of depth);
        # "model": the whole forward is one graph (compile time grows with depth).
        self.region, self.mode = region, mode
        if region == "layer":
            self._layers = decoder_layers(runner.policy.model, runner.num_layers)
            self._windows = sorted({getattr(l.self_attn, "sliding_window", None) or None for l in self._layers},
                                   key=lambda w: -1 if w is None else w)
            self._trusts: dict[int, LayerTrust] = {}  # per unit size: a size planned again keeps its graphs
            self._want = unit_size(unit, runner.policy.config)
            self._hooked = False  # one layer per call while a decoder layer has a hook: units come back after
            self._plan(self._want)
            self._fn = self._step_layers
        else:
            self.trust, self.unit_size, self._trusts, self._hooked = None, None, {}, False
            self._fn = torch.compile(self._step, mode=mode, dynamic=None)
        self.warmup_s = 0.0
        self.warm_graphs = None  # graphs counted once warm; compiles past it are recompiles
        self.warm_compiled = 0  # graphs the warm-up compiled
        self.recompiles = 0
        self.steps = 0
        self.eager_steps = 0
        self._no_store = None  # the prefix stand-ins of steps without a prefix entry (``step_prefix``)
        if runner._kernel and self.ws is not None:
            self.ws.min_entries = 2  # the prefix store's entries: a dynamic dimension, never specialized as 1

    # ------------------------------------------------------------------ the graph
    def _step(self, input_ids, position_ids, lengths, write_slots, k_pos, pool_k, pool_v, ws_k, ws_v, prefix=None,
              check=False):
        r = self.runner
        key_len = k_pos.shape[0]
        kp = k_pos.view(1, -1)
        ctx = ForwardContext("decode", lengths.view(-1, 1), kp, kp <= lengths.view(-1, 1), check=check,
                             lengths=lengths, prefix=prefix)
        ctx.inner, ctx.kernel = r._inner, r._kernel
        view = StaticView(r.kv, pool_k, pool_v, ws_k, ws_v, write_slots, lengths, key_len, ctx)
        out = r.policy.model(input_ids=input_ids, position_ids=position_ids, attention_mask=None, use_cache=True,
                             logits_to_keep=1, **{r._cache_arg: view, CTX_KWARG: ctx})
        if check:  # the eager run in warm(): every layer wrote and read through this view
            ctx.verify(r.policy.model, r.num_layers)
        return out.logits[:, -1, :]

    def _plan(self, size: int) -> None:
        """Decoder layers in units of up to ``size`` (decode_units.py), each unit one compiled call; dynamo's
        guards are checked on the steps after a possible change, trusted between (decode_trust.py)."""
        self.unit_size, self._units = size, plan_units(self._layers, size)
        trust = self._trusts.get(size)
        if trust is None:
            trust = self._trusts[size] = LayerTrust(units_call, [[self._layers[i] for i in u] for u in self._units],
                                                    self.mode)
        self.trust, trust.graphs = trust, None  # its first step guarded

    def _step_layers(self, input_ids, position_ids, lengths, write_slots, k_pos, pool_k, pool_v, ws_k, ws_v,
                     prefix=None):
        """The model's own forward, eager outside its decoder layers; each unit of layers runs the compiled region.
        ``prefix`` (a ``StaticPrefix``): the rows' shared prefixes; ``lengths`` are then the rows' own positions."""
        r = self.runner
        layers, trust, state = self._layers, self.trust, self._state(prefix is not None)
        # ran: None on a trusted step, else filled with the graphs each unit ran; mark: a region may trace now
        # (a trace must keep the batch and the context dynamic; a trusted copy already traced never traces)
        fns, ran, mark = trust.fns(state)
        if mark:
            mark_step((input_ids, position_ids, lengths, write_slots, k_pos, pool_k, pool_v, ws_k, ws_v, prefix))
        kp = k_pos.view(1, -1)
        ctx = ForwardContext("decode", lengths.view(-1, 1), kp, kp <= lengths.view(-1, 1), check=False,
                             lengths=lengths, prefix=prefix)
        ctx.inner, ctx.kernel = r._inner, r._kernel
        for w in self._windows:  # built once per step, outside the region: every layer reads the same masks
            ranges = ctx.key_range(w) if ctx.kernel else ()  # the CPU kernel reads each row's key range
            masks = (ctx.mask(w), ctx.additive_mask(w, r.policy.dtype))  # (they serve shapes it does not take)
            if mark:
                for t in ranges:
                    torch._dynamo.mark_dynamic(t, 0)
                for m in masks:
                    torch._dynamo.mark_dynamic(m, 0)
                    torch._dynamo.mark_dynamic(m, 3)
        view = StaticView(r.kv, pool_k, pool_v, ws_k, ws_v, write_slots, lengths, k_pos.shape[0], ctx)
        rows = view.rows
        if mark:
            torch._dynamo.mark_dynamic(rows, 0)
        units = self._units
        if len(units) < len(layers) and layer_hooked(layers):  # a hooked layer must see its own input and output
            raise Hooked("a decoder layer has a forward hook")

        def cache(i, kwargs):  # layer i's own pool and workspace tensors (and its prefix store)
            c = {k: LayerView(pool_k[i], pool_v[i], ws_k[i], ws_v[i], write_slots, rows, lengths, k_pos, ctx)
                 for k, v in kwargs.items() if v is view}
            if prefix is not None:  # this layer's prefix store, as a tensor input (not a list index)
                lctx = copy.copy(ctx)
                lctx.prefix_kv = (prefix.pk[i], prefix.pv[i])
                c[CTX_KWARG] = lctx
            return c

        def leader(u, unit):
            fn, mods, lead = fns[u], [layers[i] for i in unit], Lead()

            def forward(hidden_states, *args, **kwargs):
                lead.args, lead.kwargs = args, dict(kwargs)
                if mark:
                    torch._dynamo.mark_dynamic(hidden_states, 0)
                    for t in kwargs.get("position_embeddings") or ():
                        torch._dynamo.mark_dynamic(t, 0)
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
            out = r.policy.model(input_ids=input_ids, position_ids=position_ids, attention_mask=None,
                                 use_cache=True, logits_to_keep=1, **{r._cache_arg: view, CTX_KWARG: ctx})
        finally:
            for layer in layers:
                del layer.forward
        if ran is not None:
            trust.vouch(ran, state)
        return out.logits[:, -1, :]

    def _state(self, prefixed_step: bool) -> tuple:
        """What a guarded step vouches for: the traced-under key and the weight-change count (every change of
        the policy's weights or adapters goes through ``RolloutEngine.weights_changed``, engine/weights.py)."""
        clock = self.runner.weights_clock
        return self._key() + (prefixed_step,), (clock.changes if clock is not None else None)

    def _inputs(self, tokens, lengths, deltas, block_tables):
        r, kv = self.runner, self.runner.kv
        n = len(tokens)
        b = batch_bucket(n) if self.pad_buckets else max(n, 2)
        bs = kv.block_size
        write = [t[m // bs] * bs + m % bs for t, m in zip(block_tables, lengths)] + [kv.scratch_slot] * (b - n)
        pad = [0] * (b - n)
        input_ids, pos, lens_t = r._decode_inputs(list(tokens) + pad, list(lengths) + pad, list(deltas) + pad)
        prefix = step_prefix(self, b) if self.prefixed() and self.ws.has_prefixes else None
        held = self.ws.own_lengths if prefix is not None else list(lengths)  # the positions each row holds
        if prefix is not None:
            lens_t = torch.tensor(held + pad, device=self.device)
            self.ws.prefix_steps += 1
        key_len = self._key_len(max(held), prefix is not None)
        # one spare position: a view never spans the whole capacity (dynamo would guard on that equality)
        if not self.ws._ensure(b, key_len + 1):  # padded rows write position 0 of spare rows: masked, refilled on join
            raise RuntimeError("static decode: the padded batch does not fit the decode workspace budget")
        k_pos = torch.arange(key_len, device=self.device)
        args = (input_ids, pos, lens_t, torch.tensor(write, device=self.device), k_pos,
                kv.k, kv.v, self.ws.k, self.ws.v, prefix)
        if self.trust is None:  # region "model": one graph (the layer regions mark only when one may trace)
            mark_step(args)
        return args

    def fits(self, n_rows: int, held: int, prefixes: bool = False) -> bool:
        """Whether the padded batch's rows (``held``: the most positions a row holds; ``prefixes``: rows read prefix
        entries) fit the workspace budget (else this step runs eager)."""
        b = batch_bucket(n_rows) if self.pad_buckets else max(n_rows, 2)
        return self.ws._ensure(b, self._key_len(held, prefixes) + 1)

    def _key_len(self, held: int, prefixes: bool) -> int:
        """Keys a step attends over: the longest row's and its new token's; one more over prefix entries (a row that
        just joined its entry holds one position of its own: a size-1 dimension would specialize)."""
        return self._aligned(held + (2 if prefixes else 1))

    def _aligned(self, key_len: int) -> int:  # the key length attended over (masked past each row's length)
        return -(-key_len // self.key_align) * self.key_align

    def run(self, tokens, lengths, deltas, block_tables) -> torch.Tensor:
        """Logits [B, V] of a decode step whose rows are arranged in the workspace (``arrange``)."""
        ws = self.ws
        if ws.lengths != list(lengths) or ws.rows != len(tokens):
            raise RuntimeError("decode rows are not arranged: call arrange_decode with this batch first")
        args = self._inputs(tokens, lengths, deltas, block_tables)
        graphs = self.graphs if self.warm_graphs is not None else None
        if graphs is not None and (logits := graphs.run(args, _graphs)) is not None:  # replayed (cuda-graphs)
            ws.advance()
            self.steps += 1
            return logits[: len(tokens)]
        for attempt in (1, 2):
            before = _graphs()
            try:
                logits = self._call(args)[: len(tokens)]
                break
            except Exception:
                if attempt == 2 or self.trust is None or not self.trust.last_trusted:
                    if self.warm_graphs is not None and _graphs() > before:  # a graph traced now failed: the cache?
                        self._checked(args)  # CacheBypassError names the layer
                    raise
            # A trusted step failed: inductor's input asserts saw a layer tensor of another size or layout (a
            # parameter given new data, a replaced module, without weights_changed). The step again, guarded:
            # dynamo's guards see the change and retrace (the K/V it writes are the same, to the same places).
            log.info("static decode: a trusted step failed; running it guarded", exc_info=True)
            self.trust.graphs, self.trust.failed_trusted = None, self.trust.failed_trusted + 1
        if self.warm_graphs is not None and _graphs() > before:
            logits = self._retraced(args, _graphs() - before)[: len(tokens)]
        ws.advance()
        self.steps += 1
        return logits

    def _retraced(self, args, traced: int) -> torch.Tensor:
        """A step that traced graphs after start (the model changed): counted as recompiles, run again eager
        through the cache-use guard (same K/V, same places; a layer off the engine's cache: CacheBypassError by
        name), then once more compiled, so its K/V and logits are the compiled graph's as every step's are."""
        self.recompiles += traced
        if self.trust is not None:  # the next step guarded again (it marks what a trace keeps dynamic)
            self.trust.graphs = None
        self._checked(args)
        return self._call(args)

    def _key(self) -> tuple:
        """What the graph was traced under that dynamo's guards would otherwise have to re-check every step."""
        m = self.runner.policy.model
        peft = getattr(m, "peft_config", None)
        return (id(m), m.training, str(getattr(m, "active_adapter", None)), tuple(sorted(peft or ())),
                tuple(sorted(getattr(self.runner.policy, "served_adapters", None) or ())), self.runner._inner,
                self.runner._kernel, self.prefixed(), torch.is_inference_mode_enabled(), torch.is_grad_enabled())

    def prefixed(self) -> bool:
        """Whether steps over prefix entries run in the graph (CPU kernel, layer regions, the workspace's shared
        prefixes on): such steps pass the prefix store, and run their own graph (compiled at warm-up beside the
        plain one, which steps without an entry keep: no per-step cost for them)."""
        return self.trust is not None and bool(self.runner._kernel) and self.ws.shared_prefix

    def _checked(self, args) -> torch.Tensor:
        """The step run eager through the cache-use guard (``ForwardContext.verify``: CacheBypassError by name)."""
        return self._call(args, lambda *a: self._step(*a, check=True))

    def _call(self, args, fn=None):
        cfg = self.runner._text_config
        saved = cfg._attn_implementation_internal
        cfg._attn_implementation_internal = ATTN_NAME  # the engine holds policy.lock: nothing else runs now
        set_current(None)
        try:
            if fn is not None:
                return fn(*args)
            try:
                if self._hooked and not layer_hooked(self._layers):
                    log.info("static decode: no decoder layer has a hook now; %d layers per call again", self._want)
                    self._hooked = False
                    self._plan(self._want)
                return self._fn(*args)
            except Ungrouped as e:  # K/V of this step's layers rewritten below, to the same positions
                self._hooked = isinstance(e, Hooked)  # a hook: until it goes; a loop changing a layer's input: for good
                log.warning("static decode: %s; decoder layers run one per compiled call %s", e,
                            "while it stays" if self._hooked else "from now on")
                self._plan(1)
                return self._fn(*args)
        finally:
            cfg._attn_implementation_internal = saved

    def warm(self) -> None:
        """Compile the step now (a throwaway batch of two rows in a free block), so no request waits on it."""
        kv, ws = self.runner.kv, self.ws
        blocks = kv.allocate(1)
        if blocks is None:
            return
        t, g0 = time.perf_counter(), _graphs()
        try:
            with self.runner.policy.lock, torch.inference_mode(), self.runner.policy.inference():
                keys = [("warm", 0), ("warm", 1)]
                if ws.arrange(keys, [2, 2], [blocks, blocks]) is None:
                    return  # a workspace budget too small for two rows: every step gathers, eager
                args = self._inputs([0, 0], [2, 2], [0, 0], [blocks, blocks])
                # the plain step, and the step over prefix entries (a stand-in store that no row reads)
                variants = [args] + ([args[:-1] + (step_prefix(self, len(args[0])),)] if self.prefixed() else [])
                for a in variants:
                    ws.lengths = [2, 2]
                    self._checked(a)  # the cache-use guard, eager
                    for _ in range(2):  # guarded (it vouches for the layers), then trusted (compiles the copies)
                        ws.lengths = [2, 2]
                        self._call(a)
                ws.advance()
        finally:
            ws.arrange([], [], [])
            kv.free(blocks)
        self.warmup_s = time.perf_counter() - t
        self.warm_graphs = _graphs()
        self.warm_compiled = self.warm_graphs - g0  # region "layer": 1 whatever the depth (0: cached earlier)
