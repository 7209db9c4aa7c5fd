"""TRL 1.16's ``GRPOTrainer(use_vllm=True, vllm_mode="server")`` against the real ``unsloth-rollout serve`` started
as TRL's ``trl vllm-serve`` starts vLLM (``--logprobs-mode processed_logprobs --max-logprobs -1``), with
``--weight-transfer-config '{"backend": "gloo"}'``: full weights (PEFT: the merged adapter) follow the trainer, and
the logprobs TRL receives are those of the distribution each token was drawn from.

Reproduces TRL's tests of its vLLM client weight sync (tests/test_vllm_client_server.py: ``init_communicator``,
``update_model_params``, ``update_named_param``, ``reset_prefix_cache``) and of server-mode GRPO training
(tests/test_grpo_trainer.py's ``vllm_mode="server"`` runs), rewritten for a tiny random model on CPU. TRL's trainer
side refuses a non-CUDA device and a machine without vLLM; ``unsloth_rollout.testing.trl_cpu
.allow_grpo_server_mode_on_cpu`` lifts the two install checks and gives TRL's client the gloo end of the wire,
nothing else (the NCCL wire, which TRL's client speaks on CUDA: tests/test_weight_transfer_nccl_wire.py and
benchmarks/gpu/weight_transfer_check.py). Oracles: TRL's own recomputed logprobs
(``sampling/sampling_logp_difference/max``), HF ``generate()`` on the trainer's model, a forward of the trainer's
model for prompt logprobs, and the sampling distribution computed from its definition over that forward's logits
(``testing.oracles.processed_distribution``).
"""

import json
import logging
import os

import pytest

pytest.importorskip("trl")
pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
pytestmark = pytest.mark.trl
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import torch  # noqa: E402

from unsloth_rollout.testing.server import completion_length_reward, free_port, serve_subprocess  # noqa: E402
from unsloth_rollout.testing.tiny import tiny_model_path  # noqa: E402

TOL = 1e-5
SEQ = [7, 8, 9, 10, 11, 12, 13, 14]


@pytest.fixture(scope="module")
def model_dir():
    return str(tiny_model_path("qwen2", "tiny"))


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("trl_sync_server") / "server.log"
    with serve_subprocess(model_dir, "--max-model-len", "256", "--kv-cache-memory-bytes", "32MiB",
                          "--weight-transfer-config", '{"backend": "gloo", "timeout_s": 120}',
                          "--logprobs-mode", "processed_logprobs", "--max-logprobs", "-1", log_path=log) as base:
        yield base


@pytest.fixture(scope="module")
def gloo_trl():
    from unsloth_rollout.testing.trl_cpu import allow_grpo_server_mode_on_cpu

    restore = allow_grpo_server_mode_on_cpu()
    yield
    restore()


@pytest.fixture(scope="module")
def client(server, gloo_trl):
    """TRL's ``VLLMClient`` with its communicator open (gloo), as ``VLLMGeneration`` builds it in server mode."""
    from trl.generation.vllm_client import VLLMClient

    c = VLLMClient(base_url=server, group_port=free_port(), connection_timeout=30)
    c.init_communicator(device="cpu")
    yield c
    c.close_communicator()


def _server_prompt_logprobs(base, seq=SEQ):
    body = httpx.post(base + "/v1/completions", json={"prompt": seq, "max_tokens": 0, "prompt_logprobs": 0},
                      timeout=60).json()
    return torch.tensor([next(iter(d.values()))["logprob"] for d in body["choices"][0]["prompt_logprobs"][1:]])


def _model_logprobs(model, seq=SEQ):
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([seq])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(seq[1:]).unsqueeze(1)).squeeze(1)


def _server_greedy(base, prompt, n=12):
    body = httpx.post(base + "/v1/completions", json={"prompt": prompt, "max_tokens": n, "temperature": 0,
                                                     "return_token_ids": True}, timeout=60).json()
    return body["choices"][0]["token_ids"]


