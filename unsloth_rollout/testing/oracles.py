"""The independent oracles the tests and the bench hold the engine to.

``teacher_forced`` is the trainer's view of a completion: one plain HF forward over prompt + output
(no engine, no KV cache), scored as ``log_softmax(logits / T)[token]`` in fp32: what AReaL's and
TRL's trainers recompute. Vision inputs pass through as the model's processor made them. It runs in the model's
own dtype, whatever mixed precision a trainer set up: autocast off, and the model class's own ``forward`` (a
trainer's wrapper of the instance's, such as accelerate's autocast wrapper, is not the model).
``processed_distribution`` is, from its definition, the distribution a token is drawn from (vLLM's
``processed_logprobs``), computed in float64 from such a forward's logits.
"""

from __future__ import annotations

import torch

from ..engine.inputs import mm_token_type_ids

__all__ = ["PARITY_FLOOR", "hf_generate_logprobs", "hf_greedy_ignoring_eos", "hf_logprobs", "mm_token_type_ids",
           "parity_bound", "perturb_lora", "processed_distribution", "teacher_forced", "teacher_forced_logprobs"]

# The one bar for the engine's logprobs against a teacher-forced fp32 forward: ``PARITY_FLOOR``, or 1.5x HF
# ``generate()``'s own distance from that forward on the same prompts when that is larger (``parity_bound``). HF's
# cached decode sums in another order than a full forward; how far that moves fp32 logprobs depends on the model,
# the machine and the thread count, so a test that can measure it holds the engine to it.
PARITY_FLOOR = 1e-5


def perturb_lora(model, std: float = 0.5, seed: int = 0) -> int:
    """LoRA B starts at zero (a no-op adapter): give every B matrix seeded random values so LoRA really changes
    the model a test or bench measures. Returns how many matrices were touched."""
    g = torch.Generator().manual_seed(seed)
    n = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.dtype) * std)
                n += 1
    return n


def teacher_forced(policy, prompt_ids, output_ids, temperature: float = 1.0, **vision):
    """(logprobs [n_out], logits [n_out, V]) of ``output_ids`` after ``prompt_ids`` from one forward.

    ``vision``: pixel_values, image_grid_thw, image_sizes, token_type_ids ... as the processor returns them
    for the prompt (per-token ones are extended over the output as text); Qwen-VL's ``mm_token_type_ids``
    (M-RoPE image positions) is derived when not given.

    Example::

        lp, _ = teacher_forced(policy, out.prompt_ids, out.output_ids, temperature=1.0)
        assert (lp - torch.tensor(out.output_logprobs)).abs().max() <= 1e-5
    """
    dev = policy.device
    ids = torch.tensor([list(prompt_ids) + list(output_ids)], device=dev)
    kw = {k: v for k, v in vision.items() if v is not None}
    n_out = len(output_ids)
    for k in ("token_type_ids", "mm_token_type_ids"):  # per-token inputs of the prompt: the output is text (0)
        if k in kw and kw[k].shape[-1] == len(prompt_ids):
            kw[k] = torch.nn.functional.pad(kw[k], (0, n_out))
    if "pixel_values" in kw:
        kw["pixel_values"] = kw["pixel_values"].to(dev, policy.dtype)
    if "image_grid_thw" in kw:  # Qwen-VL: M-RoPE image positions come from mm_token_type_ids
        kw.setdefault("mm_token_type_ids", mm_token_type_ids(ids, policy.config))
    kw = {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    model = policy.model
    with policy.lock, torch.no_grad(), torch.autocast(dev.type, enabled=False):
        was_training = model.training
        model.eval()
        policy.clear_rope_deltas()
        try:
            logits = type(model).forward(model, input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False,
                                         **kw).logits
        finally:
            policy.clear_rope_deltas()
            if was_training:
                model.train()
    n = len(prompt_ids)
    logits = logits[0, n - 1:-1].float()
    lp = torch.log_softmax(logits / temperature, dim=-1)
    return lp.gather(1, ids[0, n:].unsqueeze(1)).squeeze(1).cpu(), logits.cpu()


def teacher_forced_logprobs(policy, prompt_ids, output_ids, temperature=1.0, pixel_values=None, image_grid_thw=None,
                            mm=None):
    """log_softmax(logits / T) of each output token from one full forward over prompt + output (the oracle),
    and the logits; see ``teacher_forced``. ``mm``: any other family's processor outputs for the
    prompt (pixel_values, image_sizes, token_type_ids ...)."""
    vision = {k: v for k, v in (mm or {}).items() if k not in ("input_ids", "attention_mask")}
    if pixel_values is not None:
        vision.update(pixel_values=pixel_values, image_grid_thw=image_grid_thw)
    return teacher_forced(policy, prompt_ids, output_ids, temperature, **vision)


def processed_distribution(logits, context_ids, output_ids, *, temperature: float = 1.0, top_k: int = 0,
                           top_p: float = 1.0, min_p: float = 0.0, repetition_penalty: float = 1.0,
                           frequency_penalty: float = 0.0, presence_penalty: float = 0.0) -> torch.Tensor:
    """[V] log-probabilities (float64, -inf where dropped) of the distribution the next token is sampled from, given
    one position's raw ``logits``: the repetition penalty over ``context_ids`` (prompt + output so far), frequency
    and presence penalties over ``output_ids`` (the output so far), then ``/ temperature``, the top-k logits, the
    tokens under ``min_p`` x the top probability dropped, the smallest prefix of the rest (most likely first) whose
    mass reaches ``top_p`` kept, renormalised.

    Example::

        _, logits = teacher_forced(policy, prompt, out)
        want = processed_distribution(logits[i], prompt + out[:i], out[:i], temperature=0.7, top_p=0.9)[out[i]]
    """
    x = logits.double().clone()
    if repetition_penalty != 1.0:
        idx = torch.tensor(sorted(set(context_ids)), dtype=torch.long)
        v = x[idx]
        x[idx] = torch.where(v > 0, v / repetition_penalty, v * repetition_penalty)
    for t in set(output_ids):
        x[t] -= frequency_penalty * list(output_ids).count(t) + presence_penalty
    x = x / temperature
    if top_k > 0:
        x[x < x.topk(top_k).values[-1]] = float("-inf")
    p = torch.softmax(x, dim=-1)
    if min_p > 0:
        p[p < min_p * p.max()] = 0
    keep, mass, total = torch.zeros_like(p, dtype=torch.bool), 0.0, float(p.sum())
    for t in p.argsort(descending=True).tolist():
        if mass >= top_p * total:
            break
        keep[t] = True
        mass += float(p[t])
    p = torch.where(keep, p, torch.zeros_like(p))
    return torch.log(p / p.sum())


def hf_logprobs(model, ids: list[int], n_out: int) -> torch.Tensor:
    """``[n_out, V]`` ``log_softmax`` of a plain HF (or PEFT) model's logits at the positions that predict the last
    ``n_out`` of ``ids``: the forward of a checkpoint or adapter that is not a PolicyModel (T = 1)."""
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits[len(ids) - n_out - 1:-1], dim=-1)


