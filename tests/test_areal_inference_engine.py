"""UnslothInferenceEngine against AReaL 1.0.4: the assertions of AReaL's tests/test_inference_engines.py
(rollout with group sizes, staleness control, wait_for_task) plus the agenerate contract, checked
against a teacher-forced HF forward of the same model (the oracle), and the VLM workflows."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest
import torch

pytest.importorskip("areal")
pytestmark = pytest.mark.areal

import torch.distributed as dist  # noqa: E402
from areal.api import ModelRequest, RolloutWorkflow, WeightUpdateMeta  # noqa: E402
from areal.api.cli_args import GenerationHyperparameters, InferenceEngineConfig  # noqa: E402
from areal.utils.data import concat_padded_tensors, get_batch_size  # noqa: E402
from areal.workflow import RLVRWorkflow  # noqa: E402

from unsloth_rollout import EngineConfig, RolloutEngine, load_model  # noqa: E402
from unsloth_rollout.areal.inference_engine import UnslothInferenceEngine  # noqa: E402
from unsloth_rollout.testing.tiny import tiny_model_path  # noqa: E402

try:  # tests/ as a package or as a plain folder on sys.path
    from tests._areal_helpers import png_data_url, random_image, teacher_forced_logprobs, vlm_item  # noqa: E402
except ImportError:
    from _areal_helpers import png_data_url, random_image, teacher_forced_logprobs, vlm_item  # noqa: E402


def _dummy_reward_fn(*args, **kwargs):
    return 1.0


@pytest.fixture(scope="module")
def text_policy():
    return load_model(str(tiny_model_path("qwen2")), backend="transformers", lora={"r": 8, "random_state": 0})


@pytest.fixture(scope="module")
def shared_engine(text_policy):
    eng = RolloutEngine(text_policy, EngineConfig(kv_cache_memory_bytes=16 << 20, max_model_len=512), seed=0)
    yield eng
    eng.shutdown()


@pytest.fixture
def make_engine(shared_engine):
    """engine_class(config) of AReaL's tests: a fresh UnslothInferenceEngine on the shared RolloutEngine."""
    made = []
    shared_engine.set_version(0)

    def make(**cfg):
        cfg.setdefault("backend", "unsloth:d1")
        e = UnslothInferenceEngine(InferenceEngineConfig(**cfg), rollout_engine=shared_engine)
        made.append(e)
        return e

    yield make
    for e in made:
        if e.initialized:
            e.destroy()


def _workflow(policy, max_new_tokens):
    return RLVRWorkflow(reward_fn=_dummy_reward_fn,
                        gconfig=GenerationHyperparameters(max_new_tokens=max_new_tokens, greedy=False),
                        tokenizer=policy.tokenizer, enable_thinking=False)


# ============================================================================ AReaL's test_inference_engines.py
@pytest.mark.parametrize("n_samples", [1, 2, 4])
def test_rollout(make_engine, text_policy, n_samples):
    engine = make_engine(max_concurrent_rollouts=2, consumer_batch_size=2, enable_rollout_tracing=True,
                         max_head_offpolicyness=int(1e10))
    engine.initialize()
    workflow = _workflow(text_policy, 16)
    data = {"messages": [{"role": "user", "content": "Hello, how are you?"}]}
    result = engine.rollout_batch([data] * 2, workflow=workflow, group_size=n_samples)
    assert isinstance(result, list)
    bs = get_batch_size(concat_padded_tensors(result))
    assert bs == 2 * n_samples

    class NullWorkflow(RolloutWorkflow):
        async def arun_episode(self, engine, data):
            return None

    assert engine.rollout_batch([data] * 2, workflow=NullWorkflow()) == []
    engine.destroy()
    assert not dist.is_initialized()


