"""AReaL 1.0.4's teacher scoring (``compute_logp``, on-policy distillation) against this project.

Reproduces AReaL's scoring contract as its ``RemoteInfEngine.compute_logp`` implements it (areal/infra/
remote_inf_engine.py with ``VLLMBackend.build_score_request`` / ``parse_score_response``) and as its trainer
calls it (``rl_trainer.py``: ``teacher.compute_logp(rollout_batch)``): per trajectory a ``[B, T]`` fp32 tensor,
the token's logprob at ``loss_mask`` positions and 0 elsewhere. Two engines: AReaL's own ``RemotevLLMEngine``
against the real server (a subprocess, one per module), and ``UnslothInferenceEngine`` in process, text and VLM.
Oracle: a teacher-forced forward of the same weights (``log_softmax(logits)``, T = 1), within 1e-5 in fp32.
"""

import pytest

pytest.importorskip("areal")
pytest.importorskip("fastapi")
pytestmark = pytest.mark.areal

import torch  # noqa: E402
from areal.api.cli_args import InferenceEngineConfig  # noqa: E402

from unsloth_rollout import EngineConfig, GenerationRequest, RolloutEngine, load_model  # noqa: E402
from unsloth_rollout.areal.inference_engine import UnslothInferenceEngine  # noqa: E402
from unsloth_rollout.testing.oracles import teacher_forced  # noqa: E402
from unsloth_rollout.testing.fixtures import policy_fixture, server_fixture  # noqa: E402
from unsloth_rollout.testing.tiny import tiny_model_path  # noqa: E402

TOL = 1e-5


text_policy = policy_fixture(model="qwen2_dir")


server = server_fixture("--max-model-len", "256", "--kv-cache-memory-bytes", "32MiB", model="qwen2_dir")


def _batch(rows: list[tuple[list[int], int]], pad: int = 0) -> dict:
    """A right-padded AReaL batch: each row is (token ids, how many trailing tokens are the output)."""
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.bool)
    loss = torch.zeros((len(rows), width), dtype=torch.int32)
    for i, (ids, n_out) in enumerate(rows):
        input_ids[i, :len(ids)] = torch.tensor(ids)
        attn[i, :len(ids)] = True
        loss[i, len(ids) - n_out:len(ids)] = 1
    return {"input_ids": input_ids, "attention_mask": attn, "loss_mask": loss}


def _check(policy, batch: dict, got: torch.Tensor, **vision) -> None:
    assert got.shape == batch["loss_mask"].shape and got.dtype == torch.float32
    for i in range(got.shape[0]):
        ids = batch["input_ids"][i][batch["attention_mask"][i].bool()].tolist()
        n_out = int(batch["loss_mask"][i].sum())
        want, _ = teacher_forced(policy, ids[:len(ids) - n_out], ids[len(ids) - n_out:], **vision)
        mask = batch["loss_mask"][i].bool()
        assert (got[i][mask] - want).abs().max() <= TOL
        assert bool((got[i][~mask] == 0).all())


ROWS = [([5, 6, 7, 8, 9, 10], 3), ([11, 12, 13, 14], 2), ([5, 6, 7, 8, 20, 21, 22, 23], 4)]


def test_remote_vllm_engine_compute_logp_against_the_server(server, text_policy):
    """AReaL's ``RemotevLLMEngine.compute_logp`` (RemoteInfEngine: one /v1/completions per row with echo,
    prompt_logprobs=1, max_tokens=1, temperature 0; it reads the last ``target_len`` prompt logprobs and the
    first entry of each, the prompt's own token) against the server: equal to teacher forcing."""
    from areal.engine.vllm_remote import RemotevLLMEngine

    remote = RemotevLLMEngine(InferenceEngineConfig(backend="vllm:d1", setup_timeout=60, request_timeout=120,
                                                    request_retries=1))
    remote.initialize(addr=server.removeprefix("http://"))
    try:
        batch = _batch(ROWS)
        (got,) = remote.compute_logp([batch])
    finally:
        remote.destroy()
    _check(text_policy, batch, got)


