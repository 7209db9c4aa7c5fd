"""Sampler: logits -> token, logprob (+ top logprobs), per-row parameters, seeded.

One call is a pipeline of named steps over one per-batch metadata object (``SamplingBatch``), as vLLM v1's
sampler: raw logprobs -> processed logits (penalties, suppressed tokens, min-token bans) -> the grammar's
mask -> the token (greedy argmax or a seeded draw) -> the logprobs returned -> the result.

Logprobs are ``log_softmax(raw_logits / T)[token]`` (T = 1 when greedy), computed before
penalties, masks (a structured output's grammar too) and top-k/p/min-p: the value AReaL's trainer
recomputes. Rows whose request asks for ``logprobs_mode="processed_logprobs"`` get, from a separate step
(``processed_logprobs``), the log of the distribution they were sampled from (a grammar's mask included), as
vLLM's mode of that name. Sampling uses one uniform number per row from that row's own RNG (inverse CDF over
the vocabulary in its natural order, for every row: top-p sorts only its own rows to find the nucleus), so a
seeded request draws the same tokens whatever else, with whatever parameters, is in the batch.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from .sequence import Sequence


@dataclass
class SampleResult:
    tokens: list[int]
    logprobs: list[float]
    top: list[dict[int, float] | None]
    # Rows with a grammar: the token's logprob renormalised over what the grammar allowed (None elsewhere).
    constrained: list[float | None] | None = None
    # Rows whose grammar failed this step: {row: message}; their token is not to be used.
    errors: dict[int, str] = field(default_factory=dict)


# Columns of a sequence's parameter row (built once per sequence, on its first sampled token).
_LPT, _T, _TOPK, _TOPP, _MINP, _GREEDY, _REP, _FREQ, _PRES = range(9)


def _param_row(s: Sequence, vocab: int) -> tuple:
    row = s.sampling_row
    if row is None:
        sp = s.sampling
        k = min(sp.top_k, vocab) if sp.top_k > 0 else 0  # min(): a top_k above the vocabulary keeps every token
        row = (sp.logprob_temperature, 1.0 if sp.greedy else sp.temperature, k, sp.top_p, sp.min_p,
               1.0 if sp.greedy else 0.0, sp.repetition_penalty, sp.frequency_penalty, sp.presence_penalty)
        s.sampling_row = row
    return row


def _padded(lists: list[list[int]], pad: int, device) -> torch.Tensor:
    n = max((len(x) for x in lists), default=0)
    return torch.tensor([x + [pad] * (n - len(x)) for x in lists], dtype=torch.long, device=device).view(len(lists), n)


@dataclass
class SamplingBatch:
    """One sampler call's rows and which steps each needs, built once per call (``of``); every step reads it."""

    # The rows' sequences, in the logits' row order.
    seqs: list[Sequence]
    # Each row's parameter tuple (columns _LPT .. _PRES), cached on its sequence.
    rows: list[tuple]
    # The same rows as one float32 tensor [B, 9] on the logits' device.
    par: torch.Tensor
    # Rows with a repetition, frequency or presence penalty.
    penalized: list[int]
    # Rows short of min_new_tokens: their stop tokens (and EOS unless ignore_eos) may not be sampled yet.
    banned: list[int]
    # Rows with a grammar (structured outputs).
    constrained: list[int]
    # Greedy rows (argmax); every other row draws from its own RNG.
    greedy: list[int]
    # Rows whose logprobs_mode is "processed_logprobs".
    processed: list[int]
    # Rows asking for top logprobs.
    want_top: list[int]

    @classmethod
    def of(cls, seqs: list[Sequence], logits: torch.Tensor) -> "SamplingBatch":
        rows = [_param_row(s, logits.shape[1]) for s in seqs]
        return cls(
            seqs=seqs, rows=rows, par=torch.tensor(rows, dtype=torch.float32, device=logits.device),
            penalized=[i for i, r in enumerate(rows) if r[_REP] != 1.0 or r[_FREQ] or r[_PRES]],
            banned=[i for i, s in enumerate(seqs) if len(s.output_ids) < s.sampling.min_new_tokens],
            constrained=[i for i, s in enumerate(seqs) if s.constraint is not None],
            greedy=[i for i, r in enumerate(rows) if r[_GREEDY] > 0],
            processed=[i for i, s in enumerate(seqs) if s.sampling.logprobs_mode == "processed_logprobs"],
            want_top=[i for i, s in enumerate(seqs) if s.sampling.logprobs])


