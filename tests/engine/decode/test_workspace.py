"""The decode workspace (engine/decode/workspace.py): no per-step copy of the KV history, rows never stale.

Oracles: the paged pool itself (every workspace row must hold exactly the pool's positions of its sequence),
HF greedy generate() and a teacher-forced forward (outputs through the workspace under preemption), and
torch's profiler (no index_select / gather in a steady-state decode step).
"""

from __future__ import annotations

import pytest
import torch

from unsloth_rollout.testing.oracles import hf_greedy_ignoring_eos, teacher_forced_logprobs
from unsloth_rollout.engine.config import DecodeConfig
from unsloth_rollout import EngineConfig, SamplingParams, load_model
from unsloth_rollout.engine.core import EngineCore
from unsloth_rollout.engine.decode.workspace import DecodeWorkspace
from unsloth_rollout.engine.inputs import PreparedPrompt
from unsloth_rollout.engine.kv_cache import KVCache
from unsloth_rollout.engine.sequence import Sequence
from unsloth_rollout.testing.drive import add_sequences, engine_core, step_until_idle


def _rows_equal_pool(ws: DecodeWorkspace, cache: KVCache, tables: dict) -> None:
    for r, (key, n) in enumerate(zip(ws.keys, ws.lengths)):
        slots = torch.tensor(cache.slots(tables[key], 0, n))
        for i in range(cache.num_layers):
            assert torch.equal(ws.k[i][r, :, :n], cache.k[i][slots].transpose(0, 1)), (key, i)
            assert torch.equal(ws.v[i][r, :, :n], cache.v[i][slots].transpose(0, 1)), (key, i)


def test_workspace_rows_follow_the_pool_through_joins_leaves_and_new_incarnations():
    torch.manual_seed(0)
    cache = KVCache(2, 2, 4, num_blocks=32, block_size=4, dtype=torch.float32, device=torch.device("cpu"))
    for t in cache.k + cache.v:
        t.copy_(torch.randn_like(t))
    ws = DecodeWorkspace(cache, min_capacity=4)
    tables = {("a", 0): cache.allocate(3), ("b", 0): cache.allocate(2), ("c", 0): cache.allocate(4)}
    lens = {("a", 0): 9, ("b", 0): 5, ("c", 0): 13}
    keys = list(tables)
    order = ws.arrange(keys, [lens[k] for k in keys], [tables[k] for k in keys])
    assert [keys[i] for i in order] == ws.keys and ws.fills == 3
    _rows_equal_pool(ws, cache, tables)
    # "a" leaves: the last row moves into its hole; nothing is refilled.
    keys = [("b", 0), ("c", 0)]
    ws.arrange(keys, [lens[k] for k in keys], [tables[k] for k in keys])
    assert ws.rows == 2 and ws.fills == 3 and ws.moves == 1
    _rows_equal_pool(ws, cache, tables)
    # "b" is recomputed (new KV incarnation, same length): its row is refilled from the pool, never reused.
    tables[("b", 1)] = tables.pop(("b", 0))
    lens[("b", 1)] = lens.pop(("b", 0))
    slots = torch.tensor(cache.slots(tables[("b", 1)], 0, 5))
    for t in cache.k + cache.v:
        t[slots] = torch.randn(5, 2, 4)
    keys = [("c", 0), ("b", 1)]
    ws.arrange(keys, [lens[k] for k in keys], [tables[k] for k in keys])
    assert ws.fills == 4 and ("b", 0) not in ws.keys
    _rows_equal_pool(ws, cache, tables)
    # A row whose length is not the sequence's cached length is refilled too.
    lens[("c", 0)] = 12
    ws.arrange(keys, [lens[k] for k in keys], [tables[k] for k in keys])
    assert ws.fills == 5
    _rows_equal_pool(ws, cache, tables)
    ws.release()
    assert ws.rows == 0 and ws.memory_bytes == 0