def hf_greedy_ignoring_eos(model, prompt_ids: list[int], n: int) -> list[int]:
    """HF ``generate()``'s ``n`` greedy tokens after ``prompt_ids`` with EOS neither ending the answer nor forbidden:
    what a greedy request with ``ignore_eos`` gives. (``min_new_tokens=n`` would forbid EOS instead, so where the
    argmax is EOS it would answer the second-best token.)"""
    ids = torch.tensor([list(prompt_ids)])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


def assert_greedy_matches(policy, prompt_ids, got: list[int], ref: list[int], tie: float = 1e-5, label="") -> None:
    """``got`` (the engine's greedy tokens) equals ``ref`` (HF ``generate``'s), except that where they first differ
    both tokens must be the argmax within ``tie`` of a teacher-forced forward (a float32 near-tie: two kernels'
    rounding may break it either way); past that point the two continuations are different prompts."""
    if got == ref:
        return
    i = next((j for j, (a, b) in enumerate(zip(got, ref)) if a != b), None)
    assert i is not None, f"{label}: outputs of different lengths {len(got)} vs {len(ref)}"
    _, logits = teacher_forced(policy, prompt_ids, got[: i + 1])
    row = logits[i]
    top = float(row.max())
    gap_got, gap_ref = top - float(row[got[i]]), top - float(row[ref[i]])
    assert gap_got <= tie and gap_ref <= tie, (
        f"{label}: greedy token {i} is {got[i]} (engine) vs {ref[i]} (HF): their logits are {gap_got:.3g} and "
        f"{gap_ref:.3g} below the max, not a near-tie (<= {tie})")


def parity_bound(hf_distance: float) -> float:
    """The largest logprob difference from a teacher-forced forward the engine may show, given HF ``generate()``'s
    own distance from the same forward measured in the same test (see ``PARITY_FLOOR``)."""
    return max(PARITY_FLOOR, 1.5 * hf_distance)


def hf_generate_logprobs(model, inputs: dict, max_new_tokens: int, **generate_kw) -> tuple[list[int], torch.Tensor]:
    """HF ``generate()``'s greedy tokens for one prompt (``inputs``: the processor's or tokenizer's encoding) and
    the fp32 ``log_softmax`` (T = 1) its own cached decode gave each of them."""
    ids = inputs["input_ids"]
    mask = inputs.get("attention_mask")
    inputs = {**inputs, "attention_mask": torch.ones_like(ids) if mask is None else mask}
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, **generate_kw)
    tokens = out.sequences[0, ids.shape[1]:].tolist()
    lp = torch.stack([torch.log_softmax(lg[0].float(), -1)[t] for lg, t in zip(out.logits, tokens)])
    return tokens, lp
