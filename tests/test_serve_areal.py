"""AReaL's own clients against the real server (``python -m unsloth_rollout.serve``, a subprocess): the
``RemotevLLMEngine`` / ``VLLMBackend`` request shapes and the ``/areal_*`` control routes (pause, weight update).

Oracles: an in-process RolloutEngine on the same model folder (token ids equal, logprobs close) and a
teacher-forced forward of the same weights (a saved checkpoint's own forward after a weight update).
One server and one in-process engine per module: the model loads once each.
"""

import json
import threading

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

import torch  # noqa: E402

from unsloth_rollout import GenerationRequest, SamplingParams  # noqa: E402
from unsloth_rollout.testing.fixtures import (engine_fixture, model_copy_fixture, policy_fixture,  # noqa: E402
                                              server_fixture)
from unsloth_rollout.testing.oracles import hf_logprobs  # noqa: E402
from unsloth_rollout.testing.server import metrics  # noqa: E402
from unsloth_rollout.testing.toy import png_data_url, seeded_image  # noqa: E402
from unsloth_rollout.testing.waits import wait_for  # noqa: E402

MAX_MODEL_LEN = 512
NAME = "tiny-vlm"
LP_TOL = 2e-4
IMAGE_SIZE = (84, 56)  # (width, height) of the test images


model_dir = model_copy_fixture("qwen2_5_vl", "tiny")  # its own copy: a weight update is served from disk
server = server_fixture("--max-model-len", str(MAX_MODEL_LEN), "--served-model-name", NAME, "--max-images-per-request",
                        "2", "--max-n", "8", "--max-image-pixels", "10000", "--kv-cache-memory-bytes", "64MiB")
