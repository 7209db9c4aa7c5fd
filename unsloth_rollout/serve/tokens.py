"""vLLM's token-in / token-out generation (``POST /inference/v1/generate``): token ids in, token ids and logprobs
out, vLLM's ``SamplingParams`` as JSON. The client renders the prompt itself (Prime Intellect's ``verifiers`` train
client through ``renderers.client.generate``, prime-rl), so nothing is templated or detokenized here.

The request becomes one engine ``GenerationRequest``, prepared, submitted and rendered as /v1/completions' are (one
engine path: same sampler, same logprobs, same pause gate and disconnect abort). vLLM's body is a complete
``SamplingParams``: a field left out takes vLLM's dataclass default, not the model's generation_config (only
``max_tokens`` left out means the room the prompt leaves, as vLLM). Fields that would change the output and that
the engine cannot honour (``logit_bias``, ``features`` ...) are a 400 naming the field, never ignored.

Example::

    body = {"model": "tiny", "token_ids": [1, 2, 3],
            "sampling_params": {"temperature": 1.0, "max_tokens": 8, "logprobs": 1, "stop_token_ids": [2]}}
    # -> {"request_id": "generate-tokens-...", "choices": [{"index": 0, "token_ids": [...], "finish_reason": ...,
    #     "logprobs": {"content": [{"token": "token_id:17", "logprob": -3.2, ...}, ...]}}], "prompt_token_ids": ...}
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import Field, field_validator
from starlette.background import BackgroundTask

from ..engine import GenerationRequest, InvalidRequestError
from ..engine.options import logits_width, sampling_from_options
from ..models.families import family_of
from .prepare import _max_tokens
from .protocol import INT64_MAX, INT64_MIN, APIError, StreamOptions, _Base, error_body
from .render import _check_errors, _sse, _usage
from .scoring import _lp, prompt_logprobs_json, truncate_prompt
from .state import ClientDisconnected, ServerState, run_until_disconnect
from .streaming import _in_band_error, _usage_wanted

SP = "sampling_params"
# Engine field -> vLLM SamplingParams field, for the ``param`` of a 400.
_VLLM_NAME = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}


class TokenSamplingParams(_Base):
    """vLLM's ``SamplingParams`` as the body's ``sampling_params`` (JSON). None: vLLM's default."""

    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # 0 or -1: off
    min_p: float | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    max_tokens: int | None = None  # None: the room the prompt leaves in max_model_len
    min_tokens: int | None = None
    logprobs: int | None = None  # k: the sampled token's logprob and the top k; None: no logprobs
    prompt_logprobs: int | None = None
    structured_outputs: dict[str, Any] | None = None  # json / regex / choice / grammar
    truncate_prompt_tokens: int | None = None
    # Output-text settings: this route returns no text, so they change nothing.
    detokenize: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    # vLLM fields the engine does not implement: refused when set (each would change which tokens come out).
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    logits_processors: list[Any] | None = None
    guided_decoding: dict[str, Any] | None = None
    best_of: int | None = None


class TokenGenerateRequest(_Base):
    """POST /inference/v1/generate (vLLM's ``GenerateRequest``).

    Example body (``renderers.client.generate``, as verifiers' train client sends it)::

        {"model": "tiny", "token_ids": [747, 82, 88], "sampling_params": {"temperature": 1.0, "max_tokens": 64,
         "stop_token_ids": [748], "logprobs": 1, "skip_special_tokens": false}}
    """

    token_ids: list[int] = Field(min_length=1)
    sampling_params: TokenSamplingParams = Field(default_factory=TokenSamplingParams)
    model: str | None = None
    request_id: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool | None = None  # also report image placeholder ranges (mm_placeholders)
    content_parts: list[dict[str, Any]] | None = None  # images, in the order of their placeholders in token_ids
    output_mode: Literal["tokens", "text"] | None = "tokens"
    cache_salt: str | None = None  # accepted, as on the other routes: it changes no output (the cache is not salted)
    priority: int | None = 0
    features: dict[str, Any] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None

    @field_validator("token_ids")
    @classmethod
    def _non_negative(cls, v: list[int]) -> list[int]:
        if any(t < 0 for t in v):
            raise ValueError("token_ids must not contain negative values")
        return v


