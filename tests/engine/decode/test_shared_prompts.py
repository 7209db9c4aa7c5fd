"""Shared prompts (engine/decode/shared_prompts.py, attention.shared_prompt_attention): the samples of one prompt
read its KV once per step, and still produce exactly what a plain decode would.

Oracles: HF greedy generate() (tokens), a teacher-forced forward (logprobs of sampled rows), the plain
workspace decode of the same seeded requests (tokens), the paged pool (what the shared-prompt store and the rows
hold), and the split attention against SDPA over the whole history.
"""

from __future__ import annotations

import pytest
import torch

from unsloth_rollout import EngineConfig, SamplingParams, load_model
from unsloth_rollout.engine.config import DecodeConfig
from unsloth_rollout.engine.attention import shared_prompt_attention
from unsloth_rollout.engine.core import EngineCore
from unsloth_rollout.engine.decode.trust import forget_regions
from unsloth_rollout.engine.decode.workspace import DecodeWorkspace
from unsloth_rollout.engine.inputs import PreparedPrompt
from unsloth_rollout.engine.sequence import Sequence
from unsloth_rollout.engine.kv_cache import KVCache
from unsloth_rollout.testing.drive import add_sequences, engine_core, step_until_idle
from unsloth_rollout.testing.families import FAMILIES, family_model_path
from unsloth_rollout.testing.oracles import (assert_greedy_matches, hf_greedy_ignoring_eos, perturb_lora,
                                             teacher_forced_logprobs)


def _core(policy, shared: bool, kv_tokens: int | None = None) -> EngineCore:
    # shared_prompt_min_tokens=32: these prompts are short, and the default under the compiled step is 640
    core = engine_core(policy, kv_tokens, decode=DecodeConfig(shared_prompt_min_tokens=32))
    ws = core.runner.decode_steps.workspace
    assert ws.shared_prompts, "qwen2 (full attention, SDPA) is served with shared prompts"
    ws.shared_prompts = shared
    return core


def _prompts(tok):
    # 40-90 tokens: two to five full blocks of 16 shared by each prompt's samples
    return [tok.encode(" ".join(["apple", "bob", "count", "dog"][(j + i) % 4] for j in range(20 + 12 * i)))
            for i in range(3)]


def _run_watching(core, prompts, max_new, n, temperature):
    seqs = add_sequences(core, prompts, max_new, n=n, seed_by_prompt=True, temperature=temperature)
    ws, seen = core.runner.decode_steps.workspace, {"entries": 0, "steps": 0}
    for _ in range(4000):
        if not core.scheduler.has_work():
            break
        core.step()
        if ws.has_shared:
            seen["steps"] += 1
            seen["entries"] = max(seen["entries"], len(ws.store.keys))
            assert all((o > 0) == (e >= 0) for o, e in zip(ws.origins, ws.row_entry))
    return seqs, seen


def test_groups_read_their_prompt_once_and_decode_exactly(qwen2_dir):
    policy = load_model(qwen2_dir, backend="transformers")
    prompts = _prompts(policy.tokenizer)
    # Samples finish at different steps (rows leave, entries are dropped and compacted while others decode).
    max_new = [24, 9, 17]
    core = _core(policy, shared=True)
    seqs, seen = _run_watching(core, prompts, max_new, n=4, temperature=0.0)
    assert seen["entries"] == 3 and seen["steps"] >= 9, seen
    assert core.runner.decode_steps.workspace.shared_steps == seen["steps"]
    for s in seqs:
        ref = hf_greedy_ignoring_eos(policy.model, s.prompt_ids, len(s.output_ids))
        assert s.output_ids == ref
    # Sampled: the same tokens as the plain decode of the same seeded requests; logprobs = teacher-forced.
    outs = {}
    for shared in (True, False):
        outs[shared], seen = _run_watching(_core(policy, shared), prompts, max_new, n=4, temperature=1.0)
        assert (seen["steps"] > 0) == shared
    for a, b in zip(outs[True], outs[False]):
        assert a.output_ids == b.output_ids
        tf, _ = teacher_forced_logprobs(policy, a.prompt_ids, a.output_ids, temperature=1.0)
        assert (torch.tensor(a.output_logprobs) - tf).abs().max() <= 1e-5


