"""Weight updates during generation: a token stamped v is sampled from, and scored by, weights v.

The scenario of a colocated trainer: pause("keep") mid-generation, one optimizer step on the LoRA the engine
samples from, set_version, resume; with n > 1 groups sharing a prompt prefix and a greedy request in flight.
Oracles: a teacher-forced HF forward of the old weights (for the tokens stamped 0) and of the new weights (for
the tokens stamped 1), and HF ``generate()`` on the new weights from prompt + the tokens stamped 0. Also: pauses
compose (onload never releases the caller's pause), through the engine and AReaL's colocated path.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from unsloth_rollout.testing.oracles import teacher_forced_logprobs
from unsloth_rollout.engine.config import DecodeConfig
from unsloth_rollout import EngineConfig, GenerationRequest, RolloutEngine, SamplingParams, load_model
from unsloth_rollout.testing.waits import wait_for

SHARED = "Alice and Bob count the red apples in the"  # the prompt of the two sampled groups (prefix cache)
GREEDY = "the lazy dog sleeps while"
MAX_NEW = 48
TOL = 1e-5


@pytest.fixture
def policy(qwen2_lora_policy):
    return qwen2_lora_policy


def lora_state(policy) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in policy.model.named_parameters() if p.requires_grad}


def load_state(policy, state) -> None:
    with torch.no_grad():
        for n, p in policy.model.named_parameters():
            if n in state:
                p.copy_(state[n])


def optimizer_step(policy, kind: str) -> None:
    """One step on the LoRA: plain SGD (a large change) or a realistic first AdamW step at lr 1e-4."""
    params = [p for p in policy.model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.5) if kind == "sgd" else torch.optim.AdamW(params, lr=1e-4, weight_decay=0)
    with policy.lock, policy.training():
        ids = torch.tensor([policy.tokenizer.encode("Carol paints the blue house by the river at night")])
        policy.model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def hf_greedy(policy, ids, n):
    policy.clear_rope_deltas()
    with torch.no_grad():
        out = policy.model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                                    attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    return out[0, len(ids):].tolist()


def check_against_both_weights(policy, samples, old, new):
    """samples: (prompt_ids, output_ids, logprobs, versions, temperature). Tokens stamped 0 against the old
    weights, tokens stamped 1 against the new ones; returns (worst gap, how far apart the two weights score
    the tokens stamped 1) — the second shows the check could fail."""
    worst, apart = 0.0, 0.0
    tf = {}
    for state, key in ((old, 0), (new, 1)):
        load_state(policy, state)
        tf[key] = [teacher_forced_logprobs(policy, p, o, t)[0] for p, o, _, _, t in samples]
    for i, (_, out, lps, versions, _) in enumerate(samples):
        assert versions == sorted(versions) and set(versions) <= {0, 1}
        lp = torch.tensor(lps)
        k = versions.count(0)
        worst = max(worst, (lp[:k] - tf[0][i][:k]).abs().max().item() if k else 0.0,
                    (lp[k:] - tf[1][i][k:]).abs().max().item() if k < len(out) else 0.0)
        if k < len(out):
            apart = max(apart, (tf[0][i][k:] - tf[1][i][k:]).abs().max().item())
    return worst, apart


def requests(policy):
    tok = policy.tokenizer
    return [
        GenerationRequest(input_ids=tok.encode(SHARED), request_id="group-a", sampling=SamplingParams(
            max_new_tokens=MAX_NEW, temperature=1.0, n=4, seed=1, ignore_eos=True)),
        GenerationRequest(input_ids=tok.encode(SHARED), request_id="group-b", sampling=SamplingParams(
            max_new_tokens=MAX_NEW, temperature=0.8, n=3, seed=2, ignore_eos=True)),
        GenerationRequest(input_ids=tok.encode(GREEDY), request_id="greedy", sampling=SamplingParams(
            max_new_tokens=MAX_NEW, temperature=0)),
    ]


def as_samples(reqs, outs_per_req):
    out = []
    for r, outs in zip(reqs, outs_per_req):
        t = r.sampling.logprob_temperature
        out += [(o.prompt_ids, o.output_ids, o.output_logprobs, o.output_versions, t) for o in outs]
    return out


def generate_across_an_update(policy, kind, recompute=True):
    engine = RolloutEngine(policy, EngineConfig(kv_cache_memory_bytes=16 << 20,
                                                recompute_on_weight_change=recompute))
    rs = requests(policy)
    futs = [engine.submit(r) for r in rs]
    wait_for(lambda: engine.stats()["decode_tokens"] >= 3 * 8)
    engine.pause("keep")
    assert not any(f.done() for f in futs)
    old = lora_state(policy)
    optimizer_step(policy, kind)
    new = lora_state(policy)
    assert any(not torch.equal(old[n], new[n]) for n in old)
    engine.set_version(1)
    engine.resume()
    outs = [f.result(timeout=120) for f in futs]
    stats = engine.stats()
    engine.shutdown()
    return engine, rs, outs, old, new, stats


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_tokens_stamped_v_come_from_weights_v(policy, kind):
    _, rs, outs, old, new, stats = generate_across_an_update(policy, kind)
    flat = [o for os_ in outs for o in os_]
    assert all(0 in o.output_versions and 1 in o.output_versions for o in flat), "every sample spans the update"
    assert all(o.output_kv_versions == o.output_versions for o in flat)
    assert stats["weight_recomputes"] >= len(flat) and stats["num_preemptions"] == 0
    worst, apart = check_against_both_weights(policy, as_samples(rs, outs), old, new)
    assert worst <= TOL, f"a token's logprob is {worst:.2e} off the weights of its version"
    assert apart > 1e-4, "the step must change the scores for this check to mean anything"
    # The greedy request: its v1 tokens are HF generate() on the new weights from prompt + the v0 tokens.
    (g,) = outs[2]
    k = g.output_versions.count(0)
    load_state(policy, new)
    assert g.output_ids[k:] == hf_greedy(policy, g.prompt_ids + g.output_ids[:k], len(g.output_ids) - k)


def test_stale_cache_opt_in_is_stamped_and_really_stale(policy):
    """recompute_on_weight_change=False keeps the old cache: the tokens stamped 1 then do not match the new
    weights (what the default prevents), and output_kv_versions says they attended to version-0 KV."""
    _, rs, outs, old, new, _ = generate_across_an_update(policy, "sgd", recompute=False)
    flat = [o for os_ in outs for o in os_]
    for o in flat:
        k = o.output_versions.count(0)
        assert 0 < k < len(o.output_ids)
        assert o.output_kv_versions == [0] * len(o.output_ids), "stale KV must be stamped with its version"
    samples = as_samples(rs, outs)
    load_state(policy, new)
    gaps = [(torch.tensor(lps) - teacher_forced_logprobs(policy, p, o, t)[0])[v.count(0):].abs().max().item()
            for p, o, lps, v, t in samples]
    assert max(gaps) > 1e-3


def test_offload_onload_never_release_the_callers_pause(policy):
    """pause -> offload -> optimizer step -> onload -> set_version -> resume: nothing decodes while the
    caller's pause holds; every token after it is stamped 1 and comes from the new weights."""
    engine = RolloutEngine(policy, EngineConfig(kv_cache_memory_bytes=16 << 20))
    rs = requests(policy)
    futs = [engine.submit(r) for r in rs]
    wait_for(lambda: engine.stats()["decode_tokens"] >= 3 * 8)
    engine.pause("keep")
    engine.offload()
    at_pause = {(s.request_id, s.sample_index): len(s.output_ids) for s in engine.core.scheduler.waiting}
    assert len(at_pause) == 8
    old = lora_state(policy)
    optimizer_step(policy, "sgd")
    new = lora_state(policy)
    frozen = engine.stats()
    engine.onload()
    assert engine.is_paused and engine.paused_by == {"user"}, "onload() released the caller's pause"
    time.sleep(0.3)
    engine.set_version(1)
    time.sleep(0.2)
    now = engine.stats()
    assert (now["decode_tokens"], now["prefill_tokens"]) == (frozen["decode_tokens"], frozen["prefill_tokens"])
    assert not any(f.done() for f in futs)
    engine.resume()
    outs = [f.result(timeout=120) for f in futs]
    engine.shutdown()
    for os_ in outs:
        for o in os_:
            assert o.output_versions.count(0) == at_pause[(o.request_id, o.sample_index)]
    worst, _ = check_against_both_weights(policy, as_samples(rs, outs), old, new)
    assert worst <= TOL