@pytest.mark.parametrize(("ofp", "bs", "n_samples"), [(0, 2, 1), (1, 2, 2), (4, 2, 1), (4, 4, 2)])
def test_staleness_control(make_engine, text_policy, ofp, bs, n_samples):
    engine = make_engine(consumer_batch_size=bs, max_head_offpolicyness=ofp, enable_rollout_tracing=True)
    engine.initialize()
    workflow = _workflow(text_policy, 2)
    data = {"messages": [{"role": "user", "content": "Hello, how are you?"}]}
    for _ in range(bs * 2):
        engine.submit(data, workflow=workflow, group_size=n_samples)
    if ofp < 1:
        with pytest.raises(TimeoutError):  # controlled off-policyness: not all are committed
            engine.wait(count=bs * 2, timeout=3)
    else:
        results = engine.wait(count=bs * 2, timeout=30)
        result = concat_padded_tensors([r for r in results if r is not None])
        assert result["attention_mask"].shape[0] == bs * 2 * n_samples

    engine.set_version(1)
    for _ in range(bs * 2):
        engine.submit(data, workflow=workflow, group_size=n_samples)
    if ofp < 2:
        with pytest.raises(TimeoutError):
            engine.wait(count=bs * 4, timeout=2)
    else:
        results = engine.wait(count=bs * 2, timeout=30)
        results = concat_padded_tensors([r for r in results if r is not None])
        assert results["attention_mask"].shape[0] == bs * 2 * n_samples
    engine.destroy()
    assert not dist.is_initialized()


def test_set_version_alone_releases_staleness_blocked_work(make_engine, text_policy):
    """The trap in AReaL's dispatcher: a version bump with no new submit must still release capacity."""
    engine = make_engine(consumer_batch_size=2, max_head_offpolicyness=0)
    engine.initialize()
    workflow = _workflow(text_policy, 2)
    data = {"messages": [{"role": "user", "content": "Hi"}]}
    for _ in range(4):
        engine.submit(data, workflow=workflow)
    assert len(engine.wait(2, timeout=30)) == 2
    with pytest.raises(TimeoutError):
        engine.wait(2, timeout=1.5)
    engine.set_version(1)  # no submit, no pause/resume
    assert len(engine.wait(2, timeout=30)) == 2


def test_wait_for_task(make_engine, text_policy):
    engine = make_engine(max_concurrent_rollouts=8, consumer_batch_size=4, max_head_offpolicyness=int(1e10))
    engine.initialize()
    workflow = _workflow(text_policy, 8)
    data = {"messages": [{"role": "user", "content": "Hello"}]}

    task_id1 = engine.submit(data, workflow=workflow)
    task_id2 = engine.submit(data, workflow=workflow)
    task_id3 = engine.submit(data, workflow=workflow)
    result2 = engine.wait_for_task(task_id2, timeout=30.0)
    assert result2 is not None and isinstance(result2, dict)
    assert engine.wait_for_task(task_id1, timeout=30.0) is not None
    assert engine.wait_for_task(task_id3, timeout=30.0) is not None

    with pytest.raises(ValueError, match="never submitted"):
        engine.wait_for_task(999999, timeout=1.0)

    slow_task_id = engine.submit(data, workflow=workflow)
    result = engine.wait_for_task(slow_task_id, timeout=0.001, raise_timeout=False)
    if result is None:
        assert engine.wait_for_task(slow_task_id, timeout=30.0) is not None

    task_ids = [engine.submit(data, workflow=workflow) for _ in range(4)]
    assert engine.wait_for_task(task_ids[1], timeout=30.0) is not None
    remaining = engine.wait(count=3, timeout=30.0)
    assert len(remaining) == 3 and all(r is not None for r in remaining)
    engine.destroy()
    assert not dist.is_initialized()


# ============================================================================ agenerate contract
def _agen(engine, req):
    return asyncio.run(engine.agenerate(req))


