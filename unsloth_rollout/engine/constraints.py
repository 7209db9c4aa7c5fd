"""Structured outputs: one grammar per sample, an allowed-token mask each step (llguidance).

``SamplingParams(structured_outputs=StructuredOutputs(json=schema))`` asks that every sample's output match a
JSON schema (or any JSON object, a regex, one of some strings, a Lark grammar). The engine compiles it once per
request (``GrammarCompiler.compile``), gives each sample its own matcher (``SequenceConstraint``); the sampler's
``constrain`` step sets every token the matcher rejects to -inf before sampling, and the sampled token advances
the matcher. Once the grammar is complete, only the EOS ids and the request's stop token ids are allowed.

Logprobs keep the engine's contract: ``log_softmax(raw_logits / T)[token]``, the unconstrained policy's, which
is what a trainer's forward recomputes. ``GenerationOutput.output_constrained_logprobs`` holds the same token's
logprob under the distribution it was drawn from: renormalised over the tokens the grammar allowed.

llguidance is optional; without it a constrained request is refused by name. Example::

    >>> sp = SamplingParams(max_new_tokens=64, structured_outputs={"json": {"type": "object"}})
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass

import torch

from ..errors import InvalidRequestError

# JSON as json.dumps writes it (and chat templates' tojson render it): the tokens a model samples are the tokens
# its next turn's template renders back, and a random model cannot pad an answer with whitespace forever.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass
class StructuredOutputs:
    """What a sample's output must match; give exactly one field (vLLM's ``structured_outputs`` names).

    Args:
        json: a JSON schema (a dict, or its JSON text).
        json_object: any JSON object.
        regex: a regular expression the whole output matches.
        choice: one of these strings.
        grammar: a Lark grammar in llguidance's dialect (``%json {...}`` embeds a schema, ``<[id]>`` a token).
    """

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self):
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise InvalidRequestError("structured_outputs", f"structured_outputs needs exactly one of {_KINDS}, "
                                                            f"got {given or 'none'}")
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except json.JSONDecodeError as e:
                raise InvalidRequestError("structured_outputs.json", f"structured_outputs.json is not JSON: {e}") \
                    from None
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise InvalidRequestError("structured_outputs.json", "structured_outputs.json must be a JSON schema "
                                                                 f"(an object), got {type(self.json).__name__}")
        if self.choice is not None and (not isinstance(self.choice, (list, tuple)) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            raise InvalidRequestError("structured_outputs.choice",
                                      "structured_outputs.choice must be a non-empty list of non-empty strings")
        for k in ("regex", "grammar"):
            if getattr(self, k) is not None and not isinstance(getattr(self, k), str):
                raise InvalidRequestError(f"structured_outputs.{k}", f"structured_outputs.{k} must be a string")

    @classmethod
    def from_dict(cls, d) -> "StructuredOutputs":
        if isinstance(d, StructuredOutputs):
            return d
        if not isinstance(d, dict):
            raise InvalidRequestError("structured_outputs", "structured_outputs must be an object")
        unknown = sorted(set(d) - set(_KINDS))
        if unknown:
            raise InvalidRequestError(f"structured_outputs.{unknown[0]}",
                                      f"structured_outputs.{unknown[0]} is not supported; supported: {list(_KINDS)}")
        return cls(**d)

    def grammar_text(self) -> str:
        """The llguidance grammar text."""
        import llguidance

        if self.json is not None or self.json_object:
            schema = {"type": "object"} if self.json_object else self.json
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_STYLE)
        if self.regex is not None:
            return llguidance.LLMatcher.grammar_from_regex(self.regex)
        if self.choice is not None:
            return llguidance.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in self.choice))
        return llguidance.LLMatcher.grammar_from_lark(self.grammar)


class SequenceConstraint:
    """One sample's grammar state: which tokens may come next, advanced by each sampled token."""

    def __init__(self, matcher, words: int):
        self.matcher = matcher
        self.words = words  # int32 words of one bitmask row

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed-token bitmask (bit t of word t // 32 set = token t allowed) into ``bitmask[row]``."""
        v = bitmask[row]
        self.matcher.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * v.element_size())

    @property
    def accepting(self) -> bool:
        return self.matcher.is_accepting()

    def error(self) -> str | None:
        return self.matcher.get_error() if self.matcher.is_error() else None

    def advance(self, token: int) -> str | None:
        """Consume the sampled ``token``; an error message when the grammar rejects it (never for masked tokens)."""
        if self.matcher.consume_token(int(token)):
            return None
        return self.matcher.get_error() or f"token {token} rejected by the grammar"