def _hf_greedy(model, prompt, n=12):
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def test_transfer_config_is_vllms_and_nccl_needs_the_model_on_cuda(model_dir):
    """``--weight-transfer-config`` reads vLLM's ``{"backend": ...}`` (default ``"nccl"``, as vLLM); NCCL moves
    weights between CUDA devices, so on a model served from the CPU it stops the server at start naming gloo,
    never accepted and left to hang a trainer."""
    import argparse

    from unsloth_rollout.serve.cli import add_serve_arguments, build_app
    from unsloth_rollout.serve.weight_transfer import parse_weight_transfer_config

    assert parse_weight_transfer_config('{"backend": "gloo"}') == {"backend": "gloo", "timeout_s": 600.0}
    assert parse_weight_transfer_config("{}") == {"backend": "nccl", "timeout_s": 600.0}
    assert parse_weight_transfer_config(None) is None
    with pytest.raises(ValueError, match="unknown key"):
        parse_weight_transfer_config({"backend": "gloo", "packed": True})
    with pytest.raises(ValueError, match="backend must be 'nccl'.*or 'gloo'"):
        parse_weight_transfer_config({"backend": "ipc"})
    parser = add_serve_arguments(argparse.ArgumentParser())
    with pytest.raises(SystemExit, match="weight-transfer-config.*got 'ipc'"):  # before the model loads
        build_app(parser.parse_args(["/nonexistent", "--weight-transfer-config", '{"backend": "ipc"}']))
    args = parser.parse_args([model_dir, "--model-backend", "transformers", "--device", "cpu",
                              "--weight-transfer-config", '{"backend": "nccl"}'])
    with pytest.raises(SystemExit, match="weight-transfer-config.*'nccl'.*on cpu.*gloo"):
        build_app(args)


def test_trl_client_finds_the_transfer_config_then_refuses_cpu_itself(server):
    """TRL's ``init_communicator`` as TRL ships it (only vLLM's ``get_ip`` supplied and the install check lifted,
    vLLM not being installed): it reads ``weight_transfer_config`` from ``/server_info``, finds it (on a server
    without it, the same call stops at "has no weight-transfer engine", tests/test_conformance_trl.py), and goes on
    until TRL's own device check refuses the CPU, before any rendezvous."""
    import trl.generation.vllm_client as mod

    from unsloth_rollout.testing.trl_cpu import vllm_get_ip

    trl_own = mod.VLLMClient.init_communicator
    assert trl_own.__module__ == mod.__name__, "runs before this module's gloo shim replaces init_communicator"
    mp = pytest.MonkeyPatch()
    try:
        mp.setattr(mod, "is_vllm_available", lambda *a, **k: True)
        mp.setattr(mod, "get_ip", vllm_get_ip, raising=False)
        client = mod.VLLMClient(base_url=server, group_port=free_port(), connection_timeout=30)
        assert client.get_server_info()["weight_transfer_config"]["backend"] == "gloo"
        with pytest.raises(NotImplementedError, match="needs a CUDA device, got 'cpu'"):
            trl_own(client, device="cpu")
        assert client.communicator is None
    finally:
        mp.undo()


