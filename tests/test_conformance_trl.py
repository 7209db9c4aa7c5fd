"""TRL 1.16's own clients and trainers against the real ``unsloth-rollout serve`` (one subprocess for the module).

Each test names the TRL behaviour it reproduces (TRL's tests of ``VLLMClient`` in tests/test_vllm_client_server.py
and of async GRPO in tests/experimental/test_async_grpo_trainer.py / test_async_vllm_client.py), rewritten to run on
a tiny random model on CPU: shapes, counts and consistency only. TRL's clients import-guard on vLLM being
installed and its async trainer on CUDA; where a test lifts such a guard it says which (nothing on the server's
side of the wire is replaced). Oracle for logprobs: a teacher-forced forward of the same weights.
"""

import pytest

pytest.importorskip("trl")
pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
pytestmark = pytest.mark.trl

import torch  # noqa: E402

from unsloth_rollout.testing.oracles import teacher_forced  # noqa: E402
from unsloth_rollout.testing.fixtures import policy_fixture, server_fixture  # noqa: E402
from unsloth_rollout.testing.server import completion_length_reward  # noqa: E402

TOL = 1e-5


server = server_fixture("--max-model-len", "256", "--kv-cache-memory-bytes", "32MiB", "--max-loras", "4",
                        "--max-lora-rank", "64", "--enable-runtime-lora", model="qwen2_dir")


policy = policy_fixture(model="qwen2_dir")


@pytest.fixture(scope="module")
def vllm_client(server, monkeypatch_module):
    """TRL's ``VLLMClient`` (trl/generation/vllm_client.py). Its constructor refuses unless vLLM is installed; its
    HTTP methods never use vLLM, so that one import guard is lifted."""
    import trl.generation.vllm_client as mod

    monkeypatch_module.setattr(mod, "is_vllm_available", lambda: True)
    return mod.VLLMClient(base_url=server, connection_timeout=30)


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def test_server_info_has_what_trl_reads(server):
    """TRL's ``get_server_info`` users: ``select_adapter_sync`` (lora_config.max_lora_rank / max_loras,
    parallel_config.data_parallel_size), ``GRPOTrainer`` (model_config.logprobs_mode), ``init_communicator``
    (weight_transfer_config), ``get_dtype`` (model_config.dtype) and ``get_max_model_len`` (/v1/models)."""
    info = httpx.get(server + "/server_info", params={"config_format": "json"}).json()["vllm_config"]
    assert info["lora_config"]["max_lora_rank"] == 64 and info["lora_config"]["max_loras"] == 4
    assert info["parallel_config"]["data_parallel_size"] == 1
    assert info["model_config"]["logprobs_mode"] == "raw_logprobs"
    assert info["model_config"]["dtype"] == "torch.float32"
    assert "weight_transfer_config" in info and info["weight_transfer_config"] is None
    assert httpx.get(server + "/v1/models").json()["data"][0]["max_model_len"] == 256