policy = policy_fixture()
engine = engine_fixture(MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("serve_areal")


def _one(engine, **kw) -> list:
    sampling = kw.pop("sampling")
    return engine.generate([GenerationRequest(sampling=SamplingParams(**sampling), **kw)])


# ====================================================================== AReaL's control routes
def test_areal_pause_aborts_in_flight_with_partial_output(server):
    """/areal_pause_generation: running requests return their partial output with finish_reason "abort"."""
    body = {"model": NAME, "prompt": [1, 2, 3], "max_tokens": 400, "temperature": 1.0, "ignore_eos": True,
            "logprobs": 0, "return_tokens_as_token_ids": True, "return_token_ids": True}
    queued = {}
    with httpx.stream("POST", server + "/v1/completions", json={**body, "stream": True}, timeout=120) as r:
        lines = r.iter_lines()
        events = []
        for line in lines:  # the first token: the request is running
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
                break
        httpx.post(server + "/pause", params={"mode": "keep"})  # freeze it mid-generation
        # A request that arrives now waits in the queue (no tokens yet).
        t = threading.Thread(target=lambda: queued.update(httpx.post(server + "/v1/completions", json=body,
                                                                     timeout=120).json()))
        t.start()
        wait_for(lambda: metrics(server)["vllm:num_requests_waiting"] == 1, timeout=30.0,
                 what="the second request to queue", poll_s=0.02)
        r2 = httpx.post(server + "/areal_pause_generation", timeout=60)
        assert r2.status_code == 200 and r2.json()["success"] is True
        events += [json.loads(ln[6:]) for ln in lines if ln.startswith("data: {")]
    t.join(60)
    tokens = sum((e["choices"][0]["token_ids"] for e in events), [])
    assert events[-1]["choices"][0]["finish_reason"] == "abort"
    assert 0 < len(tokens) < 400
    # The queued one: an empty abort, which AReaL's VLLMBackend reads as "resubmit".
    choice = queued["choices"][0]
    assert choice["finish_reason"] == "abort" and choice["token_ids"] == []
    assert choice["logprobs"]["tokens"] == []
    assert httpx.get(server + "/is_paused").json()["is_paused"] is True
    assert httpx.post(server + "/areal_continue_generation").json()["success"] is True
    assert httpx.get(server + "/is_paused").json()["is_paused"] is False




def test_areal_full_weight_update_from_disk(server, model_dir, workdir):
    """AReaL's /areal_update_weights: a saved checkpoint replaces the served weights; the original restores."""
    from transformers import AutoModelForImageTextToText

    from unsloth_rollout.testing.fixtures import perturbed_vlm_checkpoint

    ckpt = perturbed_vlm_checkpoint(model_dir, workdir / "step-1")
    model = AutoModelForImageTextToText.from_pretrained(ckpt, dtype=torch.float32).eval()

    prompt = [13, 17, 19, 23]
    body = {"model": NAME, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "logprobs": 0,
            "return_token_ids": True}
    before = httpx.post(server + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    r = httpx.post(server + "/areal_update_weights", json={"model_path": str(ckpt)}, timeout=120)
    assert r.status_code == 200 and r.json()["success"] is True, r.text
    after = httpx.post(server + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    assert after["token_ids"] != before["token_ids"]
    lp = hf_logprobs(model, prompt + after["token_ids"], 8)  # oracle: the checkpoint's own forward
    assert after["logprobs"]["token_logprobs"] == pytest.approx(
        lp[torch.arange(8), after["token_ids"]].tolist(), abs=LP_TOL)

    r = httpx.post(server + "/areal_update_weights", json={"model_path": str(workdir / "missing")}, timeout=60)
    assert r.status_code == 400 and r.json()["success"] is False
    assert httpx.post(server + "/areal_update_weights", json={"model_path": model_dir}, timeout=120).status_code == 200
    restored = httpx.post(server + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    assert restored["token_ids"] == before["token_ids"]


# ====================================================================== AReaL's own remote engine
def areal_reward(prompt, completion, prompt_ids, completion_ids, **kwargs):
    """Module-level: AReaL runs reward functions in a process pool."""
    return float(len(completion_ids))


def test_areal_remote_vllm_engine_rollouts(server, engine, policy):
    pytest.importorskip("areal")
    from areal.api.cli_args import GenerationHyperparameters, InferenceEngineConfig
    from areal.engine.vllm_remote import RemotevLLMEngine
    from areal.utils.data import concat_padded_tensors
    from areal.workflow.rlvr import RLVRWorkflow

    config = InferenceEngineConfig(backend="vllm:d1", max_concurrent_rollouts=4, consumer_batch_size=2,
                                   max_head_offpolicyness=10 ** 9, setup_timeout=60, request_timeout=120,
                                   request_retries=1)
    remote = RemotevLLMEngine(config)
    remote.initialize(addr=server.removeprefix("http://"))
    tok = policy.tokenizer
    data = [{"messages": [{"role": "user", "content": "Say hello."}]},
            {"messages": [{"role": "user", "content": "Name a color."}]}]
    try:
        for greedy in (True, False):
            gconfig = GenerationHyperparameters(max_new_tokens=8, greedy=greedy, temperature=1.0)
            workflow = RLVRWorkflow(reward_fn=areal_reward, gconfig=gconfig, tokenizer=tok)
            trajectories = remote.rollout_batch(data, workflow=workflow, group_size=2)
            batch = concat_padded_tensors(trajectories)
            assert batch["input_ids"].shape[0] == 4
            for i in range(4):
                mask = batch["attention_mask"][i].bool()
                ids = batch["input_ids"][i][mask].tolist()
                loss = batch["loss_mask"][i][mask].bool()
                n_out = int(loss.sum())
                prompt, out = ids[: len(ids) - n_out], ids[len(ids) - n_out:]
                lps = batch["logprobs"][i][mask][loss].tolist()
                assert batch["rewards"][i].item() == n_out
                if greedy:  # the in-process engine gives the same tokens and logprobs
                    (w,) = _one(engine, input_ids=prompt, sampling=dict(max_new_tokens=8, temperature=0))
                    assert out == w.output_ids
                    assert lps == pytest.approx(w.output_logprobs, abs=LP_TOL)
                else:  # sampled: logprobs equal a teacher-forced forward of the same policy (T = 1)
                    ref = hf_logprobs(policy.model, prompt + out, n_out)
                    assert lps == pytest.approx(ref[torch.arange(n_out), out].tolist(), abs=LP_TOL)
    finally:
        remote.destroy()


def test_areal_vlm_chat_payload_parses(server, engine):
    """AReaL's VLM path: VLLMBackend builds /v1/chat/completions with image data, parses 'token_id:N'."""
    pytest.importorskip("areal")
    from areal.api import ModelRequest
    from areal.api.cli_args import GenerationHyperparameters
    from areal.engine.vllm_remote import VLLMBackend

    b64 = png_data_url(seeded_image(3, IMAGE_SIZE)).split(",", 1)[1]
    messages = [{"role": "user", "content": [{"type": "image_url"}, {"type": "text", "text": "What is it?"}]}]
    req = ModelRequest(input_ids=[1], image_data=[b64], vision_msg_vllm=[messages],
                       gconfig=GenerationHyperparameters(max_new_tokens=6, greedy=True))
    backend = VLLMBackend()
    http_req = backend.build_generation_request(req, with_lora=False, version=0)
    assert http_req.endpoint == "/v1/chat/completions"
    r = httpx.post(server + http_req.endpoint, json=http_req.payload, timeout=60)
    assert r.status_code == 200, r.text
    result = backend.parse_generation_response(r.json())
    image_url = {"url": png_data_url(seeded_image(3, IMAGE_SIZE))}
    want_msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": image_url},
                                              {"type": "text", "text": "What is it?"}]}]
    (w,) = _one(engine, messages=want_msgs, sampling=dict(max_new_tokens=6, temperature=0))
    assert result.output_tokens == w.output_ids
    assert result.output_logprobs == pytest.approx(w.output_logprobs, abs=LP_TOL)