def test_agenerate_contract_matches_teacher_forced_forward(make_engine, text_policy):
    engine = make_engine()
    engine.initialize()
    tok = text_policy.tokenizer
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Tell me a story"}],
                                             add_generation_prompt=True, tokenize=False))
    engine.set_version(3)
    for temperature, greedy in ((0.7, False), (1.0, True)):
        g = GenerationHyperparameters(max_new_tokens=24, temperature=temperature, greedy=greedy)
        g = g.new_with_stop_and_pad_token_ids(tok)
        resp = _agen(engine, ModelRequest(input_ids=list(ids), gconfig=g, tokenizer=tok))
        assert resp.input_tokens == ids
        assert resp.tokenizer is tok and resp.processor is None
        assert len(resp.output_tokens) == len(resp.output_logprobs) == len(resp.output_versions) >= 1
        assert all(v == 3 for v in resp.output_versions)
        assert all(torch.isfinite(torch.tensor(resp.output_logprobs)))
        if resp.stop_reason == "stop":
            assert resp.output_tokens[-1] in (tok.eos_token_id, tok.pad_token_id)  # EOS kept
            assert resp.output_tokens_without_stop == resp.output_tokens[:-1]
        else:
            assert resp.stop_reason == "length" and len(resp.output_tokens) == 24
        oracle = teacher_forced_logprobs(text_policy, ids, resp.output_tokens, 1.0 if greedy else temperature)
        assert torch.allclose(torch.tensor(resp.output_logprobs), oracle, atol=1e-5, rtol=0), temperature
    # max_tokens caps prompt + output, as RemoteInfEngine does.
    g = GenerationHyperparameters(max_new_tokens=50, max_tokens=len(ids) + 3, ignore_eos=True)
    resp = _agen(engine, ModelRequest(input_ids=list(ids), gconfig=g, tokenizer=tok))
    assert len(resp.output_tokens) == 3 and resp.stop_reason == "length"
    with pytest.raises(RuntimeError, match="non-positive"):
        _agen(engine, ModelRequest(input_ids=list(ids), gconfig=GenerationHyperparameters(max_tokens=len(ids))))
    with pytest.raises(ValueError, match="n_samples > 1"):
        _agen(engine, ModelRequest(input_ids=list(ids), gconfig=GenerationHyperparameters(n_samples=2)))


def test_backend_string_without_install(shared_engine):
    """backend 'unsloth:d1' works with AReaL's untouched grammar; other backends are refused."""
    e = UnslothInferenceEngine(InferenceEngineConfig(backend="unsloth:d1"), rollout_engine=shared_engine)
    e.initialize()
    e.destroy()
    with pytest.raises(ValueError, match="rollout.backend"):
        UnslothInferenceEngine(InferenceEngineConfig(backend="sglang:d1"), rollout_engine=shared_engine)


def test_engine_from_a_model_folder():
    path = str(tiny_model_path("qwen2"))
    e = UnslothInferenceEngine(InferenceEngineConfig(backend="unsloth:d1"), path, seed=0,
                               load_options={"backend": "transformers", "lora": {"r": 4}},
                               kv_cache_memory_bytes=8 << 20, max_model_len=256)
    e.initialize()
    try:
        assert e.policy.name_or_path == path and e.rollout_engine.max_model_len == 256
        resp = _agen(e, ModelRequest(input_ids=e.policy.tokenizer.encode("Hi there"),
                                     gconfig=GenerationHyperparameters(max_new_tokens=4, ignore_eos=True)))
        assert len(resp.output_tokens) == 4
    finally:
        e.destroy()
    with pytest.raises(TypeError, match="unknown engine option"):
        UnslothInferenceEngine(InferenceEngineConfig(backend="unsloth:d1"), path, kv_cache_bytes=1)