def _refuse_unsupported(req: TokenGenerateRequest) -> None:
    """400 naming the first field set that the engine cannot honour (ignoring it would change the answer)."""
    sp = req.sampling_params
    for name in ("logit_bias", "allowed_token_ids", "bad_words", "logits_processors"):
        if getattr(sp, name):
            raise APIError(f"{SP}.{name} is not supported by this server", param=f"{SP}.{name}")
    if sp.guided_decoding is not None:
        raise APIError(f"{SP}.guided_decoding is not supported; use {SP}.structured_outputs",
                       param=f"{SP}.guided_decoding")
    if sp.best_of is not None and sp.best_of != (sp.n or 1):
        raise APIError(f"{SP}.best_of must equal n on this server, got {sp.best_of}", param=f"{SP}.best_of")
    if sp.logprobs is not None and sp.logprobs < 0:
        raise APIError(f"{SP}.logprobs must be at least 0 on this server (-1, the whole vocabulary, is not "
                       "served)", param=f"{SP}.logprobs")
    if req.features is not None:
        raise APIError("features (vLLM-serialized multimodal tensors) is not supported; send the images as "
                       "content_parts", param="features")
    for name in ("kv_transfer_params", "ec_transfer_params"):
        if getattr(req, name):
            raise APIError(f"{name} (disaggregated serving) is not supported by this server", param=name)
    if req.priority:
        raise APIError(f"priority {req.priority} needs priority scheduling, which this server does not do",
                       param="priority")
    if req.output_mode != "tokens":
        raise APIError("output_mode 'text' is not supported; this route returns tokens", param="output_mode")
    if req.stream and sp.prompt_logprobs is not None:
        raise APIError(f"{SP}.prompt_logprobs is not available when stream is true", param=f"{SP}.prompt_logprobs")
    if req.stream_options and not req.stream:
        raise APIError("stream_options can only be set when stream is true", param="stream_options")


async def _images(state: ServerState, parts: list[dict] | None) -> list:
    """The images of ``content_parts`` (``{"type": "image_url", "url": ...}``), in order, under the media policy."""
    images = []
    for i, part in enumerate(parts or []):
        where = f"content_parts[{i}]"
        kind = part.get("type")
        if kind not in ("image_url", "image"):
            raise APIError(f"{where}: only image parts are supported, got type {kind!r}", param=where)
        if not state.engine.policy.is_vlm:
            raise APIError(f"{where}: this model takes no images", param=where)
        src = part.get("url") or part.get(kind)
        url = src.get("url") if isinstance(src, dict) else src
        if not isinstance(url, str) or not url:
            raise APIError(f"{where}: expected an image URL", param=where)
        if len(images) >= state.media.max_images:
            raise APIError(f"At most {state.media.max_images} image(s) may be given in one request.",
                           param="content_parts")
        images.append(await state.media.load(url, where))
    return images


def _engine_field(field: str) -> str:
    """The request field an engine refusal names."""
    if field in ("input_ids", "messages"):
        return "token_ids"
    if field == "images":
        return "content_parts"
    if field == "lora_name":
        return "model"
    return f"{SP}.{_VLLM_NAME.get(field, field)}"


def _as_api_error(e: InvalidRequestError) -> APIError:
    param = _engine_field(e.field)
    message = str(e).replace(e.field, param, 1)
    for engine_name, vllm_name in _VLLM_NAME.items():
        message = message.replace(engine_name, vllm_name)
    return APIError(message, param=param)


