"""Per-step logprob checks of the real-weights GRPO run, on exactly the weights that sampled the step's rows.

Three logprobs of every checked sampled token, all before the step's optimizer update:
- behaviour: the engine's (TRL + engine, AReaL), or HF generate's own ``log_softmax(logits / T)`` on TRL's own
  generate path (TRL returns none there; ``HFGenerateLogprobs`` asks ``model.generate`` for its raw logits);
- the trainer's recompute, as the trainer does it (TRL: ``_get_per_token_logps_and_entropies`` on its left-padded
  batch, captured by ``TrainerLogprobs``; AReaL: ``compute_logp``);
- the oracle: a teacher-forced fp32 forward of the sample alone (``unsloth_rollout.testing.oracles.teacher_forced``,
  the oracle of tests/test_real_checkpoint.py).

``behaviour - oracle`` is the sampler's fp32 noise (held to the tests' bound); ``trainer - oracle`` is the
trainer's own (HF's batch-vs-single drift on the same rows: the batched matmuls sum in another order; left
padding, positions, train mode and dropout change nothing here, measured); ``|behaviour - trainer|`` is at most
their sum, so its bound per step is the tests' bound plus the drift measured on the same rows in that step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RowCheck:
    """One step's checks over its checked rows (max over their sampled tokens)."""

    oracle: float | None = None  # max |behaviour - teacher-forced|
    drift: float | None = None  # max |trainer - teacher-forced|
    trainer: float | None = None  # max |behaviour - trainer| on the checked rows
    hf: float | None = None  # max |HF generate's own logprob of the same tokens (forced) - teacher-forced|


def teacher_forced_rows(policy, rows, temperature: float) -> list:
    """The oracle logprobs of each of ``rows`` = [(prompt_ids, output_ids, ...)] (None for an empty output)."""
    from ...testing.oracles import teacher_forced

    return [teacher_forced(policy, list(r[0]), list(r[1]), temperature)[0] if len(r[1]) else None for r in rows]


def hf_generate_forced_rows(policy, rows, temperature: float) -> list:
    """HF ``generate()``'s own ``log_softmax(logits / T)`` of each of ``rows``' sampled tokens (every token forced,
    one left-padded batch of the rows, as HF generate batches them): HF's fp32 noise on exactly the tokens and
    weights the behaviour logprobs came from (None for an empty output)."""
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    live = [r for r in rows if len(r[1])]
    if not live:
        return [None] * len(rows)
    tok = policy.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    P = max(len(r[0]) for r in live)
    forced = [list(r[1]) for r in live]

    class Force(LogitsProcessor):
        def __call__(self, input_ids, scores):
            t, out = input_ids.shape[1] - P, torch.full_like(scores, float("-inf"))
            for b, f in enumerate(forced):
                out[b, f[t] if t < len(f) else pad] = 0.0
            return out

    ids = torch.full((len(live), P), pad)
    am = torch.zeros(len(live), P, dtype=torch.long)
    for i, r in enumerate(live):
        ids[i, P - len(r[0]):], am[i, P - len(r[0]):] = torch.tensor(list(r[0])), 1
    dev, model = policy.device, policy.model
    with policy.inference(), policy.lock, torch.no_grad():  # the class's generate: not HFGenerateLogprobs' wrapper
        g = type(model).generate(model, input_ids=ids.to(dev), attention_mask=am.to(dev), do_sample=False,
                                    max_new_tokens=max(map(len, forced)),
                                    logits_processor=LogitsProcessorList([Force()]), output_logits=True,
                                    return_dict_in_generate=True, pad_token_id=pad)
    new = g.sequences[:, P:].cpu()
    if any(new[i, :len(f)].tolist() != f for i, f in enumerate(forced)):
        raise RuntimeError("logprob check: forcing the sampled tokens through HF generate failed")
    logits = torch.stack(list(g.logits), 1).float().cpu() / temperature
    lp = torch.log_softmax(logits, -1).gather(-1, new.unsqueeze(-1)).squeeze(-1)
    it = iter(lp[i, :len(f)] for i, f in enumerate(forced))
    return [next(it) if len(r[1]) else None for r in rows]


def _max(pairs) -> float | None:
    vals = [(torch.as_tensor(a, dtype=torch.float32) - torch.as_tensor(b, dtype=torch.float32)).abs().max().item()
            for a, b in pairs if len(a)]
    return max(vals) if vals else None


