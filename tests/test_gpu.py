"""The engine on a CUDA device, against the same oracles as on CPU.

Skipped without CUDA (CPU CI skips every test here). Run on a GPU machine with
``pytest -q tests/test_gpu.py`` (``bash benchmarks/gpu/device_check.sh probe`` does).

Tolerances, and why:
- fp32: greedy tokens equal HF ``generate()`` token for token, and logprobs equal a teacher-forced forward
  within ``FP32_TOL`` = 1e-4. The CPU contract is 1e-5; CUDA kernels reduce in a different order for a
  batch of one than for a batch of many (SDPA picks its kernel by shape), and TF32 is switched off here
  so that the only difference is reduction order.
- bf16: tokens are not compared (a near-tie flips with rounding); instead every engine token's logprob is
  compared with the trainer's teacher-forced bf16 forward within ``BF16_TOL`` = 0.1 (max) and
  ``BF16_MEAN_TOL`` = 0.02 (mean), and greedy tokens must be within ``BF16_TOL`` of the forward's best
  logprob at their position. bf16 keeps 8 bits of mantissa, so a logit of magnitude ~8 moves by ~0.03 with
  each rounding, and the batched and single-sequence paths round differently. The same comparison against
  a model with a different adapter must fail by far more than the tolerance (checked: the tolerance is not
  so loose that it accepts any model).
- 4-bit (bitsandbytes NF4, fp32 compute): logprobs within ``NF4_TOL`` = 1e-3 of a teacher-forced forward
  of the same quantized model: dequantization is deterministic, but bitsandbytes takes a different kernel
  (gemv) for one-token decode rows than for the multi-token forward.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from unsloth_rollout.testing.oracles import perturb_lora, teacher_forced_logprobs
from unsloth_rollout.engine.config import DecodeConfig
from test_engine_parity import hf_greedy, make_requests
from unsloth_rollout import EngineConfig, RolloutEngine, SamplingParams, load_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA device (CPU CI skips these; run pytest tests/test_gpu.py on a GPU)"),
]

FP32_TOL = 1e-4
BF16_TOL = 0.1
BF16_MEAN_TOL = 0.02
NF4_TOL = 1e-3
MAX_NEW = 12


@pytest.fixture(autouse=True)
def _no_tf32():
    """Plain fp32 arithmetic in matmuls and convolutions (the vision patch embedding is a Conv3d)."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def load(path, dtype, device="cuda", load_in_4bit=False, lora_seed=0, std=0.2):
    torch.manual_seed(lora_seed)
    policy = load_model(path, backend="transformers", dtype=dtype, device=device, load_in_4bit=load_in_4bit,
                        lora={"r": 8})
    assert perturb_lora(policy.model, std=std, seed=lora_seed) > 0
    assert policy.device.type == torch.device(device).type
    return policy


def run_engine(policy, reqs, decode_backend="auto"):
    engine = RolloutEngine(policy, EngineConfig(kv_cache_memory_bytes=64 << 20,
                                                decode=DecodeConfig(backend=decode_backend)), seed=0)
    try:
        engine.pause()  # admit everything in one step: the batch composition is fixed, not timing-dependent
        futs = [engine.submit(r) for r in reqs]
        engine.resume()
        return engine, [f.result(timeout=300)[0] for f in futs]
    finally:
        engine.shutdown()


def forward_logprobs(policy, engine, req, out):
    """The trainer's view: (logprobs of the output tokens, raw logits) from one teacher-forced forward."""
    prompt = engine.prepare(req)
    return teacher_forced_logprobs(policy, out.prompt_ids, out.output_ids, 1.0, prompt.pixel_values,
                                   prompt.image_grid_thw)


def check_fp32_parity(path, device="cuda", decode_backend="auto"):
    policy = load(path, torch.float32, device)
    reqs = make_requests(policy, 6, MAX_NEW)
    engine, outs = run_engine(policy, reqs, decode_backend)
    st = engine.stats()
    assert st["decode_backend"] == ("compiled" if decode_backend == "auto" else decode_backend)
    if decode_backend == "graph":
        assert st["decode_graphs_disabled"] is None and st["decode_graph_replays"] > 0, st
    worst = 0.0
    for req, out in zip(reqs, outs):
        assert out.output_ids == hf_greedy(policy, engine, req, MAX_NEW)[1], f"request {req.request_id}"
        ref, _ = forward_logprobs(policy, engine, req, out)
        worst = max(worst, (torch.tensor(out.output_logprobs) - ref).abs().max().item())
    assert worst <= FP32_TOL, f"fp32 logprobs differ from the teacher-forced forward by {worst:.2e}"
    return worst


