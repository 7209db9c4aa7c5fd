"""The engine's forwards run in the model's own dtype whatever mixed precision the trainer beside it set up.

Two ways a trainer turns autocast on reach the engine: a ``torch.autocast`` context on the thread that calls
``generate`` (which steps on that thread), and accelerate's ``prepare_model`` wrapper of the model's ``forward``
(HF ``Trainer`` / TRL with ``bf16=True``, ``GRPOConfig``'s default), which enters autocast on whichever thread
calls the model, the engine's worker thread included. The engine here is even built under both (its probe and
the compiled decode step's warm-up run then).

Oracles: HF ``generate()`` (greedy) and a teacher-forced float32 forward (``teacher_forced``: autocast off, the
model class's own forward) for the outputs made with no autocast anywhere; the same requests under autocast must
give the same tokens and logprobs. Afterwards the caller's autocast state and the trainer's wrapper are as they
were, and the wrapper still computes in bf16 (the trainer keeps its mixed precision).
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import torch

from unsloth_rollout import EngineConfig, GenerationRequest, RolloutEngine, SamplingParams, load_model
from unsloth_rollout.testing.oracles import assert_greedy_matches, perturb_lora, teacher_forced

TOL = 1e-5
MAX_NEW = 8


@pytest.fixture(scope="module")
def policy(qwen2_dir):
    torch.manual_seed(0)
    p = load_model(qwen2_dir, backend="transformers", lora={"r": 8})
    perturb_lora(p.model, std=0.3)
    return p


@pytest.fixture(scope="module")
def bf16_forward(policy):
    """The ``forward`` accelerate gives ``policy.model`` in bf16 mixed precision on CPU (as HF Trainer prepares a
    model under ``bf16=True``); the model keeps its class's forward until a test puts this one on."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    # A trainer run earlier in this process (TRL's tests) leaves accelerate's process-wide state set to its own
    # precision, which accelerate refuses to change; start from a fresh state as a new training process does.
    AcceleratorState._reset_state(reset_partial_state=True)
    Accelerator(cpu=True, mixed_precision="bf16").prepare_model(policy.model)
    wrapper = policy.model.forward
    del policy.model.forward
    yield wrapper
    AcceleratorState._reset_state(reset_partial_state=True)  # as transformers' TrainingArguments does


@contextlib.contextmanager
def prepared(model, forward):
    """``model`` with accelerate's mixed-precision ``forward`` on, as during training."""
    model.forward = forward
    try:
        yield
    finally:
        del model.forward


@pytest.fixture(scope="module")
def engine(policy, bf16_forward):
    """Built (probe, compiled step's warm-up) under a caller's autocast and accelerate's wrapper."""
    with prepared(policy.model, bf16_forward), torch.autocast("cpu", dtype=torch.bfloat16):
        eng = RolloutEngine(policy, EngineConfig(kv_cache_memory_bytes=32 << 20, max_model_len=256), seed=0)
    yield eng
    eng.shutdown()


def requests(policy) -> list[GenerationRequest]:
    """Greedy, seeded sampling (n=2) and scoring (prompt logprobs, nothing generated), prompts of mixed lengths."""
    enc = policy.tokenizer.encode
    prompts = [enc("the quick brown fox"), enc("Alice and Bob count 12 + 7 = 19 apples while the dog sleeps"),
               enc("hello")]
    return ([GenerationRequest(input_ids=p, sampling=SamplingParams(max_new_tokens=MAX_NEW, temperature=0))
             for p in prompts]
            + [GenerationRequest(input_ids=prompts[1], sampling=SamplingParams(max_new_tokens=MAX_NEW, seed=3, n=2)),
               GenerationRequest(input_ids=prompts[1], sampling=SamplingParams(max_new_tokens=0, prompt_logprobs=1))])


def run(engine, reqs, via: str):
    """Every request through ``generate`` or ``submit`` + ``wait_for`` (both step on this thread) or ``agenerate``
    (the worker thread steps), each prompt prefilled again (no prefix-cache hits from an earlier run)."""
    engine.invalidate_prefix_cache()
    if via == "generate":
        return engine.generate(reqs)
    if via == "wait_for":
        futures = [engine.submit(r) for r in reqs]
        engine.wait_for(futures)
        return [o for f in futures for o in f.result()]

    async def all_of():
        outs = await asyncio.gather(*(engine.agenerate(r) for r in reqs))
        return [o for x in outs for o in (x if isinstance(x, list) else [x])]
    return asyncio.run(all_of())


