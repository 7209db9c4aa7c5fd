"""Output handling in one place: stop checks, incremental detokenizing, and stream deltas.

Stop strings follow vLLM: a match counts only where it ends after the text of the first
``min_new_tokens`` tokens, and the final text is cut before it. While streaming, text a stop string
may still cut, and the bytes of an incomplete UTF-8 character, are held back until they are settled.
"""

from __future__ import annotations

from .internals import tokenizer_backend
from .request import StreamDelta
from .sequence import Sequence


def _stream_backend(tokenizer):
    """The ``tokenizers`` backend whose DecodeStream can decode a fast tokenizer's output incrementally, or None
    (slow tokenizers, and those whose decode cleans up spaces afterwards, are decoded whole)."""
    backend = tokenizer_backend(tokenizer)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    try:
        from tokenizers import Tokenizer
        from tokenizers.decoders import DecodeStream  # noqa: F401  (tokenizers >= 0.21)
    except ImportError:
        return None
    return backend if isinstance(backend, Tokenizer) else None


def eos_token_ids(policy) -> list[int]:
    """EOS ids from the generation config (one or a list) and the tokenizer."""
    ids = set()
    gc = getattr(policy.base_model, "generation_config", None)
    e = getattr(gc, "eos_token_id", None) if gc is not None else None
    for x in (e if isinstance(e, (list, tuple)) else [e]):
        if isinstance(x, int):
            ids.add(x)
    if policy.tokenizer.eos_token_id is not None:
        ids.add(policy.tokenizer.eos_token_id)
    return sorted(ids)


class OutputProcessor:
    def __init__(self, tokenizer, eos_ids: list[int], max_model_len: int):
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.max_model_len = max_model_len
        self._backend = _stream_backend(tokenizer)

    def full_text(self, s: Sequence) -> str:
        return self.tokenizer.decode(s.output_ids, skip_special_tokens=s.sampling.skip_special_tokens)

    def text(self, s: Sequence) -> str:
        """``tokenizer.decode(output_ids)``, without decoding the whole output every token: the new tokens go
        through the tokenizer's DecodeStream; while it holds bytes back (a character split across tokens, or a
        token that adds no text) the whole output is decoded instead, so the result is always the full
        decode's."""
        if self._backend is None:
            return self.full_text(s)
        from tokenizers.decoders import DecodeStream

        ids, st = s.output_ids, s.detok
        if st is None or st[2] > len(ids):
            st = s.detok = [DecodeStream(skip_special_tokens=s.sampling.skip_special_tokens), "", 0, True]
        try:
            for t in ids[st[2]:]:
                piece = st[0].step(self._backend, t)
                st[3] = piece is not None
                if piece:
                    st[1] += piece
        except Exception:  # noqa: BLE001  (any stream failure: decode whole, from scratch next time)
            s.detok = None
            return self.full_text(s)
        st[2] = len(ids)
        return st[1] if st[3] else self.full_text(s)

    def check_stop(self, s: Sequence, tok: int):
        """(finish_reason, stop_reason) after ``tok`` was appended, or (None, None) to go on."""
        sp = s.sampling
        n = len(s.output_ids)
        if n >= sp.min_new_tokens:
            if tok in sp.stop_token_ids:
                return "stop", tok
            if not sp.ignore_eos and tok in self.eos_ids:
                return "stop", None
            if sp.stop:
                text = self.text(s)
                protected = self._protected_chars(s)
                hits = [(i, x) for x in sp.stop if (i := text.find(x, max(0, protected - len(x) + 1))) >= 0]
                if hits:
                    idx, x = min(hits)
                    s.text = text[:idx]
                    s.stop_text_truncated = True
                    return "stop", x
        if n >= sp.max_new_tokens or s.num_tokens >= self.max_model_len:
            return "length", None
        return None, None

    def _protected_chars(self, s: Sequence) -> int:
        k = s.sampling.min_new_tokens
        if k == 0:
            return 0
        if s.protected_chars is None:  # the text of the first min_new_tokens tokens, decoded once
            s.protected_chars = len(self.tokenizer.decode(
                s.output_ids[:k], skip_special_tokens=s.sampling.skip_special_tokens).rstrip("\ufffd"))
        return s.protected_chars

    def finalize_text(self, s: Sequence) -> None:
        if not s.stop_text_truncated:
            s.text = self.full_text(s)
        s.detok = None

    def delta(self, s: Sequence, sent_tokens: int, sent_chars: int, finished: bool):
        """The StreamDelta of what ``s`` has that was not sent yet (None when nothing is ready), with the new
        (sent_tokens, sent_chars)."""
        text = s.text if finished else self.text(s)
        if not finished:
            text = text.rstrip("\ufffd")  # an incomplete UTF-8 sequence: wait for its last byte
            if s.sampling.stop:  # hold back what a stop string still being matched could cut
                text = text[: max(0, len(text) - max(map(len, s.sampling.stop)) + 1)]
        if not finished and len(s.output_ids) <= sent_tokens:
            return None, sent_tokens, sent_chars
        new_text = text[sent_chars:] if len(text) >= sent_chars else ""
        d = sent_tokens
        delta = StreamDelta(
            s.request_id, s.sample_index, s.output_ids[d:], s.output_logprobs[d:], s.output_versions[d:], new_text,
            None if s.top_logprobs is None else s.top_logprobs[d:], s.finish_reason if finished else None,
            s.stop_reason if finished else None, s.to_output() if finished else None)
        if d == 0 and s.prompt_scores is not None:  # scored at prefill: a stream can echo the prompt first
            delta.prompt_logprobs = s.prompt_scores.as_dicts(s.sampling.prompt_logprobs or 0)[0]
        return delta, len(s.output_ids), max(sent_chars, len(text))