def test_pause_holders_nest(policy):
    engine = RolloutEngine(policy, EngineConfig(kv_cache_memory_bytes=8 << 20))
    engine.pause(holder="trainer")
    engine.pause()  # the user's
    engine.resume(holder="trainer")
    assert engine.is_paused and engine.paused_by == {"user"}
    engine.resume(holder="someone-else")  # releasing a pause one does not hold changes nothing
    assert engine.paused_by == {"user"}
    engine.resume()
    assert not engine.is_paused
    with pytest.raises(Exception, match="holder"):
        engine.pause(holder="")
    engine.shutdown()


def test_same_through_areal_colocated_update(policy):
    """AReaL's colocated loop: pause_generation -> offload -> train_batch (an AdamW step, lr 1e-4) -> onload ->
    update_weights -> set_version -> continue_generation. No path resumes AReaL's pause early, and tokens
    stamped v come from weights v."""
    pytest.importorskip("areal")
    from areal.api import FinetuneSpec, ModelRequest, WeightUpdateMeta
    from areal.api.cli_args import (GenerationHyperparameters, InferenceEngineConfig, OptimizerConfig,
                                    TrainEngineConfig)

    from unsloth_rollout.areal import ColocatedTrainEngine, UnslothInferenceEngine

    rollout = UnslothInferenceEngine(InferenceEngineConfig(backend="unsloth:d1", max_head_offpolicyness=int(1e10)),
                                     policy, kv_cache_memory_bytes=16 << 20, max_model_len=512, seed=0)
    rollout.initialize()
    trainer = ColocatedTrainEngine(TrainEngineConfig(
        experiment_name="t", trial_name="t", path="", backend="unsloth:d1", dtype="float32",
        optimizer=OptimizerConfig(type="adam", lr=1e-4, weight_decay=0.0, warmup_steps_proportion=0.0)), policy)
    trainer.initialize(ft_spec=FinetuneSpec(total_train_epochs=1, dataset_size=8, train_batch_size=4))
    trainer.connect_engine(rollout, WeightUpdateMeta(type="disk"))
    engine = rollout.rollout_engine
    tok = policy.tokenizer
    shared, greedy = tok.encode(SHARED), tok.encode(GREEDY)
    sampled = GenerationHyperparameters(max_new_tokens=MAX_NEW, temperature=1.0, ignore_eos=True)
    reqs = [ModelRequest(input_ids=list(shared), gconfig=sampled, tokenizer=tok) for _ in range(4)]
    reqs.append(ModelRequest(input_ids=list(greedy), gconfig=GenerationHyperparameters(
        max_new_tokens=MAX_NEW, greedy=True), tokenizer=tok))
    result = {}

    async def run_all():
        return await asyncio.gather(*(rollout.agenerate(r) for r in reqs))

    t = threading.Thread(target=lambda: result.update(out=asyncio.run(run_all())))
    t.start()
    try:
        wait_for(lambda: engine.stats()["decode_tokens"] >= 3 * 5)
        rollout.pause_generation()
        rollout.offload()
        old = lora_state(policy)
        ids = torch.tensor([tok.encode("Carol paints the blue house by the river at night")])
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        trainer.train_batch(batch, lambda logp, entropy, mb: -logp.sum(), lambda mb: 1.0)
        new = lora_state(policy)
        assert any(not torch.equal(old[n], new[n]) for n in old)
        rollout.onload()
        frozen = engine.stats()["decode_tokens"]
        trainer.update_weights(WeightUpdateMeta(type="disk", version=1))
        assert engine.paused_by == {"areal"}, "update_weights/onload released AReaL's pause_generation"
        trainer.set_version(1)
        rollout.set_version(1)
        time.sleep(0.2)
        assert engine.stats()["decode_tokens"] == frozen
        rollout.continue_generation()
    finally:
        t.join(120)
    outs = result["out"]
    samples = [(r.input_ids, o.output_tokens, o.output_logprobs, o.output_versions, 1.0) for r, o in zip(reqs, outs)]
    assert all(0 in s[3] and 1 in s[3] for s in samples), "every sample spans the update"
    worst, apart = check_against_both_weights(policy, samples, old, new)
    assert worst <= TOL and apart > 1e-5
    g = outs[-1]
    k = g.output_versions.count(0)
    load_state(policy, new)
    assert g.output_tokens[k:] == hf_greedy(policy, list(greedy) + g.output_tokens[:k], len(g.output_tokens) - k)
    rollout.destroy()
    trainer.destroy()