class CompiledGrammar:
    """A request's grammar, checked against the tokenizer; ``matcher()`` gives each sample its own state."""

    def __init__(self, first_matcher, words: int):
        self._first = first_matcher
        self._words = words
        self._used = False

    def matcher(self) -> SequenceConstraint:
        if not self._used:
            self._used = True
            return SequenceConstraint(self._first, self._words)
        return SequenceConstraint(self._first.deep_copy(), self._words)


class GrammarCompiler:
    """Compiles StructuredOutputs for one tokenizer (wrapped for llguidance once, on first use)."""

    def __init__(self, tokenizer):
        self._hf = tokenizer
        self._ll = None
        self._lock = threading.Lock()

    def ll_tokenizer(self):
        with self._lock:
            if self._ll is None:
                try:
                    import llguidance.hf
                except ImportError:
                    raise InvalidRequestError(
                        "structured_outputs", "structured outputs need the llguidance package "
                        "(pip install 'unsloth_rollout[structured]')") from None
                try:
                    self._ll = llguidance.hf.from_tokenizer(self._hf, n_vocab=len(self._hf))
                except ValueError as e:  # a slow (Python) tokenizer: llguidance reads the Rust one
                    raise InvalidRequestError("structured_outputs", f"structured outputs need a fast tokenizer: {e}") \
                        from None
            return self._ll

    def compile(self, spec: StructuredOutputs, field: str = "structured_outputs") -> CompiledGrammar:
        """Check ``spec`` against the tokenizer; an InvalidRequestError naming ``field`` when it does not compile."""
        tok = self.ll_tokenizer()  # first: without llguidance, the refusal says what to install
        import llguidance

        try:
            grammar = spec.grammar_text()
        except (ValueError, TypeError) as e:
            raise InvalidRequestError(field, f"{field}: {e}") from None
        matcher = llguidance.LLMatcher(tok, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(field, f"{field} does not compile: {matcher.get_error().splitlines()[0]}")
        return CompiledGrammar(matcher, (tok.vocab_size + 31) // 32)


def _unpack(bitmask: torch.Tensor, cols: int) -> torch.Tensor:
    """[n, words] int32 bitmask -> [n, cols] bool (tokens past the mask's vocabulary: not allowed)."""
    bits = torch.arange(32, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).bool().view(bitmask.shape[0], -1)
    if allowed.shape[1] >= cols:
        return allowed[:, :cols]
    pad = torch.zeros(allowed.shape[0], cols - allowed.shape[1], dtype=torch.bool)
    return torch.cat([allowed, pad], dim=1)


def allowed_tokens(seqs: list, cols: int, eos_ids: list[int]) -> tuple[torch.Tensor, dict[int, str]]:
    """[len(seqs), cols] bool: the tokens each constrained sequence's grammar allows next (EOS ids and the
    request's stop token ids too, once the grammar is complete), and {row: error} for matchers in error."""
    bitmask = torch.zeros(len(seqs), seqs[0].constraint.words, dtype=torch.int32)
    errors = {}
    for j, s in enumerate(seqs):
        s.constraint.fill(bitmask, j)
        err = s.constraint.error()
        if err is not None:
            errors[j] = err
    allowed = _unpack(bitmask, cols)
    for j, s in enumerate(seqs):
        if s.constraint.accepting:
            stop = [t for t in set(eos_ids) | set(s.sampling.stop_token_ids) if t < cols]
            allowed[j, stop] = True
    return allowed, errors