def test_workflow_resolution_and_forward_compatible_kwargs(make_engine, text_policy):
    engine = make_engine(consumer_batch_size=2, max_head_offpolicyness=int(1e10))
    engine.initialize()
    data = {"messages": [{"role": "user", "content": "Hi"}]}
    kwargs = dict(reward_fn="unsloth_rollout.testing.toy.target_token_fraction",
                  gconfig=GenerationHyperparameters(max_new_tokens=4), tokenizer=text_policy.tokenizer)
    by_class = engine.rollout_batch([data], workflow=RLVRWorkflow, workflow_kwargs=kwargs, group_size=2)
    by_string = engine.rollout_batch([data], workflow="areal.workflow.rlvr.RLVRWorkflow", workflow_kwargs=kwargs,
                                     group_size=2, reward_normalization=False, drop_incomplete_group=False)
    assert by_class[0]["input_ids"].shape[0] == by_string[0]["input_ids"].shape[0] == 2
    assert all(0.0 <= r <= 1.0 for r in by_string[0]["rewards"].tolist())
    with pytest.raises(ValueError, match="workflow_kwargs is required"):
        engine.rollout_batch([data], workflow=RLVRWorkflow)
    tid = engine.submit(data, workflow=RLVRWorkflow, workflow_kwargs=kwargs, callback_addr=None, proxy_addr=None,
                        reward_normalization=False)
    assert engine.wait_for_task(tid, timeout=30) is not None
    from torchdata.stateful_dataloader import StatefulDataLoader

    loader = StatefulDataLoader([data] * 4, batch_size=2, collate_fn=lambda x: x)
    batch = engine.prepare_batch(loader, workflow="areal.workflow.rlvr.RLVRWorkflow", workflow_kwargs=kwargs,
                                 group_size=2, drop_incomplete_group=False)
    assert len(batch) == 2 and all(t["input_ids"].shape[0] == 2 for t in batch)


def test_partial_rollout_keeps_tokens_across_pause_generation(make_engine, text_policy):
    engine = make_engine()
    engine.initialize()
    ids = text_policy.tokenizer.encode("Once upon a time")
    g = GenerationHyperparameters(max_new_tokens=256, ignore_eos=True, temperature=1.0)
    for attempt in range(3):  # a starved polling thread may miss the window; the engine is not at fault then
        out = {}
        t = threading.Thread(target=lambda: out.setdefault("r", _agen(engine, ModelRequest(input_ids=ids, gconfig=g))))
        stats0 = engine.rollout_engine.stats()["decode_tokens"]
        t.start()
        deadline = time.time() + 30
        while engine.rollout_engine.stats()["decode_tokens"] - stats0 < 4 and time.time() < deadline:
            time.sleep(0.001)
        engine.pause_generation()
        paused_at = engine.rollout_engine.stats()["decode_tokens"] - stats0
        time.sleep(0.05)
        assert engine.rollout_engine.stats()["decode_tokens"] - stats0 == paused_at  # nothing decodes while paused
        engine.set_version(attempt + 1)
        engine.continue_generation()
        t.join(60)
        resp = out["r"]
        if paused_at < 255:
            break
    assert len(resp.output_tokens) == 256 and resp.stop_reason == "length"
    v = resp.output_versions
    assert v == sorted(v) and v[0] == attempt and v[-1] == attempt + 1, "versions mix; no token lost or repeated"
    oracle = teacher_forced_logprobs(text_policy, ids, resp.output_tokens, 1.0)
    assert torch.allclose(torch.tensor(resp.output_logprobs), oracle, atol=1e-5, rtol=0)


def test_pause_resume_offload_stats(make_engine, text_policy):
    engine = make_engine(consumer_batch_size=2, max_head_offpolicyness=int(1e10))
    engine.initialize()
    wf = _workflow(text_policy, 2)
    data = {"messages": [{"role": "user", "content": "Hi"}]}
    engine.pause()
    tid = engine.submit(data, workflow=wf)
    assert engine.wait_for_task(tid, timeout=1.0, raise_timeout=False) is None  # nothing starts while paused
    engine.resume()
    assert engine.wait_for_task(tid, timeout=30) is not None
    engine.offload()
    engine.onload()
    assert len(engine.rollout_batch([data], workflow=wf)) == 1
    stats = engine.export_stats()
    assert stats["rollout/accepted"] == 1.0 and "rollout/reward" in stats and "unsloth_rollout/kv_usage" in stats
    fut = WeightUpdateMeta(type="disk")
    with pytest.raises(NotImplementedError):  # not colocated and not LoRA: nothing to load
        engine.update_weights_from_disk(fut)


