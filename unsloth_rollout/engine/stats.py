"""``RolloutEngine.stats()``: the core's counters plus gauges read from its parts, in one flat dict.

Keys as vLLM names the same figures where it has them (``num_running``, ``kv_usage``, ``prefix_cache_hits``).
"""

from __future__ import annotations

from . import cpu_attention


def engine_stats(engine) -> dict:
    core, driver = engine.core, engine.driver
    s = dict(core.stats)
    sch, kv, ws = core.scheduler, core.kv, core.runner.workspace
    held = set()  # KV blocks held by requests, not by the prefix cache alone
    for seq in list(sch.running):
        held.update(seq.block_table)
    s.update(
        requests=driver.inbox.requests, version=engine.version, paused=engine.is_paused,
        paused_by=sorted(engine.paused_by), num_running=len(sch.running),
        num_waiting=len(sch.waiting) + len(driver.inbox.queued),
        kv_blocks_total=kv.num_blocks, kv_blocks_free=kv.num_free_blocks, kv_block_size=kv.block_size,
        kv_cache_bytes=kv.memory_bytes, kv_usage=1 - kv.num_free_blocks / kv.num_blocks,
        kv_blocks_held_by_requests=len(held),
        decode_workspace_bytes=ws.memory_bytes if ws is not None else 0,
        decode_workspace_peak_bytes=ws.peak_bytes if ws is not None else 0,
        decode_workspace_budget_bytes=ws.budget_bytes if ws is not None else 0,
        decode_workspace_fallbacks=ws.fallbacks if ws is not None else 0,
        decode_shared_prefix=bool(ws is not None and ws.shared_prefix),
        decode_prefix_min_tokens=ws.min_prefix if ws is not None else None,
        decode_prefix_entries=len(ws.pkeys) if ws is not None else 0,
        decode_prefix_bytes=ws.prefix_bytes if ws is not None else 0,
        decode_prefix_steps=ws.prefix_steps if ws is not None else 0,
        decode_prefix_rehomed=ws.rehomed if ws is not None else 0,
        prefix_cache_entries=len(sch.prefix), prefix_cache_hits=sch.prefix.hits,
        prefix_cache_extensions=sch.prefix.extensions, prefix_cache_reused_tokens=sch.prefix.reused_tokens,
        num_preemptions=sch.num_preemptions, max_model_len=engine.max_model_len,
        adapter_switch_changes=core.weights.switch_changes,
        decode_backend=core.runner.decode_backend, decode_backend_fallback=core.runner.decode_backend_fallback,
        cpu_attention_kernel=core.runner._kernel,
        cpu_attention_op=cpu_attention.op_registration() if core.runner._kernel else None,
        mm_processor_cache_hits=core.inputs.cache.hits,
        mm_processor_cache_misses=core.inputs.cache.misses, mm_processor_cache_bytes=core.inputs.cache.bytes)
    if (st := core.runner.static) is not None:  # the captured decode (decode_static.py)
        trusts = st._trusts.values()  # one per unit size the step has run (decode_trust.py)
        s.update(decode_warmup_s=st.warmup_s, decode_recompiles=st.recompiles, decode_eager_steps=st.eager_steps,
                 decode_guarded_steps=sum(t.guarded_steps for t in trusts) if trusts else st.steps,
                 decode_trusted_steps=sum(t.trusted_steps for t in trusts),
                 decode_failed_trusted_steps=sum(t.failed_trusted for t in trusts),
                 decode_prefix_compiled=st.prefixed(),  # steps over shared-prefix entries run in the graph
                 decode_layers_per_call=st.unit_size)  # decoder layers per compiled call (decode_units.py)
        if (g := st.graphs) is not None:  # compile_mode="cuda-graphs" (decode_graphs.py)
            s.update(decode_graph_captures=g.captures, decode_graph_replays=g.replays,
                     decode_graph_invalidations=g.invalidations, decode_graphs_disabled=g.disabled)
    return s
