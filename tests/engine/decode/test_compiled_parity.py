"""The fixed-shape compiled decode step (torch.compile / inductor on CPU) keeps parity with HF generate."""

from __future__ import annotations

import torch

from unsloth_rollout.testing.oracles import teacher_forced_logprobs
from unsloth_rollout.engine.config import DecodeConfig
from unsloth_rollout import EngineConfig, GenerationRequest, RolloutEngine, SamplingParams, load_model

PROMPTS = ["Alice counts", "Bob and Carol went to the market", "12 + 7 =", "the lazy dog sleeps while", "think"]


def test_compiled_decode_matches_hf_generate(qwen2_dir):
    policy = load_model(qwen2_dir, backend="transformers")
    engine = RolloutEngine(policy, EngineConfig(kv_cache_memory_bytes=8 << 20, decode=DecodeConfig(backend="compiled")))
    reqs = [GenerationRequest(input_ids=policy.tokenizer.encode(p),
                              sampling=SamplingParams(max_new_tokens=10, temperature=0)) for p in PROMPTS]
    outs = engine.generate(reqs)  # 5 rows through the compiled step
    sampled = engine.generate([GenerationRequest(input_ids=reqs[1].input_ids, sampling=SamplingParams(
        max_new_tokens=10, temperature=0.8, seed=1))])[0]
    engine.shutdown()
    st = engine.core.runner.decode_steps.compiled
    assert st is not None and st.steps > 0 and st.eager_steps == 0
    for r, o in zip(reqs, outs):
        ref = policy.model.generate(torch.tensor([r.input_ids]), max_new_tokens=10, do_sample=False)
        assert o.output_ids == ref[0, len(r.input_ids):].tolist()
    lp, _ = teacher_forced_logprobs(policy, sampled.prompt_ids, sampled.output_ids, 0.8)
    assert (torch.tensor(sampled.output_logprobs) - lp).abs().max() <= 1e-5