# ============================================================================ VLM workflows
@pytest.fixture(scope="module")
def vlm_engine():
    policy = load_model(str(tiny_model_path("qwen2_5_vl")), backend="transformers",
                        lora={"r": 8, "random_state": 0})
    eng = UnslothInferenceEngine(InferenceEngineConfig(backend="unsloth:d1", consumer_batch_size=2,
                                                       max_head_offpolicyness=int(1e10)),
                                 policy, kv_cache_memory_bytes=16 << 20, max_model_len=512, seed=0)
    eng.initialize()
    yield eng
    eng.destroy()


def test_vision_rlvr_rollout_batch_and_prepare_batch(vlm_engine):
    from areal.workflow.vision_rlvr import VisionRLVRWorkflow
    from torchdata.stateful_dataloader import StatefulDataLoader

    policy = vlm_engine.policy
    wf = VisionRLVRWorkflow(reward_fn=_dummy_reward_fn, gconfig=GenerationHyperparameters(max_new_tokens=6),
                            tokenizer=policy.tokenizer, processor=policy.processor, enable_thinking=False)
    data = [vlm_item(policy, i) for i in range(2)]
    res = vlm_engine.rollout_batch(data, workflow=wf, group_size=2)
    assert len(res) == 2
    for traj in res:
        assert traj["input_ids"].shape[0] == 2 and len(traj["multi_modal_input"]) == 2
        assert traj["mm_token_type_ids"].shape == traj["input_ids"].shape
        row = traj["input_ids"][0][traj["attention_mask"][0]].tolist()
        n_prompt = int((traj["loss_mask"][0] == 0).sum())
        n_out = int(traj["loss_mask"][0].sum())
        mm = traj["multi_modal_input"][0]
        oracle = teacher_forced_logprobs(policy, row[:n_prompt], row[n_prompt:n_prompt + n_out], 1.0,
                                         pixel_values=mm["pixel_values"], image_grid_thw=mm["image_grid_thw"])
        got = traj["logprobs"][0][n_prompt:n_prompt + n_out]
        assert torch.allclose(got, oracle, atol=1e-5, rtol=0)
    loader = StatefulDataLoader([vlm_item(policy, i) for i in range(4)], batch_size=2, collate_fn=lambda x: x)
    batch = vlm_engine.prepare_batch(loader, workflow=wf, group_size=2)
    assert len(batch) == 2 and all(t["input_ids"].shape[0] == 2 for t in batch)


def test_areal_openai_multi_turn_with_image(vlm_engine):
    from areal.experimental.openai import ArealOpenAI

    policy = vlm_engine.policy
    client = ArealOpenAI(engine=vlm_engine, tokenizer=policy.tokenizer)

    async def conversation():
        messages = [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": png_data_url(0)}},
            {"type": "text", "text": "What is in the picture?"}]}]
        first = await client.chat.completions.create(messages=messages, max_completion_tokens=8, temperature=1.0)
        messages += [{"role": "assistant", "content": first.choices[0].message.content or ""},
                     {"role": "user", "content": "And the colour?"}]
        second = await client.chat.completions.create(messages=messages, max_completion_tokens=8, temperature=1.0)
        return first, second

    first, second = asyncio.run(conversation())
    client.set_reward(first.id, 0.5)
    client.set_reward(second.id, 1.0)
    interactions = client.export_interactions(style="individual")
    assert set(interactions) == {first.id, second.id}
    image_pad = policy.config.image_token_id
    _, pv, grid = _expand_with_processor(policy, [], 0)
    for cid, inter in interactions.items():
        resp = inter.model_response
        # The prompt as the model ran it: ArealOpenAI's one placeholder expanded to the image's pad tokens,
        # and the engine's own pixel values for the trainer (multi_modal_input).
        assert resp.input_images and resp.input_tokens.count(image_pad) == int(grid[0].prod()) // 4
        assert len(resp.output_logprobs) == len(resp.output_tokens) >= 1
        td = inter.to_tensor_dict()
        assert td["logprobs"].shape == td["input_ids"].shape
        mask = td["loss_mask"][0].bool()
        assert torch.equal(td["logprobs"][0][mask], torch.tensor(resp.output_logprobs, dtype=torch.float32))
        assert torch.equal(td["multi_modal_input"][0]["pixel_values"], pv)
    # The behaviour logprobs are the model's: check one against a teacher-forced forward with the image.
    inter = interactions[second.id]
    resp = inter.model_response
    oracle = teacher_forced_logprobs(policy, resp.input_tokens, resp.output_tokens, 1.0, pixel_values=pv,
                                     image_grid_thw=grid)
    assert torch.allclose(torch.tensor(resp.output_logprobs), oracle, atol=1e-5, rtol=0)


