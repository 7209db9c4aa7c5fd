"""Front ends' sampling options -> the engine's ``SamplingParams``, and the room a prompt leaves for a completion.

The server (OpenAI / vLLM request fields), AReaL (``GenerationHyperparameters``) and TRL (``GRPOConfig`` and
``generation_kwargs``) each spell "not set" and "top-k off" their own way; these functions are the one place
those spellings become the engine's, so the three front ends cannot drift apart.

Example::

    sampling_from_options({"max_new_tokens": 8, "top_k": 0, "temperature": None}, defaults={"temperature": 0.7})
    # SamplingParams(max_new_tokens=8, top_k=-1, temperature=0.7, ...)
"""

from __future__ import annotations

from collections.abc import Mapping

from .config import SamplingParams


def logits_width(policy) -> int | None:
    """How many logits the policy scores per position (its text config's ``vocab_size``, padding included): a top_k
    of at least this keeps every token. None when the config does not say."""
    width = getattr(policy.text_config, "vocab_size", None)
    return width if isinstance(width, int) and width > 0 else None


def top_k_or_off(top_k, vocab_size: int | None = None):
    """The engine's ``top_k``: -1 (off) for None, 0 or -1 (vLLM's and transformers' spellings of off) and, given
    ``vocab_size`` (``logits_width``), for a k that keeps every logit (AReaL's default is 1e8); an integral float
    as an int; anything else as given, for ``SamplingParams`` to refuse by name."""
    if isinstance(top_k, float) and top_k.is_integer():
        top_k = int(top_k)
    if top_k is None or (isinstance(top_k, int) and not isinstance(top_k, bool) and top_k in (0, -1)):
        return -1
    if vocab_size is not None and isinstance(top_k, int) and not isinstance(top_k, bool) and top_k >= vocab_size:
        return -1  # keeps every logit: the same distribution as off, without a top-k over all of them
    return top_k


def sampling_from_options(options: Mapping, defaults: Mapping | None = None,
                          vocab_size: int | None = None) -> SamplingParams:
    """``SamplingParams`` from a front end's options (``SamplingParams`` field names).

    A None value is unset: ``defaults`` (e.g. the model's generation_config), then ``SamplingParams``' own
    default apply. ``top_k`` goes through ``top_k_or_off``. An unknown name, or a value out of range, is an
    ``InvalidRequestError`` naming the field.

    Example::

        sp = sampling_from_options({"max_new_tokens": 16, "top_k": None, "stop": "\\n"}, vocab_size=32000)
        sp.top_k == -1 and sp.stop == ["\\n"]
    """
    merged = {k: v for k, v in (defaults or {}).items() if v is not None}
    merged.update((k, v) for k, v in options.items() if v is not None)
    if "top_k" in merged:
        merged["top_k"] = top_k_or_off(merged["top_k"], vocab_size)
    return SamplingParams.from_dict(merged)


def completion_room(prompt_len: int, max_model_len: int) -> int:
    """Tokens a completion may add after a prompt of ``prompt_len`` tokens within ``max_model_len`` (0 or less:
    the prompt alone fills the context)."""
    return max_model_len - prompt_len