def check_bf16_tolerance(path, device="cuda", decode_backend="auto", policy=None):
    policy = policy if policy is not None else load(path, torch.bfloat16, device)
    reqs = make_requests(policy, 6, MAX_NEW)
    for r in reqs[3:]:  # half greedy, half sampled
        r.sampling = SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, seed=7)
    engine, outs = run_engine(policy, reqs, decode_backend)
    diffs, refs = [], []
    for req, out in zip(reqs, outs):
        ref, logits = forward_logprobs(policy, engine, req, out)
        refs.append(ref)
        got = torch.tensor(out.output_logprobs)
        assert torch.isfinite(got).all()
        diffs.append((got - ref).abs())
        if req.sampling.greedy:
            lp = torch.log_softmax(logits, dim=-1)
            lp[:, list(engine.core.sampler.suppress_ids or [])] = float("-inf")  # never sampled (vision tokens)
            best = lp.max(dim=-1).values
            assert ((best - ref) <= BF16_TOL).all(), f"greedy token not within {BF16_TOL} of the best logprob"
    d = torch.cat(diffs)
    assert d.max().item() <= BF16_TOL and d.mean().item() <= BF16_MEAN_TOL, (
        f"bf16 logprob drift max {d.max().item():.3f} mean {d.mean().item():.4f}")
    # Discrimination: the same outputs scored by a model with another adapter differ far beyond the tolerance.
    perturb_lora(policy.model, std=0.2, seed=1)
    other = torch.cat([(forward_logprobs(policy, engine, req, out)[0] - ref).abs()
                       for req, out, ref in zip(reqs, outs, refs)])
    assert other.mean().item() > 5 * BF16_MEAN_TOL, "the bf16 tolerance would accept a different model"
    return d.max().item(), d.mean().item()


def check_nf4(path, device="cuda"):
    policy = load(path, torch.float32, device, load_in_4bit=True)
    assert any("4bit" in type(m).__name__ for m in policy.model.modules()), "no 4-bit layers were loaded"
    reqs = make_requests(policy, 4, MAX_NEW)
    engine, outs = run_engine(policy, reqs)
    worst = 0.0
    for req, out in zip(reqs, outs):
        ref, _ = forward_logprobs(policy, engine, req, out)
        worst = max(worst, (torch.tensor(out.output_logprobs) - ref).abs().max().item())
    assert worst <= NF4_TOL, f"4-bit logprobs differ from the teacher-forced forward by {worst:.2e}"
    return worst


# "auto" is the compiled step on CUDA for these (transformers + PEFT, fp32 / bf16); "workspace" the eager one;
# "graph": the compiled step replayed as CUDA graphs (decode/graph.py, off by default); "paged": attention read from
# the pool in place by the Triton kernel (decode/paged.py, configured only).
@pytest.mark.parametrize("decode_backend", ["auto", "workspace", "graph", "paged"])
@pytest.mark.parametrize("arch", ["qwen2", "qwen2_5_vl"])
def test_fp32_greedy_and_logprob_parity_on_gpu(model_dirs, arch, decode_backend):
    check_fp32_parity(model_dirs[arch], decode_backend=decode_backend)


@pytest.mark.parametrize("decode_backend", ["auto", "workspace", "graph", "paged"])
@pytest.mark.parametrize("arch", ["qwen2", "qwen2_5_vl"])
def test_bf16_logprobs_within_tolerance_on_gpu(model_dirs, arch, decode_backend):
    check_bf16_tolerance(model_dirs[arch], decode_backend=decode_backend)


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="needs bitsandbytes (4-bit weights)")
@pytest.mark.parametrize("arch", ["qwen2", "qwen2_5_vl"])
def test_nf4_logprob_parity_on_gpu(model_dirs, arch):
    check_nf4(model_dirs[arch])
