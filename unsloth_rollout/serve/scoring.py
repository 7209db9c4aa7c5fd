"""Prompt scoring and truncation on the server: vLLM's ``prompt_logprobs`` / ``echo`` shapes and
``truncate_prompt_tokens``. The scores themselves come from the engine (``SamplingParams(prompt_logprobs=k)``).
"""

from __future__ import annotations

from .protocol import APIError


def _lp(v: float) -> float:
    return max(float(v), -9999.0)  # JSON has no -inf; vLLM clamps the same way


def truncate_prompt(state, ids: list[int], req, param: str, has_images: bool = False) -> list[int]:
    """``truncate_prompt_tokens`` (-1: max_model_len) keeps the last (``truncation_side="left"``, vLLM's default)
    or first N tokens; a prompt with images is not cut (it would split an image's placeholders): 400."""
    k = req.truncate_prompt_tokens
    if k is None:
        return ids
    limit = state.engine.max_model_len
    if k == -1:
        k = limit
    if k > limit:
        raise APIError(f"truncate_prompt_tokens ({k}) cannot be greater than max_model_len ({limit})",
                       param="truncate_prompt_tokens")
    if k == 0:
        raise APIError("truncate_prompt_tokens must be -1 or >= 1", param="truncate_prompt_tokens")
    if len(ids) <= k:
        return ids
    if has_images:
        raise APIError(f"truncate_prompt_tokens={k} would cut a prompt of {len(ids)} tokens that holds images",
                       param="truncate_prompt_tokens")
    return ids[:k] if req.truncation_side == "right" else ids[-k:]


def prompt_logprobs_json(state, out) -> list | None:
    """vLLM's ``prompt_logprobs``: [None, {"<token id>": {"logprob", "rank", "decoded_token"}, ...}, ...], the
    prompt's own token first, then the top k (ranks 1..k)."""
    if out.prompt_logprobs is None:
        return None
    result = [None]
    for d, rank in zip(out.prompt_logprobs[1:], out.prompt_logprob_ranks[1:]):
        entry = {}
        for j, (t, v) in enumerate(d.items()):
            # A top-k token's rank: everything more likely is in the top k too (the prompt's token included).
            r = rank if j == 0 else 1 + sum(1 for w in d.values() if w > v)
            entry[t] = {"logprob": _lp(v), "rank": r, "decoded_token": state.token_str(t)}
        result.append(entry)
    return result


def echo_logprobs(out):
    """(ids, logprobs, tops) of an echoed completion: the prompt's (first None) then the output's."""
    return _echoed(out.prompt_ids, out.prompt_logprobs, out.output_ids, out.output_logprobs, out.top_logprobs)


def echo_stream_logprobs(prompt_ids, delta):
    """(ids, logprobs, tops) of a stream's first chunk with echo: the prompt's, then the delta's tokens (vLLM
    streams the prompt in the first chunk of each choice)."""
    return _echoed(prompt_ids, delta.prompt_logprobs, delta.token_ids, delta.logprobs, delta.top_logprobs)


def _echoed(prompt_ids, prompt_lps, ids, lps, tops):
    prompt = prompt_lps or [None] * len(prompt_ids)
    all_lps = [None if d is None else next(iter(d.values())) for d in prompt] + list(lps)
    all_tops = [None if d is None else dict(list(d.items())[1:]) for d in prompt] + list(tops or [{}] * len(ids))
    return list(prompt_ids) + list(ids), all_lps, all_tops
