"""SGLang's native API on the real server (``python -m unsloth_rollout.serve``, a subprocess), driven by AReaL 1.0.4's
own ``RemoteSGLangEngine`` (``SGLangBackend``) unchanged: the cases of AReaL's tests/test_inference_engines.py
(rollout, staleness control, wait_for_task), pause / continue with resubmission, weight updates from disk (full
and LoRA), teacher scoring, a VLM workflow; then /generate's own fields and refusals over plain HTTP.

Oracles: a teacher-forced forward of the same weights (the served checkpoint, an updated one, an adapter's PEFT
model) and an in-process RolloutEngine on the same model folder (greedy tokens equal). One server per module.
"""

import asyncio
import datetime
import json
import threading

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("areal")
httpx = pytest.importorskip("httpx")
pytestmark = pytest.mark.areal

import torch  # noqa: E402
from areal.api import ModelRequest, WeightUpdateMeta  # noqa: E402
from areal.api.cli_args import GenerationHyperparameters, InferenceEngineConfig  # noqa: E402
from areal.engine.sglang_remote import RemoteSGLangEngine  # noqa: E402
from areal.utils.data import concat_padded_tensors, get_batch_size  # noqa: E402
from areal.workflow.rlvr import RLVRWorkflow  # noqa: E402

from unsloth_rollout import GenerationRequest, SamplingParams  # noqa: E402
from unsloth_rollout.testing.fixtures import (engine_fixture, model_copy_fixture, policy_fixture,  # noqa: E402
                                              server_fixture)
from unsloth_rollout.testing.oracles import hf_logprobs, teacher_forced  # noqa: E402
from unsloth_rollout.testing.server import metrics  # noqa: E402
from unsloth_rollout.testing.toy import seeded_image  # noqa: E402
from unsloth_rollout.testing.waits import wait_for  # noqa: E402

MAX_MODEL_LEN = 512
NAME = "tiny-vlm"
LP_TOL = 2e-4
EXP, TRIAL = "sglang-exp", "t0"
IMAGE_SIZE = (84, 56)

model_dir = model_copy_fixture("qwen2_5_vl", "tiny")  # its own copy: weight updates are served from disk
server = server_fixture("--max-model-len", str(MAX_MODEL_LEN), "--served-model-name", NAME, "--max-images-per-request",
                        "2", "--max-n", "8", "--max-image-pixels", "10000", "--kv-cache-memory-bytes", "64MiB",
                        "--enable-runtime-lora")
