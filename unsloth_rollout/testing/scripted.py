"""A scripted sampler: the model "writes" what a test chooses (a tool call a random tiny model would never write),
and a request can be aborted at an exact output length, so a test reaches every finish reason deterministically.

Example::

    with ForcedOutput(engine, tokenizer.encode('<tool_call>\\n{"name": "f", "arguments": {}}\\n</tool_call>')):
        ...   # every sequence emits those ids, then EOS
    with ForcedOutput(engine, None, abort_at=7):
        ...   # the model samples as usual; each request is aborted once its output holds 7 tokens
"""

from __future__ import annotations

import torch


class ForcedOutput:
    """A fixed-output double at the sampler level: every sequence emits ``ids`` then EOS.

    It wraps the engine's real Sampler: the sampler runs as usual, then each row's token is replaced by
    the scripted one (by the row's output position) and its logprob by the model's own
    ``log_softmax(logits / T)`` of that token, so everything past the sampler (stop checks,
    detokenization, logprobs, versions, the server and ArealOpenAI) runs unchanged, as if the model had
    sampled the script. Use as a context manager.
    """

    def __init__(self, rollout_engine, ids, abort_at: int | None = None):
        """``ids``: the token ids to emit, ``ids(seq) -> token ids`` choosing per sequence (by its prompt), or None
        to keep the sampled tokens (a grammar-constrained request stays within its grammar). ``abort_at``: abort
        each request once its output holds that many tokens (``RolloutEngine.abort`` from inside the step lands at
        the next step boundary, right after this step's token), as a client's or trainer's abort would."""
        self.engine = rollout_engine
        self.inner = rollout_engine.core.sampler
        self.script = None if ids is None else ids if callable(ids) else (lambda seq, ids=list(ids): ids)
        self.abort_at = abort_at
        eos = rollout_engine.tokenizer.eos_token_id  # the chat turn's end (<|im_end|>), as a chat model ends
        self.eos = eos if eos is not None else rollout_engine.eos_ids[0]

    def __call__(self, logits, seqs):
        res = self.inner(logits, seqs)
        if self.abort_at is not None:
            for s in seqs:
                if len(s.output_ids) + 1 == self.abort_at:
                    self.engine.abort(s.request_id)
        if self.script is None:
            return res
        temps = torch.tensor([s.sampling.logprob_temperature for s in seqs], device=logits.device).unsqueeze(1)
        raw = torch.log_softmax(logits.float() / temps, dim=-1)
        for i, s in enumerate(seqs):
            n = len(s.output_ids)
            ids = self.script(s)
            t = ids[n] if n < len(ids) else self.eos
            res.tokens[i] = t
            res.logprobs[i] = float(raw[i, t])
        return res

    def __enter__(self):
        self.engine.core.sampler = self  # the core samples each step
        return self

    def __exit__(self, *exc):
        self.engine.core.sampler = self.inner
