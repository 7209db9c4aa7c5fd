"""``RolloutEngine.stats()``: the core's counters plus gauges read from its parts, in one flat dict.

Keys as vLLM names the same figures where it has them (``num_running``, ``kv_usage``, ``prefix_cache_hits``).
"""

from __future__ import annotations

from .decode import cpu_kernel


def engine_stats(engine) -> dict:
    core, driver = engine.core, engine.driver
    s = dict(core.stats)
    sch, kv, runner = core.scheduler, core.kv, core.runner
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
        prefix_cache_entries=len(sch.prefix), prefix_cache_hits=sch.prefix.hits,
        prefix_cache_extensions=sch.prefix.extensions, prefix_cache_reused_tokens=sch.prefix.reused_tokens,
        num_preemptions=sch.num_preemptions, max_model_len=engine.max_model_len,
        adapter_switch_changes=core.weights.switch_changes,
        cpu_attention_kernel=runner.kernel, cpu_attention_op=cpu_kernel.op_registration() if runner.kernel else None,
        mm_processor_cache_hits=core.inputs.cache.hits,
        mm_processor_cache_misses=core.inputs.cache.misses, mm_processor_cache_bytes=core.inputs.cache.bytes)
    s.update(runner.decode_steps.stats())  # the decode variants (engine/decode/steps.py)
    return s