def test_shared_prompts_survive_preemption_and_recompute(qwen2_dir):
    policy = load_model(qwen2_dir, backend="transformers")
    prompts = _prompts(policy.tokenizer)
    core = _core(policy, shared=True, kv_tokens=16 * 14)  # too small for every sample's growth: preemption
    seqs, seen = _run_watching(core, prompts, [40, 40, 40], n=3, temperature=0.8)
    assert core.scheduler.num_preemptions > 0 and seen["steps"] > 0
    for s in seqs:
        assert s.finish_reason == "length", s.error
        tf, _ = teacher_forced_logprobs(policy, s.prompt_ids, s.output_ids, temperature=0.8)
        assert (torch.tensor(s.output_logprobs) - tf).abs().max() <= 1e-5


def _staggered(policy, shared: bool, prompt, steps_alone: int, temperature: float):
    """Sample 0 of ``prompt`` decodes alone for ``steps_alone`` steps, then samples 1-3 arrive (how AReaL and the
    server submit a group: one request at a time). Returns the sequences and, per step after the arrivals, the
    rows' origins and the longest own part."""
    from unsloth_rollout.engine.inputs import PreparedPrompt
    from unsloth_rollout.engine.sequence import Sequence

    core = _core(policy, shared)
    seqs = [Sequence(f"r{j}", 0, PreparedPrompt(prompt), SamplingParams(max_new_tokens=20, ignore_eos=True,
                                                                        seed=j, temperature=temperature))
            for j in range(4)]
    core.add(seqs[0])
    for _ in range(steps_alone):
        core.step()
    for s in seqs[1:]:
        core.add(s)
    ws, seen = core.runner.decode_steps.workspace, []
    while core.scheduler.has_work():
        core.step()
        if ws.rows:
            seen.append((list(ws.origins), max(ws.own_lengths)))
    return core, seqs, seen


def test_a_sample_that_decoded_alone_joins_its_group_s_shared_prompt(qwen2_dir):
    """The first sample's row was whole (nothing shared its blocks when it joined). Once its siblings arrive,
    every row of the group holds only its own positions: the longest own part is the generated tail, not the
    prompt, and the tokens and logprobs are those of the whole-rows decode."""
    policy = load_model(qwen2_dir, backend="transformers")
    prompt = _prompts(policy.tokenizer)[2]
    shared_len = len(prompt) // 16 * 16  # its full blocks
    outs = {}
    for shared in (True, False):
        core, outs[shared], seen = _staggered(policy, shared, prompt, steps_alone=5, temperature=1.0)
        if shared:
            assert core.runner.decode_steps.workspace.rehomed == 1
            full = [(o, m) for o, m in seen if len(o) == 4]
            assert full and all(min(o) == shared_len >= 64 for o, _ in full), seen[:3]
            # the partial block and the generated tail, never the whole prompt
            assert max(m for _, m in full) <= len(prompt) - shared_len + 20 + 1, seen[:3]
        else:
            assert all(max(o) == 0 for o, _ in seen)
    for a, b in zip(outs[True], outs[False]):
        assert a.output_ids == b.output_ids
        tf, _ = teacher_forced_logprobs(policy, a.prompt_ids, a.output_ids, temperature=1.0)
        assert (torch.tensor(a.output_logprobs) - tf).abs().max() <= 1e-5