policy = policy_fixture()
engine = engine_fixture(MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("serve_sglang")


@pytest.fixture
def make_remote(server):
    """engine_class(config) of AReaL's tests: a RemoteSGLangEngine on the server, destroyed after the test."""
    made = []

    def make(**cfg):
        cfg = {"backend": "sglang:d1", "setup_timeout": 60, "request_timeout": 120, "request_retries": 1,
               "experiment_name": EXP, "trial_name": TRIAL, **cfg}
        remote = RemoteSGLangEngine(InferenceEngineConfig(**cfg))
        remote.initialize(addr=server.removeprefix("http://"))
        made.append(remote)
        return remote

    yield make
    for remote in made:
        if remote.initialized:
            remote.destroy()


def areal_reward(prompt=None, completion=None, prompt_ids=None, completion_ids=None, **kwargs):
    """Module-level: AReaL runs reward functions in a process pool. RLVRWorkflow passes its arguments by position,
    VisionRLVRWorkflow by keyword (``completions=``)."""
    return float(len(completion_ids))


def _workflow(policy, max_new_tokens, greedy=False):
    gconfig = GenerationHyperparameters(max_new_tokens=max_new_tokens, greedy=greedy, temperature=1.0)
    return RLVRWorkflow(reward_fn=areal_reward, gconfig=gconfig, tokenizer=policy.tokenizer, enable_thinking=False)


def _rows(batch):
    """(prompt ids, output ids, output logprobs) of each row of an AReaL trajectory batch."""
    for i in range(batch["input_ids"].shape[0]):
        mask = batch["attention_mask"][i].bool()
        ids = batch["input_ids"][i][mask].tolist()
        n_out = int(batch["loss_mask"][i][mask].sum())
        lps = batch["logprobs"][i][mask][len(ids) - n_out:].tolist()
        yield ids[:len(ids) - n_out], ids[len(ids) - n_out:], lps


def _oracle(policy, prompt, out, temperature=1.0, **vision):
    return teacher_forced(policy, prompt, out, temperature, **vision)[0].tolist()


def _generate(server, **body):
    r = httpx.post(server + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


# ====================================================================== AReaL's test_inference_engines.py cases
@pytest.mark.parametrize("n_samples", [1, 2])
def test_remote_sglang_rollout(make_remote, engine, policy, n_samples):
    """rollout_batch with group sizes: greedy tokens and logprobs equal the in-process engine's; sampled ones
    equal a teacher-forced forward (T = 1); the reward saw every token."""
    remote = make_remote(max_concurrent_rollouts=4, consumer_batch_size=2, max_head_offpolicyness=10 ** 9)
    data = [{"messages": [{"role": "user", "content": "Say hello."}]},
            {"messages": [{"role": "user", "content": "Name a color."}]}]
    for greedy in (True, False):
        trajectories = remote.rollout_batch(data, workflow=_workflow(policy, 8, greedy), group_size=n_samples)
        batch = concat_padded_tensors(trajectories)
        assert get_batch_size(batch) == 2 * n_samples
        for i, (prompt, out, lps) in enumerate(_rows(batch)):
            assert batch["rewards"][i].item() == len(out) >= 1
            if greedy:
                (want,) = engine.generate([GenerationRequest(input_ids=prompt, sampling=SamplingParams(
                    max_new_tokens=8, temperature=0))])
                assert out == want.output_ids
                assert lps == pytest.approx(want.output_logprobs, abs=LP_TOL)
            else:
                assert lps == pytest.approx(_oracle(policy, prompt, out), abs=LP_TOL)


@pytest.mark.parametrize(("ofp", "bs", "n_samples"), [(0, 2, 1), (1, 2, 2), (4, 2, 1)])
def test_remote_sglang_staleness_control(make_remote, policy, ofp, bs, n_samples):
    remote = make_remote(consumer_batch_size=bs, max_head_offpolicyness=ofp)
    workflow = _workflow(policy, 2)
    data = {"messages": [{"role": "user", "content": "Hello, how are you?"}]}
    for _ in range(bs * 2):
        remote.submit(data, workflow=workflow, group_size=n_samples)
    if ofp < 1:
        with pytest.raises(TimeoutError):  # controlled off-policyness: not all are committed
            remote.wait(count=bs * 2, timeout=3)
    else:
        results = remote.wait(count=bs * 2, timeout=60)
        assert concat_padded_tensors([r for r in results if r is not None])["attention_mask"].shape[0] == \
            bs * 2 * n_samples
    remote.set_version(1)
    for _ in range(bs * 2):
        remote.submit(data, workflow=workflow, group_size=n_samples)
    if ofp < 2:
        with pytest.raises(TimeoutError):
            remote.wait(count=bs * 4, timeout=2)
    else:
        results = remote.wait(count=bs * 2, timeout=60)
        assert concat_padded_tensors([r for r in results if r is not None])["attention_mask"].shape[0] == \
            bs * 2 * n_samples


def test_remote_sglang_wait_for_task(make_remote, policy):
    remote = make_remote(max_concurrent_rollouts=8, consumer_batch_size=4, max_head_offpolicyness=10 ** 9)
    workflow = _workflow(policy, 4)
    data = {"messages": [{"role": "user", "content": "Hello"}]}
    ids = [remote.submit(data, workflow=workflow) for _ in range(3)]
    assert isinstance(remote.wait_for_task(ids[1], timeout=60), dict)
    assert remote.wait_for_task(ids[0], timeout=60) is not None and remote.wait_for_task(ids[2], timeout=60)
    with pytest.raises(ValueError, match="never submitted"):
        remote.wait_for_task(999999, timeout=1.0)
    ids = [remote.submit(data, workflow=workflow) for _ in range(4)]
    assert remote.wait_for_task(ids[1], timeout=60) is not None
    remaining = remote.wait(count=3, timeout=60)
    assert len(remaining) == 3 and all(r is not None for r in remaining)


# ====================================================================== pause / continue: partial rollout
def test_remote_sglang_pause_continue_resubmits_and_loses_nothing(make_remote, server, policy):
    """AReaL's pause_generation (/pause_generation, abort) mid-generation: the request returns its partial output,
    AReaL resubmits it with those tokens appended, the server holds it until continue_generation, and the final
    answer has every token once: its logprobs equal a teacher-forced forward of the whole output, its versions
    step from 0 to 1 where the pause fell."""
    remote = make_remote()
    ids = policy.tokenizer.encode("Once upon a time")
    g = GenerationHyperparameters(max_new_tokens=200, ignore_eos=True, temperature=1.0)
    for attempt in range(3):  # a request that finishes before the pause lands proves nothing: try again
        remote.set_version(0)
        out = {}
        start = metrics(server).get("vllm:iteration_tokens_total_count", 0)
        t = threading.Thread(target=lambda: out.setdefault("r", asyncio.run(remote.agenerate(ModelRequest(
            input_ids=list(ids), gconfig=g)))))
        t.start()
        wait_for(lambda: metrics(server).get("vllm:iteration_tokens_total_count", 0) - start >= 4, timeout=60,
                 what="a few decode steps", poll_s=0.01)
        remote.pause_generation()
        try:
            assert httpx.get(server + "/is_paused").json()["is_paused"] is True
            # AReaL resubmits the rest at once; the server holds it while paused.
            wait_for(lambda: metrics(server)["vllm:num_requests_waiting"] == 1 or not t.is_alive(), timeout=30,
                     what="the resubmitted request to queue", poll_s=0.02)
            resubmitted = t.is_alive()
            remote.set_version(1)
        finally:  # a failure here must not leave the module's server paused
            remote.continue_generation()
        t.join(120)
        resp = out["r"]
        if resubmitted:
            break
    assert resubmitted, "the pause never fell inside the generation"
    assert len(resp.output_tokens) == 200 and resp.stop_reason == "length"
    v = resp.output_versions
    assert v == sorted(v) and v[0] == 0 and v[-1] == 1
    assert resp.output_logprobs == pytest.approx(_oracle(policy, ids, resp.output_tokens), abs=LP_TOL)
    assert httpx.get(server + "/is_paused").json()["is_paused"] is False


def test_pause_generation_modes_and_queued_requests(server):
    """SGLang's abort mode: a request queued while paused returns empty with "Abort before prefill" (AReaL's
    resubmit signal); retract keeps in-flight tokens and continues; a bad mode is a 400 naming it."""
    body = {"input_ids": [1, 2, 3], "return_logprob": True,
            "sampling_params": {"max_new_tokens": 300, "ignore_eos": True, "temperature": 0}}
    assert httpx.post(server + "/pause_generation", json={"mode": "retract"}).json()["status"] == "ok"
    got = {}
    t = threading.Thread(target=lambda: got.update(_generate(server, **body)))
    t.start()
    try:
        wait_for(lambda: metrics(server)["vllm:num_requests_waiting"] == 1, timeout=30, what="a queued request",
                 poll_s=0.02)
        assert httpx.post(server + "/pause_generation", json={}).status_code == 200  # abort: the queued one returns
        t.join(60)
    finally:  # a failure here must not leave the module's server paused
        if t.is_alive():
            httpx.post(server + "/continue_generation")
    assert got["output_ids"] == [] and got["meta_info"]["finish_reason"]["type"] == "abort"
    assert got["meta_info"]["finish_reason"]["message"].startswith("Abort before prefill")
    assert got["meta_info"]["output_token_logprobs"] == []
    r = httpx.post(server + "/pause_generation", json={"mode": "later"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "mode"
    assert httpx.post(server + "/continue_generation").json()["status"] == "ok"
    # retract / in_place: an in-flight request keeps its tokens and continues
    body["sampling_params"]["max_new_tokens"] = 60
    want = _generate(server, **body)
    t = threading.Thread(target=lambda: got.update(_generate(server, **body)))
    start = metrics(server).get("vllm:iteration_tokens_total_count", 0)
    t.start()
    wait_for(lambda: metrics(server).get("vllm:iteration_tokens_total_count", 0) - start >= 3, timeout=60,
             what="a few decode steps", poll_s=0.01)
    httpx.post(server + "/pause_generation", json={"mode": "in_place"})
    httpx.post(server + "/continue_generation")
    t.join(60)
    assert got["output_ids"] == want["output_ids"] and got["meta_info"]["finish_reason"] == {"type": "length",
                                                                                              "length": 60}


# ====================================================================== weight updates from disk
def _publish(remote) -> None:
    """The trainer's half of AReaL's disk protocol: announce the checkpoint for the engine's current version."""
    import areal.utils.name_resolve as name_resolve
    from areal.utils import names

    name_resolve.add(names.update_weights_from_disk(EXP, TRIAL, remote.get_version()),
                     str(datetime.datetime.now().timestamp()), replace=True)


@pytest.fixture(scope="module")
def name_resolve_dir(workdir):
    import areal.utils.name_resolve as name_resolve
    from areal.api.cli_args import NameResolveConfig

    name_resolve.reconfigure(NameResolveConfig(type="nfs", nfs_record_root=str(workdir / "name_resolve")))


def test_remote_sglang_full_weight_update_from_disk(make_remote, server, model_dir, workdir, name_resolve_dir):
    """RemoteSGLangEngine.update_weights_from_disk (/update_weights_from_disk, abort_all_requests): the served
    policy becomes the checkpoint (its own forward is the oracle); a bad path is refused with success false and
    the server serves on; the original checkpoint restores the original answers."""
    from transformers import AutoModelForImageTextToText

    from unsloth_rollout.testing.fixtures import perturbed_vlm_checkpoint

    ckpt = perturbed_vlm_checkpoint(model_dir, workdir / "step-1")
    model = AutoModelForImageTextToText.from_pretrained(ckpt, dtype=torch.float32).eval()

    remote = make_remote()
    prompt = [13, 17, 19, 23]
    g = GenerationHyperparameters(max_new_tokens=8, greedy=True, ignore_eos=True)
    before = asyncio.run(remote.agenerate(ModelRequest(input_ids=prompt, gconfig=g)))
    fut = remote.update_weights_from_disk(WeightUpdateMeta(type="disk", path=str(ckpt),
                                                           clear_checkpoint_after_load=False))
    _publish(remote)
    fut.result(timeout=120)
    remote.set_version(1)
    after = asyncio.run(remote.agenerate(ModelRequest(input_ids=prompt, gconfig=g)))
    assert after.output_tokens != before.output_tokens and set(after.output_versions) == {1}
    lp = hf_logprobs(model, prompt + after.output_tokens, 8)
    assert after.output_logprobs == pytest.approx(lp[torch.arange(8), after.output_tokens].tolist(), abs=LP_TOL)

    r = httpx.post(server + "/update_weights_from_disk", json={"model_path": str(workdir / "missing")}, timeout=60)
    assert r.status_code == 400 and r.json()["success"] is False
    r = httpx.post(server + "/update_weights_from_disk", json={"model_path": model_dir, "weight_version": "v2"})
    assert r.status_code == 400 and "weight_version" in r.json()["message"]
    # Without abort_all_requests a request in flight keeps its tokens and finishes on the new weights; with it
    # (AReaL's), it returns its partial output at once.
    for abort, version in ((False, "2"), (True, "3")):
        got, body = {}, {"input_ids": prompt, "sampling_params": {"max_new_tokens": 300, "ignore_eos": True}}
        t = threading.Thread(target=lambda: got.update(_generate(server, **body)))
        start = metrics(server).get("vllm:iteration_tokens_total_count", 0)
        t.start()
        wait_for(lambda: metrics(server).get("vllm:iteration_tokens_total_count", 0) - start >= 3, timeout=60,
                 what="a few decode steps", poll_s=0.01)
        r = httpx.post(server + "/update_weights_from_disk", json={
            "model_path": model_dir, "weight_version": version, "abort_all_requests": abort}, timeout=120)
        assert r.status_code == 200 and r.json()["success"] is True and r.json()["num_paused_requests"] == 1, r.text
        t.join(60)
        finish = got["meta_info"]["finish_reason"]
        if abort:
            assert finish["type"] == "abort" and 0 < len(got["output_ids"]) < 300
        else:
            assert finish == {"type": "length", "length": 300} and got["meta_info"]["weight_version"] == "2"
    assert httpx.get(server + "/get_model_info").json()["weight_version"] == "3"
    restored = asyncio.run(remote.agenerate(ModelRequest(input_ids=prompt, gconfig=g)))
    assert restored.output_tokens == before.output_tokens
    assert httpx.post(server + "/update_weight_version", json={"version": 0}).status_code == 200


def test_remote_sglang_lora_update_from_disk(make_remote, server, model_dir, workdir, name_resolve_dir):
    """AReaL's LoRA path: /load_lora_adapter of ``<name>-v<version>``, requests naming it in ``lora_path`` (their
    logprobs are the PEFT model's own), and the version that left ``lora_keep_versions`` unloaded."""
    import peft
    from transformers import AutoModelForImageTextToText

    base = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    lora = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                     init_lora_weights=False)).eval()
    ckpt = workdir / "adapter"
    lora.save_pretrained(ckpt)

    remote = make_remote(use_lora=True, lora_name="policy")
    prompt = [29, 31, 37]
    g = GenerationHyperparameters(max_new_tokens=6, ignore_eos=True, temperature=1.0, lora_name="policy")
    for version in (1, 2):
        meta = WeightUpdateMeta(type="disk", path=str(ckpt), use_lora=True, lora_name="policy", version=version,
                                lora_keep_versions=1, clear_checkpoint_after_load=False)
        fut = remote.update_weights_from_disk(meta)
        _publish(remote)
        fut.result(timeout=120)
        remote.set_version(version)
        loaded = httpx.get(server + "/v1/models").json()["data"]
        assert [m["id"] for m in loaded[1:]] == [f"policy-v{version}"]  # v1 unloaded once v2 is in
        resp = asyncio.run(remote.agenerate(ModelRequest(input_ids=prompt, gconfig=g)))
        lp = hf_logprobs(lora, prompt + resp.output_tokens, 6)
        assert resp.output_logprobs == pytest.approx(lp[torch.arange(6), resp.output_tokens].tolist(), abs=LP_TOL)
    r = httpx.post(server + "/unload_lora_adapter", json={"lora_name": "policy-v1"})
    assert r.status_code == 400 and r.json()["success"] is False
    r = httpx.post(server + "/load_lora_adapter", json={"lora_name": NAME, "lora_path": str(ckpt)})
    assert r.status_code == 400 and "served model" in r.json()["error_message"]
    assert httpx.post(server + "/unload_lora_adapter", json={"lora_name": "policy-v2"}).json()["success"] is True
    r = httpx.post(server + "/generate", json={"input_ids": prompt, "lora_path": "policy-v2"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
    remote.set_version(0)


# ====================================================================== teacher scoring
def test_remote_sglang_compute_logp(make_remote, policy):
    """AReaL's compute_logp over SGLang (/generate with logprob_start_len, input_token_logprobs) equals a
    teacher-forced forward (T = 1) on the loss-mask positions and 0 elsewhere."""
    rows = [([5, 6, 7, 8, 9, 10], 3), ([11, 12, 13, 14], 2)]
    width = max(len(ids) for ids, _ in rows)
    batch = {"input_ids": torch.zeros((2, width), dtype=torch.long),
             "attention_mask": torch.zeros((2, width), dtype=torch.bool),
             "loss_mask": torch.zeros((2, width), dtype=torch.int32)}
    for i, (ids, n_out) in enumerate(rows):
        batch["input_ids"][i, :len(ids)] = torch.tensor(ids)
        batch["attention_mask"][i, :len(ids)] = True
        batch["loss_mask"][i, len(ids) - n_out:len(ids)] = 1
    (got,) = make_remote().compute_logp([batch])
    for i, (ids, n_out) in enumerate(rows):
        mask = batch["loss_mask"][i].bool()
        assert got[i][mask].tolist() == pytest.approx(_oracle(policy, ids[:-n_out], ids[-n_out:]), abs=LP_TOL)
        assert bool((got[i][~mask] == 0).all())


# ====================================================================== VLM
def test_remote_sglang_vision_rlvr_rollout(make_remote, engine, policy):
    """VisionRLVRWorkflow through RemoteSGLangEngine: expanded image tokens in input_ids plus bare base64 PNGs in
    image_data; the logprobs equal a teacher-forced forward with the processor's own pixels, the greedy tokens
    the in-process engine's on the same image."""
    from areal.workflow.vision_rlvr import VisionRLVRWorkflow

    remote = make_remote(consumer_batch_size=2, max_head_offpolicyness=10 ** 9)
    tok = policy.tokenizer
    images = [seeded_image(7 + i, IMAGE_SIZE) for i in range(2)]
    data = [{"messages": tok.apply_chat_template([{"role": "user", "content": "<|vision_start|><|image_pad|>"
                                                   "<|vision_end|>" + f"What is shape {i}?"}],
                                                 tokenize=False, add_generation_prompt=True),
             "images": [img]} for i, img in enumerate(images)]
    for greedy in (True, False):
        wf = VisionRLVRWorkflow(reward_fn=areal_reward, gconfig=GenerationHyperparameters(
            max_new_tokens=6, greedy=greedy, temperature=1.0), tokenizer=tok, processor=policy.processor,
            enable_thinking=False)
        trajectories = remote.rollout_batch(data, workflow=wf)
        assert len(trajectories) == 2  # AReaL drops a failed episode: none may be missing
        for traj in trajectories:  # in the order they finished: each finds its image by its prompt
            ((prompt, out, lps),) = list(_rows(traj))
            (img,) = [img for i, img in enumerate(images) if f"What is shape {i}?" in tok.decode(prompt)]
            mm = traj["multi_modal_input"][0]
            vision = {"pixel_values": mm["pixel_values"], "image_grid_thw": mm["image_grid_thw"]}
            assert lps == pytest.approx(_oracle(policy, prompt, out, **vision), abs=LP_TOL)
            if greedy:
                (want,) = engine.generate([GenerationRequest(input_ids=prompt, images=[img],
                                                             sampling=SamplingParams(max_new_tokens=6, temperature=0))])
                assert out == want.output_ids


# ====================================================================== /generate over plain HTTP
def test_generate_logprobs_against_teacher_forced_forward(server, policy):
    """output_token_logprobs at T = 0.7 and input_token_logprobs from logprob_start_len (T = 1, SGLang's) equal a
    teacher-forced forward; the top logprobs are the forward's k best; -1 scores no prompt token."""
    prompt = [3, 5, 7, 11, 13, 17]
    body = _generate(server, input_ids=prompt, return_logprob=True, top_logprobs_num=3, logprob_start_len=2,
                     return_text_in_logprobs=True, sampling_params={"max_new_tokens": 6, "temperature": 0.7,
                                                                    "ignore_eos": True, "sampling_seed": 3})
    meta, out = body["meta_info"], body["output_ids"]
    assert meta["finish_reason"] == {"type": "length", "length": 6} and meta["completion_tokens"] == 6
    assert meta["prompt_tokens"] == len(prompt) and meta["weight_version"] == "0"
    assert [e[1] for e in meta["output_token_logprobs"]] == out
    assert [e[0] for e in meta["output_token_logprobs"]] == pytest.approx(_oracle(policy, prompt, out, 0.7),
                                                                         abs=LP_TOL)
    assert [e[2] for e in meta["output_token_logprobs"]] == [policy.tokenizer.decode([t]) for t in out]
    lp_prompt, logits = teacher_forced(policy, prompt[:1], prompt[1:])
    assert [e[1] for e in meta["input_token_logprobs"]] == prompt[2:]
    assert [e[0] for e in meta["input_token_logprobs"]] == pytest.approx(lp_prompt[1:].tolist(), abs=LP_TOL)
    for j, top in enumerate(meta["input_top_logprobs"]):  # position 2 + j, scored by logits row 1 + j
        best = torch.log_softmax(logits[1 + j], -1).topk(3)
        assert [e[1] for e in top] == best.indices.tolist()
        assert [e[0] for e in top] == pytest.approx(best.values.tolist(), abs=LP_TOL)
    _, out_logits = teacher_forced(policy, prompt, out, 0.7)
    for j, top in enumerate(meta["output_top_logprobs"]):
        assert [e[1] for e in top] == torch.log_softmax(out_logits[j] / 0.7, -1).topk(3).indices.tolist()

    plain = _generate(server, input_ids=prompt, return_logprob=True, sampling_params={"max_new_tokens": 2})
    assert plain["meta_info"]["input_token_logprobs"] == [[None, prompt[-1], None]]
    assert "output_top_logprobs" not in plain["meta_info"]
    scored = _generate(server, input_ids=prompt, return_logprob=True, logprob_start_len=0,
                       sampling_params={"max_new_tokens": 0})
    assert scored["output_ids"] == [] and scored["meta_info"]["input_token_logprobs"][0] == [None, prompt[0], None]
    assert [e[0] for e in scored["meta_info"]["input_token_logprobs"][1:]] == pytest.approx(lp_prompt.tolist(),
                                                                                             abs=LP_TOL)


def test_generate_text_batch_n_stop_and_stream(server, engine, policy):
    """text prompts and batches (prompt-major, n samples each); a stop token ends with {"type": "stop",
    "matched": id} and stays in output_ids; a stream's chunks grow to the non-streamed answer, then [DONE]."""
    tok = policy.tokenizer
    texts = ["The sky is", "One two three"]
    batch = _generate(server, text=texts, sampling_params={"max_new_tokens": 5, "temperature": 0, "n": 2})
    assert len(batch) == 4
    for k, text in enumerate(texts):
        (want,) = engine.generate([GenerationRequest(input_ids=tok.encode(text), sampling=SamplingParams(
            max_new_tokens=5, temperature=0))])
        assert [b["output_ids"] for b in batch[2 * k:2 * k + 2]] == [want.output_ids] * 2
        assert batch[2 * k]["text"] == want.text
    first = batch[0]["output_ids"]
    stopped = _generate(server, text=texts[0], sampling_params={"max_new_tokens": 5, "temperature": 0,
                                                                 "stop_token_ids": [first[2]]})
    assert stopped["output_ids"] == first[:3]
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": first[2]}
    # SGLang caps max_new_tokens at the room the context leaves: the answer ends with "length" there (a sampled
    # EOS would end it first, so EOS is ignored)
    capped = _generate(server, input_ids=[1] * (MAX_MODEL_LEN - 3), sampling_params={"max_new_tokens": 100,
                                                                                      "ignore_eos": True})
    assert capped["meta_info"]["finish_reason"] == {"type": "length", "length": 3}

    body = {"input_ids": [2, 4, 6], "return_logprob": True, "stream": True,
            "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}
    with httpx.stream("POST", server + "/generate", json=body, timeout=60) as r:
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
    final = _generate(server, **{**body, "stream": False})
    assert [len(c["output_ids"]) for c in chunks] == sorted(len(c["output_ids"]) for c in chunks)
    assert chunks[-1]["output_ids"] == final["output_ids"]
    assert chunks[-1]["meta_info"]["output_token_logprobs"] == final["meta_info"]["output_token_logprobs"]
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 6}


@pytest.mark.parametrize(("body", "param"), [
    ({"input_ids": []}, "input_ids"),
    ({"text": "hi", "input_ids": [1]}, "input_ids"),
    ({"input_ids": [1], "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": "8"}}, "sampling_params.max_new_tokens"),
    ({"input_ids": [1], "sampling_params": {"top_p": 0}}, "sampling_params.top_p"),
    ({"input_ids": [1], "sampling_params": {"best_of": 2}}, "sampling_params.best_of"),
    ({"input_ids": [1], "sampling_params": {"ebnf": "root ::= \"a\""}}, "sampling_params.ebnf"),
    ({"input_ids": [1], "sampling_params": {"n": 9}}, "sampling_params.n"),
    ({"input_ids": [[1], [2]], "sampling_params": [{}]}, "sampling_params"),
    ({"input_ids": [[1], [2]], "sampling_params": [{"n": 1}, {"n": 2}]}, "sampling_params[1].n"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": -1}}, "sampling_params.max_new_tokens"),
    ({"input_ids": [1], "sampling_params": {"regex": "("}}, "sampling_params.regex"),
    ({"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 2}, "logprob_start_len"),
    ({"input_ids": [1], "return_logprob": True, "top_logprobs_num": 21}, "top_logprobs_num"),
    ({"input_ids": [1], "input_embeds": [[0.0]]}, "input_embeds"),
    ({"input_ids": [1], "return_hidden_states": True}, "return_hidden_states"),
    ({"input_ids": [1 << 40]}, "input_ids"),
    ({"input_ids": [1] * MAX_MODEL_LEN}, "input_ids"),
    ({"input_ids": [1], "image_data": "not base64!"}, "image_data"),
    ({"input_ids": [1], "image_data": ["a", "b", "c"]}, "image_data"),
    ({"input_ids": [1], "lora_path": "nope"}, "lora_path"),
])
def test_generate_refuses_by_field_and_keeps_serving(server, body, param):
    r = httpx.post(server + "/generate", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    ok = _generate(server, input_ids=[1, 2], sampling_params={"max_new_tokens": 1})
    assert len(ok["output_ids"]) == 1


def test_info_health_cache_memory_and_refused_routes(server):
    info = httpx.get(server + "/get_model_info").json()
    assert info["is_generation"] is True and info["has_image_understanding"] is True
    assert info["model_type"] == "qwen2_5_vl" and info["weight_version"] == "0"
    assert httpx.get(server + "/health_generate", timeout=60).status_code == 200
    r = httpx.post(server + "/flush_cache")
    assert r.status_code == 200 and r.text.startswith("Cache flushed")
    assert httpx.post(server + "/release_memory_occupation", json={}).status_code == 200
    assert httpx.get(server + "/health_generate").status_code == 503  # nothing can be generated now
    assert httpx.post(server + "/resume_memory_occupation", json={"tags": ["kv_cache"]}).status_code == 200
    assert httpx.post(server + "/release_memory_occupation", json={"tags": ["disk"]}).status_code == 400
    assert len(_generate(server, input_ids=[1, 2], sampling_params={"max_new_tokens": 2})["output_ids"]) == 2
    # SGLang's server description, in its server-argument names, agrees with vLLM's /server_info of the same engine
    sinfo, vllm = httpx.get(server + "/get_server_info").json(), httpx.get(server + "/server_info").json()
    cache = vllm["vllm_config"]["cache_config"]
    assert sinfo["context_length"] == MAX_MODEL_LEN and sinfo["served_model_name"] == NAME
    assert sinfo["max_total_num_tokens"] == cache["num_gpu_blocks"] * cache["block_size"] > 0
    assert sinfo["page_size"] == cache["block_size"] and sinfo["tp_size"] == sinfo["dp_size"] == 1
    assert sinfo["status"] == "ready" and sinfo["version"] == vllm["version"] and sinfo["enable_multimodal"]
    assert sinfo["internal_states"][0]["last_gen_throughput"] > 0  # tokens were decoded above
    r = httpx.post(server + "/update_weights_from_distributed", json={"names": []})
    assert r.status_code == 501 and "/update_weights_from_disk" in r.json()["message"]