def test_workspace_grows_once_to_the_hinted_batch_within_its_budget():
    """With the core's hint (rows that may still join, the longest length a row may reach) the rows are sized
    once, not at every join and every 25% of context; a hint past the budget is not followed; rows stay exact."""
    torch.manual_seed(0)
    cache = KVCache(2, 2, 4, num_blocks=80, block_size=4, dtype=torch.float32, device=torch.device("cpu"))
    for t in cache.k + cache.v:
        t.copy_(torch.randn_like(t))
    tables = {(s, 0): cache.allocate(12) for s in "abcdef"}

    def grow_through(ws, hint):
        for n_rows, length in ((2, 5), (4, 9), (6, 20), (6, 40)):
            keys = list(tables)[:n_rows]
            ws.arrange(keys, [length] * n_rows, [tables[k] for k in keys], hint)
            assert ws.ensure(n_rows, length + 1)
            _rows_equal_pool(ws, cache, {k: tables[k] for k in keys})
        return ws

    hinted = grow_through(DecodeWorkspace(cache, min_capacity=4), (6, 44))
    plain = grow_through(DecodeWorkspace(cache, min_capacity=4), None)
    assert hinted.grows == 1 and hinted.k[0].shape[:1] == (6,) and hinted.k[0].shape[2] >= 45
    assert plain.grows >= 3
    # A budget too small for the hint: the rows hold the batch, as without one.
    per = hinted.bytes_per_position
    tight = grow_through(DecodeWorkspace(cache, min_capacity=4, budget_bytes=6 * 48 * per), (64, 1000))
    assert tight.memory_bytes <= 6 * 48 * per and not tight.gathering


def _core(policy, backend: str, kv_tokens: int | None = None, **decode) -> EngineCore:
    return engine_core(policy, kv_tokens, decode=DecodeConfig(backend=backend, **decode))


def _run(core: EngineCore, prompts: list[list[int]], max_new: list[int], temperature: float, n: int = 1):
    seqs = add_sequences(core, prompts, max_new, n=n, seed_by_prompt=True, temperature=temperature)
    step_until_idle(core, max_steps=2000)
    return seqs


def test_workspace_decode_equals_hf_and_teacher_forced_under_preemption(qwen2_dir):
    policy = load_model(qwen2_dir, backend="transformers")
    tok = policy.tokenizer
    prompts = [tok.encode(" ".join(["apple", "bob", "count"][j % 3] for j in range(3 + 7 * i))) for i in range(5)]
    max_new = [60, 50, 30, 20, 10]
    # A pool of 10 blocks for 5 sequences of 64-72 tokens (5 blocks each): decode growth preempts and recomputes.
    core = _core(policy, "workspace", kv_tokens=16 * 10)
    seqs = _run(core, prompts, max_new, temperature=0.0)
    assert core.scheduler.num_preemptions > 0, "the budget was meant to force preemption"
    assert core.runner.decode_steps.workspace.fills > len(seqs), "a recomputed sequence must join (be refilled) again"
    for s in seqs:
        assert s.finish_reason == "length", s.error
        ref = hf_greedy_ignoring_eos(policy.model, s.prompt_ids, len(s.output_ids))
        assert s.output_ids == ref
    # Sampled (seeded) through both backends: same tokens, logprobs equal a teacher-forced forward.
    outs = {}
    for backend in ("workspace", "gather"):
        core = _core(policy, backend, kv_tokens=16 * 10)
        outs[backend] = _run(core, prompts, max_new, temperature=0.9, n=2)
    for a, b in zip(outs["workspace"], outs["gather"]):
        assert a.output_ids == b.output_ids
        tf, _ = teacher_forced_logprobs(policy, a.prompt_ids, a.output_ids, temperature=0.9)
        assert (torch.tensor(a.output_logprobs) - tf).abs().max() <= 1e-5


def pool_reads(core: EngineCore) -> list[str]:
    """Ops of one engine step that index into the paged pool (an input whose first dim is the pool's slots)."""
    rows = core.kv.k[0].shape[0]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        core.step()
    return [e.name for e in prof.events() if e.name in ("aten::index_select", "aten::gather", "aten::index",
                                                        "aten::take")
            and any(len(sh) == 3 and sh[0] == rows for sh in e.input_shapes if isinstance(sh, list))]