def test_the_store_holds_the_pool_and_blocks_reused_for_other_kv_never_match():
    torch.manual_seed(0)
    cache = KVCache(2, 2, 8, num_blocks=40, block_size=4, dtype=torch.float32, device=torch.device("cpu"))
    for t in cache.k + cache.v:
        t.copy_(torch.randn_like(t))
    ws = DecodeWorkspace(cache, min_capacity=4, budget_bytes=1 << 20, shared_prompts=True, min_shared_tokens=8)
    prompt = cache.allocate(3)  # 12 shared positions
    tables = {(f"s{i}", 0): cache.share(prompt) + cache.allocate(2) for i in range(3)}
    tables[("lone", 0)] = cache.allocate(5)
    keys = list(tables)
    lens = [14, 14, 14, 14]
    ws.arrange(keys, lens, [tables[k] for k in keys])
    assert len(ws.store.keys) == 1 and ws.store.lengths == [12] and ws.store.readers == [3]
    assert sorted(ws.origins) == [0, 12, 12, 12]
    slots = torch.tensor(cache.slots(prompt, 0, 12))
    for i in range(2):
        assert torch.equal(ws.store.k[i][0, :, :12], cache.k[i][slots].transpose(0, 1))
    for r, k in enumerate(ws.keys):  # each row holds exactly its positions past its origin
        o = ws.origins[r]
        own = torch.tensor(cache.slots(tables[k], o, 14))
        assert torch.equal(ws.k[0][r, :, :14 - o], cache.k[0][own].transpose(0, 1))
    # Every sharer leaves: the entry goes. The prompt's blocks are freed and reused for other KV: sequences
    # sharing them get a new entry (the blocks' generations moved on), filled with the new KV, never the old copy.
    ws.arrange([("lone", 0)], [14], [tables[("lone", 0)]])
    assert not ws.store.keys and ws.origins == [0]
    old_key = tuple((b, cache.generation[b]) for b in prompt)
    for k in keys[:3]:
        cache.free(tables[k][3:])
        cache.free(tables[k][:3])
    cache.free(prompt)  # its first owner's reference
    filler = cache.allocate(cache.num_free_blocks - 3)  # what was free before: the prompt's blocks come next
    again = cache.allocate(3)
    assert sorted(again) == sorted(prompt)
    cache.free(filler[:2])  # room for the new sequences' own blocks
    fresh = torch.tensor(cache.slots(again, 0, 12))
    for t in cache.k + cache.v:
        t[fresh] = torch.randn(12, 2, 8)
    new_tables = {(f"t{i}", 0): cache.share(again) + cache.allocate(1) for i in range(2)}
    ws.arrange([("lone", 0)] + list(new_tables), [14, 13, 13], [tables[("lone", 0)]] + list(new_tables.values()))
    assert len(ws.store.keys) == 1 and ws.store.keys[0] != old_key
    for i in range(2):
        assert torch.equal(ws.store.k[i][0, :, :12], cache.k[i][fresh].transpose(0, 1))
        assert torch.equal(ws.store.v[i][0, :, :12], cache.v[i][fresh].transpose(0, 1))


def test_rows_are_sized_to_what_each_row_holds_of_its_own():
    """With a reach per sequence in the hint (the longest length it may get), shared rows are sized to reach less their
    origin: a group of a long prompt gets rows for its generated tail, not for the prompt the entry holds."""
    cache = KVCache(2, 2, 8, num_blocks=80, block_size=4, dtype=torch.float32, device=torch.device("cpu"))
    prompt = cache.allocate(25)  # 100 shared positions
    tables = {(f"s{i}", 0): cache.share(prompt) + cache.allocate(1) for i in range(4)}
    keys = list(tables)
    ws = DecodeWorkspace(cache, min_capacity=4, shared_prompts=True, min_shared_tokens=8)
    ws.arrange(keys, [101] * 4, [tables[k] for k in keys], hint=(4, 100 + 20, [120] * 4))
    assert ws.origins == [100] * 4
    assert ws.k[0].shape[0] == 4 and 21 <= ws.k[0].shape[2] <= 32, ws.k[0].shape
    ws2 = DecodeWorkspace(cache, min_capacity=4, shared_prompts=True, min_shared_tokens=8)
    lone = cache.allocate(2)
    ws2.arrange(keys + [("lone", 0)], [101] * 4 + [6], [tables[k] for k in keys] + [lone], hint=(5, 120,
                                                                                                 [120] * 4 + [16]))
    assert sorted(ws2.origins) == [0, 100, 100, 100, 100]
    assert ws2.k[0].shape[2] <= 32, "a short whole row beside the group does not size every row to the prompt"


