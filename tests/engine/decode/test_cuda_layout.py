"""What the engine does differently on CUDA, reproduced on CPU (an H200 run found both of these broken).

- CUDA's fp32 SDPA kernels return the grouped-query decode attention strided by heads, not contiguous: the
  engine's attention must not assume a layout (it raised "view size is not compatible" at the first decode on
  every fp32 and NF4 model). Reproduced by an SDPA that returns the same values in that layout.
- On CUDA the compiled step pads the batch to a bucket and the key length to a multiple of 16 (the memory-
  efficient kernel's mask alignment, a branch dynamo guards on: unpadded lengths recompiled twice per run). The
  same padding forced on CPU, over SDPA instead of the CPU kernel: greedy tokens equal HF ``generate()``,
  logprobs equal a teacher-forced forward, and nothing recompiles after warm-up.
"""

from __future__ import annotations

import pytest
import torch

from unsloth_rollout import EngineConfig, RolloutEngine
from unsloth_rollout.engine.config import DecodeConfig
from unsloth_rollout.engine import attention
from unsloth_rollout.engine.decode import compiled
from unsloth_rollout.testing.decode import check_greedy_and_logprobs, lora_policy, word_prompts


def test_decode_attention_takes_sdpa_output_in_any_layout(qwen2_dir, monkeypatch):
    policy = lora_policy(qwen2_dir)
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
    engine = RolloutEngine(policy, EngineConfig(kv_cache_memory_bytes=32 << 20,
                                                decode=DecodeConfig(backend="workspace", cpu_kernel=False)))
    try:
        check_greedy_and_logprobs(policy, engine, word_prompts(policy, 5), 12)
    finally:
        engine.shutdown()
    assert strided, "the grouped-query decode attention never ran"


@pytest.mark.parametrize("arch", ["qwen2", "qwen2_5_vl"])
def test_compiled_step_with_cuda_padding_is_exact_and_never_recompiles(model_dirs, arch, monkeypatch):
    init = compiled.CompiledStep.__init__
    key_lens = []

    def cuda_layout(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.pad_buckets, self.key_align = True, 16

    inputs = compiled.CompiledStep.prepare

    def spy(self, *args):
        out = inputs(self, *args)
        key_lens.append((out[0].shape[0], out[4].shape[0]))
        return out

    monkeypatch.setattr(compiled.CompiledStep, "__init__", cuda_layout)
    monkeypatch.setattr(compiled.CompiledStep, "prepare", spy)
    policy = lora_policy(model_dirs[arch])
    engine = RolloutEngine(policy, EngineConfig(kv_cache_memory_bytes=32 << 20, decode=DecodeConfig(backend="compiled",
                                                                                                    cpu_kernel=False)))
    try:
        st = engine.core.runner.decode_steps.compiled
        assert engine.stats()["decode_backend"] == "compiled" and st.key_align == 16
        prompts = word_prompts(policy, 7)
        prompts[2] = (prompts[2] * 20)[:150]  # a context that crosses several multiples of 16
        check_greedy_and_logprobs(policy, engine, prompts[:1], 20)
        check_greedy_and_logprobs(policy, engine, prompts, 24)
        assert st.steps >= 40 and st.eager_steps == 0
        assert st.recompiles == 0 and engine.stats()["decode_recompiles"] == 0
    finally:
        engine.shutdown()
    assert key_lens and all(L % 16 == 0 for _, L in key_lens)
    assert {b for b, _ in key_lens} >= {2, 8}  # batches of 1 and 7 padded to their buckets