def test_trl_generate_returns_the_logprobs_of_the_distribution_it_sampled(server, model_dir):
    """TRL's ``VLLMClient.generate`` with every sampling knob TRL passes (``repetition_penalty``, ``temperature``,
    ``top_p``, ``top_k``, ``min_p``; frequency and presence penalties through ``generation_kwargs``) on a server in
    ``processed_logprobs`` mode, which ``/server_info`` reports where ``GRPOTrainer`` reads it: each token's logprob
    is that of the distribution it was drawn from, recomputed from a teacher-forced forward; the raw
    ``log_softmax(logits / T)`` is more than 1e-2 away for these settings (a check that can fail)."""
    import trl.generation.vllm_client as mod
    from transformers import AutoModelForCausalLM

    from unsloth_rollout.testing.oracles import processed_distribution

    info = httpx.get(server + "/server_info").json()["vllm_config"]
    assert info["model_config"]["logprobs_mode"] == "processed_logprobs"
    mp = pytest.MonkeyPatch()
    mp.setattr(mod, "is_vllm_available", lambda *a, **k: True)
    try:
        client = mod.VLLMClient(base_url=server, connection_timeout=30)
        model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        knob_sets = [dict(repetition_penalty=1.05, top_p=0.9, temperature=0.7),
                     dict(repetition_penalty=1.2, top_k=12, min_p=0.02, temperature=1.3,
                          generation_kwargs={"frequency_penalty": 0.4, "presence_penalty": 0.3})]
        for knobs in knob_sets:
            extra = knobs.pop("generation_kwargs", {})
            prompts = [[5, 6, 7, 8, 5, 6], [40, 41, 40, 41]]
            out = client.generate(prompts, n=2, max_tokens=10, logprobs=0, **knobs,
                                  generation_kwargs={"seed": 3, "ignore_eos": True, **extra})
            raw_gap = 0.0
            for k, (ids, lps) in enumerate(zip(out["completion_ids"], out["logprobs"])):
                prompt = prompts[k // 2]
                with torch.no_grad():
                    logits = model(input_ids=torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1].float()
                for i, tok in enumerate(ids):
                    want = processed_distribution(logits[i], prompt + ids[:i], ids[:i], **knobs, **extra)[tok]
                    assert abs(lps[i][0] - float(want)) <= TOL, (knobs, k, i)
                    raw = torch.log_softmax(logits[i] / knobs["temperature"], -1)[tok]
                    raw_gap = max(raw_gap, abs(float(want) - float(raw)))
            assert raw_gap > 1e-2, (knobs, raw_gap)
        # --max-logprobs -1 (TRL's command line): no cap on prompt_logprobs (TRL's distillation asks 100).
        scored = client.get_sequence_logprobs([[3, 4, 5, 6, 7]], [2], top_logprobs=40)
        assert len(scored["logprobs"][0]) == 3 and len(scored["logprobs"][0][0]) == 40
    finally:
        mp.undo()


def test_init_info_that_cannot_be_served_is_a_400_naming_the_field(server):
    """vLLM answers a bad ``init_weight_transfer_engine`` body with 400 before any rendezvous; so does this server,
    naming the field (this server is one worker: world_size must be rank_offset + 1). vLLM's own init_info, as
    TRL's client sends it on CUDA before opening an NCCL group, lacks ``backend: "gloo"``: refused by name rather
    than joined with the wrong transport."""
    good = {"backend": "gloo", "master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1,
            "world_size": 2}
    vllm_nccl = {k: v for k, v in good.items() if k != "backend"} | {"packed": True}
    for body, param in (({}, "init_info"), ({"init_info": {**good, "world_size": 3}}, "init_info.world_size"),
                        ({"init_info": {**good, "master_port": "x"}}, "init_info.master_port"),
                        ({"init_info": vllm_nccl}, "init_info.backend"),
                        ({"init_info": {**good, "backend": "nccl"}}, "init_info.backend")):
        r = httpx.post(server + "/init_weight_transfer_engine", json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_init_communicator_joins_and_update_named_param_writes_in_place(server, client, model_dir):
    """TRL's ``init_communicator`` + ``update_named_param`` (test_vllm_client_server.py): one tensor broadcast into
    the served model changes what it computes, exactly as the same change does in a local copy; the weight version
    moves on; ``reset_prefix_cache`` answers."""
    from transformers import AutoModelForCausalLM

    info = httpx.get(server + "/server_info").json()["vllm_config"]
    assert info["weight_transfer_config"]["backend"] == "gloo"
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    before = httpx.get(server + "/get_weight_version").json()["weight_version"]
    name = "model.layers.1.mlp.down_proj.weight"
    with torch.no_grad():
        dict(model.named_parameters())[name].mul_(1.5)
    client.update_named_param(name, dict(model.named_parameters())[name].data)
    client.reset_prefix_cache()
    assert httpx.get(server + "/get_weight_version").json()["weight_version"] == before + 1
    assert (_server_prompt_logprobs(server) - _model_logprobs(model)).abs().max() <= TOL
    fresh = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    assert (_server_prompt_logprobs(server) - _model_logprobs(fresh)).abs().max() > 1e-3  # the change is visible
    client.update_model_params(fresh)  # every weight back, in one packed round
    assert (_server_prompt_logprobs(server) - _model_logprobs(fresh)).abs().max() <= TOL


def test_unpacked_layout_and_an_explicit_weight_version(server, client, model_dir):
    """vLLM's unpacked layout (``packed: false`` in update_info: one broadcast per tensor, in its dtype), and
    ``/finish_weight_update`` with ``weight_version``, which later tokens are stamped with."""
    from concurrent.futures import ThreadPoolExecutor

    from transformers import AutoModelForCausalLM

    from unsloth_rollout.models.weight_wire import broadcast_one_by_one_producer

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    params = dict(model.named_parameters())
    names = ["model.layers.0.self_attn.k_proj.bias", "model.norm.weight"]
    with torch.no_grad():
        for n in names:
            params[n].add_(0.25)
    info = {"names": names, "dtype_names": ["float32"] * 2, "shapes": [list(params[n].shape) for n in names],
            "packed": False}
    assert httpx.post(server + "/start_weight_update", json={}).status_code == 200
    with ThreadPoolExecutor(1) as ex:
        fut = ex.submit(httpx.post, server + "/update_weights", json={"update_info": info}, timeout=60)
        broadcast_one_by_one_producer(((n, params[n].data) for n in names), client.communicator, 0)
        assert fut.result().status_code == 200
    r = httpx.post(server + "/finish_weight_update", json={"weight_version": 41})
    assert r.status_code == 200 and r.json()["weight_version"] == 41
    assert httpx.get(server + "/get_weight_version").json()["weight_version"] == 41
    assert (_server_prompt_logprobs(server) - _model_logprobs(model)).abs().max() <= TOL
    client.update_model_params(AutoModelForCausalLM.from_pretrained(model_dir))  # back to the checkpoint


def test_a_request_in_flight_continues_on_the_new_weights(server, client, model_dir):
    """A stream running while the weights change is held, not aborted, and every token it returns is scored by the
    weights that sampled it: its logprobs equal the old weights' teacher forcing up to some token and the new
    weights' after it (no token is scored by a mix, no KV from the old weights is reused)."""
    from transformers import AutoModelForCausalLM

    old = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    new = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        # A change far above 1e-5 in the logprobs that leaves the logits' scale (and so fp32 noise) as it was.
        dict(new.named_parameters())["model.layers.1.mlp.down_proj.weight"].mul_(-1.0)
    prompt, n_tokens = [5, 6, 7, 8], 200
    body = {"prompt": prompt, "max_tokens": n_tokens, "ignore_eos": True, "stream": True, "temperature": 0,
            "logprobs": 0, "return_token_ids": True}
    ids, lps = [], []
    with httpx.stream("POST", server + "/v1/completions", json=body, timeout=120) as r:
        lines = (line for line in r.iter_lines() if line.startswith("data: {"))
        for i, line in enumerate(lines):
            ch = json.loads(line[6:])["choices"][0]
            ids += ch["token_ids"]
            lps += ch["logprobs"]["token_logprobs"]
            if i == 0:  # hold the stream (so the change lands mid-stream however loaded the machine), then swap
                httpx.post(server + "/pause", params={"mode": "keep"})
                client.update_model_params(new)
                httpx.post(server + "/resume")
    assert len(ids) == n_tokens

    def scored(model):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1]
        return torch.log_softmax(logits, -1).gather(1, torch.tensor(ids).unsqueeze(1)).squeeze(1)

    got, by_old, by_new = torch.tensor(lps), scored(old), scored(new)
    k = next((i for i in range(n_tokens) if abs(got[i] - by_old[i]) > TOL), n_tokens)
    assert 0 < k < n_tokens, k  # the switch happened mid-stream
    before, after = (got[:k] - by_old[:k]).abs().max(), (got[k:] - by_new[k:]).abs().max()
    assert before <= TOL and after <= TOL, (k, before, after)
    client.update_model_params(old)


@pytest.mark.parametrize("case", ["shape", "dtype", "name"])
def test_a_tensor_that_does_not_fit_is_received_refused_by_name_and_nothing_changes(server, client, case):
    """vLLM's ``load_weights`` raises on a tensor that does not fit; here it is a 400 naming the tensor, after the
    broadcast is received (TRL's client is not left hanging), with no weight written and the server serving."""
    before = _server_prompt_logprobs(server)
    version = httpx.get(server + "/get_weight_version").json()["weight_version"]
    name, t = "model.layers.0.self_attn.q_proj.weight", torch.zeros(64, 64)
    if case == "shape":
        t = torch.zeros(64, 65)
    elif case == "dtype":
        t = t.to(torch.bfloat16)
    else:
        name = "model.layers.9.self_attn.q_proj.weight"
    with pytest.raises(Exception, match="400") as err:
        client.update_named_params([(name, str(t.dtype).removeprefix("torch."), list(t.shape)),
                                    ("lm_head.weight", "float32", [768, 64])],
                                   iter([(name, t), ("lm_head.weight", torch.zeros(768, 64))]))
    assert {"shape": "shape [64, 65]", "dtype": "dtype bfloat16", "name": "not a weight"}[case] in str(err.value)
    assert name in str(err.value)
    assert torch.equal(_server_prompt_logprobs(server), before)  # lm_head, which did fit, was not written either
    assert httpx.get(server + "/get_weight_version").json()["weight_version"] == version
    assert httpx.get(server + "/is_paused").json()["is_paused"] is False


def _grpo(model_dir, server, tmp_path, lr, **extra):
    from datasets import Dataset
    from trl import GRPOTrainer

    from unsloth_rollout.trl.toy import grpo_config

    ds = Dataset.from_dict({"prompt": [f"count to {i}:" for i in range(12)]})
    # a float32 trainer, as the server: TRL's recompute must equal the server's logprobs within 1e-5
    args = grpo_config(str(tmp_path), 3, lr=lr, num_generations=2, prompts_per_step=2, max_completion_length=8,
                       use_vllm=True, vllm_mode="server", vllm_server_base_url=server, vllm_group_port=free_port(),
                       vllm_server_timeout=30, bf16=False)
    trainer = GRPOTrainer(model=model_dir, reward_funcs=completion_length_reward, args=args, train_dataset=ds,
                          **extra)
    trainer.train()
    return trainer


def _check_followed(trainer, server, model_dir, start_version):
    """Every step's samples came from the weights TRL recomputes with (1e-5: at these settings, T = 1 and no
    filter, the sampling distribution is the softmax TRL recomputes); after TRL's sync of the last optimizer step
    (the one its next generation would do) the server computes what the trainer's model computes (greedy tokens,
    prompt logprobs), and that model moved."""
    from transformers import AutoModelForCausalLM

    diffs = [h["sampling/sampling_logp_difference/max"] for h in trainer.state.log_history
             if "sampling/sampling_logp_difference/max" in h]
    assert len(diffs) == 3 and max(diffs) <= TOL, diffs
    assert httpx.get(server + "/get_weight_version").json()["weight_version"] == start_version + 3  # one per sync
    trainer.vllm_generation.sync_weights()  # the third step's update, which no generation has fetched yet
    model = trainer.model.eval()
    start = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    assert (_model_logprobs(model) - _model_logprobs(start)).abs().max() > 1e-3  # stale weights would fail below
    assert (_server_prompt_logprobs(server) - _model_logprobs(model)).abs().max() <= TOL
    for prompt in ([5, 6, 7, 8], [40, 41, 42]):
        assert _server_greedy(server, prompt) == _hf_greedy(model, prompt)


@pytest.mark.timeout(600)
def test_grpo_server_mode_full_fine_tune_weights_follow_the_trainer(server, gloo_trl, model_dir, tmp_path, caplog):
    """GRPOTrainer(vllm_mode="server") on the full model: 3 steps, each after TRL's sync (update_named_params of
    every parameter, packed, then reset_prefix_cache). TRL reads the server's logprobs mode at start and does not
    warn that it biases the importance-sampling correction."""
    version = httpx.get(server + "/get_weight_version").json()["weight_version"]
    with caplog.at_level(logging.WARNING):
        trainer = _grpo(model_dir, server, tmp_path, lr=1e-3)
    assert not [r.getMessage() for r in caplog.records if "logprobs-mode" in r.getMessage()]
    _check_followed(trainer, server, model_dir, version)


@pytest.mark.timeout(600)
def test_grpo_server_mode_peft_sends_merged_weights_that_follow_the_trainer(server, gloo_trl, model_dir, tmp_path):
    """With a PEFT model TRL merges the adapter, sends the merged base weights under their plain names (LoRA
    tensors skipped), and unmerges: the server, which holds no adapter, computes the trainer's PEFT model."""
    from peft import LoraConfig

    version = httpx.get(server + "/get_weight_version").json()["weight_version"]
    trainer = _grpo(model_dir, server, tmp_path, lr=3e-2,
                    peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    assert any("lora_B" in n for n, _ in trainer.model.named_parameters())
    _check_followed(trainer, server, model_dir, version)