def test_the_store_holds_as_many_entries_as_groups():
    """Groups joining in one step (the first decode step after a GRPO prefill), their prompts of growing lengths:
    the store is sized once, to the groups' count and the longest prompt, and each entry holds its own
    prompt's keys. (Grown entry by entry, it doubled its entries whenever a longer prompt came: 1024 entries for
    16 groups.) Groups arriving in a later step grow it by half again."""
    cache = KVCache(2, 2, 8, num_blocks=400, block_size=4, dtype=torch.float32, device=torch.device("cpu"))
    for t in cache.k + cache.v:
        t.copy_(torch.randn(t.shape))
    tables, lengths = {}, {}
    for g in range(10):
        prompt = cache.allocate(3 + g)  # 12, 16, ... 48 shared positions
        for j in range(3):
            tables[(f"g{g}s{j}", 0)] = cache.share(prompt) + cache.allocate(1)
            lengths[(f"g{g}s{j}", 0)] = 4 * (3 + g) + 1
    ws = DecodeWorkspace(cache, min_capacity=4, shared_prompts=True, min_shared_tokens=8)
    keys = [k for k in tables if int(k[0][1:k[0].index("s")]) < 8]
    ws.arrange(keys, [lengths[k] for k in keys], [tables[k] for k in keys], hint=(30, 60))
    assert len(ws.store.keys) == 8 and ws.store.k[0].shape[0] == 8, ws.store.k[0].shape
    assert ws.store.k[0].shape[2] == 48 and ws.store.lengths == sorted(ws.store.lengths), "entries in order of length"
    for e, key in enumerate(ws.store.keys):
        slots = torch.tensor(cache.slots([b for b, _ in key], 0, ws.store.lengths[e]))
        assert torch.equal(ws.store.k[1][e, :, :ws.store.lengths[e]], cache.k[1][slots].transpose(0, 1))
    ws.advance()
    later = keys + [k for k in tables if k not in keys]
    ws.arrange(later, [lengths[k] + (k in keys) for k in later], [tables[k] for k in later], hint=(30, 60))
    store = ws.store
    assert len(store.keys) == 10 and store.k[0].shape[0] == 12 and store.k[0].shape[2] == 48, store.k[0].shape