def test_server_sleep_and_wake_up_keep_a_pause(qwen2_dir):
    """/pause then /sleep then /wake_up: still paused (the server's pause is its own); /resume releases it."""
    pytest.importorskip("fastapi")
    from starlette.testclient import TestClient

    from unsloth_rollout.serve import create_app

    eng = RolloutEngine(load_model(qwen2_dir, backend="transformers"), EngineConfig(kv_cache_memory_bytes=8 << 20))
    with TestClient(create_app(eng, served_model_name="m", owns_engine=True)) as c:
        assert c.post("/pause", params={"mode": "keep"}).status_code == 200
        assert c.post("/sleep").status_code == 200 and c.post("/wake_up").status_code == 200
        assert c.get("/is_paused").json() == {"is_paused": True}
        eng.pause(holder="trainer")
        assert c.post("/resume").status_code == 200
        assert c.get("/is_paused").json() == {"is_paused": True}, "/resume released a trainer's pause"
        eng.resume(holder="trainer")
        assert c.get("/is_paused").json() == {"is_paused": False}
        r = c.post("/v1/completions", json={"model": "m", "prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("length", "stop")


@pytest.mark.parametrize("backend", ["workspace", "compiled"])
def test_disable_adapter_mid_generation_without_weights_changed(policy, backend):
    """A caller pauses the engine mid-generation and enters ``with model.disable_adapter():`` without
    ``weights_changed`` (PEFT's switch, not a weight): the tokens after the switch are HF greedy of the base model
    from prompt + the tokens before it (the in-flight KV was computed with the adapter on, so it is recomputed),
    and a prompt cached under the adapter is not reused without it."""
    engine = RolloutEngine(policy, EngineConfig(kv_cache_memory_bytes=16 << 20, decode=DecodeConfig(backend=backend)))
    ids = policy.tokenizer.encode(GREEDY)
    lora = hf_greedy(policy, ids, 24)
    try:
        fut = engine.submit(GenerationRequest(input_ids=ids, sampling=SamplingParams(
            max_new_tokens=24, temperature=0, ignore_eos=True)))
        wait_for(lambda: engine.stats()["decode_tokens"] >= 6)
        engine.pause("keep")
        with policy.model.disable_adapter():
            k = engine.stats()["decode_tokens"] + 1  # tokens so far (the prefill's first one included)
            engine.resume()
            out = fut.result(timeout=120)[0].output_ids
            assert out[:k] == lora[:k]
            want = hf_greedy(policy, ids + out[:k], 24 - k)  # HF stops at EOS, the engine ignores it
            assert want and out[k:k + len(want)] == want
            base = hf_greedy(policy, ids, 24)
            assert base != lora, "the adapter was meant to change the greedy tokens"
            again = engine.generate([GenerationRequest(input_ids=ids, sampling=SamplingParams(
                max_new_tokens=24, temperature=0, ignore_eos=True))])[0].output_ids
            assert again[:len(base)] == base
        stats = engine.stats()
        assert stats["adapter_switch_changes"] == 1 and stats["weight_recomputes"] >= 1
    finally:
        engine.shutdown()


@pytest.mark.parametrize("how", ["unload", "merge_and_unload"])
@pytest.mark.parametrize("backend", ["workspace", "compiled"])
def test_unloading_lora_without_weights_changed(backend, how):
    """PEFT's ``unload()`` / ``merge_and_unload()`` replace every LoRA layer with its base layer, and callers rarely
    pair them with ``weights_changed``: a prompt cached with the adapter is not reused, and the tokens are HF greedy
    of the model as it now is (plain base weights, or base + LoRA merged)."""
    from unsloth_rollout.bench.overhead import deep_policy

    pol = deep_policy("tiny-lm", 3, 8, 0)  # its own model: unloading is for good
    engine = RolloutEngine(pol, EngineConfig(kv_cache_memory_bytes=16 << 20, decode=DecodeConfig(backend=backend)))
    ids = pol.tokenizer.encode(GREEDY)
    try:
        lora = hf_greedy(pol, ids, 16)
        assert engine.generate([GenerationRequest(input_ids=ids, sampling=SamplingParams(
            max_new_tokens=16, temperature=0, ignore_eos=True))])[0].output_ids[:len(lora)] == lora
        getattr(pol.model, how)()
        now = hf_greedy(pol, ids, 16)
        if how == "unload":
            assert now != lora, "the adapter was meant to change the greedy tokens"
        out = engine.generate([GenerationRequest(input_ids=ids, sampling=SamplingParams(
            max_new_tokens=16, temperature=0, ignore_eos=True))])[0].output_ids
        assert out[:len(now)] == now
        assert engine.stats()["adapter_switch_changes"] >= 1
    finally:
        engine.shutdown()