def _sampling(state: ServerState, sp: TokenSamplingParams, max_tokens: int):
    limits = state.settings
    n = sp.n if sp.n is not None else 1
    if n > limits.max_n:
        raise APIError(f"{SP}.n must be at most {limits.max_n}, got {n}", param=f"{SP}.n")
    if sp.prompt_logprobs is not None and sp.prompt_logprobs > limits.max_logprobs:
        raise APIError(f"{SP}.prompt_logprobs must be at most {limits.max_logprobs} (the server's "
                       f"--max-logprobs), got {sp.prompt_logprobs}", param=f"{SP}.prompt_logprobs")
    options = dict(
        max_new_tokens=max_tokens, min_new_tokens=sp.min_tokens, temperature=sp.temperature, top_p=sp.top_p,
        top_k=sp.top_k, min_p=sp.min_p, repetition_penalty=sp.repetition_penalty,
        frequency_penalty=sp.frequency_penalty, presence_penalty=sp.presence_penalty, stop=sp.stop,
        stop_token_ids=sp.stop_token_ids, ignore_eos=sp.ignore_eos, seed=sp.seed, logprobs=sp.logprobs, n=n,
        logprobs_mode=limits.logprobs_mode, prompt_logprobs=sp.prompt_logprobs,
        structured_outputs=sp.structured_outputs)
    try:  # no generation_config defaults: vLLM's body is a complete SamplingParams
        return sampling_from_options(options, None, vocab_size=logits_width(state.engine.policy))
    except InvalidRequestError as e:
        raise _as_api_error(e) from None


class _Truncation:
    """``truncate_prompt_tokens`` in the shape ``scoring.truncate_prompt`` reads (vLLM cuts from the left)."""

    truncation_side = "left"

    def __init__(self, k: int | None):
        self.truncate_prompt_tokens = k


def _placeholders(state: ServerState, ids: list[int], n_images: int) -> dict | None:
    """vLLM's ``mm_placeholders`` of an expanded prompt: each image's run of image tokens, ``{"offset", "length"}``
    (Qwen-VL families, where vLLM's placeholder range is exactly that run); None without images."""
    if not n_images:
        return None
    tok = getattr(state.engine.policy.config, "image_token_id", None)
    runs, i = [], 0
    while i < len(ids):
        if ids[i] == tok:
            j = i
            while j < len(ids) and ids[j] == tok:
                j += 1
            runs.append({"offset": i, "length": j - i})
            i = j
        else:
            i += 1
    return {"image": runs}


async def _prepare(state: ServerState, req: TokenGenerateRequest) -> tuple[GenerationRequest, list[int], list]:
    """The engine request (prepared: images processed, placeholders expanded), its expanded prompt and images."""
    _refuse_unsupported(req)
    lora = state.adapter_for(req.model)
    images = await _images(state, req.content_parts)
    if images and req.return_token_ids and not family_of(state.engine.policy.config).grid_images:
        raise APIError("return_token_ids with images reports placeholder ranges for Qwen-VL families only",
                       param="return_token_ids")
    sp = req.sampling_params
    try:
        ids = truncate_prompt(state, list(req.token_ids), _Truncation(sp.truncate_prompt_tokens), "token_ids",
                              has_images=bool(images))
    except APIError as e:
        raise APIError(e.message, param=f"{SP}.truncate_prompt_tokens") from None
    greq = GenerationRequest(input_ids=ids, images=images or None, request_id=uuid.uuid4().hex, lora_name=lora)
    try:
        greq.prepared = state.engine.prepare(greq)
    except InvalidRequestError as e:
        raise _as_api_error(e) from None
    expanded = greq.prepared.prompt_ids
    max_tokens = _max_tokens(state, len(expanded), sp.max_tokens, f"{SP}.max_tokens", "token_ids")
    greq.sampling = _sampling(state, sp, max_tokens)
    return greq, expanded, images


def _logprobs(ids, lps, tops, k: int) -> dict:
    """vLLM's token-route logprobs: per token ``{"token": "token_id:<id>", "logprob", "bytes": None,
    "top_logprobs"}``, the top list the sampled token first, then the others most likely first, max(k, 1) long."""
    content = []
    for i, (t, lp) in enumerate(zip(ids, lps)):
        others = sorted(((u, v) for u, v in (tops[i] if tops else {}).items() if u != t), key=lambda kv: -kv[1])
        top = [(t, lp), *others][:max(k, 1)]
        content.append({"token": f"token_id:{t}", "logprob": _lp(lp), "bytes": None,
                        "top_logprobs": [{"token": f"token_id:{u}", "logprob": _lp(v), "bytes": None}
                                         for u, v in top]})
    return {"content": content}