@pytest.mark.parametrize("chunks", [None, [(0, 1, 16), (1, 2, 24)]])
@pytest.mark.parametrize("g", [1, 2, 4])
def test_split_attention_equals_sdpa_over_the_whole_history(g, chunks):
    """The merged (prefix + own) attention against SDPA over prefix ++ own positions, rows with and without a
    prefix, entries of different lengths, one padded member slot; the entries read in one attention call, or in
    two, each padded only to its own longest entry (``prompt_chunks``)."""
    torch.manual_seed(0)
    from unsloth_rollout.engine.decode.shared_prompts import SharedPromptBatch

    kvh, d, bs = 2, 16, 8
    plens, members = [16, 24], [[0, 2, 3], [4]]  # row 1 has no prefix
    own = torch.tensor([5, 9, 1, 3, 7])
    b = own.numel()
    pk = [torch.randn(2, kvh, 32, d)]
    pv = [torch.randn(2, kvh, 32, d)]
    k = torch.randn(b, kvh, 12, d)
    v = torch.randn(b, kvh, 12, d)
    q = torch.randn(b, kvh * g, 1, d)
    mask = (torch.arange(12).view(1, -1) <= own.view(-1, 1)).view(b, 1, 1, 12)
    entry, slot, alone = [0] * b, [0] * b, [True] * b
    for e, rows in enumerate(members):
        for j, r in enumerate(rows):
            entry[r], slot[r], alone[r] = e, j, False
    m = max(len(x) for x in members)
    pmax = max(plens)
    pmask = torch.zeros(2, 1, 1, pmax).masked_fill_(
        (torch.arange(pmax).view(1, -1) >= torch.tensor(plens).view(-1, 1)).view(2, 1, 1, pmax), float("-inf"))
    pb = SharedPromptBatch(pk, pv, 2, pmax, m, pmask, torch.tensor([x + [x[0]] * (m - len(x)) for x in members]),
                     torch.tensor(entry), torch.tensor(slot), torch.tensor(alone), chunks)
    out = shared_prompt_attention(q, k, v, mask, d ** -0.5, pb, 0)
    for r in range(b):
        keys, vals = k[r, :, :own[r] + 1], v[r, :, :own[r] + 1]
        if not alone[r]:
            e = entry[r]
            keys = torch.cat([pk[0][e, :, :plens[e]], keys], dim=1)
            vals = torch.cat([pv[0][e, :, :plens[e]], vals], dim=1)
        ref = torch.nn.functional.scaled_dot_product_attention(q[r:r + 1].view(1, kvh, g, d), keys[None], vals[None],
                                                               scale=d ** -0.5)
        assert (out[r].view(kvh, g, d) - ref[0]).abs().max() <= 1e-6