def test_in_process_compute_logp_text(text_policy):
    """``UnslothInferenceEngine.compute_logp``: the same contract in process, rows batched as prefill-only
    requests; two trajectories, right padding honoured, a shared prefix served from the prefix cache."""
    rollout = RolloutEngine(text_policy, EngineConfig(kv_cache_memory_bytes=16 << 20, max_model_len=256), seed=0)
    engine = UnslothInferenceEngine(InferenceEngineConfig(backend="unsloth:d1"), rollout_engine=rollout)
    engine.initialize()
    try:
        batches = [_batch(ROWS[:2]), _batch(ROWS[2:])]
        got = engine.compute_logp(batches)
        again = engine.compute_logp([batches[0]])[0]
        assert rollout.stats()["prefix_cache_hits"] >= 2  # the repeated rows were answered from the cache
    finally:
        engine.destroy()
        rollout.shutdown()
    assert len(got) == 2
    for batch, g in zip(batches, got):
        _check(text_policy, batch, g)
    assert torch.equal(again, got[0])


def test_in_process_compute_logp_vlm():
    """``compute_logp`` on a VisionRLVRWorkflow-shaped VLM trajectory: expanded image tokens in ``input_ids`` and
    the processed ``multi_modal_input`` (pixel_values, image_grid_thw), scored with those exact pixels."""
    import numpy as np
    from PIL import Image

    policy = load_model(str(tiny_model_path("qwen2_5_vl", "tiny")), backend="transformers")
    rollout = RolloutEngine(policy, EngineConfig(kv_cache_memory_bytes=16 << 20, max_model_len=512), seed=0)
    engine = UnslothInferenceEngine(InferenceEngineConfig(backend="unsloth:d1"), rollout_engine=rollout)
    engine.initialize()
    try:
        img = Image.fromarray(np.random.default_rng(0).integers(0, 255, (56, 56, 3), dtype=np.uint8))
        prepared = rollout.prepare(GenerationRequest(messages=[{"role": "user", "content": [
            {"type": "image", "image": img}, {"type": "text", "text": "what is it?"}]}]))
        ids = list(prepared.prompt_ids) + [30, 31, 32, 33]
        batch = _batch([(ids, 4)])
        batch["multi_modal_input"] = [{"pixel_values": prepared.pixel_values,
                                       "image_grid_thw": prepared.image_grid_thw}]
        (got,) = engine.compute_logp([batch])
    finally:
        engine.destroy()
        rollout.shutdown()
    _check(policy, batch, got, pixel_values=prepared.pixel_values, image_grid_thw=prepared.image_grid_thw)


def test_areals_model_request_carries_no_structured_outputs():
    """AReaL 1.0.4's ``ModelRequest`` (areal/api/io_struct.py) and its ``GenerationHyperparameters`` hold no
    response_format / JSON schema / regex / grammar field, and ``ArealOpenAI.chat.completions.create`` takes
    ``response_format`` only into ``**kwargs``, where AReaL drops it: no constraint reaches an inference engine, so
    ``UnslothInferenceEngine.agenerate`` has none to honour (the server's response_format is the constrained path).
    If AReaL adds such a field this fails, naming it, so the engine can take it up."""
    import dataclasses
    import inspect

    from areal.api.cli_args import GenerationHyperparameters
    from areal.api.io_struct import ModelRequest
    from areal.experimental.openai.client import AsyncCompletionsWithReward

    words = ("format", "schema", "json", "regex", "grammar", "guided", "structured", "choice")
    for cls in (ModelRequest, GenerationHyperparameters):
        found = [f.name for f in dataclasses.fields(cls) if any(w in f.name for w in words)]
        assert not found, f"{cls.__name__} now carries {found}: pass it to the engine's structured_outputs"
    assert "response_format" not in inspect.signature(AsyncCompletionsWithReward.create).parameters
