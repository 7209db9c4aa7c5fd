"""The decode variants one engine runs, built once from ``choose_backend``, and the one ``choose_step`` picks per step.

nano-vllm's ``run_model`` is one branch (eager or replay); here the branch is ``choose_step``'s table, and each
variant is a module of its own behind one interface (decode/step.py): the gather step (always there), the eager
workspace step, the compiled step, the graph step, the paged step.
"""

from __future__ import annotations

import torch

from ...logs import get_logger
from ...models.families import family_of
from .choose import PARTS, check_bitwise, choose_backend, choose_step, facts_of, layers_per_call, \
    shared_prompt_min_tokens, shared_prompts_served
from .compiled import CompiledStep
from .gather import GatherStep
from .graph import KEY_BUCKET, GraphStep, check_device
from .paged import PagedStep
from .step import DecodeContext, DecodeRows, DecodeStep
from .workspace import DecodeWorkspace, WorkspaceStep

logger = get_logger("unsloth_rollout")


class DecodeSteps:
    """``arrange`` and ``run`` of the engine's decode: the chosen variant, falling back per step (``choose_step``)."""

    def __init__(self, context: DecodeContext):
        self.context = context
        cfg = context.config
        self.requested = cfg.backend
        self.fallback = None  # why ``auto`` runs the eager workspace where it chose the compiled step
        if context.bitwise:
            check_bitwise(cfg.backend, cfg.compile_mode)
        if cfg.backend == "auto":
            self.backend, self.why = choose_backend(facts_of(context.policy, context.device, cfg.workspace_bytes,
                                                             context.bitwise))
        else:
            self.backend, self.why = cfg.backend, "configured"
        parts = PARTS[self.backend]
        self.gather = GatherStep(context)
        self.workspace = self.eager = self.compiled = self.graph = None
        self.paged = PagedStep(context) if parts.paged else None
        if parts.workspace:
            self.workspace = DecodeWorkspace(
                context.kv, budget_bytes=cfg.workspace_bytes,
                shared_prompts=cfg.shared_prompt and shared_prompts_served(context.device, context.inner,
                                                                          context.bitwise))
            if parts.compiled and context.kernel:  # the store's entries: a dynamic dimension, never 1
                self.workspace.store.min_entries = 2
            self.eager = WorkspaceStep(context, self.workspace)
        if parts.compiled:
            self._build_compiled(parts.graph)
        self._set_min_shared()

    def _build_compiled(self, graph: bool) -> None:
        c = self.context
        per_call = layers_per_call(c.config.layers_per_call, family_of(c.policy.config).served)
        if graph:
            check_device(c.device)
        self.compiled = CompiledStep(c, self.workspace, per_call, KEY_BUCKET if graph else None)
        self.graph = GraphStep(self.compiled) if graph else None

    def _set_min_shared(self) -> None:
        if self.workspace is not None:
            self.workspace.store.min_tokens = shared_prompt_min_tokens(
                self.context.config.shared_prompt_min_tokens, self.backend, self.context.kernel)

    # ------------------------------------------------------------------ a step
    def arrange(self, keys: list[tuple], lengths: list[int], block_tables: list[list[int]],
                hint: tuple | None = None) -> list[int]:
        """The order the decode batch runs in: for each row, the index of its sequence in the arguments
        (``keys[i]``: the sequence's (id, kv_epoch)). The workspace runs rows in its own row order; a batch that does
        not fit its budget runs in the given order, through the gather step."""
        return (self.eager or self.gather).arrange(keys, lengths, block_tables, hint)

    def step_for(self, rows: DecodeRows, eager: bool = False) -> DecodeStep:
        """The variant that runs these rows (``choose_step``)."""
        ws, compiled = self.workspace, self.compiled
        arranged = rows.keys is not None and ws is not None and not ws.gathering
        shared = arranged and ws.has_shared

        def fits() -> bool:
            held = max(ws.own_lengths) if shared else max(rows.lengths)  # the most positions a row holds
            return compiled.fits(len(rows.tokens), held, shared)

        reads_shared = compiled is not None and compiled.reads_shared()
        if reads_shared and shared and not eager and rows.adapters is None:
            reads_shared = compiled.warm_shared()  # the first step over shared prompts: compile their graph now
        name = choose_step(arranged=arranged, compiled=compiled is not None, eager=eager,
                           adapters=rows.adapters is not None, shared=shared, compiled_reads_shared=reads_shared,
                           fits=fits, paged=self.paged is not None)
        step = {"gather": self.gather, "workspace": self.eager, "compiled": self.graph or compiled,
                "paged": self.paged}[name]
        if compiled is not None and not eager and step is self.eager:
            compiled.eager_steps += 1  # a step the compiled step does not serve
        return step

    def run(self, rows: DecodeRows, eager: bool = False) -> torch.Tensor:
        """Logits ``[B, V]`` of one new token per row."""
        return self.step_for(rows, eager).run(rows)

    # ------------------------------------------------------------------ engine start and stop
    def serve_shared_prompts(self, served: bool) -> None:
        """What the probe saw: a layer with a sliding window or logit soft-capping turns shared prompts off."""
        if self.workspace is not None and not served:
            self.workspace.shared_prompts = False

    def warm(self) -> None:
        """Compile the compiled step now; ``auto`` falls back to the eager workspace where it cannot be compiled."""
        if self.compiled is None:
            return
        try:
            self.compiled.warm()  # after its eager run through the guard (the probe)
        except Exception as e:  # noqa: BLE001 - "auto" falls back to the eager workspace; the variant was asked
            if self.requested != "auto":
                raise
            self.fallback = f"{type(e).__name__}: {e}"[:500]
            logger.warning("unsloth_rollout: the compiled decode step could not be compiled (%s); decoding "
                           "with the eager workspace instead", self.fallback)
            self.compiled = self.graph = None
            self.backend = "workspace"
            self._set_min_shared()

    def release(self) -> None:
        if self.workspace is not None:
            self.workspace.release()

    def stats(self) -> dict:
        ws = self.workspace
        s = dict(decode_backend=self.backend, decode_backend_reason=self.why, decode_backend_fallback=self.fallback,
                 decode_workspace_bytes=ws.memory_bytes if ws is not None else 0,
                 decode_workspace_peak_bytes=ws.peak_bytes if ws is not None else 0,
                 decode_workspace_budget_bytes=ws.budget_bytes if ws is not None else 0,
                 decode_workspace_fallbacks=ws.fallbacks if ws is not None else 0,
                 decode_shared_prefix=bool(ws is not None and ws.shared_prompts),
                 decode_prefix_min_tokens=ws.store.min_tokens if ws is not None else None,
                 decode_prefix_entries=len(ws.store.keys) if ws is not None else 0,
                 decode_prefix_bytes=ws.store.memory_bytes if ws is not None else 0,
                 decode_prefix_steps=ws.shared_steps if ws is not None else 0,
                 decode_prefix_rehomed=ws.rehomed if ws is not None else 0)
        if self.compiled is not None:
            s.update(self.compiled.stats())
        if self.graph is not None:
            s.update(self.graph.stats())
        return s
