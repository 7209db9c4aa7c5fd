"""Engine control: pause/resume with version bumps, shared-weight updates, abort, rejection, preemption,
async and streaming front doors."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from unsloth_rollout import EngineConfig, GenerationRequest, RequestRejected, RolloutEngine, SamplingParams
from unsloth_rollout.testing.waits import wait_for

PROMPTS = ["Alice counts", "Bob and Carol went to the market", "12 + 7 =", "the lazy dog sleeps while",
           "Grace reads a long book about", "think", "answer: 42", "Oscar paints the blue house"]


def greedy_ref(policy, ids, max_new):
    policy.clear_rope_deltas()
    with torch.no_grad():
        out = policy.model.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False)
    return out[0, len(ids):].tolist()


def reqs(policy, max_new, **sp):
    return [GenerationRequest(input_ids=policy.tokenizer.encode(p),
                              sampling=SamplingParams(max_new_tokens=max_new, temperature=0, **sp)) for p in PROMPTS]


@pytest.fixture
def policy(qwen2_lora_policy):
    return qwen2_lora_policy


def test_pause_set_version_resume_loses_nothing(policy):
    engine = RolloutEngine(policy, EngineConfig(kv_cache_memory_bytes=16 << 20))
    rs = reqs(policy, 40)
    futs = [engine.submit(r) for r in rs]
    wait_for(lambda: engine.stats()["decode_tokens"] >= 3 * len(rs))
    engine.pause()
    frozen = engine.stats()["decode_tokens"]
    time.sleep(0.2)
    assert engine.stats()["decode_tokens"] == frozen, "decoding went on while paused"
    assert engine.is_paused and not any(f.done() for f in futs)
    engine.set_version(1)
    engine.resume()
    outs = [f.result(timeout=120)[0] for f in futs]
    engine.shutdown()
    mixed = 0
    for r, o in zip(rs, outs):
        assert o.output_ids == greedy_ref(policy, r.input_ids, 40), "tokens lost or duplicated across the pause"
        assert o.output_versions == sorted(o.output_versions) and set(o.output_versions) <= {0, 1}
        mixed += len(set(o.output_versions)) == 2
    assert mixed > 0, "some sequences must span the version bump"


def test_lora_step_on_shared_weights_then_set_version(policy):
    engine = RolloutEngine(policy, EngineConfig(kv_cache_memory_bytes=16 << 20))
    rs = reqs(policy, 16)
    before = [o.output_ids for o in engine.generate(rs)]
    ptrs = {n: p.data_ptr() for n, p in policy.model.named_parameters()}
    lora_params = [p for n, p in policy.model.named_parameters() if p.requires_grad]
    assert lora_params and all("lora_" in n for n, p in policy.model.named_parameters() if p.requires_grad)
    opt = torch.optim.SGD(lora_params, lr=0.5)
    with policy.lock, policy.training():
        ids = torch.tensor([rs[0].input_ids + before[0]])
        loss = policy.model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    engine.set_version(1)
    after = engine.generate(reqs(policy, 16))
    engine.shutdown()
    assert [o.output_ids for o in after] != before
    for r, o in zip(rs, after):
        assert o.output_ids == greedy_ref(policy, r.input_ids, 16)
        assert set(o.output_versions) == {1}
    assert {n: p.data_ptr() for n, p in policy.model.named_parameters()} == ptrs, "weights were copied"


def test_abort_frees_kv_and_others_continue(policy):
    engine = RolloutEngine(policy, EngineConfig(kv_cache_memory_bytes=16 << 20, prefix_cache=False))
    total = engine.core.kv.num_blocks
    rs = reqs(policy, 60)
    futs = [engine.submit(r) for r in rs]
    wait_for(lambda: engine.stats()["decode_tokens"] >= 2 * len(rs))
    engine.abort(rs[0].request_id)
    aborted = futs[0].result(timeout=60)[0]
    assert aborted.finish_reason == "abort" and 0 < len(aborted.output_ids) < 60
    rest = [f.result(timeout=120)[0] for f in futs[1:]]
    assert all(o.error is None and o.finish_reason in ("length", "stop") for o in rest)
    assert all(o.output_ids == greedy_ref(policy, r.input_ids, 60) for r, o in zip(rs[1:], rest))
    assert engine.core.kv.num_free_blocks == total, "KV blocks leaked"
    engine.shutdown()


def test_too_long_request_is_rejected_while_others_complete(policy):
    engine = RolloutEngine(policy, EngineConfig(kv_cache_memory_bytes=1 << 20, max_model_len=4096))
    slots = engine.core.kv.num_slots
    ok = reqs(policy, 8)[:2]
    huge = GenerationRequest(input_ids=policy.tokenizer.encode("word") * 10, sampling=SamplingParams(
        max_new_tokens=slots + 100, temperature=0))
    outs = engine.generate([ok[0], huge, ok[1]])
    assert outs[1].error and "max_new_tokens" in outs[1].error and outs[1].finish_reason == "abort"
    assert outs[0].error is None and outs[2].error is None and len(outs[0].output_ids) > 0
    with pytest.raises(RequestRejected) as e:
        asyncio.run(engine.agenerate(huge))
    assert e.value.field == "max_new_tokens"
    too_long_prompt = GenerationRequest(input_ids=[5] * 5000, sampling=SamplingParams(max_new_tokens=4))
    with pytest.raises(RequestRejected, match="max_model_len"):
        engine.submit(too_long_prompt)
    engine.shutdown()


def test_preemption_under_a_small_kv_budget_keeps_parity(policy):
    per_token = engine_bytes_per_token(policy)
    # Room for about 3 full sequences at a time; 8 are submitted.
    engine = RolloutEngine(policy, EngineConfig(kv_cache_memory_bytes=per_token * 16 * 9, block_size=16,
                                                prefix_cache=False))
    rs = reqs(policy, 30)
    outs = engine.generate(rs)
    stats = engine.stats()
    engine.shutdown()
    assert stats["num_preemptions"] > 0
    for r, o in zip(rs, outs):
        assert o.output_ids == greedy_ref(policy, r.input_ids, 30)
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def engine_bytes_per_token(policy):
    from unsloth_rollout.engine.kv_cache import KVCache
    from unsloth_rollout.models.families import text_dims

    return KVCache.bytes_per_token(*text_dims(policy.text_config), policy.dtype)


def test_agenerate_from_many_threads_and_loops_and_stream(policy):
    engine = RolloutEngine(policy, EngineConfig(kv_cache_memory_bytes=16 << 20))
    rs = reqs(policy, 12)
    results = {}

    def worker(r):
        results[r.request_id] = asyncio.run(engine.agenerate(r))

    threads = [threading.Thread(target=worker, args=(r,)) for r in rs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for r in rs:
        assert results[r.request_id].output_ids == greedy_ref(policy, r.input_ids, 12)

    async def consume(r):
        deltas = [d async for d in engine.stream(r)]
        return deltas

    r = reqs(policy, 12)[1]
    deltas = asyncio.run(consume(r))
    final = deltas[-1]
    assert final.finish_reason == "length" and final.output is not None
    assert sum((d.token_ids for d in deltas), []) == final.output.output_ids == greedy_ref(policy, r.input_ids, 12)
    assert "".join(d.text for d in deltas) == final.output.text
    assert len(deltas) > 2, "tokens should arrive incrementally"

    async def disconnect(r):
        async for _ in engine.stream(r):
            break  # client goes away after the first delta

    r = reqs(policy, 200)[2]
    asyncio.run(disconnect(r))
    wait_for(lambda: engine.stats()["num_running"] == 0)
    engine.invalidate_prefix_cache()
    assert engine.core.kv.num_free_blocks == engine.core.kv.num_blocks
    engine.shutdown()


def test_offload_and_onload(policy):
    engine = RolloutEngine(policy, EngineConfig(kv_cache_memory_bytes=8 << 20))
    rs = reqs(policy, 10)
    first = [o.output_ids for o in engine.generate(rs)]
    engine.offload()
    assert engine.core.kv.memory_bytes == 0
    fut = engine.submit(reqs(policy, 10)[0])
    time.sleep(0.1)
    assert not fut.done()
    engine.onload()
    assert fut.result(timeout=60)[0].output_ids == first[0]
    engine.shutdown()


def test_stream_rejects_bad_input_before_iteration_and_holds_back_stop_text(policy):
    engine = RolloutEngine(policy, EngineConfig(kv_cache_memory_bytes=8 << 20))
    from unsloth_rollout import InvalidRequestError

    async def bad():
        engine.stream(GenerationRequest(input_ids=[10**8], sampling=SamplingParams()))

    with pytest.raises(InvalidRequestError):
        asyncio.run(bad())
    r = reqs(policy, 30)[3]
    full = engine.generate([r])[0]
    text = full.text
    start = next(i for i in range(len(text) // 3, len(text) - 2)
                 if text[i:i + 2] not in text[:i + 1] and "\ufffd" not in text[i:i + 2])
    cut = text[start:start + 2]

    async def consume():
        return [d async for d in engine.stream(GenerationRequest(input_ids=r.input_ids, sampling=SamplingParams(
            max_new_tokens=30, temperature=0, stop=[cut])))]

    deltas = asyncio.run(consume())
    final = deltas[-1].output
    assert final.finish_reason == "stop" and final.stop_reason == cut
    assert final.text == full.text[: full.text.index(cut)]
    assert "".join(d.text for d in deltas) == final.text
    engine.shutdown()


def test_a_failing_prompt_in_a_packed_prefill_fails_alone(policy):
    """Distinct prompts admitted together share one packed prefill forward; when it raises for one of them, the
    others are prefilled again on their own and complete (checked against HF greedy), only that one fails."""
    engine = RolloutEngine(policy, EngineConfig(kv_cache_memory_bytes=16 << 20), seed=0)
    bad = 3  # the prompt whose prefill raises
    real = engine.core.runner.prefill_packed

    def faulty(items, *args, **kwargs):
        if any(len(ids) == len(policy.tokenizer.encode(PROMPTS[bad])) and list(ids) == policy.tokenizer.encode(
                PROMPTS[bad]) for ids, *_ in items):
            raise RuntimeError("injected prefill fault")
        return real(items, *args, **kwargs)

    engine.core.runner.prefill_packed = faulty
    reqs = [GenerationRequest(input_ids=policy.tokenizer.encode(p), sampling=SamplingParams(max_new_tokens=6,
                                                                                              temperature=0))
            for p in PROMPTS[:5]]
    engine.pause()  # all five are admitted in one step: one pack
    futs = [engine.submit(r) for r in reqs]
    engine.resume()
    outs = [f.result(timeout=120)[0] for f in futs]
    engine.shutdown()
    assert "injected prefill fault" in (outs[bad].error or "") and outs[bad].finish_reason == "abort"
    for i, (req, out) in enumerate(zip(reqs, outs)):
        if i == bad:
            continue
        assert out.error is None
        with torch.no_grad():
            want = policy.model.generate(input_ids=torch.tensor([req.input_ids]), max_new_tokens=6,
                                         do_sample=False)[0, len(req.input_ids):].tolist()
        assert out.output_ids == want[:len(out.output_ids)] and (len(out.output_ids) == 6 or out.finish_reason == "stop")
