"""What the decode tests share: a LoRA policy whose adapter is not a no-op, word prompts of growing length, and
the check every decode variant is held to (HF generate's greedy tokens, a teacher-forced forward's logprobs)."""

from __future__ import annotations

import torch

from ..engine import GenerationRequest, SamplingParams
from ..models import load_model
from .oracles import perturb_lora, teacher_forced


def lora_policy(path):
    """The model at ``path`` with LoRA r=8 whose B matrices are random (so LoRA is not a no-op)."""
    torch.manual_seed(0)
    policy = load_model(path, backend="transformers", lora={"r": 8, "random_state": 0})
    perturb_lora(policy.model, std=0.3, seed=0)
    return policy


def hf_greedy_ids(policy, engine, ids, n):
    """HF generate's greedy tokens; a VLM's vision tokens are never sampled by the engine, nor here."""
    out = policy.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                max_new_tokens=n, do_sample=False,
                                suppress_tokens=engine.core.sampler.suppress_ids or None)
    return out[0, len(ids):].tolist()


def word_prompts(policy, n, first="alice"):
    """``n`` prompts of 3, 10, 17, ... words (``first`` leads the first)."""
    words = [first, "bob", "counts", "apples", "and", "pears"]
    return [policy.tokenizer.encode(" ".join(words[(i + j) % 6] for j in range(3 + 7 * i))) for i in range(n)]


def check_greedy_and_logprobs(policy, engine, prompts, max_new):
    """Greedy requests of different lengths through ``engine``: HF generate's tokens, and logprobs within 1e-5 of
    a teacher-forced forward's."""
    reqs = [GenerationRequest(input_ids=p, sampling=SamplingParams(max_new_tokens=max_new - i % 4, temperature=0.0))
            for i, p in enumerate(prompts)]
    for r, o in zip(reqs, engine.generate(reqs)):
        assert o.output_ids == hf_greedy_ids(policy, engine, r.input_ids, r.sampling.max_new_tokens), r.input_ids[:4]
        lp, _ = teacher_forced(policy, o.prompt_ids, o.output_ids, 1.0)
        assert (torch.tensor(o.output_logprobs) - lp).abs().max() <= 1e-5
