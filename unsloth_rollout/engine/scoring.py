"""Prompt scoring: the logprob of every prompt token given the ones before it, from the prefill forward.

A request with ``SamplingParams(prompt_logprobs=k)`` goes through the normal scheduler: its prompt is prefilled
(packed with the step's other prompts, chunked when long) with the logits of every position kept, and
``PromptScorer`` turns each forward's rows into per-token scores as they come, so the full ``[L, V]`` logits
never sit in memory at once. Scores are ``log_softmax(raw_logits)`` at T = 1 (vLLM's prompt logprobs: no
temperature, no filtering), with the token's rank and the top ``k``. The scores live on the prefix-cache entry,
so a later request for the same prompt (and no more than ``k``) is answered from the cache without a forward.

Example::

    out = engine.generate([GenerationRequest(input_ids=ids, sampling=SamplingParams(max_new_tokens=0,
                                                                                     prompt_logprobs=0))])[0]
    out.prompt_logprobs[1]   # {ids[1]: log p(ids[1] | ids[:1])}
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class PromptScores:
    """Scores of prompt positions 1 .. L-1 (position 0 has no context and no score)."""

    k: int  # top logprobs kept per position
    logprobs: list[float] = field(default_factory=list)  # log p(ids[j] | ids[:j]) for j = 1 .. L-1
    ranks: list[int] = field(default_factory=list)  # 1 + how many tokens are more likely than ids[j]
    top: list[dict[int, float]] = field(default_factory=list)  # the k most likely tokens at j, best first

    def as_dicts(self, k: int) -> tuple[list[dict[int, float] | None], list[int | None]]:
        """vLLM's per-position shape for a request asking ``k`` (<= self.k): [None, {token: lp, top...}, ...]
        (the prompt's own token first) and the ranks of the prompt's tokens (None at position 0)."""
        dicts: list[dict[int, float] | None] = [None]
        ranks: list[int | None] = [None]
        for j, (lp, rank, top) in enumerate(zip(self.logprobs, self.ranks, self.top)):
            d = {self._tokens[j]: lp}
            for t, v in list(top.items())[:k]:
                d.setdefault(t, v)
            dicts.append(d)
            ranks.append(rank)
        return dicts, ranks

    _tokens: list[int] = field(default_factory=list, repr=False)  # ids[1:], the scored tokens


class PromptScorer:
    """Collects scores of one prompt ``ids`` from logits rows handed over forward by forward."""

    def __init__(self, ids: list[int], k: int):
        self.ids = list(ids)
        self.scores = PromptScores(k, _tokens=self.ids[1:])
        self._next = 0  # next position whose row is expected

    def reset(self) -> None:
        self.scores = PromptScores(self.scores.k, _tokens=self.ids[1:])
        self._next = 0

    def add(self, first_pos: int, logits: torch.Tensor) -> None:
        """``logits[r]``: the model's logits at prompt position ``first_pos + r`` (they predict token
        ``first_pos + r + 1``); the last position's row (the next token's) is not a prompt score."""
        if first_pos != self._next:
            raise RuntimeError(f"prompt scores out of order: got position {first_pos}, expected {self._next}")
        n = min(logits.shape[0], len(self.ids) - 1 - first_pos)
        self._next = first_pos + logits.shape[0]
        if n <= 0:
            return
        lp = torch.log_softmax(logits[:n].float(), dim=-1)
        targets = torch.tensor(self.ids[first_pos + 1:first_pos + 1 + n], device=lp.device)
        chosen = lp.gather(1, targets.unsqueeze(1))
        ranks = (lp > chosen).sum(dim=1) + 1
        s = self.scores
        s.logprobs += chosen.squeeze(1).tolist()
        s.ranks += ranks.tolist()
        if s.k:
            vals, idx = lp.topk(min(s.k, lp.shape[-1]), dim=-1)
            s.top += [dict(zip(i, v)) for i, v in zip(idx.tolist(), vals.tolist())]
        else:
            s.top += [{} for _ in range(n)]

    def result(self) -> PromptScores:
        if len(self.scores.logprobs) != len(self.ids) - 1:
            raise RuntimeError(f"prompt scores incomplete: {len(self.scores.logprobs)} of {len(self.ids) - 1}")
        return self.scores
