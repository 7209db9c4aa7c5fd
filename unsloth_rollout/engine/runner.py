"""ModelRunner: one batched forward of the policy with the engine-owned KV cache.

The model is only asked for ``forward()``. Positions are given explicitly per row, with each prompt's vision
inputs, by ``PromptVision`` (vision.py: M-RoPE for Qwen-VL, image blocks, packing rules). Masks are not
the model's business: each forward carries a ``ForwardContext`` that the engine's attention function
(attention.py) builds every layer's mask from, and that checks every layer used the engine's cache.
Prefill is here; a decode step is one of the variants of engine/decode/, chosen by decode/choose.py.
"""

from __future__ import annotations

import inspect

import torch

from .. import bitwise
from ..models import adapters as served_adapters  # a module: models.adapters imports engine.config
from ..models.families import check_supported, text_dims
from . import internals
from .attention import ATTN_NAME, CTX_KWARG, ForwardContext, inner_implementation, register, set_current
from .config import EngineConfig
from .decode import cpu_kernel
from .decode.step import DecodeContext, DecodeRows
from .decode.steps import DecodeSteps
from .kv_cache import CacheView, KVCache
from .vision import PromptVision


class ModelRunner:
    def __init__(self, policy, kv_cache: KVCache, config: EngineConfig, vision_token_ids=frozenset(),
                 weights_clock=None):
        self.policy = policy
        self.kv = kv_cache
        self.prefill_chunk_tokens = config.prefill.chunk_tokens
        # The bitwise on-policy mode (unsloth_rollout/bitwise.py): every engine forward and the sampler's log-softmax
        # run its batch-invariant ops; decode/choose.py keeps the decode step eager for it.
        self.bitwise = bitwise.enabled(policy)
        if self.bitwise:
            bitwise.check(policy)
        self.log_softmax = bitwise.log_softmax if self.bitwise else torch.log_softmax  # the sampler's (core.py)
        self.vision_token_ids = frozenset(vision_token_ids)  # tokens whose embedding needs the prompt's pixels
        self.device = policy.device
        check_supported(policy.config, getattr(policy, "allow_unverified_family", False))
        # Positions (M-RoPE too), vision inputs, image blocks and packing rules of this family's prompts.
        self.vision = PromptVision(policy, self.device)
        register()
        # The decoder's config; its attention implementation is switched to the engine's during engine forwards,
        # whose arithmetic follows the implementation the model was configured with (as in training).
        self.text_config = policy.text_config
        self.inner = inner_implementation(internals.configured_attention(self.text_config))
        # decode attention on CPU through decode/cpu_kernel.py's kernel (SDPA arithmetic; built at first use)
        self.kernel = (config.decode.cpu_kernel and self.device.type == "cpu" and self.inner in ("sdpa", "fused")
                       and not self.bitwise and cpu_kernel.available())
        self.num_layers = text_dims(self.text_config)[0]
        # transformers >= 5.24 names the cache argument ``cache`` (``past_key_values`` is deprecated there).
        params = inspect.signature(policy.base_model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self._last_ctx = None  # the ForwardContext of the latest eager forward (the probe reads what it saw)
        self.decode_steps = DecodeSteps(DecodeContext(
            policy, kv_cache, config.decode, self.device, self.num_layers, self.text_config, self.inner, self.kernel,
            self._cache_arg, self.vision, self._forward, weights_clock, self.bitwise))
        kv_cache.on_release.append(self.decode_steps.release)

    # ------------------------------------------------------------------ forwards
    def _forward(self, input_ids, position_ids, ctx: ForwardContext, view, adapters=None, keep=None, **mm):
        """Logits [B, V] of each row's last position, or [K, V] of the positions ``keep`` of a packed row.
        ``adapters``: one adapter name per row ("__base__": none), selected by ``adapter_scope`` and put back after
        the forward, also when it raises; None: the model's active adapter."""
        ctx.inner, ctx.kernel, ctx.bitwise = self.inner, self.kernel, self.bitwise
        cfg = self.text_config
        saved = internals.swap_attention(cfg, ATTN_NAME)  # the engine holds policy.lock: nothing else runs now
        set_current(ctx)
        self._last_ctx = ctx
        try:
            with served_adapters.adapter_scope(self.policy.model, adapters), bitwise.engine_ops(self.policy,
                                                                                                 self.bitwise):
                out = self.policy.model(input_ids=input_ids, position_ids=position_ids, attention_mask=None,
                                        use_cache=True, logits_to_keep=1 if keep is None else keep,
                                        **{self._cache_arg: view, CTX_KWARG: ctx}, **mm)
        finally:
            internals.swap_attention(cfg, saved)
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

    # ------------------------------------------------------------------ decode (engine/decode/)
    def arrange_decode(self, keys: list[tuple], lengths: list[int], block_tables: list[list[int]],
                       hint: tuple | None = None) -> list[int]:
        """The order the decode batch runs in: for each row, the index of its sequence in the arguments
        (``keys[i]``: the sequence's (id, kv_epoch)); ``DecodeSteps.arrange``."""
        return self.decode_steps.arrange(keys, lengths, block_tables, hint)

    def decode(self, tokens: list[int], lengths: list[int], deltas: list[int], block_tables: list[list[int]],
               adapters: list[str | None] | None = None, eager: bool = False, keys: list[tuple] | None = None):
        """One new token per row. ``lengths[i]``: tokens already cached for row i (the new token's position).
        ``keys``: the rows' (seq id, kv_epoch), in ``arrange_decode``'s order. ``eager``: never the compiled step."""
        names = self.adapter_names(adapters or [None] * len(tokens))
        return self.decode_steps.run(DecodeRows(tokens, lengths, deltas, block_tables, names, keys), eager)

    def probe(self) -> None:
        """A two-token prefill and a one-token decode into a free block, run the way ``step()`` runs them:
        a model whose attention bypasses the engine's cache (or computes what the engine cannot) raises
        here, when the engine is built, before any request is served. Then the compiled step is compiled."""
        blocks = self.kv.allocate(1)
        if blocks is None:
            return
        steps = self.decode_steps
        try:
            with self.policy.lock, torch.inference_mode(), self.policy.inference():
                slots = self.kv.slots(blocks, 0, 3)
                self.prefill([0, 0], slots[:2])
                self.decode([0], [2], [0], [blocks], eager=True)
                # a layer with a sliding window or soft-capping: no shared prompts
                steps.serve_shared_prompts(not any(w is not None or cap for w, cap in self._last_ctx.seen))
                if steps.workspace is not None:  # the workspace path, through the same guard
                    key = [("probe", 0)]
                    self.arrange_decode(key, [2], [blocks])
                    self.decode([0], [2], [0], [blocks], eager=True, keys=key)
        finally:
            if steps.workspace is not None:
                steps.workspace.arrange([], [], [])
            self.kv.free(blocks)
        steps.warm()
