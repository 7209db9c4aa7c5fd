"""The decode workspace stays inside its byte budget (``DecodeConfig.workspace_bytes``, by default the KV
pool's size) under the worst mix: one long row beside many short ones, where rows x longest row would be many times
the pool. Such steps decode through the gather path: tokens equal HF ``generate()``'s, logprobs the teacher-forced
forward's."""

from __future__ import annotations

import pytest
import torch

from unsloth_rollout import EngineConfig, InvalidRequestError, SamplingParams, load_model
from unsloth_rollout.engine.config import DecodeConfig
from unsloth_rollout.engine.core import EngineCore
from unsloth_rollout.engine.decode.workspace import DecodeWorkspace
from unsloth_rollout.engine.inputs import PreparedPrompt
from unsloth_rollout.engine.kv_cache import KVCache
from unsloth_rollout.models.families import text_dims
from unsloth_rollout.engine.sequence import Sequence
from unsloth_rollout.testing.oracles import teacher_forced
from unsloth_rollout.testing.drive import add_sequences, step_until_idle

LONG, SHORT, N_SHORT = 600, 10, 31


def _mix(policy):
    """Random ordinary token ids (no repetitive text: greedy near-ties would make HF's own two paths disagree)."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 500, (LONG,), generator=g).tolist()]
    prompts += [torch.randint(100, 500, (SHORT,), generator=g).tolist() for _ in range(N_SHORT)]
    return prompts, [24] + [40] * N_SHORT


@pytest.mark.parametrize("budget", [None, "half"], ids=["default", "half-the-pool"])
def test_one_long_row_beside_many_short_stays_inside_the_budget(qwen2_dir, budget):
    policy = load_model(qwen2_dir, backend="transformers")
    prompts, max_new = _mix(policy)
    per_token = KVCache.bytes_per_token(*text_dims(policy.text_config), policy.dtype)
    need = sum(len(p) + m for p, m in zip(prompts, max_new))
    kv_bytes = int(need * 1.3) * per_token  # the KV budget 30% above what the batch needs
    ws_bytes = None if budget is None else kv_bytes // 2
    core = EngineCore(policy, EngineConfig(kv_cache_memory_bytes=kv_bytes, block_size=16,
                                           decode=DecodeConfig(workspace_bytes=ws_bytes)), seed=0)
    ws = core.runner.decode_steps.workspace
    assert ws.budget_bytes == (core.kv.memory_bytes if budget is None else ws_bytes)
    # Rows x longest row, as an unbounded workspace pads them: many times the pool.
    assert (1 + N_SHORT) * (LONG + max_new[0]) * per_token > 4 * core.kv.memory_bytes
    seqs = add_sequences(core, prompts, max_new, temperature=0)

    def within_budget():
        assert ws.memory_bytes <= ws.budget_bytes

    step_until_idle(core, max_steps=500, after_step=within_budget)
    assert ws.peak_bytes <= ws.budget_bytes
    assert ws.fallbacks > 0, "the long row's steps were meant to exceed the budget"
    assert ws.fills > 0, "once the long row finished, the short rows fit the workspace"
    assert core.scheduler.num_preemptions == 0
    for i, s in enumerate(seqs):
        assert s.finish_reason == "length", s.error
        lp, logits = teacher_forced(policy, s.prompt_ids, s.output_ids)
        assert s.output_ids == logits.argmax(-1).tolist()
        assert (lp - torch.tensor(s.output_logprobs)).abs().max() <= 1e-5
        if i < 4:  # the long row and three short ones through HF generate() too (the slow oracle)
            n = len(s.output_ids)
            ref = policy.model.generate(torch.tensor([s.prompt_ids]), max_new_tokens=n, min_new_tokens=n,
                                        do_sample=False)[0, len(s.prompt_ids):]
            assert s.output_ids == ref.tolist()


def test_a_zero_budget_always_gathers_and_a_negative_one_is_refused(qwen2_dir):
    policy = load_model(qwen2_dir, backend="transformers")
    core = EngineCore(policy, EngineConfig(kv_cache_memory_bytes=4 << 20, decode=DecodeConfig(workspace_bytes=0)),
                      seed=0)
    ids = policy.tokenizer.encode("alice counts apples")
    s = Sequence("r", 0, PreparedPrompt(ids), SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True))
    core.add(s)
    before = core.runner.decode_steps.workspace.fallbacks  # the engine's own probe at construction
    while core.scheduler.has_work():
        core.step()
    ws = core.runner.decode_steps.workspace
    assert ws.memory_bytes == 0 and ws.fallbacks - before == 5
    ref = policy.model.generate(torch.tensor([ids]), max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert s.output_ids == ref[0, len(ids):].tolist()
    with pytest.raises(InvalidRequestError, match="decode.workspace_bytes"):
        EngineConfig(decode=DecodeConfig(workspace_bytes=-1))


def test_rows_keep_their_history_when_the_budget_reshapes_the_workspace():
    """Inside the budget the workspace trades growth headroom and spare rows for positions, copying the rows it
    keeps; past it, arrange() says gather. The oracle is the paged pool itself."""
    torch.manual_seed(0)
    cache = KVCache(2, 2, 4, num_blocks=96, block_size=4, dtype=torch.float32, device=torch.device("cpu"))
    for t in cache.k + cache.v:
        t.copy_(torch.randn_like(t))
    per_pos = KVCache.bytes_per_token(2, 2, 4, torch.float32)
    ws = DecodeWorkspace(cache, min_capacity=4, budget_bytes=256 * per_pos)
    tables = {(f"s{i}", 0): cache.allocate(11) for i in range(8)}
    keys = list(tables)

    def arrange(ks, n):
        order = ws.arrange(ks, [n] * len(ks), [tables[k] for k in ks])
        assert ws.memory_bytes <= ws.budget_bytes and ws.peak_bytes <= ws.budget_bytes
        for r, (key, m) in enumerate(zip(ws.keys, ws.lengths)):  # every held row equals the pool
            slots = torch.tensor(cache.slots(tables[key], 0, m))
            for i in range(cache.num_layers):
                assert torch.equal(ws.k[i][r, :, :m], cache.k[i][slots].transpose(0, 1))
                assert torch.equal(ws.v[i][r, :, :m], cache.v[i][slots].transpose(0, 1))
        return order

    assert arrange(keys, 5) is not None and ws.k[0].shape[0] == 8  # 8 rows x 16 positions: no headroom fits
    assert arrange(keys[:2], 5) is not None and ws.rows == 2  # six leave
    assert arrange(keys[:2], 22) is not None and tuple(ws.k[0].shape[::2]) == (2, 128)  # fewer rows, longer
    assert arrange(keys[:3], 22) is not None and tuple(ws.k[0].shape[::2]) == (3, 32)  # two rows kept, copied
    assert ws.fills == 8 + 2 + 1
    assert arrange(keys, 40) is None and ws.gathering and ws.fallbacks == 1  # 8 x 41 positions: over budget
    assert arrange(keys[:3], 22) is not None and not ws.gathering