def _expand_with_processor(policy, ids, seed):
    """Expand the single image placeholder with the processor (the oracle's own expansion)."""
    enc = policy.processor.image_processor(images=[random_image(seed)], return_tensors="pt")
    n = int(enc["image_grid_thw"][0].prod()) // policy.processor.image_processor.merge_size ** 2
    pad = policy.config.image_token_id
    out = []
    for t in ids:
        out.extend([t] * n if t == pad else [t])
    return out, enc["pixel_values"], enc["image_grid_thw"]


def test_update_weights_from_disk_loads_adapter_for_a_separate_trainer(tmp_path, vlm_engine):
    """A trainer that does not share the model (another process, simulated by a second model copy) goes
    through AReaL's disk protocol; the engine serves its adapter as <lora_name>-v<version>."""
    import areal.utils.name_resolve as name_resolve
    from areal.api.cli_args import NameResolveConfig, OptimizerConfig, TrainEngineConfig

    from unsloth_rollout.areal.train_engine import ColocatedTrainEngine

    name_resolve.reconfigure(NameResolveConfig(type="nfs", nfs_record_root=str(tmp_path / "nr")))
    other = load_model(str(tiny_model_path("qwen2_5_vl")), backend="transformers", lora={"r": 8, "random_state": 0})
    with torch.no_grad():
        for n, p in other.model.named_parameters():
            if "lora_B" in n:
                p.add_(0.05 * torch.randn_like(p))
    cfg = InferenceEngineConfig(backend="unsloth:d1", experiment_name="exp", trial_name="t")
    engine = UnslothInferenceEngine(cfg, rollout_engine=vlm_engine.rollout_engine)
    engine.initialize()
    trainer = ColocatedTrainEngine(TrainEngineConfig(experiment_name="exp", trial_name="t", backend="fsdp:d1",
                                                     path="", optimizer=OptimizerConfig()), other)
    trainer.initialize()
    meta = WeightUpdateMeta(type="disk", path=str(tmp_path / "w"), use_lora=True, lora_name="default_lora",
                            version=1, clear_checkpoint_after_load=True)
    trainer.connect_engine(engine, meta)
    assert not trainer._colocated
    trainer.update_weights(meta)
    assert "default_lora-v1" in engine.rollout_engine.lora_adapters
    engine.set_version(1)
    tok = other.tokenizer
    ids = tok.encode("A picture of")
    g = GenerationHyperparameters(max_new_tokens=8, ignore_eos=True)
    resp = _agen(engine, ModelRequest(input_ids=ids, gconfig=g))
    want = teacher_forced_logprobs(other, ids, resp.output_tokens, 1.0)
    assert torch.allclose(torch.tensor(resp.output_logprobs), want, atol=1e-5, rtol=0)
    base = teacher_forced_logprobs(vlm_engine.policy, ids, resp.output_tokens, 1.0)
    assert not torch.allclose(torch.tensor(resp.output_logprobs), base, atol=1e-3)
    engine.rollout_engine.unload_lora_adapter("default_lora-v1")
    engine.destroy()
    assert not os.path.exists(meta.path)  # clear_checkpoint_after_load, as the remote engines do