def _choice(k: int | None, index: int, ids, lps, tops, finish, stop_reason) -> dict:
    return {"index": index, "logprobs": None if k is None else _logprobs(ids, lps, tops, k),
            "finish_reason": finish, "stop_reason": stop_reason, "token_ids": list(ids), "routed_experts": None}


async def generate_tokens(state: ServerState, req: TokenGenerateRequest, raw) -> Response:
    """The route's handler: wait at the pause gate, prepare, run (or stream), answer in vLLM's shape."""
    state.counters[("requests", "generate")] += 1
    await state.wait_gate()
    greq, expanded, images = await _prepare(state, req)
    rid = f"generate-tokens-{raw.headers.get('x-request-id') or req.request_id or uuid.uuid4().hex}"
    state.counters["prompt_tokens"] += len(expanded)
    k = req.sampling_params.logprobs
    prompt = {"prompt_token_ids": expanded, "mm_placeholders": _placeholders(state, expanded, len(images))}
    if req.stream:
        try:
            stream = state.engine.stream_many([greq])
        except InvalidRequestError as e:
            raise _as_api_error(e) from None
        return StreamingResponse(_events(state, req, stream, rid, k, prompt), media_type="text/event-stream",
                                 background=BackgroundTask(stream.close))
    try:
        results = await run_until_disconnect(state.engine, [greq], raw)
    except ClientDisconnected:
        return Response(status_code=499)
    except InvalidRequestError as e:
        raise _as_api_error(e) from None
    (outs,) = results
    _check_errors(outs)
    choices = []
    for out in outs:
        state.count_finished(out)
        choices.append(_choice(k, out.sample_index, out.output_ids, out.output_logprobs, out.top_logprobs,
                               out.finish_reason or "stop", out.stop_reason))
    scored = greq.sampling.prompt_logprobs is not None
    return JSONResponse({
        "request_id": rid, "model": req.model or state.model_name, "created": int(time.time()), "choices": choices,
        "usage": _usage(len(expanded), sum(len(o.output_ids) for o in outs)),
        "prompt_logprobs": prompt_logprobs_json(state, outs[0]) if scored else None, **prompt,
        "kv_transfer_params": None})


async def _events(state: ServerState, req: TokenGenerateRequest, stream, rid: str, k: int | None, prompt: dict):
    """vLLM's streamed shape: one chunk per engine delta ``{"request_id", "choices": [one choice], "usage"}`` (the
    first also carries ``prompt_token_ids`` / ``mm_placeholders``), a usage chunk when ``stream_options`` asks, then
    ``[DONE]``."""
    include_usage, continuous = _usage_wanted(req)
    prompt_len = len(prompt["prompt_token_ids"])
    ntoks: dict[int, int] = {}
    try:
        async for _, d in stream:
            ntoks[d.sample_index] = ntoks.get(d.sample_index, 0) + len(d.token_ids)
            if d.finish_reason is not None:
                state.count_finished(d.output)
                if d.output.error:
                    yield _sse(error_body(f"generation failed: {d.output.error}", 500))
            elif not d.token_ids:
                continue
            body = {"request_id": rid, "choices": [_choice(k, d.sample_index, d.token_ids, d.logprobs,
                                                           d.top_logprobs, d.finish_reason, d.stop_reason)],
                    "usage": _usage(prompt_len, sum(ntoks.values())) if continuous else None, **prompt}
            prompt = {}
            yield _sse(body)
        if include_usage:
            yield _sse({"request_id": rid, "choices": [], "usage": _usage(prompt_len, sum(ntoks.values()))})
    except Exception as e:
        yield _in_band_error(e)
    yield "data: [DONE]\n\n"