def prompt_scores(out) -> list[float]:
    return [next(iter(d.values())) for d in out.prompt_logprobs[1:]]


@pytest.fixture(scope="module")
def plain(policy, engine):
    """The outputs with no autocast anywhere, held to HF generate() and the teacher-forced float32 forward."""
    reqs = requests(policy)
    outs = run(engine, reqs, "generate")
    for req, out in zip(reqs[:3], outs[:3]):
        ids = torch.tensor([req.input_ids])
        with torch.no_grad():
            ref = policy.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW,
                                        do_sample=False)[0, ids.shape[1]:].tolist()
        assert_greedy_matches(policy, req.input_ids, out.output_ids, ref)
    for out in outs[:5]:
        want, _ = teacher_forced(policy, out.prompt_ids, out.output_ids)
        assert (torch.tensor(out.output_logprobs) - want).abs().max() <= TOL
    scored = outs[5]
    want, _ = teacher_forced(policy, scored.prompt_ids[:1], scored.prompt_ids[1:])
    assert (torch.tensor(prompt_scores(scored)) - want).abs().max() <= TOL
    return outs


def test_engine_built_under_mixed_precision(engine):
    """The probe and the compiled decode step's warm-up ran under the caller's autocast and accelerate's wrapper:
    the step compiled (no fall-back to the eager step) and the wrapper is the model's forward no longer."""
    stats = engine.stats()
    assert stats["decode_backend_fallback"] is None, stats["decode_backend_fallback"]
    assert "forward" not in vars(engine.policy.model)


def assert_same(got, want):
    assert [o.output_ids for o in got] == [o.output_ids for o in want]
    for g, w in zip(got, want):
        assert len(g.output_logprobs) == len(w.output_logprobs)
        if w.output_logprobs:
            assert (torch.tensor(g.output_logprobs) - torch.tensor(w.output_logprobs)).abs().max() <= TOL
    assert (torch.tensor(prompt_scores(got[-1])) - torch.tensor(prompt_scores(want[-1]))).abs().max() <= TOL


@pytest.mark.parametrize("via", ["generate", "wait_for"])
def test_callers_autocast_context(policy, engine, plain, via):
    """Under ``torch.autocast("cpu", dtype=torch.bfloat16)`` on the caller's thread: the same tokens, logprobs and
    prompt scores as with none; the caller's autocast is on again, with its dtype, when the call returns."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outs = run(engine, requests(policy), via)
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    assert_same(outs, plain)
    assert all(o.error is None for o in outs)
    assert engine.stats().get("decode_recompiles", 0) == 0  # the compiled step's guards saw one autocast state


@pytest.mark.parametrize("via", ["generate", "agenerate"])
def test_accelerate_mixed_precision_wrapper(policy, engine, plain, bf16_forward, via):
    """With the model's forward wrapped by accelerate (bf16 autocast inside it, on any thread): the same outputs as
    with none; the wrapper is the model's forward again afterwards, and still runs the trainer's forward in bf16."""
    ids = torch.tensor([plain[1].prompt_ids + plain[1].output_ids])
    with prepared(policy.model, bf16_forward):
        outs = run(engine, requests(policy), via)
        with policy.lock, torch.no_grad():  # a trainer's forward: after the engine's step in progress, if any
            assert policy.model.forward is bf16_forward
            trainer_logits = policy.model(input_ids=ids).logits[0, -len(plain[1].output_ids) - 1:-1]
    assert_same(outs, plain)
    assert all(o.error is None for o in outs)
    assert engine.stats().get("decode_recompiles", 0) == 0
    _, fp32_logits = teacher_forced(policy, plain[1].prompt_ids, plain[1].output_ids)
    assert (trainer_logits.float() - fp32_logits).abs().max() > 1e-3  # the trainer's forward is bf16 autocast's
