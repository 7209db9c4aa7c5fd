"""ModelRunner: one batched forward of the policy with the engine-owned KV cache.

The model is only asked for ``forward()``. Positions are given explicitly per row, with each prompt's vision
inputs, by ``PromptVision`` (vision.py: M-RoPE for Qwen-VL, image blocks, packing rules). Masks are not
the model's business: each forward carries a ``ForwardContext`` that the engine's attention function
(attention.py) builds every layer's mask from, and that checks every layer used the engine's cache.
The compiled decode step (``decode_backend="static"``, also what ``decode_compile=True`` selects) is
decode_static.py.
"""

from __future__ import annotations

import inspect

import numpy as np
import torch

from .. import bitwise
from ..logs import get_logger
from ..models import adapters as served_adapters  # a module: models.adapters imports engine.config
from ..models.families import check_supported, text_dims
from . import cpu_attention
from .attention import ATTN_NAME, CTX_KWARG, ForwardContext, inner_implementation, register, set_current
from .decode_backend import DECODE_BACKENDS, DecodeWorkspace
from .decode_static import auto_decode_backend
from .kv_cache import CacheView, KVCache
from .vision import PromptVision

logger = get_logger("unsloth_rollout")

# Fewest shared positions for a prefix entry (EngineConfig.shared_prefix_min_tokens=None): 32, also with the
# compiled step on the CPU kernel, which reads prefix entries in the graph (faster than whole rows from 128 shared
# positions on, benchmarks/cpu/shared-prefix-crossover.md); 640 with the compiled step without the kernel, whose
# steps over prefix entries run eager (compiled whole rows were faster up to ~600 tokens there)
EAGER_MIN_PREFIX, STATIC_MIN_PREFIX = 32, 640


