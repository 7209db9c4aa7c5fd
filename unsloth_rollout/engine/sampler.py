"""Sampler: logits -> token, logprob (+ top logprobs), per-row parameters, seeded.

Logprobs are ``log_softmax(raw_logits / T)[token]`` (T = 1 when greedy), computed before
penalties, masks and top-k/p/min-p: the value AReaL's trainer recomputes. Sampling uses one
uniform number per row from that row's own RNG (inverse CDF), so a seeded request draws the
same tokens whatever else is in the batch.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from .sequence import Sequence


@dataclass
class SampleResult:
    tokens: list[int]
    logprobs: list[float]
    top: list[dict[int, float] | None]


class Sampler:
    def __init__(self, vocab_size: int, eos_ids: list[int], suppress_ids: list[int], seed: int | None = None):
        self.vocab_size = vocab_size
        self.eos_ids = list(eos_ids)
        self.suppress_ids = list(suppress_ids)
        self.rng = random.Random(seed)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SampleResult:
        """``logits``: [B, V'] raw logits for the next token of each sequence (V' >= vocab)."""
        logits = logits.float()
        b = logits.shape[0]
        dev = logits.device
        temps = torch.tensor([s.sampling.logprob_temperature for s in seqs], device=dev).unsqueeze(1)
        raw_lp = torch.log_softmax(logits / temps, dim=-1)

        proc = logits.clone()
        self._apply_penalties(proc, seqs)
        if self.suppress_ids:
            proc[:, self.suppress_ids] = float("-inf")
        for i, s in enumerate(seqs):
            if len(s.output_ids) < s.sampling.min_new_tokens:
                banned = list(s.sampling.stop_token_ids) + ([] if s.sampling.ignore_eos else self.eos_ids)
                if banned:
                    proc[i, banned] = float("-inf")

        greedy = [s.sampling.greedy for s in seqs]
        tokens = torch.empty(b, dtype=torch.long, device=dev)
        g_idx = [i for i, g in enumerate(greedy) if g]
        s_idx = [i for i, g in enumerate(greedy) if not g]
        if g_idx:
            gi = torch.tensor(g_idx, device=dev)
            tokens[gi] = proc[gi].argmax(dim=-1)
        if s_idx:
            si = torch.tensor(s_idx, device=dev)
            tokens[si] = self._sample(proc[si], [seqs[i] for i in s_idx])

        chosen = raw_lp.gather(1, tokens.unsqueeze(1)).squeeze(1)
        tok_list = tokens.tolist()
        lp_list = chosen.tolist()
        top: list[dict[int, float] | None] = [None] * b
        k_max = max(s.sampling.logprobs for s in seqs)
        if k_max:
            vals, idx = raw_lp.topk(k_max, dim=-1)
            vals, idx = vals.tolist(), idx.tolist()
            for i, s in enumerate(seqs):
                k = s.sampling.logprobs
                if k:
                    top[i] = {int(t): float(v) for t, v in zip(idx[i][:k], vals[i][:k])}
        return SampleResult(tok_list, lp_list, top)

    def _apply_penalties(self, proc: torch.Tensor, seqs: list[Sequence]) -> None:
        for i, s in enumerate(seqs):
            sp = s.sampling
            if sp.repetition_penalty != 1.0:
                ids = torch.tensor(sorted(set(s.all_ids)), device=proc.device)
                row = proc[i, ids]
                proc[i, ids] = torch.where(row > 0, row / sp.repetition_penalty, row * sp.repetition_penalty)
            if (sp.frequency_penalty or sp.presence_penalty) and s.output_ids:
                counts = torch.bincount(torch.tensor(s.output_ids, device=proc.device),
                                        minlength=proc.shape[1]).to(proc.dtype)
                proc[i] -= sp.frequency_penalty * counts + sp.presence_penalty * (counts > 0).to(proc.dtype)

    def _sample(self, proc: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        dev = proc.device
        temps = torch.tensor([s.sampling.temperature for s in seqs], device=dev).unsqueeze(1)
        x = proc / temps
        top_k = [s.sampling.top_k for s in seqs]
        if any(k > 0 for k in top_k):
            # min(): a top_k above the vocabulary keeps every token (and one above int64 no longer overflows)
            kk = torch.tensor([min(k, x.shape[1]) if k > 0 else x.shape[1] for k in top_k], device=dev)
            kth = x.sort(dim=-1, descending=True).values.gather(1, (kk - 1).clamp(max=x.shape[1] - 1).unsqueeze(1))
            x = x.masked_fill(x < kth, float("-inf"))
        probs = torch.softmax(x, dim=-1)
        min_p = torch.tensor([s.sampling.min_p for s in seqs], device=dev).unsqueeze(1)
        if (min_p > 0).any():
            probs = probs.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
        top_p = torch.tensor([s.sampling.top_p for s in seqs], device=dev).unsqueeze(1)
        order = None
        if (top_p < 1).any():
            probs, order = probs.sort(dim=-1, descending=True)
            mass_before = probs.cumsum(dim=-1) - probs
            probs = probs.masked_fill(mass_before >= top_p * probs.sum(-1, keepdim=True), 0.0)
        # One uniform in (0, 1] per row from the row's own RNG: reproducible whatever the batch.
        u = torch.tensor([1.0 - (s.rng or self.rng).random() for s in seqs], device=dev, dtype=torch.float64)
        cdf = probs.double().cumsum(dim=-1)
        target = (u * cdf[:, -1]).unsqueeze(1)
        pos = torch.searchsorted(cdf, target).squeeze(1).clamp(max=probs.shape[1] - 1)
        # searchsorted can land on a zero-probability token only through rounding at the top end.
        bad = probs.gather(1, pos.unsqueeze(1)).squeeze(1) <= 0
        if bad.any():
            pos = torch.where(bad, probs.argmax(dim=-1), pos)
        return order.gather(1, pos.unsqueeze(1)).squeeze(1) if order is not None else pos
