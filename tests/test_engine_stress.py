"""Engine under churn: many concurrent clients, abort storms, pause/resume and version bumps, a KV budget
small enough to force preemption. Oracle: every sample that finished equals HF greedy generation (an aborted
one is a prefix of it); every request ends; all KV blocks return to the pool."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from unsloth_rollout import EngineConfig, GenerationRequest, RolloutEngine, SamplingParams, load_model
from unsloth_rollout.engine.config import PrefillConfig
from unsloth_rollout.engine.kv_cache import KVCache
from unsloth_rollout.models.families import text_dims

WORDS = "alice bob carol dave the red blue apples count seven twelve market house book".split()


@pytest.mark.parametrize("n_requests", [pytest.param(120, id="ci"), pytest.param(1200, marks=pytest.mark.slow,
                                                                                   id="full")])
def test_churn_loses_nothing(qwen2_dir, n_requests):
    policy = load_model(qwen2_dir, backend="transformers")
    per_token = KVCache.bytes_per_token(*text_dims(policy.text_config), policy.dtype)
    engine = RolloutEngine(policy, EngineConfig(kv_cache_memory_bytes=per_token * 16 * 24, max_num_seqs=32,
                                                prefill=PrefillConfig(max_tokens=256)))
    rng = random.Random(0)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 20))) for _ in range(12)]
    results: dict[str, tuple] = {}
    lock = threading.Lock()

    def client(cid: int):
        r = random.Random(cid)
        for i in range(n_requests // 8):
            p = r.choice(prompts)
            req = GenerationRequest(input_ids=policy.tokenizer.encode(p), request_id=f"c{cid}-{i}",
                                    sampling=SamplingParams(max_new_tokens=r.randint(1, 40), temperature=0,
                                                            n=r.choice([1, 1, 2])))
            fut = engine.submit(req)
            if r.random() < 0.2:
                time.sleep(r.random() * 0.01)
                engine.abort(req.request_id)
            outs = fut.result(timeout=300)
            with lock:
                results[req.request_id] = (req, outs)

    def chaos():
        r = random.Random(99)
        v = 0
        while len(results) < n_requests // 8 * 8:
            time.sleep(r.random() * 0.05)
            engine.pause()
            v += 1
            engine.set_version(v)
            time.sleep(r.random() * 0.01)
            engine.resume()

    threads = [threading.Thread(target=client, args=(c,)) for c in range(8)]
    ch = threading.Thread(target=chaos)
    for t in threads + [ch]:
        t.start()
    for t in threads + [ch]:
        t.join(600)
        assert not t.is_alive(), "a client hung"
    stats = engine.stats()
    engine.invalidate_prefix_cache()
    assert engine.core.kv.num_free_blocks == engine.core.kv.num_blocks, "KV blocks leaked"
    engine.shutdown()
    assert len(results) == n_requests // 8 * 8
    refs = {}
    aborted = 0
    for req, outs in results.values():
        key = (tuple(req.input_ids), req.sampling.max_new_tokens)
        if key not in refs:
            ids = torch.tensor([req.input_ids])
            refs[key] = policy.model.generate(ids, max_new_tokens=req.sampling.max_new_tokens,
                                              do_sample=False)[0, ids.shape[1]:].tolist()
        ref = refs[key]
        assert len(outs) == req.sampling.n
        for o in outs:
            assert o.error is None
            assert o.output_versions == sorted(o.output_versions)
            if o.finish_reason == "abort":
                aborted += 1
                assert o.output_ids == ref[: len(o.output_ids)]
            else:
                assert o.output_ids == ref
    assert aborted > 0
    assert stats["num_preemptions"] > 0, "the KV budget was meant to force preemption"