def test_store_entries_are_read_in_two_calls_only_when_that_saves_reads():
    """One call pads every entry to the longest; a split into two contiguous ranges pays for its extra call
    (SPLIT_COST positions) in padded positions it does not read."""
    from unsloth_rollout.engine.decode.shared_prompts import SPLIT_COST, prompt_chunks

    assert prompt_chunks([256]) == [(0, 1, 256)]
    assert prompt_chunks([64, 64, 64]) == [(0, 3, 64)], "equal lengths: nothing to save"
    # 8 short entries and 2 long ones, in order of length (as arrange creates them): split between them
    assert prompt_chunks([48] * 8 + [256] * 2) == [(0, 8, 48), (8, 10, 256)]
    # saving less than one call's cost: one call
    small = [128 - SPLIT_COST // 8] + [128]
    assert prompt_chunks(small) == [(0, 2, 128)]
    # any order: each range padded to its own longest, and never more padded positions than one call
    plens = [96, 256, 48, 160, 32, 256, 80]
    chunks = prompt_chunks(plens)
    assert chunks[0][0] == 0 and chunks[-1][1] == len(plens) and all(c[1] == n[0] for c, n in zip(chunks, chunks[1:]))
    assert all(p == max(plens[a:b]) for a, b, p in chunks)
    assert sum((b - a) * p for a, b, p in chunks) + SPLIT_COST * (len(chunks) - 1) <= len(plens) * max(plens)


def _windowed_or_capped(cfg) -> bool:
    """What the config says: some layer attends over a sliding window, or logits are soft-capped."""
    window = getattr(cfg, "sliding_window", None) is not None and getattr(cfg, "use_sliding_window", True) is not False
    return window or getattr(cfg, "attn_logit_softcapping", None) is not None


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_serves_groups_exactly_with_or_without_shared_prompts(family):
    """A GRPO group of 4 samples of a ~60-token prompt beside a lone prompt: tokens equal HF greedy; sampled
    logprobs equal a teacher-forced forward. Families with windows or soft-capping are refused the split by the
    engine's probe (what their layers ask of the attention), not by a list."""
    policy = load_model(str(family_model_path(family)), backend="transformers", lora={"r": 8, "random_state": 0},
                        attn_implementation="eager" if family == "gemma2" else "sdpa")
    perturb_lora(policy.model, std=0.3)
    tok = policy.tokenizer
    text = " ".join(["alice", "counts", "seven", "apples", "in", "paris"] * 10)
    core = EngineCore(policy, EngineConfig(kv_cache_memory_bytes=16 << 20, block_size=8,
                                           decode=DecodeConfig(shared_prompt_min_tokens=32)),
                      seed=0)
    ws = core.runner.decode_steps.workspace
    assert ws.shared_prompts == (not _windowed_or_capped(policy.text_config)), family
    greedy = add_sequences(core, [tok.encode(text), tok.encode(text[:40])], [10, 10], n=3, temperature=0.0)
    sp = SamplingParams(max_new_tokens=10, n=4, temperature=1.0, seed=3, ignore_eos=True)
    sampled = [Sequence("sampled", j, PreparedPrompt(tok.encode(text[5:])), sp) for j in range(4)]
    for seq in sampled:
        core.add(seq)
    step_until_idle(core, max_steps=500)
    assert (ws.shared_steps > 0) == ws.shared_prompts
    for s in greedy:
        ref = hf_greedy_ignoring_eos(policy.model, s.prompt_ids, 10)
        assert_greedy_matches(policy, s.prompt_ids, s.output_ids, ref, label=family)
    for s in sampled:
        tf, _ = teacher_forced_logprobs(policy, s.prompt_ids, s.output_ids, temperature=1.0)
        assert (torch.tensor(s.output_logprobs) - tf).abs().max() <= 1e-5, family


def test_the_compiled_step_reads_short_shared_prompts_once_too(qwen2_dir):
    """With the compiled decode step on the CPU kernel (the CPU default), steps over store entries run in the graph,
    so a group's prompt gets an entry from 32 shared positions (``shared_prompt_min_tokens=None``), as with the
    eager workspace; without the kernel those steps would run eager, and only prompts of 640+ shared positions get
    one. A group of a short prompt and one of a long prompt: read once, compiled; tokens equal HF greedy."""
    policy = load_model(qwen2_dir, backend="transformers")
    tok = policy.tokenizer
    short = tok.encode(" ".join(["apple", "bob", "count", "dog"] * 20))[:80]
    long_ = (tok.encode(" ".join(["carol", "eats", "nine", "figs"] * 200)) * 2)[:700]
    core = EngineCore(policy, EngineConfig(kv_cache_memory_bytes=64 << 20, block_size=16), seed=0)
    assert core.runner.decode_steps.backend == "compiled" and core.runner.decode_steps.workspace.store.min_tokens == 32
    ws, st = core.runner.decode_steps.workspace, core.runner.decode_steps.compiled
    seqs = add_sequences(core, [short, long_], [12, 6], n=4, temperature=0.0)
    step_until_idle(core, max_steps=500)
    assert ws.shared_steps > 0 and st.eager_steps == 0 and st.recompiles == 0
    for s in seqs:
        ref = hf_greedy_ignoring_eos(policy.model, s.prompt_ids, len(s.output_ids))
        assert_greedy_matches(policy, s.prompt_ids, s.output_ids, ref, label="qwen2")
    no_kernel = EngineCore(policy, EngineConfig(kv_cache_memory_bytes=8 << 20, decode=DecodeConfig(cpu_kernel=False)),
                           seed=0)
    steps = no_kernel.runner.decode_steps
    assert steps.backend == "compiled" and steps.workspace.store.min_tokens == 640
    assert not no_kernel.runner.decode_steps.compiled.reads_shared()
    eager = EngineCore(policy, EngineConfig(kv_cache_memory_bytes=8 << 20, decode=DecodeConfig(backend="workspace")),
                       seed=0)
    assert eager.runner.decode_steps.workspace.store.min_tokens == 32


@pytest.mark.parametrize("backend", ["compiled", "workspace"])
def test_shared_prompt_steps_run_compiled_without_recompiling(qwen2_dir, backend):
    """The compiled step (the CPU default) reads each row's store entry inside the graph (the CPU kernel's
    prefixed op: the entry's keys, then the row's own, under one softmax): steps over store entries are not
    eager and compile nothing after warm-up, while groups join, finish and leave entries behind. Tokens equal HF
    greedy's; sampled logprobs equal a teacher-forced forward (a LoRA model). The eager workspace runs the same
    op, for the same results."""
    forget_regions()  # this engine's own compiles are counted below (engines of one model share graphs otherwise)
    policy = load_model(qwen2_dir, backend="transformers", lora={"r": 8, "random_state": 0})
    perturb_lora(policy.model, std=0.3)
    core = EngineCore(policy, EngineConfig(kv_cache_memory_bytes=64 << 20, block_size=16,
                                           decode=DecodeConfig(backend=backend, shared_prompt_min_tokens=32)), seed=0)
    ws, st = core.runner.decode_steps.workspace, core.runner.decode_steps.compiled
    assert (st is not None and st.reads_shared()) == (backend == "compiled")
    if backend == "compiled":  # the graph over shared prompts waits for the first step that reads one
        warm_plain = st.warm_compiled
        assert not st.shared_ready() and 0 < warm_plain <= 2
    prompts = _prompts(policy.tokenizer)
    seqs, seen = _run_watching(core, prompts, [20, 8, 14], n=4, temperature=0.0)
    if backend == "compiled":  # compiled then as warm-up compiles the plain graph: counted there, not a recompile
        assert st.shared_ready() and warm_plain < st.warm_compiled <= 2 * warm_plain
    sampled, seen2 = _run_watching(core, prompts[1:], [10, 12], n=3, temperature=1.0)
    assert seen["entries"] == 3 and seen["steps"] >= 8 and seen2["steps"] >= 8, (seen, seen2)
    assert seen["steps"] + seen2["steps"] - 2 <= ws.shared_steps <= seen["steps"] + seen2["steps"]  # (prefills)
    if backend == "compiled":
        assert st.eager_steps == 0 and st.recompiles == 0 and st.steps >= ws.shared_steps
    for s in seqs:
        ref = hf_greedy_ignoring_eos(policy.model, s.prompt_ids, len(s.output_ids))
        assert_greedy_matches(policy, s.prompt_ids, s.output_ids, ref, label=backend)
    for s in sampled:
        tf, _ = teacher_forced_logprobs(policy, s.prompt_ids, s.output_ids, temperature=1.0)
        assert (torch.tensor(s.output_logprobs) - tf).abs().max() <= 1e-5, backend


def test_a_shared_prompt_graph_that_fails_to_compile_leaves_those_steps_eager(qwen2_dir, monkeypatch):
    """The graph over shared prompts is compiled before the first step that reads one; where that compile raises,
    steps over shared prompts run the eager workspace step (as without the CPU kernel), the plain graph keeps the
    others, and the tokens still equal HF greedy's."""
    from unsloth_rollout.engine.decode.compiled import CompiledStep

    real_warm = CompiledStep._warm

    def warm(self, ws, shared):
        if shared:
            raise RuntimeError("inductor failed on the shared-prompt graph")
        return real_warm(self, ws, shared)

    monkeypatch.setattr(CompiledStep, "_warm", warm)
    policy = load_model(qwen2_dir, backend="transformers")
    core = EngineCore(policy, EngineConfig(kv_cache_memory_bytes=64 << 20, block_size=16,
                                           decode=DecodeConfig(shared_prompt_min_tokens=32)), seed=0)
    ws, st = core.runner.decode_steps.workspace, core.runner.decode_steps.compiled
    assert st.reads_shared() and not st.shared_ready()
    seqs, seen = _run_watching(core, _prompts(policy.tokenizer)[:2], [10, 6], n=3, temperature=0.0)
    assert not st.reads_shared() and not st.shared_ready() and seen["steps"] > 0 and ws.shared_steps > 0
    assert st.eager_steps >= seen["steps"] - 2 and st.recompiles == 0
    for s in seqs:
        ref = hf_greedy_ignoring_eos(policy.model, s.prompt_ids, len(s.output_ids))
        assert_greedy_matches(policy, s.prompt_ids, s.output_ids, ref, label="eager shared steps")