def row_check(behaviour, trainer, oracle, hf=None) -> RowCheck:
    """Maxima over rows of aligned per-row logprob lists (``trainer`` may hold None for rows not scored; ``hf``:
    HF generate's own logprobs of the same rows, ``hf_generate_forced_rows``)."""
    ok = [(b, t, o) for b, t, o in zip(behaviour, trainer, oracle) if o is not None]
    hf_max = None if hf is None else _max((h, o) for h, o in zip(hf, oracle) if o is not None and h is not None)
    return RowCheck(hf=hf_max, oracle=_max((b, o) for b, _, o in ok),
                    drift=_max((t, o) for _, t, o in ok if t is not None),
                    trainer=_max((b, t) for b, t, _ in ok if t is not None))


class TrainerLogprobs:
    """Wraps ``trainer._get_per_token_logps_and_entropies`` and keeps, per step, the rows of its first call with
    ``grad`` as asked: TRL's no-grad recompute (``old_per_token_logps``, what TRL's sampling_logp_difference
    compares) on the engine path, the training forward on TRL's own generate path (TRL recomputes nothing else
    there). ``on_rows(rows)`` gets [(prompt_ids, completion_ids, logps)] once per step."""

    def __init__(self, trainer, grad: bool, on_rows):
        self.grad, self.on_rows, self.armed = grad, on_rows, False
        self._logps = trainer._get_per_token_logps_and_entropies
        trainer._get_per_token_logps_and_entropies = self._wrapped

    def _wrapped(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        res = self._logps(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)
        if self.armed and torch.is_grad_enabled() == self.grad:
            self.armed = False
            k, logps = logits_to_keep, res[0].detach().float().cpu()
            rows = []
            for b in range(input_ids.shape[0]):
                prompt = input_ids[b, :-k][attention_mask[b, :-k].bool()].tolist()
                comp = input_ids[b, -k:][attention_mask[b, -k:].bool()].tolist()
                rows.append((prompt, comp, logps[b, : len(comp)].tolist()))
            self.on_rows(rows)
        return res


def match_rows(sampled, scored) -> list:
    """For each of ``sampled`` = [(prompt_ids, output_ids, ...)], the logps of its row in ``scored`` =
    [(prompt_ids, completion_ids, logps)] (each scored row used once; rows of one group may repeat)."""
    pool = [(tuple(p), list(c), lp) for p, c, lp in scored]
    out = []
    for r in sampled:
        p, c = tuple(r[0]), list(r[1])
        j = next((j for j, (q, d, _) in enumerate(pool) if q == p and d == c), None)
        if j is None:
            raise RuntimeError("logprob check: a sampled row matches no row of the trainer's recompute")
        out.append(pool.pop(j)[2])
    return out


class HFGenerateLogprobs:
    """Wraps ``model.generate`` (TRL's own generate path) to keep HF generate's ``log_softmax(logits / T)`` of
    each sampled token: ``rows`` = [(prompt_ids, new_ids, logprobs)] of the last call."""

    def __init__(self, model, temperature: float):
        self.temperature = temperature
        self.rows: list[tuple[tuple[int, ...], list[int], list[float]]] = []
        self._generate = model.generate
        model.generate = self._wrapped_generate

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


def with_widest(checked: list, rows: list, behaviour: list, trainer: list) -> list:
    """``checked`` plus the row of ``rows`` where |behaviour - trainer| is largest (when not already in it): the
    step's largest gap is then always split into its behaviour and trainer parts by the oracle."""
    gaps = [(torch.as_tensor(b) - torch.as_tensor(t)).abs().max().item() if len(b) else -1.0
            for b, t in zip(behaviour, trainer)]
    if not gaps:
        return list(checked)
    w = rows[max(range(len(gaps)), key=gaps.__getitem__)]
    return list(checked) + ([] if any(w is c for c in checked) else [w])


def spread(items: list, k: int) -> list:
    """``k`` items evenly spread over ``items`` (every group of a GRPO batch gets its turn)."""
    if k <= 0 or not items:
        return []
    if k >= len(items):
        return list(items)
    return [items[round(i * (len(items) - 1) / (k - 1))] if k > 1 else items[0] for i in range(k)]
