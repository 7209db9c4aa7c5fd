"""Per-step logprob checks of the real-weights GRPO run.

- ``HFGenerateLogprobs``: TRL's own generate path returns no logprobs, so the check TRL logs for the engine
  path (behaviour vs its recomputed logprobs) does not exist there. This asks ``model.generate`` for its raw
  logits as well and compares ``log_softmax(logits / T)`` of each sampled token with the trainer's
  training-forward logprobs of the same rows (same weights: one optimizer step per generation batch):
  HF generate's own distance from the trainer, the reference the engine's distance is read against.
- ``oracle_gap``: the engine's behaviour logprobs against a teacher-forced fp32 forward of each sample
  alone (``unsloth_rollout.testing.oracles.teacher_forced``, the oracle of tests/test_real_checkpoint.py).
"""

from __future__ import annotations

import torch


class HFGenerateLogprobs:
    """Wraps ``model.generate`` and ``trainer._get_per_token_logps_and_entropies``; ``gaps`` gains one max per
    training forward (a step)."""

    def __init__(self, trainer, model, temperature: float):
        self.temperature = temperature
        self.rows: list[tuple[tuple[int, ...], list[int], list[float]]] = []
        self.gaps: list[float] = []
        self._generate = model.generate
        self._logps = trainer._get_per_token_logps_and_entropies
        model.generate = self._wrapped_generate
        trainer._get_per_token_logps_and_entropies = self._wrapped_logps

    def _wrapped_generate(self, *args, **kwargs):
        kwargs.update(output_logits=True, return_dict_in_generate=True)
        out = self._generate(*args, **kwargs)
        ids, mask = kwargs["input_ids"], kwargs["attention_mask"]
        new = out.sequences[:, ids.shape[1]:]
        logits = torch.stack(list(out.logits), 1).float() / self.temperature  # [B, N, V]
        lp = torch.log_softmax(logits, -1).gather(-1, new.unsqueeze(-1)).squeeze(-1)
        self.rows = [(tuple(ids[b][mask[b].bool()].tolist()), new[b].tolist(), lp[b].tolist())
                     for b in range(ids.shape[0])]
        return out.sequences

    def _wrapped_logps(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        res = self._logps(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)
        if self.rows and torch.is_grad_enabled():  # the training forward (TRL's no-grad ones are not this path's)
            self.gaps.append(self._gap(input_ids, attention_mask, logits_to_keep, res[0].detach()))
        return res

    def _gap(self, input_ids, attention_mask, k: int, logps) -> float:
        worst = 0.0
        pool = list(self.rows)
        for b in range(input_ids.shape[0]):
            prompt = tuple(input_ids[b, :-k][attention_mask[b, :-k].bool()].tolist())
            comp = input_ids[b, -k:][attention_mask[b, -k:].bool()].tolist()
            n = len(comp)
            j = next((j for j, (p, new, _) in enumerate(pool) if p == prompt and new[:n] == comp), None)
            if j is None:
                raise RuntimeError("HF generate logprob check: a trained row matches no generated row")
            _, _, lp = pool.pop(j)
            if n:
                worst = max(worst, (torch.tensor(lp[:n]) - logps[b, :n].float().cpu()).abs().max().item())
        return worst


def oracle_gap(policy, samples, temperature: float) -> float:
    """max |behaviour logprob - teacher-forced logprob| over ``samples`` = [(prompt_ids, output_ids, logprobs)]."""
    from ...testing.oracles import teacher_forced

    worst = 0.0
    for prompt_ids, output_ids, logprobs in samples:
        if not output_ids:
            continue
        ref, _ = teacher_forced(policy, list(prompt_ids), list(output_ids), temperature)
        worst = max(worst, (ref.cpu() - torch.tensor(list(logprobs))).abs().max().item())
    return worst


def spread(items: list, k: int) -> list:
    """``k`` items evenly spread over ``items`` (every group of a GRPO batch gets its turn)."""
    if k <= 0 or not items:
        return []
    if k >= len(items):
        return list(items)
    return [items[round(i * (len(items) - 1) / (k - 1))] if k > 1 else items[0] for i in range(k)]