def test_decode_step_copies_no_kv_history(qwen2_dir):
    """A steady-state decode step (every row already joined) runs no index_select / gather / index of the pool."""
    policy = load_model(qwen2_dir, backend="transformers")
    prompts = [policy.tokenizer.encode("alice counts twelve apples " * (4 + i)) for i in range(4)]
    core = _core(policy, "workspace")
    for i, ids in enumerate(prompts):
        core.add(Sequence(f"r{i}", 0, PreparedPrompt(ids), SamplingParams(max_new_tokens=20, temperature=0,
                                                                          ignore_eos=True)))
    for _ in range(3):  # prefill, then the first decode step (the rows join: filled from the pool once)
        core.step()
    fills = core.runner.decode_steps.workspace.fills
    assert pool_reads(core) == []
    assert core.runner.decode_steps.workspace.fills == fills and core.runner.decode_steps.workspace.rows == 4
    # The gather backend does copy (the profile can see the difference).
    core = _core(policy, "gather")
    for i, ids in enumerate(prompts):
        core.add(Sequence(f"g{i}", 0, PreparedPrompt(ids), SamplingParams(max_new_tokens=20, temperature=0)))
    for _ in range(3):
        core.step()
    assert len(pool_reads(core)) == 2 * core.kv.num_layers  # keys and values, every layer, every step


@pytest.mark.parametrize("kernel", [False, True])
def test_a_decode_step_builds_its_attention_mask_once_not_per_layer(qwen2_dir, kernel):
    """SDPA on CPU turns a boolean mask into a float one (two ``where`` ops) in every call; the engine hands it the
    float mask it made once for the step (``ForwardContext.additive_mask``), whose -inf / 0 are what SDPA makes.
    The CPU attention kernel reads each row's key range and needs no mask at all."""
    policy = load_model(qwen2_dir, backend="transformers")
    core = _core(policy, "workspace", cpu_kernel=kernel)
    assert core.runner.kernel == kernel
    for i in range(3):
        ids = policy.tokenizer.encode("alice counts twelve apples " * (2 + 3 * i))  # rows of three lengths
        core.add(Sequence(f"r{i}", 0, PreparedPrompt(ids), SamplingParams(max_new_tokens=20, temperature=0,
                                                                          ignore_eos=True)))
    for _ in range(3):
        core.step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        core.step()
    per_row = [e.name for e in prof.events() if e.name in ("aten::where", "aten::masked_fill_")
               and any(len(sh) == 4 and sh[:3] == [3, 1, 1] for sh in e.input_shapes if isinstance(sh, list))]
    assert core.kv.num_layers >= 2 and per_row == ([] if kernel else ["aten::masked_fill_"])


def test_offload_releases_the_workspace(qwen2_dir):
    from unsloth_rollout import GenerationRequest, RolloutEngine

    policy = load_model(qwen2_dir, backend="transformers")
    engine = RolloutEngine(policy, EngineConfig(kv_cache_memory_bytes=64 << 20))
    try:
        [out] = engine.generate(GenerationRequest(input_ids=policy.tokenizer.encode("alice and bob"),
                                                  sampling=SamplingParams(max_new_tokens=8, temperature=0)))
        ws = engine.core.runner.decode_steps.workspace
        held = sum(t.numel() * t.element_size() for t in ws.k + ws.v)
        assert held > 0 and engine.stats()["decode_workspace_bytes"] == held
        engine.offload()
        assert ws.memory_bytes == 0 and ws.rows == 0 and engine.stats()["decode_workspace_bytes"] == 0
        engine.onload()
        [again] = engine.generate(GenerationRequest(input_ids=policy.tokenizer.encode("alice and bob"),
                                                  sampling=SamplingParams(max_new_tokens=8, temperature=0)))
        assert again.output_ids == out.output_ids
    finally:
        engine.shutdown()