class ModelRunner:
    def __init__(self, policy, kv_cache: KVCache, compile_decode: bool = False, compile_mode: str | None = None,
                 decode_backend: str = "workspace", prefill_chunk_tokens: int | None = None,
                 vision_token_ids=frozenset(), decode_workspace_bytes: int | None = None,
                 shared_prefix_decode: bool = True, cpu_attention_kernel: bool = True,
                 shared_prefix_min_tokens: int | None = None, decode_layers_per_call: int | None = None):
        self.policy = policy
        self.kv = kv_cache
        # Bitwise on-policy mode (unsloth_rollout/bitwise.py): the eager step whose ops the mode makes invariant; the
        # compiled step is refused by name, the CPU decode kernel and the shared-prefix split are off.
        self.bitwise = bitwise.enabled(policy)
        self.log_softmax = bitwise.log_softmax if self.bitwise else torch.log_softmax  # the sampler's (core.py)
        if self.bitwise:
            decode_backend = bitwise.decode_backend(policy, decode_backend, compile_decode, compile_mode)
            compile_decode, shared_prefix_decode, cpu_attention_kernel = False, False, False
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.vision_token_ids = frozenset(vision_token_ids)  # tokens whose embedding needs the prompt's pixels
        if decode_backend not in (*DECODE_BACKENDS, "auto"):
            raise ValueError(f"decode_backend must be one of {('auto', *DECODE_BACKENDS)}, got {decode_backend!r}")
        self.decode_backend_requested = "static" if compile_decode else decode_backend
        self.decode_backend_fallback = None  # why "auto" runs the eager workspace where it meant the static step
        if decode_backend == "auto" and not compile_decode:
            decode_backend = auto_decode_backend(policy.device, decode_workspace_bytes, policy)
        # decode_compile=True is the captured step (decode_static.py), the one compiled decode path.
        self.decode_backend = "static" if compile_decode else decode_backend
        # "static" (decode_static.py) is the workspace rows read by a compiled step; eager steps share them.
        self.workspace = (DecodeWorkspace(kv_cache, budget_bytes=decode_workspace_bytes)
                          if self.decode_backend in ("workspace", "static") else None)
        kv_cache.on_release.append(self.release_workspace)
        self.device = policy.device
        check_supported(policy.config, getattr(policy, "allow_unverified_family", False))
        # Positions (M-RoPE too), vision inputs, image blocks and packing rules of this family's prompts.
        self.vision = PromptVision(policy, self.device)
        register()
        # The decoder's config; its attention implementation is switched to the engine's during engine forwards,
        # whose arithmetic follows the implementation the model was configured with (as in training).
        self._text_config = policy.text_config
        self._inner = inner_implementation(getattr(self._text_config, "_attn_implementation", None))
        # decode attention on CPU through engine/cpu_attention.py's kernel (SDPA arithmetic; built at first use)
        self._kernel = (cpu_attention_kernel and self.device.type == "cpu" and self._inner in ("sdpa", "fused")
                        and cpu_attention.available())
        self.num_layers = text_dims(self._text_config)[0]
        # transformers >= 5.24 names the cache argument ``cache`` (``past_key_values`` is deprecated there).
        params = inspect.signature(policy.base_model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self.compile_decode = compile_decode
        self._last_ctx = None  # the ForwardContext of the latest eager forward (the probe reads what it saw)
        if self.workspace is not None and shared_prefix_decode:  # static: such steps run eager (decode())
            self.workspace.shared_prefix = self._shared_prefix_servable()
        self.shared_prefix_min_tokens = shared_prefix_min_tokens
        self._set_min_prefix()
        self.static = None
        self.weights_clock = None  # the engine core's WeightsClock (set by the core; read by the captured step)
        if self.decode_backend == "static":
            from .decode_static import StaticDecode

            self.static = StaticDecode(self, compile_mode, unit=decode_layers_per_call)

    def _set_min_prefix(self) -> None:
        """Fewest shared positions worth a prefix entry: the config's, else 32, or ``STATIC_MIN_PREFIX`` when the
        compiled step runs without the CPU kernel (its steps that read prefix entries run eager)."""
        if self.workspace is not None:
            n = self.shared_prefix_min_tokens
            self.workspace.min_prefix = n if n is not None else (
                STATIC_MIN_PREFIX if self.decode_backend == "static" and not self._kernel else EAGER_MIN_PREFIX)

    def _shared_prefix_servable(self) -> bool:
        """Whether decode may read shared prefixes once per group (attention.shared_prefix_decode): on CPU (the
        split attention uses the CPU flash kernel, which returns its log-sum-exp), with SDPA arithmetic. That
        every layer attends over all of its history (no sliding window, no logit soft-capping) is what the
        probe's decode then sees, whatever the config calls it (``probe``)."""
        return self.device.type == "cpu" and self._inner in ("sdpa", "fused")

    # ------------------------------------------------------------------ forwards
    def _forward(self, input_ids, position_ids, ctx: ForwardContext, view, adapters=None, keep=None, **mm):
        """Logits [B, V] of each row's last position, or [K, V] of the positions ``keep`` of a packed row.
        ``adapters``: one adapter name per row ("__base__": none), selected by ``adapter_scope`` and put back after
        the forward, also when it raises; None: the model's active adapter."""
        ctx.inner, ctx.kernel, ctx.bitwise = self._inner, self._kernel, self.bitwise
        cfg = self._text_config
        saved = cfg._attn_implementation_internal
        cfg._attn_implementation_internal = ATTN_NAME  # the engine holds policy.lock: nothing else runs now
        set_current(ctx)
        self._last_ctx = ctx
        try:
            with served_adapters.adapter_scope(self.policy.model, adapters), bitwise.engine_ops(self.policy,
                                                                                                 self.bitwise):
                out = self.policy.model(input_ids=input_ids, position_ids=position_ids, attention_mask=None,
                                        use_cache=True, logits_to_keep=1 if keep is None else keep,
                                        **{self._cache_arg: view, CTX_KWARG: ctx}, **mm)
        finally:
            cfg._attn_implementation_internal = saved
            set_current(None)
        ctx.verify(self.policy.model, self.num_layers)
        return out.logits[:, -1, :] if keep is None else out.logits[0]

    def adapter_names(self, names: list[str | None]) -> list[str] | None:
        """Per-row adapter names, or None when every row uses the model's active adapter (the policy's own)."""
        if all(n is None for n in names):  # the model at rest: its own adapter, or the plain model (serving_wrapper)
            return None
        default = served_adapters.unnamed_adapter(self.policy)
        if default is None:
            default = getattr(self.policy.model, "active_adapter", "__base__")
        served = getattr(self.policy, "served_adapters", {})  # a name unloaded meanwhile maps to one PEFT lacks
        return [default if n is None else served.get(n, f"<unloaded {n}>") for n in names]

    def prefill(self, ids: list[int], slots: list[int], prompt=None, adapter: str | None = None, scorer=None):
        """Run a whole prompt (batch of one) from position 0, writing its KV into ``slots``; ``prompt``: the
        PreparedPrompt whose vision inputs it carries (``ids`` may extend its tokens with earlier output, when
        a preempted sequence is recomputed): pixel_values, image_grid_thw and the family's other processor
        outputs (``prompt.extra``: image_sizes, pixel_attention_mask, ...). ``scorer``: a PromptScorer that gets
        every position's logits (scoring requests). Returns (logits [V], rope_delta)."""
        input_ids = torch.tensor([ids], device=self.device)
        position_ids, delta, mm = self.vision.prompt_inputs(ids, prompt)
        block = self.vision.image_blocks(input_ids)
        ctx = ForwardContext.prefill(len(ids), self.device, block)
        view = CacheView(self.kv, torch.tensor(slots, device=self.device), None, 0, ctx)
        keep = None if scorer is None else torch.arange(len(ids), device=self.device)
        logits = self._forward(input_ids, position_ids, ctx, view, self.adapter_names([adapter]), keep=keep, **mm)
        if scorer is None:
            return logits[0], delta
        scorer.add(0, logits)
        return logits[-1], delta

    def prefill_chunked(self, ids: list[int], slots: list[int], prompt=None, adapter: str | None = None,
                        start: int = 0, scorer=None):
        """``prefill`` of positions ``start ..`` (the first ``start`` already in the pool, e.g. a cached earlier
        turn), in forwards of at most ``prefill_chunk_tokens`` tokens when there are more: from position 0 the
        first runs through the last image placeholder (it needs the pixels), each later one attends to the KV the
        earlier ones cached (``prefill_continue``). Returns (logits [V], rope_delta) of the whole prompt."""
        n = len(ids)
        chunk = self.prefill_chunk_tokens or n
        out = None
        if scorer is not None:
            if start:
                raise ValueError("prefill_chunked: a scored prompt is prefilled from position 0")
            scorer.reset()
        if start == 0:
            vis = [i for i, t in enumerate(ids) if t in self.vision_token_ids] if self.vision_token_ids else []
            start = min(n, max(chunk, vis[-1] + 1 if vis else 0))
            out = self.prefill(ids[:start], slots[:start], prompt, adapter, scorer)
        for begin in range(start, n, chunk):
            end = min(n, begin + chunk)
            out = self.prefill_continue(ids[:end], begin, slots[:end], prompt, adapter, scorer)
        return out

    def prefill_continue(self, ids: list[int], start: int, slots: list[int], prompt=None,
                         adapter: str | None = None, scorer=None):
        """Prefill positions ``start ..`` of a prompt whose first ``start`` positions are already in the pool
        (``slots``: all of its positions): the new tokens attend to the cached ones through a gather, with the
        positions (M-RoPE included) the whole prompt gives them. The new tokens must hold no image placeholders
        (their pixels would be needed). Returns (logits [V], rope_delta)."""
        dev = self.device
        position_ids, delta, _ = self.vision.prompt_inputs(ids, prompt)  # positions of the whole prompt; no pixels
        n = len(ids)
        input_ids = torch.tensor([ids[start:]], device=dev)
        q_pos = torch.arange(start, n, device=dev).unsqueeze(0)
        k_pos = torch.arange(n, device=dev).unsqueeze(0)
        ctx = ForwardContext("prefill", q_pos, k_pos, None)
        slots_t = torch.tensor(slots, device=dev)
        view = CacheView(self.kv, slots_t[start:], slots_t.unsqueeze(0), n, ctx)
        keep = None if scorer is None else torch.arange(n - start, device=dev)
        logits = self._forward(input_ids, position_ids[..., start:], ctx, view, self.adapter_names([adapter]),
                               keep=keep)
        if scorer is None:
            return logits[0], delta
        scorer.add(start, logits)
        return logits[-1], delta

    def _decode_inputs(self, tokens: list[int], lengths: list[int], deltas: list[int]):
        """(input_ids [B, 1], positions [B, 1] or M-RoPE [3, B, 1], lengths [B]) of a decode step's rows."""
        dev, b = self.device, len(tokens)
        lens_t = torch.tensor(lengths, device=dev)
        return torch.tensor(tokens, device=dev).view(b, 1), self.vision.decode_positions(lens_t, deltas), lens_t

    def can_pack(self, prompt) -> bool:
        """Whether a prompt may share a packed prefill forward (``PromptVision.can_pack``)."""
        return self.vision.can_pack(prompt)

    def prefill_packed(self, items: list[tuple], adapter: str | None = None, scorers: list | None = None):
        """Several prompts (``(ids, slots, prompt)`` each, all with ``adapter``; a lone item may add ``start``,
        its positions already cached, see ``prefill_chunked``) in one forward: packed into one
        row, each position attending only to its own prompt (``ForwardContext.spans``), with its own positions
        (M-RoPE rows included) and the vision tower run once over all their images. Returns [(logits [V],
        rope_delta)] per prompt. ``scorers[i]``: a PromptScorer for item i (every position's logits), or None."""
        scorers = scorers or [None] * len(items)
        if len(items) == 1:
            ids, slots, prompt, *start = items[0]
            return [self.prefill_chunked(ids, slots, prompt, adapter, *(start or [0]), scorer=scorers[0])]
        dev = self.device
        all_ids, all_slots, positions, spans, deltas, lasts = [], [], [], [], [], []
        vision, kept = [], []  # kept: packed positions whose logits come back (every one of a scored prompt)
        for i, (ids, slots, prompt) in enumerate(items):
            if not self.vision.can_pack(prompt):
                raise ValueError("prefill_packed: a prompt with non-concatenable vision inputs")
            pos, delta, mm = self.vision.prompt_inputs(ids, prompt)
            positions.append(pos)
            deltas.append(delta)
            if mm:
                vision.append(mm)
            if scorers[i] is not None:
                scorers[i].reset()
                kept += range(len(all_ids), len(all_ids) + len(ids))
            else:
                kept.append(len(all_ids) + len(ids) - 1)
            all_ids += ids
            all_slots += slots
            spans.append((len(all_ids) - len(ids), len(all_ids)))
            lasts.append(len(kept) - 1)  # where prompt i's last position sits among the kept rows
        input_ids = torch.tensor([all_ids], device=dev)
        position_ids = torch.cat(positions, dim=-1)
        mm = self.vision.pack(vision)
        block = self.vision.image_blocks(input_ids)
        pos_1d = torch.cat([torch.arange(len(ids), device=dev) for ids, _, _ in items]).unsqueeze(0)
        ctx = ForwardContext("prefill", pos_1d, pos_1d, None, block, spans=spans)
        view = CacheView(self.kv, torch.tensor(all_slots, device=dev), None, 0, ctx)
        logits = self._forward(input_ids, position_ids, ctx, view, self.adapter_names([adapter]),
                               keep=torch.tensor(kept, device=dev), **mm)
        for i, sc in enumerate(scorers):
            if sc is not None:
                n = len(items[i][0])
                sc.add(0, logits[lasts[i] - n + 1:lasts[i] + 1])
        return [(logits[lasts[i]], deltas[i]) for i in range(len(items))]

    def release_workspace(self) -> None:
        if self.workspace is not None:
            self.workspace.release()

    def arrange_decode(self, keys: list[tuple], lengths: list[int], block_tables: list[list[int]],
                       hint: tuple | None = None) -> list[int]:
        """The order the decode batch runs in: for each row, the index of its sequence in the arguments
        (``keys[i]``: the sequence's (id, kv_epoch)). The workspace backend runs rows in its own row order; a
        batch that does not fit the workspace's budget runs in the given order, through the gather path."""
        order = None if self.workspace is None else self.workspace.arrange(keys, lengths, block_tables, hint)
        return list(range(len(keys))) if order is None else order

    def decode(self, tokens: list[int], lengths: list[int], deltas: list[int], block_tables: list[list[int]],
               adapters: list[str | None] | None = None, eager: bool = False, keys: list[tuple] | None = None):
        """One new token per row. ``lengths[i]``: tokens already cached for row i (the new token's position).
        ``keys``: the rows' (seq id, kv_epoch), in ``arrange_decode``'s order: decode through the workspace."""
        bs = self.kv.block_size
        n_rows = len(tokens)
        names = self.adapter_names(adapters or [None] * n_rows)
        if keys is not None and self.workspace is not None and not self.workspace.gathering:
            if self.static is not None and not eager:
                ws = self.workspace
                prefixes = ws.has_prefixes
                held = max(ws.own_lengths) if prefixes else max(lengths)  # the most positions a row holds
                servable = not prefixes or self.static.prefixed()
                if names is None and servable and self.static.fits(n_rows, held, prefixes):
                    return self.static.run(tokens, lengths, deltas, block_tables)
                # rows naming different adapters, shared prefixes without the CPU kernel, or no room to pad: eager
                self.static.eager_steps += 1
            return self._decode_workspace(tokens, lengths, deltas, block_tables, names, keys)
        b, lmax = n_rows, max(lengths) + 1
        gather = np.full((b, lmax), self.kv.scratch_slot, dtype=np.int64)
        ar = np.arange(lmax)
        for i, (n, table) in enumerate(zip(lengths, block_tables)):
            blocks = np.asarray(table, dtype=np.int64)
            pos = ar[: n + 1]
            gather[i, : n + 1] = blocks[pos // bs] * bs + pos % bs
        write = gather[np.arange(b), np.asarray(lengths)]
        dev = self.device
        gather_t = torch.from_numpy(gather).to(dev)
        write_t = torch.from_numpy(write).to(dev)
        input_ids, pos, lens_t = self._decode_inputs(tokens, lengths, deltas)
        ctx = ForwardContext.decode(lens_t, lmax)
        view = CacheView(self.kv, write_t, gather_t, lmax, ctx)
        return self._forward(input_ids, pos, ctx, view, names)

    def _decode_workspace(self, tokens, lengths, deltas, block_tables, names, keys):
        ws = self.workspace
        if ws.keys != list(keys) or ws.lengths != list(lengths):
            raise RuntimeError("decode rows are not arranged: call arrange_decode with this batch first")
        bs = self.kv.block_size
        write = [t[n // bs] * bs + n % bs for t, n in zip(block_tables, lengths)]
        write_t = torch.tensor(write, device=self.device)
        input_ids, pos, lens_t = self._decode_inputs(tokens, lengths, deltas)
        if ws.has_prefixes:  # rows hold their own positions; shared prefixes are read once per group
            own_t = torch.tensor(ws.own_lengths, device=self.device)
            lmax = int(own_t.max()) + 1
            ctx = ForwardContext.decode(own_t, lmax)
            ctx.prefix = ws.prefix_batch(self.device)
            ws.prefix_steps += 1
            view = ws.view(write_t, own_t, lmax, ctx)
        else:
            lmax = max(lengths) + 1
            ctx = ForwardContext.decode(lens_t, lmax)
            view = ws.view(write_t, lens_t, lmax, ctx)
        logits = self._forward(input_ids, pos, ctx, view, names)
        ws.advance()
        return logits

    def probe(self) -> None:
        """A two-token prefill and a one-token decode into a free block, run the way ``step()`` runs them:
        a model whose attention bypasses the engine's cache (or computes what the engine cannot) raises
        here, when the engine is built, before any request is served."""
        blocks = self.kv.allocate(1)
        if blocks is None:
            return
        try:
            with self.policy.lock, torch.inference_mode(), self.policy.inference():
                slots = self.kv.slots(blocks, 0, 3)
                self.prefill([0, 0], slots[:2])
                self.decode([0], [2], [0], [blocks], eager=True)
                if self.workspace is not None and any(w is not None or cap for w, cap in self._last_ctx.seen):
                    self.workspace.shared_prefix = False  # a layer with a sliding window or soft-capping
                if self.workspace is not None:  # the workspace path, through the same guard
                    key = [("probe", 0)]
                    self.arrange_decode(key, [2], [blocks])
                    self.decode([0], [2], [0], [blocks], eager=True, keys=key)
        finally:
            if self.workspace is not None:
                self.workspace.arrange([], [], [])
            self.kv.free(blocks)
        if self.static is not None:
            try:
                self.static.warm()  # compiles the captured step, after its eager run through the guard
            except Exception as e:  # noqa: BLE001 - "auto" falls back to the eager workspace; "static" was asked
                if self.decode_backend_requested != "auto":
                    raise
                self.decode_backend_fallback = f"{type(e).__name__}: {e}"[:500]
                logger.warning("unsloth_rollout: the static decode step could not be compiled (%s); decoding "
                               "with the eager workspace instead", self.decode_backend_fallback)
                self.static, self.decode_backend = None, "workspace"
                self._set_min_prefix()