class Sampler:
    def __init__(self, vocab_size: int, eos_ids: list[int], suppress_ids: list[int], seed: int | None = None,
                 log_softmax=torch.log_softmax):
        self.vocab_size = vocab_size
        self.eos_ids = list(eos_ids)
        self.suppress_ids = list(suppress_ids)
        self.rng = random.Random(seed)
        self.log_softmax = log_softmax  # of the raw logprobs: the bitwise on-policy mode's own under it (runner.py)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SampleResult:
        """``logits``: [B, V'] raw logits for the next token of each sequence (V' >= vocab). Per-row parameters
        come as one tensor (each sequence's row is built once); penalties and bans are batched tensor ops over
        the rows that need them."""
        logits = logits.float()
        batch = SamplingBatch.of(seqs, logits)
        # what a trainer recomputes (x / 1 is x: the division is skipped when every row's temperature is 1)
        unit = all(r[_LPT] == 1.0 for r in batch.rows)
        raw_lp = self.log_softmax(logits if unit else logits / batch.par[:, _LPT:_LPT + 1], dim=-1)
        proc = self.process_logits(logits, batch)
        allowed, errors = self.apply_grammar(proc, logits, batch) if batch.constrained else (None, {})
        tokens = self.choose_tokens(proc, batch)
        returned = returned_logprobs(raw_lp, proc, batch)
        constrained = constrained_logprobs(raw_lp, tokens, allowed, batch) if batch.constrained else None
        chosen = returned.gather(1, tokens.unsqueeze(1)).squeeze(1)
        return SampleResult(tokens.tolist(), chosen.tolist(), top_logprobs(returned, batch), constrained,
                            {batch.constrained[j]: e for j, e in errors.items()})

    # ------------------------------------------------------------------ steps
    def process_logits(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """The logits a token is chosen from: penalties, then the suppressed (vision) tokens, then the min-token
        bans, each on the rows that need it. ``logits`` itself when no row needs any (or a grammar's mask)."""
        dev = logits.device
        if not (batch.penalized or batch.banned or self.suppress_ids or batch.constrained):
            return logits
        proc = logits.clone()
        if batch.penalized:
            apply_penalties(proc, [batch.seqs[i] for i in batch.penalized], batch.penalized, batch.par)
        if self.suppress_ids:
            proc[:, self.suppress_ids] = float("-inf")
        if batch.banned:
            ri, ci = [], []
            for i in batch.banned:
                s = batch.seqs[i]
                banned = list(s.sampling.stop_token_ids) + ([] if s.sampling.ignore_eos else self.eos_ids)
                ri += [i] * len(banned)
                ci += banned
            if ri:
                proc[torch.tensor(ri, device=dev), torch.tensor(ci, device=dev)] = float("-inf")
        return proc

    def apply_grammar(self, proc: torch.Tensor, logits: torch.Tensor, batch: SamplingBatch):
        """The grammar step: every token the row's grammar rejects goes to -inf in ``proc`` (the constrained
        rows). Returns (allowed [len(constrained), V] bool, {j: error}); a row left nothing to sample
        (min_new_tokens banning EOS once the grammar is complete) is an error, sampled from a placeholder the
        core never uses."""
        from .constraints import allowed_tokens

        cons = batch.constrained
        dev = proc.device
        allowed, errors = allowed_tokens([batch.seqs[i] for i in cons], proc.shape[1], self.eos_ids)
        allowed = allowed.to(dev)
        ci = torch.tensor(cons, device=dev)
        sub = proc[ci].masked_fill(~allowed, float("-inf"))
        for j in torch.nonzero(~torch.isfinite(sub).any(dim=-1)).flatten().tolist():
            errors.setdefault(j, "no token is both allowed by the grammar and by min_tokens / the other bans")
            sub[j] = logits[cons[j]]
        proc[ci] = sub
        return allowed, errors

    def choose_tokens(self, proc: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """[B] tokens: the argmax of greedy rows, a seeded draw (``draw``) for the others."""
        b = proc.shape[0]
        if len(batch.greedy) == b:
            return proc.argmax(dim=-1)
        if not batch.greedy:
            return self.draw(proc, batch.seqs, batch.par)
        dev = proc.device
        tokens = torch.empty(b, dtype=torch.long, device=dev)
        greedy = set(batch.greedy)
        s_idx = [i for i in range(b) if i not in greedy]
        gi, si = torch.tensor(batch.greedy, device=dev), torch.tensor(s_idx, device=dev)
        tokens[gi] = proc[gi].argmax(dim=-1)
        tokens[si] = self.draw(proc[si], [batch.seqs[i] for i in s_idx], batch.par[si])
        return tokens

    def draw(self, proc: torch.Tensor, seqs: list[Sequence], par: torch.Tensor) -> torch.Tensor:
        """One token per row from temperature, top-k, min-p and top-p, by the row's own uniform number."""
        dev = proc.device
        t = par[:, _T:_T + 1]
        x = proc if bool((t == 1).all()) else proc / t
        kk = par[:, _TOPK].long()
        if bool((kk > 0).any()):
            vals = x.topk(int(kk.max()), dim=-1).values
            kth = vals.gather(1, (kk - 1).clamp(min=0).unsqueeze(1))
            kth = torch.where(kk.unsqueeze(1) > 0, kth, torch.full_like(kth, float("-inf")))
            x = x.masked_fill(x < kth, float("-inf"))
        probs = torch.softmax(x, dim=-1)
        min_p = par[:, _MINP:_MINP + 1]
        if bool((min_p > 0).any()):
            probs = probs.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
        probs = top_p_nucleus(probs, par[:, _TOPP])
        # One uniform in (0, 1] per row from the row's own RNG: reproducible whatever the batch.
        u = torch.tensor([1.0 - (s.rng or self.rng).random() for s in seqs], device=dev, dtype=torch.float64)
        pos = inverse_cdf(probs, u)
        # A guard: the two-level draw lands on a positive-probability token by construction (its test checks it).
        bad = probs.gather(1, pos.unsqueeze(1)).squeeze(1) <= 0
        if bad.any():
            pos = torch.where(bad, probs.argmax(dim=-1), pos)
        return pos


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """[B] for each row the first token, in vocabulary order, at which the cumulative probability reaches ``u``
    x the row's total: an inverse-CDF draw (``u`` in (0, 1], float64). Two levels, so that no [B, V] float64
    tensor is made or scanned sequentially (at a 152k vocabulary and 128 rows a full float64 cumsum cost more
    on a CPU than the rest of the sampler): the sums of each ``chunk`` tokens, accumulated in float64, find the
    chunk; the chunk's own running total, rescaled to that chunk's sum, finds the token. The rescale keeps the
    two levels consistent, so the token found always has a positive probability; it moves a boundary by at
    most a float32 rounding of the chunk's sum, below the rounding of the probabilities themselves."""
    b, v = probs.shape
    m = v // chunk
    sums = probs[:, :m * chunk].reshape(b, m, chunk).sum(-1)  # a view of the full chunks: no copy
    if m * chunk < v:
        sums = torch.cat([sums, probs[:, m * chunk:].sum(-1, keepdim=True)], dim=1)
    n = sums.shape[1]
    sums = sums.double()  # [B, n]
    run = sums.cumsum(dim=-1)
    target = (u * run[:, -1]).unsqueeze(1)
    ci = torch.searchsorted(run, target).clamp(max=n - 1)  # [B, 1]: the first chunk whose running total reaches it
    local = target - torch.where(ci > 0, run.gather(1, (ci - 1).clamp(min=0)), torch.zeros_like(target))
    idx = ci * chunk + torch.arange(chunk, device=probs.device)  # [B, chunk]
    part = probs.gather(1, idx.clamp(max=v - 1)).masked_fill(idx >= v, 0.0).double().cumsum(dim=-1)
    local = (local * part[:, -1:] / sums.gather(1, ci)).clamp(min=torch.finfo(torch.float64).tiny)
    within = torch.searchsorted(part, local.minimum(part[:, -1:])).clamp(max=chunk - 1)
    return idx.gather(1, within).squeeze(1).clamp(max=v - 1)


def apply_penalties(proc: torch.Tensor, seqs: list[Sequence], rows: list[int], par: torch.Tensor) -> None:
    """Repetition (over prompt + output), then frequency and presence (over the output) penalties, for the
    rows ``rows`` of ``proc`` (their sequences ``seqs``), in one scatter each."""
    dev, cols = proc.device, proc.shape[1]
    ri = torch.tensor(rows, device=dev)
    p = par[ri]
    sub = proc[ri]
    rep = p[:, _REP:_REP + 1]
    if bool((rep != 1.0).any()):
        ids = _padded([s.all_ids for s in seqs], cols, dev)
        seen = torch.zeros(len(rows), cols + 1, dtype=torch.bool, device=dev).scatter_(1, ids, True)[:, :cols]
        seen &= rep != 1.0
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    freq, pres = p[:, _FREQ:_FREQ + 1], p[:, _PRES:_PRES + 1]
    if bool(((freq != 0) | (pres != 0)).any()):
        ids = _padded([s.output_ids for s in seqs], cols, dev)
        counts = torch.zeros(len(rows), cols + 1, dtype=proc.dtype, device=dev).scatter_add_(
            1, ids, torch.ones(ids.shape, dtype=proc.dtype, device=dev))[:, :cols]
        sub = sub - (freq * counts + pres * (counts > 0).to(proc.dtype))
    proc[ri] = sub


def top_p_nucleus(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Zero the tokens outside each top_p < 1 row's nucleus. Only those rows are sorted, and the kept mass
    stays in vocabulary order: every row's inverse-CDF draw walks the same order whether or not a top_p row
    shares its step (a row's token depends only on its own logits, parameters and uniform)."""
    rows = (top_p < 1).nonzero().view(-1)
    if rows.numel() == 0:
        return probs
    sub = probs[rows]
    sorted_p, order = sub.sort(dim=-1, descending=True)
    mass_before = sorted_p.cumsum(dim=-1) - sorted_p
    drop_sorted = mass_before >= top_p[rows].unsqueeze(1) * sorted_p.sum(-1, keepdim=True)
    drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
    probs = probs.clone()
    probs[rows] = sub.masked_fill(drop, 0.0)
    return probs


def returned_logprobs(raw_lp: torch.Tensor, proc: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """[B, V] the logprobs each row returns: raw, or for "processed_logprobs" rows those of the distribution
    they were drawn from. Only rows that ask for them are processed: the raw default is computed as before."""
    if not batch.processed:
        return raw_lp
    out = raw_lp.clone()
    pi = torch.tensor(batch.processed, device=raw_lp.device)
    out[pi] = processed_logprobs(proc[pi], batch.par[pi])
    return out


def constrained_logprobs(raw_lp: torch.Tensor, tokens: torch.Tensor, allowed: torch.Tensor,
                         batch: SamplingBatch) -> list[float | None]:
    """Per row, the token's logprob within its grammar's allowed set (raw minus the log of that set's mass);
    None for rows without a grammar."""
    cons = batch.constrained
    ci = torch.tensor(cons, device=raw_lp.device)
    raw = raw_lp[ci].gather(1, tokens[ci].unsqueeze(1)).squeeze(1)
    mass = torch.logsumexp(raw_lp[ci].masked_fill(~allowed, float("-inf")), dim=-1)
    out: list[float | None] = [None] * len(batch.seqs)
    for j, v in zip(cons, (raw - mass).tolist()):
        out[j] = v
    return out


def top_logprobs(returned: torch.Tensor, batch: SamplingBatch) -> list[dict[int, float] | None]:
    """Per row, its ``logprobs`` most likely tokens and their (returned) logprobs; None for rows not asking."""
    top: list[dict[int, float] | None] = [None] * len(batch.seqs)
    want = batch.want_top
    if not want:
        return top
    seqs = batch.seqs
    k_max = max(seqs[i].sampling.logprobs for i in want)
    vals, idx = returned[torch.tensor(want, device=returned.device)].topk(k_max, dim=-1)
    vals, idx = vals.tolist(), idx.tolist()
    for j, i in enumerate(want):
        k = seqs[i].sampling.logprobs
        top[i] = {int(t): float(v) for t, v in zip(idx[j][:k], vals[j][:k])}
    return top


def processed_logprobs(proc: torch.Tensor, par: torch.Tensor) -> torch.Tensor:
    """[B, V] log-probabilities of the distribution each row samples from (vLLM's "processed_logprobs").

    ``proc``: the rows' logits after penalties and bans; ``par``: their parameter rows. Row-wise (no row's kept
    set depends on another's): divide by T, keep the row's top-k, drop tokens under min_p x the top probability,
    keep the smallest top-p prefix of what is left (the keep rules ``Sampler.draw`` draws with), renormalise.
    Greedy rows: the penalised logits at T = 1, unfiltered (as vLLM's greedy rows). Dropped tokens get -inf.
    """
    greedy = par[:, _GREEDY:_GREEDY + 1] > 0
    x = proc / torch.where(greedy, torch.ones_like(par[:, _T:_T + 1]), par[:, _T:_T + 1])
    kk = torch.where(greedy.squeeze(1), torch.zeros_like(par[:, _TOPK]), par[:, _TOPK]).long()
    if bool((kk > 0).any()):
        kth = x.topk(int(kk.max()), dim=-1).values.gather(1, (kk - 1).clamp(min=0).unsqueeze(1))
        x = x.masked_fill((kk.unsqueeze(1) > 0) & (x < kth), float("-inf"))
    probs = torch.softmax(x, dim=-1)
    min_p = torch.where(greedy, torch.zeros_like(par[:, _MINP:_MINP + 1]), par[:, _MINP:_MINP + 1])
    if bool((min_p > 0).any()):
        probs = probs.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
    top_p = torch.where(greedy, torch.ones_like(par[:, _TOPP:_TOPP + 1]), par[:, _TOPP:_TOPP + 1])
    if bool((top_p < 1).any()):
        sorted_p, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_p.cumsum(dim=-1) - sorted_p
        drop_sorted = (mass_before >= top_p * sorted_p.sum(-1, keepdim=True)) & (top_p < 1)
        probs = probs.masked_fill(torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted), 0.0)
    return torch.log(probs / probs.sum(-1, keepdim=True))
