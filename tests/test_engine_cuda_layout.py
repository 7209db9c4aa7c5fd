"""What the engine does differently on CUDA, reproduced on CPU (an H200 run found both of these broken).

- CUDA's fp32 SDPA kernels return the grouped-query decode attention strided by heads, not contiguous: the
  engine's attention must not assume a layout (it raised "view size is not compatible" at the first decode on
  every fp32 and NF4 model). Reproduced by an SDPA that returns the same values in that layout.
- On CUDA the captured step pads the batch to a bucket and the key length to a multiple of 16 (the memory-
  efficient kernel's mask alignment, a branch dynamo guards on: unpadded lengths recompiled twice per run). The
  same padding forced on CPU, over SDPA instead of the CPU kernel: greedy tokens equal HF ``generate()``,
  logprobs equal a teacher-forced forward, and nothing recompiles after warm-up.
"""

from __future__ import annotations

import pytest
import torch

from unsloth_rollout import EngineConfig, GenerationRequest, RolloutEngine, SamplingParams, load_model
from unsloth_rollout.engine import attention, decode_static
from unsloth_rollout.testing.oracles import perturb_lora, teacher_forced


def _policy(path):
    torch.manual_seed(0)
    policy = load_model(path, backend="transformers", lora={"r": 8, "random_state": 0})
    perturb_lora(policy.model, std=0.3, seed=0)
    return policy


def _greedy(policy, engine, ids, n):
    """HF generate's greedy tokens; a VLM's vision tokens are never sampled by the engine, nor here."""
    out = policy.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                max_new_tokens=n, do_sample=False,
                                suppress_tokens=engine.core.sampler.suppress_ids or None)
    return out[0, len(ids):].tolist()


def _prompts(policy, n, first="alice"):
    words = [first, "bob", "counts", "apples", "and", "pears"]
    return [policy.tokenizer.encode(" ".join(words[(i + j) % 6] for j in range(3 + 7 * i))) for i in range(n)]


def _check(policy, engine, prompts, max_new):
    reqs = [GenerationRequest(input_ids=p, sampling=SamplingParams(max_new_tokens=max_new - i % 4, temperature=0.0))
            for i, p in enumerate(prompts)]
    for r, o in zip(reqs, engine.generate(reqs)):
        assert o.output_ids == _greedy(policy, engine, r.input_ids, r.sampling.max_new_tokens), r.input_ids[:4]
        lp, _ = teacher_forced(policy, o.prompt_ids, o.output_ids, 1.0)
        assert (torch.tensor(o.output_logprobs) - lp).abs().max() <= 1e-5


def test_decode_attention_takes_sdpa_output_in_any_layout(qwen2_dir, monkeypatch):
    policy = _policy(qwen2_dir)
    assert policy.config.num_key_value_heads < policy.config.num_attention_heads  # the grouped-query path
    real = torch.nn.functional.scaled_dot_product_attention
    strided = []

    def cuda_like(q, k, v, *args, **kwargs):
        out = real(q, k, v, *args, **kwargs)
        if q.dim() == 4 and q.shape[2] > 1 and k.shape[1] == q.shape[1]:
            strided.append(1)
            return out.transpose(1, 2).contiguous().transpose(1, 2)  # same values, heads-major strides
        return out

    monkeypatch.setattr(attention.torch.nn.functional, "scaled_dot_product_attention", cuda_like)
    engine = RolloutEngine(policy, EngineConfig(kv_cache_memory_bytes=32 << 20, decode_backend="workspace",
                                                cpu_attention_kernel=False))
    try:
        _check(policy, engine, _prompts(policy, 5), 12)
    finally:
        engine.shutdown()
    assert strided, "the grouped-query decode attention never ran"


@pytest.mark.parametrize("arch", ["qwen2", "qwen2_5_vl"])
def test_static_decode_with_cuda_padding_is_exact_and_never_recompiles(model_dirs, arch, monkeypatch):
    init = decode_static.StaticDecode.__init__
    key_lens = []

    def cuda_layout(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.pad_buckets, self.key_align = True, 16

    inputs = decode_static.StaticDecode._inputs

    def spy(self, *args):
        out = inputs(self, *args)
        key_lens.append((out[0].shape[0], out[4].shape[0]))
        return out

    monkeypatch.setattr(decode_static.StaticDecode, "__init__", cuda_layout)
    monkeypatch.setattr(decode_static.StaticDecode, "_inputs", spy)
    policy = _policy(model_dirs[arch])
    engine = RolloutEngine(policy, EngineConfig(kv_cache_memory_bytes=32 << 20, decode_backend="static",
                                                cpu_attention_kernel=False))
    try:
        st = engine.core.runner.static
        assert engine.stats()["decode_backend"] == "static" and st.key_align == 16
        prompts = _prompts(policy, 7)
        prompts[2] = (prompts[2] * 20)[:150]  # a context that crosses several multiples of 16
        _check(policy, engine, prompts[:1], 20)
        _check(policy, engine, prompts, 24)
        assert st.steps >= 40 and st.eager_steps == 0
        assert st.recompiles == 0 and engine.stats()["decode_recompiles"] == 0
    finally:
        engine.shutdown()
    assert key_lens and all(L % 16 == 0 for _, L in key_lens)
    assert {b for b, _ in key_lens} >= {2, 8}  # batches of 1 and 7 padded to their buckets


def test_auto_runs_the_captured_step_on_cuda_only_where_it_was_measured():
    """decode_backend="auto" on CUDA: the captured step for transformers + PEFT in full or half precision (measured
    on an H200, benchmarks/gpu/README.md); the eager workspace for 4-bit weights and Unsloth-loaded models."""
    from types import SimpleNamespace

    from unsloth_rollout.engine.decode_static import auto_decode_backend

    class Linear4bit(torch.nn.Linear):  # what bitsandbytes' quantized layers are called
        pass

    cuda = torch.device("cuda")
    plain = torch.nn.Sequential(torch.nn.Linear(2, 2))
    quantized = torch.nn.Sequential(Linear4bit(2, 2))
    assert auto_decode_backend(cuda, None, SimpleNamespace(backend="transformers", model=plain)) == "static"
    assert auto_decode_backend(cuda, None, SimpleNamespace(backend="transformers", model=quantized)) == "workspace"
    assert auto_decode_backend(cuda, None, SimpleNamespace(backend="unsloth", model=plain)) == "workspace"
    assert auto_decode_backend(cuda, 0, SimpleNamespace(backend="transformers", model=plain)) == "workspace"
    assert auto_decode_backend(torch.device("mps"), None, SimpleNamespace(backend="transformers", model=plain)) \
        == "workspace"
