"""Adapter lifecycle as vLLM's: what the engine cannot serve exactly is refused at load (400 naming the reason, 404
for a missing folder) with everything else still serving unchanged; unload-last / load-again and in-place reloads
work on a model with no adapter of its own; loading over HTTP is off unless switched on.

Oracles: a fresh PEFT model running only the adapter (greedy tokens from a teacher-forced forward, and its
logprobs), the outputs from before a refused load (identical after), and the trainer-visible state of the model
(``requires_grad``, ``training``, the plain forward) against its value before or a fresh model's.
"""

from __future__ import annotations

import pytest
import torch

from unsloth_rollout import EngineConfig, GenerationRequest, InvalidRequestError, RolloutEngine, SamplingParams
from unsloth_rollout.engine.config import LoRAConfig
from unsloth_rollout.models.adapters import AdapterNotFoundError
from unsloth_rollout.testing.adapters import adapter_oracle, bad_adapters, lora_policy, save_adapter
from unsloth_rollout.testing.oracles import teacher_forced

PROMPTS = [[21, 34, 55, 89, 144], [3, 5, 8, 13, 21, 34, 55, 89, 144, 233, 377]]
MAX_NEW = 6


@pytest.fixture(scope="module")
def adapters(qwen2_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("adapters")
    # b with LoRA dropout: a served adapter must never sample its dropout.
    a, b = save_adapter(qwen2_dir, d / "a", seed=1), save_adapter(qwen2_dir, d / "b", seed=2, lora_dropout=0.3)
    return {"a": a, "b": b, "r16": save_adapter(qwen2_dir, d / "r16", seed=3, r=16), "bad": bad_adapters(a, d / "bad")}


def run(engine, lora=None) -> list[tuple]:
    sp = SamplingParams(max_new_tokens=MAX_NEW, temperature=0, ignore_eos=True)
    outs = engine.generate([GenerationRequest(input_ids=p, lora_name=lora, sampling=sp) for p in PROMPTS])
    assert all(o.error is None for o in outs), [o.error for o in outs]
    return [(tuple(o.output_ids), tuple(o.output_logprobs)) for o in outs]


def run_mixed(engine, names: list) -> dict:
    """Every prompt under every name in ``names`` (None: unnamed) in one batch: {name: run(engine, name)}."""
    sp = SamplingParams(max_new_tokens=MAX_NEW, temperature=0, ignore_eos=True)
    engine.pause("keep", holder="test")
    futs = [(n, engine.submit(GenerationRequest(input_ids=p, lora_name=n, sampling=sp))) for n in names
            for p in PROMPTS]
    engine.resume(holder="test")
    got: dict = {}
    for n, f in futs:
        o = f.result(timeout=120)[0]
        assert o.error is None, o.error
        got.setdefault(n, []).append((tuple(o.output_ids), tuple(o.output_logprobs)))
    return got


def assert_runs(oracle, got: list[tuple]) -> None:
    """Each greedy token is the oracle's argmax and each logprob its value (a teacher-forced forward)."""
    for prompt, (ids, lps) in zip(PROMPTS, got):
        ref, logits = teacher_forced(oracle, prompt, list(ids))
        assert logits.argmax(-1).tolist() == list(ids)
        assert (torch.tensor(lps) - ref).abs().max() <= 1e-5


def trainer_state(policy) -> tuple:
    return ([(n, p.requires_grad) for n, p in policy.model.named_parameters()],
            [(n, m.training) for n, m in policy.model.named_modules()])


def test_refused_loads_change_nothing(qwen2_dir, adapters):
    policy = lora_policy(qwen2_dir, seed=0)
    engine = RolloutEngine(policy, EngineConfig(kv_cache_memory_bytes=8 << 20, lora=LoRAConfig(max_lora_rank=8,
                                                                                               max_loras=2)))
    engine.load_lora_adapter("a", adapters["a"])
    before, before_a, state = run(engine), run(engine, "a"), trainer_state(policy)
    for kind, (path, status, phrase) in adapters["bad"].items():
        err = AdapterNotFoundError if status == 404 else InvalidRequestError
        with pytest.raises(err, match=phrase) as e:
            engine.load_lora_adapter(kind, path)
        assert e.value.field == "lora_path"
        assert type(e.value) is err, kind
    with pytest.raises(InvalidRequestError, match="greater than max_lora_rank 8"):
        engine.load_lora_adapter("r16", adapters["r16"])
    with pytest.raises(InvalidRequestError, match="already been loaded"):
        engine.load_lora_adapter("a", adapters["b"])
    with pytest.raises(InvalidRequestError, match="DoRA"):  # a refused in-place reload keeps the old weights
        engine.load_lora_adapter("a", adapters["bad"]["dora"][0], load_inplace=True)
    # Any name a request may use, even the policy's own adapter's name inside PEFT or one with dots.
    engine.load_lora_adapter("default", adapters["b"])
    with pytest.raises(InvalidRequestError, match="max_loras is 2"):
        engine.load_lora_adapter("sql.v1", adapters["b"])
    assert set(engine.lora_adapters) == {"a", "default"} and len(policy.model.peft_config) == 3
    assert run(engine) == before and run(engine, "a") == before_a
    assert_runs(adapter_oracle(qwen2_dir, adapters["b"]), run(engine, "default"))
    engine.unload_lora_adapter("default")
    engine.load_lora_adapter("sql.v1", adapters["b"])
    assert_runs(adapter_oracle(qwen2_dir, adapters["b"]), run(engine, "sql.v1"))
    kept = dict(state[0])
    assert [(n, g) for n, g in trainer_state(policy)[0] if n in kept] == state[0]
    modes = dict(state[1])
    assert [(n, t) for n, t in trainer_state(policy)[1] if n in modes] == state[1]
    assert not any(t for n, t in trainer_state(policy)[1] if n not in modes)  # no dropout sampling in eval
    engine.shutdown()


def test_trainer_state_survives_load_and_unload(qwen2_dir, adapters):
    """Loading and unloading adapters beside a policy in training mode changes none of its requires_grad, its
    modes, or its forward."""
    policy = lora_policy(qwen2_dir, seed=0)
    engine = RolloutEngine(policy, EngineConfig(kv_cache_memory_bytes=8 << 20))
    policy.training()
    ids = torch.tensor([PROMPTS[1]])
    with torch.no_grad():
        ref = policy.model(input_ids=ids).logits
    state = trainer_state(policy)
    assert any(g for _, g in state[0]) and all(t for _, t in state[1])
    engine.load_lora_adapter("a", adapters["a"])
    kept = dict(state[0])
    assert [(n, g) for n, g in trainer_state(policy)[0] if n in kept] == state[0]
    assert not any(g for n, g in trainer_state(policy)[0] if n not in kept)  # the served adapter: frozen
    with torch.no_grad():
        assert torch.equal(policy.model(input_ids=ids).logits, ref)
    policy.inference()
    assert_runs(adapter_oracle(qwen2_dir, adapters["a"]), run(engine, "a"))
    policy.training()
    engine.unload_lora_adapter("a")
    assert trainer_state(policy) == state
    with torch.no_grad():
        assert torch.equal(policy.model(input_ids=ids).logits, ref)
    engine.shutdown()


def test_unload_last_then_load_again_and_reload_in_place(qwen2_dir, adapters):
    """A model with no adapter of its own (a server started without --lora): the first load wraps it in PEFT,
    unloading the last gives the plain model back, and both a later load and an in-place reload work."""
    from peft import PeftModel

    plain = adapter_oracle(qwen2_dir)
    policy = adapter_oracle(qwen2_dir)
    engine = RolloutEngine(policy, EngineConfig(kv_cache_memory_bytes=8 << 20))
    base = run(engine)
    assert_runs(plain, base)
    oracle_a, oracle_b = adapter_oracle(qwen2_dir, adapters["a"]), adapter_oracle(qwen2_dir, adapters["b"])
    for _ in range(2):
        engine.load_lora_adapter("a", adapters["a"])
        assert isinstance(policy.model, PeftModel) and policy.serving_wrapper
        assert_runs(oracle_a, run(engine, "a"))
        assert run(engine) == base  # unnamed requests (and the trainer) still see the plain model
        with torch.no_grad():
            assert torch.equal(policy.model(input_ids=torch.tensor([PROMPTS[0]])).logits,
                               plain.model(input_ids=torch.tensor([PROMPTS[0]])).logits)
        engine.unload_lora_adapter("a")
        assert not isinstance(policy.model, PeftModel) and not hasattr(policy.model, "peft_config")
        assert run(engine) == base
    engine.load_lora_adapter("a", adapters["a"])
    engine.load_lora_adapter("a", adapters["b"], load_inplace=True)  # the lone adapter, replaced
    assert engine.lora_adapters == {"a": adapters["b"]}
    assert_runs(oracle_b, run(engine, "a"))
    engine.load_lora_adapter("b", adapters["b"])
    done = engine.stats()["decode_tokens"]
    engine.pause("keep", holder="test")  # a request of "a" in flight across its replacement continues
    fut = engine.submit(GenerationRequest(input_ids=PROMPTS[0], lora_name="a", sampling=SamplingParams(
        max_new_tokens=40, temperature=0, ignore_eos=True)))
    engine.resume(holder="test")
    while engine.stats()["decode_tokens"] < done + 3:
        pass
    engine.pause("keep", holder="test")
    engine.load_lora_adapter("a", adapters["a"], load_inplace=True)  # one of two, replaced ("a" held b's)
    engine.resume(holder="test")
    out = fut.result(timeout=120)[0]
    assert out.error is None and out.finish_reason == "length" and len(out.output_ids) == 40
    # Tokens 0..k-1 came from the old weights (b's), the rest from the new (a's), each exact under its own.
    lp_b, logits_b = teacher_forced(oracle_b, PROMPTS[0], out.output_ids)
    lp_a, logits_a = teacher_forced(oracle_a, PROMPTS[0], out.output_ids)
    got = torch.tensor(out.output_logprobs)
    k = next(i for i in range(40) if abs(got[i] - lp_b[i]) > 1e-5)
    assert 3 < k and logits_b[:k].argmax(-1).tolist() == out.output_ids[:k]
    assert logits_a[k:].argmax(-1).tolist() == out.output_ids[k:] and (got[k:] - lp_a[k:]).abs().max() <= 1e-5
    mixed = run_mixed(engine, ["a", None, "b"])  # decode steps mixing both adapters and the plain model
    assert_runs(oracle_a, mixed["a"])
    assert_runs(oracle_b, mixed["b"])
    assert_runs(plain, mixed[None])
    assert run(engine) == base
    engine.shutdown()


# ====================================================================== over HTTP, on the real server
def _completion(base: str, model: str):
    import httpx

    body = {"model": model, "prompt": PROMPTS[1], "max_tokens": MAX_NEW, "temperature": 0, "logprobs": 0,
            "ignore_eos": True, "return_token_ids": True}
    r = httpx.post(base + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


def test_server_lifecycle_as_vllm(qwen2_dir, adapters, tmp_path):
    """A server started with no adapter (as TRL's and AReaL's docs start vLLM): each bad adapter is refused with
    vLLM's status and the reason while the base model and a loaded adapter keep answering exactly as before;
    unload-last then load works, and an in-place reload of the lone adapter keeps it loaded with the new weights."""
    httpx = pytest.importorskip("httpx")
    from _reliability_helpers import ServerProcess

    def post(path, **body):
        return httpx.post(srv.base + path, json=body, timeout=120)

    with ServerProcess(qwen2_dir, tmp_path, "--served-model-name", "base", "--max-model-len", "256",
                       "--kv-cache-memory-bytes", "8MiB", "--enable-runtime-lora", "--max-lora-rank", "8") as srv:
        base = _completion(srv.base, "base")
        assert post("/v1/load_lora_adapter", lora_name="a", lora_path=adapters["a"]).status_code == 200
        with_a = _completion(srv.base, "a")
        assert with_a[0] != base[0]
        ref, logits = teacher_forced(adapter_oracle(qwen2_dir, adapters["a"]), PROMPTS[1], with_a[0])
        assert logits.argmax(-1).tolist() == with_a[0] and (torch.tensor(with_a[1]) - ref).abs().max() <= 1e-4
        bad = dict(adapters["bad"], rank=(adapters["r16"], 400, "greater than max_lora_rank 8"))
        for kind, (path, status, phrase) in bad.items():
            r = post("/v1/load_lora_adapter", lora_name=kind, lora_path=path)
            assert r.status_code == status, (kind, r.text)
            err = r.json()["error"]
            assert phrase in err["message"] and err["param"] == "lora_path", (kind, err)
            assert err["type"] == ("NotFoundError" if status == 404 else "BadRequestError")
            assert _completion(srv.base, "base") == base and _completion(srv.base, "a") == with_a, kind
        models = {m["id"] for m in httpx.get(srv.base + "/v1/models").json()["data"]}
        assert models == {"base", "a"}

        assert post("/v1/unload_lora_adapter", lora_name="a").status_code == 200  # the last one
        assert _completion(srv.base, "base") == base
        r = post("/v1/load_lora_adapter", lora_name="a", lora_path=adapters["a"])
        assert r.status_code == 200, r.text  # was 500: 'Qwen2ForCausalLM' object has no attribute 'active_adapter'
        assert _completion(srv.base, "a") == with_a
        r = post("/v1/load_lora_adapter", lora_name="a", lora_path=adapters["b"], load_inplace=True)
        assert r.status_code == 200, r.text
        cards = {m["id"]: m for m in httpx.get(srv.base + "/v1/models").json()["data"]}
        assert cards["a"]["root"] == adapters["b"]
        assert post("/v1/load_lora_adapter", lora_name="b", lora_path=adapters["b"]).status_code == 200
        assert _completion(srv.base, "a") == _completion(srv.base, "b") != with_a
        assert _completion(srv.base, "base") == base
        assert srv.alive()


def test_runtime_lora_routes_are_off_unless_switched_on(qwen2_dir, adapters, monkeypatch):
    """As vLLM without VLLM_ALLOW_RUNTIME_LORA_UPDATING: the routes answer 404 (saying how to switch them on);
    ``--enable-runtime-lora`` / the environment variable turn them on. Adapters given at start load either way."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from unsloth_rollout.serve import create_app
    from unsloth_rollout.serve.cli import add_serve_arguments, build_app

    policy = adapter_oracle(qwen2_dir)
    engine = RolloutEngine(policy, EngineConfig(kv_cache_memory_bytes=8 << 20))
    body = {"lora_name": "a", "lora_path": adapters["a"]}
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    with TestClient(create_app(engine)) as client:
        for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            r = client.post(path, json=body)
            assert r.status_code == 404 and "--enable-runtime-lora" in r.json()["error"]["message"]
    assert engine.lora_adapters == {}
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    with TestClient(create_app(engine)) as client:
        assert client.post("/v1/load_lora_adapter", json=body).status_code == 200
        assert client.post("/v1/unload_lora_adapter", json={"lora_name": "a"}).status_code == 200
    with TestClient(create_app(engine, enable_runtime_lora=False)) as client:
        assert client.post("/v1/load_lora_adapter", json=body).status_code == 404
    engine.shutdown()

    import argparse

    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING")
    args = add_serve_arguments(argparse.ArgumentParser()).parse_args(
        [qwen2_dir, "--model-backend", "transformers", "--kv-cache-memory-bytes", "8MiB",
         "--lora", f"a={adapters['a']}"])
    with TestClient(build_app(args)) as client:
        assert {m["id"] for m in client.get("/v1/models").json()["data"]} >= {"a"}
        assert client.post("/v1/load_lora_adapter", json={**body, "lora_name": "b"}).status_code == 404


class _Bypass(torch.nn.Module):
    """What a fused kernel does (Unsloth's MLP / QKV on GPU): the LoRA layer's weights without its forward hooks."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x, *args, **kwargs):
        return self.inner.forward(x)


def test_mixed_adapters_refused_where_a_kernel_bypasses_the_lora_layer(qwen2_dir, adapters):
    """PEFT's mixed batch is applied in each LoRA layer's forward; a backend that reads the weights another way
    would run one adapter for every row. The step fails by name instead; one adapter per forward still works."""
    policy = lora_policy(qwen2_dir, seed=0)
    engine = RolloutEngine(policy, EngineConfig(kv_cache_memory_bytes=8 << 20))
    engine.load_lora_adapter("a", adapters["a"])
    attn = next(m for n, m in policy.model.named_modules() if n.endswith("layers.0.self_attn"))
    alone = run(engine, "a")
    attn.q_proj = _Bypass(attn.q_proj)
    try:
        assert run(engine, "a") == alone
        sp = SamplingParams(max_new_tokens=MAX_NEW, temperature=0, ignore_eos=True)
        engine.pause("keep", holder="test")  # both in the first step: its decode mixes "a" and the policy's
        futs = [engine.submit(GenerationRequest(input_ids=PROMPTS[0], lora_name="a", sampling=sp)),
                engine.submit(GenerationRequest(input_ids=PROMPTS[1], sampling=sp))]
        engine.resume(holder="test")
        outs = [f.result(timeout=120)[0] for f in futs]
        assert all(o.error is not None and "cannot mix adapters" in o.error for o in outs), [o.error for o in outs]
    finally:
        attn.q_proj = attn.q_proj.inner
    assert run(engine, "a") == alone
    engine.shutdown()


def test_served_adapter_beside_a_policy_with_modules_to_save(qwen2_dir, adapters):
    """The policy's own adapter trains a full copy of lm_head (modules_to_save): rows under a served adapter use the
    base lm_head, alone and mixed with the policy's rows in one decode step."""
    policy = lora_policy(qwen2_dir, seed=0, modules_to_save=["lm_head"])
    with torch.no_grad():
        for n, p in policy.model.named_parameters():
            if "modules_to_save" in n:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(4)) * 0.5)
    engine = RolloutEngine(policy, EngineConfig(kv_cache_memory_bytes=8 << 20))
    engine.load_lora_adapter("a", adapters["a"])
    oracle_a = adapter_oracle(qwen2_dir, adapters["a"])
    assert_runs(oracle_a, run(engine, "a"))
    mixed = run_mixed(engine, ["a", None])
    assert_runs(oracle_a, mixed["a"])
    assert_runs(policy, mixed[None])
    engine.shutdown()