def test_select_adapter_sync_takes_the_adapter_path(server, qwen2_dir, tmp_path):
    """TRL's async GRPO ``select_adapter_sync`` on the dict the server returns: a PEFT model of rank 8 within
    max_lora_rank and max_staleness + 2 <= max_loras syncs adapters (True); a rank above max_lora_rank raises,
    as TRL's own unit tests of that function expect."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    from trl.experimental.async_grpo import AsyncGRPOConfig
    from trl.experimental.async_grpo.async_grpo_trainer import select_adapter_sync
    from trl.experimental.async_grpo.vllm_client import VLLMClient as AsyncClient

    info = AsyncClient(server).get_server_info()
    base = AutoModelForCausalLM.from_pretrained(qwen2_dir)
    args = AsyncGRPOConfig(output_dir=str(tmp_path), max_staleness=1, report_to="none", use_cpu=True, bf16=False)
    small = get_peft_model(base, LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
    assert select_adapter_sync(info, small, args) is True
    big = get_peft_model(AutoModelForCausalLM.from_pretrained(qwen2_dir),
                         LoraConfig(r=128, target_modules=["q_proj", "v_proj"]))
    with pytest.raises(ValueError, match="max-lora-rank"):
        select_adapter_sync(info, big, args)


def test_grpo_server_mode_full_weight_sync_is_refused_at_start_by_name(vllm_client):
    """``GRPOTrainer(use_vllm=True, vllm_mode="server")`` calls ``VLLMClient.init_communicator`` at start: on a
    server started without ``--weight-transfer-config`` (``weight_transfer_config`` null, as vLLM without it) TRL
    raises its own named error before any rendezvous, and the routes it would call answer 501 naming the switch and
    the alternatives. (With the switch, tests/test_conformance_trl_weight_sync.py trains through it.)"""
    with pytest.raises(RuntimeError, match="no weight-transfer engine"):
        vllm_client.init_communicator(device="cpu")
    r = httpx.post(vllm_client.base_url + "/init_weight_transfer_engine", json={"init_info": {}})
    message = r.json()["error"]["message"]
    assert r.status_code == 501 and "load_lora_adapter" in message and "--weight-transfer-config" in message


def test_vllm_client_generate_token_ids_and_logprobs(vllm_client, policy):
    """TRL's ``VLLMClient.generate`` (test_vllm_client_server.py: generate with n and logprobs): prompt_ids echo
    the prompts, n completions per prompt, one logprob per token equal to the teacher-forced forward."""
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    out = vllm_client.generate(prompts, n=2, max_tokens=6, temperature=1.0, logprobs=0,
                               generation_kwargs={"seed": 1})
    assert out["prompt_ids"] == prompts
    assert len(out["completion_ids"]) == 4
    for k, (ids, lps) in enumerate(zip(out["completion_ids"], out["logprobs"])):
        assert 1 <= len(ids) <= 6 and len(lps) == len(ids)
        want, _ = teacher_forced(policy, prompts[k // 2], ids)
        got = torch.tensor([row[0] for row in lps])
        assert (got - want).abs().max() <= TOL


def test_vllm_client_sequence_logprobs_match_teacher_forcing(vllm_client, policy):
    """TRL's ``VLLMClient.get_sequence_logprobs`` (the distillation teacher call: /v1/completions with
    prompt_logprobs, max_tokens=1): per completion token the actual token's logprob and the top-k, sorted by
    rank, equal the teacher-forced log-softmax at T = 1 (vLLM's prompt logprobs take no temperature)."""
    seqs, plens, k = [[3, 4, 5, 6, 7, 8, 9], [20, 21, 22, 23, 24]], [3, 2], 4
    out = vllm_client.get_sequence_logprobs(seqs, plens, top_logprobs=k)
    for seq, n, actual, top, top_ids in zip(seqs, plens, out["actual_logprobs"], out["logprobs"],
                                            out["logprob_token_ids"]):
        want, logits = teacher_forced(policy, seq[:n], seq[n:])
        assert (torch.tensor([a[0] for a in actual]) - want).abs().max() <= TOL
        rows = torch.log_softmax(logits, dim=-1)
        for j in range(len(seq) - n):
            ref = rows[j].topk(k)
            assert top_ids[j] == ref.indices.tolist()
            assert max(abs(a - b) for a, b in zip(top[j], ref.values.tolist())) <= TOL


@pytest.mark.timeout(600)
def test_async_grpo_trainer_with_peft_trains_against_the_server(server, qwen2_dir, tmp_path):
    """TRL's ``AsyncGRPOTrainer`` with a PEFT model (test_async_grpo_trainer.py's training test, on this
    server): it probes /server_info, chooses adapter sync, trains 3 steps with rollouts from the server's
    /v1/completions, and publishes each policy as ``trl-policy-vN`` through /pause, /v1/load_lora_adapter,
    /resume. The first step's samples come from the adapter of the trainer's starting weights, so TRL's importance
    ratio exp(trainer logprob - server logprob) is 1 within 1e-5 (fp32); after training, the server scores a
    sequence under the last published adapter exactly as the trainer's model does (the weights followed).
    CPU guards lifted: ``unsloth_rollout.testing.trl_cpu`` (vLLM install check, CUDA MFU probe, FA3 kernel)."""
    from peft import LoraConfig
    from transformers import AutoTokenizer
    from trl.chat_template_utils import qwen3_chat_template
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer
    from datasets import Dataset

    from unsloth_rollout.testing.trl_cpu import allow_async_grpo_on_cpu

    tok = AutoTokenizer.from_pretrained(qwen2_dir)
    tok.chat_template = qwen3_chat_template  # a template TRL's response parser knows
    ds = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"count to {i}"}] for i in range(12)]})
    args = AsyncGRPOConfig(output_dir=str(tmp_path), vllm_server_base_url=server, num_generations=2,
                           max_completion_length=8, per_device_train_batch_size=2, max_steps=3, logging_steps=1,
                           report_to="none", weight_sync_steps=1, max_staleness=1, use_cpu=True, bf16=False,
                           dtype="float32", vllm_server_timeout=30, save_strategy="no", learning_rate=1e-3)
    restore = allow_async_grpo_on_cpu()
    try:
        trainer = AsyncGRPOTrainer(model=qwen2_dir, processing_class=tok, reward_funcs=completion_length_reward,
                                   args=args, train_dataset=ds,
                                   peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
        assert trainer._lora_sync is True  # the adapter path, chosen from /server_info
        trainer.train()
    finally:
        restore()
    logs = [h for h in trainer.state.log_history if "ratio" in h]
    assert len(logs) == 3
    assert float(logs[0]["sample/staleness_max"]) == 0 and abs(float(logs[0]["ratio"]) - 1) <= TOL, logs[0]
    latest = f"trl-policy-v{trainer.model_version}"
    assert trainer.model_version >= 3 and latest in [m["id"] for m in httpx.get(server + "/v1/models").json()["data"]]
    seq = [7, 8, 9, 10, 11, 12]
    body = httpx.post(server + "/v1/completions", json={"model": latest, "prompt": seq, "max_tokens": 0,
                                                       "prompt_logprobs": 0}, timeout=60).json()
    got = torch.tensor([next(iter(d.values()))["logprob"] for d in body["choices"][0]["prompt_logprobs"][1:]])
    model = trainer.model.eval()
    model.set_attn_implementation("sdpa")  # the trainer packs with its tree attention; the oracle is one plain row
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([seq])).logits[0, :-1].float()
    want = torch.log_softmax(logits, -1).gather(1, torch.tensor(seq[1:]).unsqueeze(1)).squeeze(1)
    assert (got - want).abs().max() <= TOL
