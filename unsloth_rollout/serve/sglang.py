"""SGLang's native ``/generate``: its request (SGLang's ``GenerateReqInput`` fields) -> the engine's
``GenerationRequest`` s, and each output -> SGLang's body (``text``, ``output_ids``, ``meta_info``).

Shapes follow SGLang's own server (``sglang/srt/entrypoints/http_server.py``, ``managers/io_struct.py``,
``sampling/sampling_params.py``), so AReaL's ``SGLangBackend`` / ``RemoteSGLangEngine`` and other SGLang clients
send what they already send. Where this server differs from SGLang, it is on purpose and exact:

- logprobs are the server's ``--logprobs-mode`` (raw by default: ``log_softmax(logits / T)``, before penalties and
  top-k / top-p, what a trainer recomputes); SGLang's output logprobs include its penalties;
- ``input_token_logprobs[0]`` is None only where nothing is asked (``logprob_start_len`` -1, SGLang's default) or
  there is no context (position 0); SGLang leaves the first entry None whatever the start, which AReaL's own
  ``parse_score_response`` cannot read (``float(None)``);
- ``meta_info`` has no ``cached_tokens`` (the engine does not count them per request).

Example::

    items, single = await generate_items(state, GenerateRequest(input_ids=[1, 2, 3], return_logprob=True,
                                                                sampling_params={"max_new_tokens": 8}))
    body = sglang_body(state, items[0], output)   # {"text", "output_ids", "meta_info": {...}}
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field

from ..engine import GenerationOutput, GenerationRequest, InvalidRequestError
from ..engine.options import completion_room, logits_width, sampling_from_options
from .prompt import prepare_prompt
from .protocol import APIError, _Base
from .scoring import _lp
from .state import ServerState

SGLANG_MAX_NEW_TOKENS = 128  # SGLang's default when sampling_params leaves max_new_tokens out

# SGLang's sampling_params name -> the engine's SamplingParams field.
_SAMPLING = {"max_new_tokens": "max_new_tokens", "min_new_tokens": "min_new_tokens", "temperature": "temperature",
             "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "frequency_penalty": "frequency_penalty",
             "presence_penalty": "presence_penalty", "repetition_penalty": "repetition_penalty", "stop": "stop",
             "stop_token_ids": "stop_token_ids", "ignore_eos": "ignore_eos",
             "skip_special_tokens": "skip_special_tokens", "n": "n", "sampling_seed": "seed"}
_GRAMMARS = {"json_schema": "json", "regex": "regex"}  # SGLang's constraint -> the engine's structured_outputs key
# Taken and applied here, or no effect on the tokens and their logprobs (only on how SGLang chunks a stream).
_HANDLED = {"no_stop_trim", "spaces_between_special_tokens", "stream_interval", "custom_params"}
_REFUSED = {
    "ebnf": "EBNF grammars are not served (the engine's grammars are llguidance's Lark dialect); use json_schema "
            "or regex",
    "structural_tag": "structural tags are not served; use json_schema or regex",
    "stop_regex": "stop regexes are not served; use stop strings",
    "logit_bias": "logit_bias is not served",
}
# Top-level /generate fields that change what a response holds and that this server does not serve.
_UNSERVED = ("input_embeds", "video_data", "audio_data", "token_ids_logprob", "custom_logit_processor",
             "return_hidden_states", "return_routed_experts", "return_entropy", "session_params",
             "return_sampling_mask", "return_flat_raw_top_logprobs")


class GenerateRequest(_Base):
    """POST /generate, SGLang's ``GenerateReqInput``: one prompt (``text`` or flat ``input_ids``) or a batch (lists
    of them); per-prompt options are a value for all or a list with one per prompt.

    Example body (AReaL's ``SGLangBackend``)::

        {"input_ids": [151644, 872, 198], "image_data": ["<base64 PNG>"], "return_logprob": true, "stream": false,
         "sampling_params": {"max_new_tokens": 64, "temperature": 1.0, "top_p": 1.0, "top_k": 100000000,
                             "stop_token_ids": [151645], "ignore_eos": false, "frequency_penalty": 0.0}}
    """

    rid: str | list[str] | None = None
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    image_data: Any = None  # per prompt: one image or a list; an image is a URL, a data URL or bare base64
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: int | list[int] | None = None  # -1 (default): score no prompt token
    top_logprobs_num: int | list[int] | None = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    lora_path: str | list[str | None] | None = None  # the name of a loaded adapter (per prompt)
    input_embeds: Any = None
    video_data: Any = None
    audio_data: Any = None
    token_ids_logprob: Any = None
    custom_logit_processor: Any = None
    return_hidden_states: Any = None
    return_routed_experts: Any = None
    return_entropy: Any = None
    session_params: Any = None
    return_sampling_mask: Any = None
    return_flat_raw_top_logprobs: Any = None


class PauseGenerationRequest(_Base):
    """POST /pause_generation: ``{"mode": "abort"}`` (``retract`` / ``in_place``: in-flight requests keep their
    tokens and continue on /continue_generation); an empty body is ``abort``, SGLang's default."""

    mode: Literal["abort", "retract", "in_place"] = "abort"


class SGLangUpdateWeightsRequest(_Base):
    """POST /update_weights_from_disk: ``{"model_path": "/ckpt/step-100", "abort_all_requests": true}``."""

    model_path: str = Field(min_length=1)
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | int | None = None


class MemoryOccupationRequest(_Base):
    """POST /release_memory_occupation, /resume_memory_occupation: ``{"tags": ["kv_cache"]}`` (None: all)."""

    tags: list[str] | None = None


class AbortRequest(_Base):
    """POST /abort_request: ``{"rid": "req-1"}`` or ``{"abort_all": true}``."""

    rid: str = ""
    abort_all: bool = False


@dataclass
class Item:
    """One prompt of a /generate request, ready for the engine, with what its response needs."""

    request: GenerationRequest  # prepared: the engine does not redo the prompt
    rid: str  # the response's meta_info id (SGLang's request id)
    return_logprob: bool
    logprob_start_len: int  # -1: no prompt token scored
    top_logprobs_num: int
    no_stop_trim: bool
    text_in_logprobs: bool
    grammar_param: str | None  # the field the prompt's output constraint came from (sampling_params.regex ...)


def refuse_unserved(req: GenerateRequest) -> None:
    """A 400 naming the first field set that this server does not serve."""
    for name in _UNSERVED:
        if getattr(req, name) not in (None, False, [], {}):
            raise APIError(f"{name} is not supported by this server's /generate", param=name)


def _prompts(state: ServerState, req: GenerateRequest) -> tuple[list[list[int]], bool, str]:
    """(prompt ids per prompt, whether the request is a single prompt, the field the prompts came from)."""
    if (req.text is None) == (req.input_ids is None):
        raise APIError("give exactly one of text or input_ids", param="input_ids")
    if req.text is not None:
        single = isinstance(req.text, str)
        ids = [state.tokenizer.encode(t) for t in ([req.text] if single else req.text)]
        field = "text"
    else:
        single = not req.input_ids or isinstance(req.input_ids[0], int)
        ids = [list(req.input_ids)] if single else [list(x) for x in req.input_ids]
        field = "input_ids"
    if not ids:
        raise APIError(f"{field} must not be empty", param=field)
    for k, x in enumerate(ids):
        if not x:
            where = field if single else f"{field}[{k}]"
            raise APIError(f"{where} must not be empty", param=where)
    return ids, single, field


def _per_prompt(req: GenerateRequest, name: str, k: int, count: int, single: bool):
    """A per-prompt option of prompt ``k``: one value for every prompt, or a list with one per prompt (a batch)."""
    value = getattr(req, name)
    if single or not isinstance(value, list):  # a single prompt's image_data list is its images
        return value, name
    if len(value) != count:
        raise APIError(f"{name} has {len(value)} entries for {count} prompts", param=name)
    return value[k], f"{name}[{k}]"


async def _images(state: ServerState, raw, where: str) -> list:
    """The images of one prompt: a URL (data:, file, http(s) under the media policy) or bare base64 each."""
    if raw is None:
        return []
    items = raw if isinstance(raw, list) else [raw]
    if items and not state.engine.policy.is_vlm:
        raise APIError(f"{where}: this model takes no images", param=where)
    if len(items) > state.media.max_images:
        raise APIError(f"At most {state.media.max_images} image(s) may be given in one request.", param=where)
    images = []
    for i, x in enumerate(items):
        at = f"{where}[{i}]" if isinstance(raw, list) else where
        if isinstance(x, dict):  # SGLang's ImageData: {"url": ...}
            x = x.get("url")
        if not isinstance(x, str) or not x:
            raise APIError(f"{at}: expected an image URL or base64 string", param=at)
        scheme = x.split(":", 1)[0].lower() if ":" in x[:12] else ""
        # AReaL sends bare base64 PNGs: read them as the data URL they are (the format is sniffed from the bytes).
        url = x if scheme in ("data", "http", "https", "file") or x.startswith("/") else "data:;base64," + x
        images.append(await state.media.load(url, at))
    return images


def _sampling_options(state: ServerState, sp: dict, where: str) -> tuple[dict, bool]:
    """(the engine's sampling options, no_stop_trim) from one prompt's SGLang ``sampling_params``."""
    options, grammar = {}, None
    for name, value in sp.items():
        if value is None:
            continue  # SGLang: null is the default
        if name in _SAMPLING:
            options[_SAMPLING[name]] = value
        elif name in _GRAMMARS:
            if grammar is not None:
                raise APIError("Only one of regex, json_schema, or ebnf can be set.", param=f"{where}.{name}")
            grammar = {_GRAMMARS[name]: value}
        elif name in _REFUSED:
            raise APIError(f"{where}.{name}: {_REFUSED[name]}", param=f"{where}.{name}")
        elif name not in _HANDLED:
            raise APIError(f"{where}.{name} is not a sampling parameter of SGLang's /generate",
                           param=f"{where}.{name}")
    for name in ("ignore_eos", "skip_special_tokens", "no_stop_trim", "spaces_between_special_tokens"):
        if sp.get(name) is not None and not isinstance(sp[name], bool):
            raise APIError(f"{where}.{name} must be a boolean, got {sp[name]!r}", param=f"{where}.{name}")
    if sp.get("spaces_between_special_tokens") is False:
        name = f"{where}.spaces_between_special_tokens"
        raise APIError(f"{name}: only true is served", param=name)
    if grammar is not None:
        options["structured_outputs"] = grammar
    n = options.get("n", 1)
    if isinstance(n, int) and n > state.settings.max_n:
        raise APIError(f"{where}.n must be at most {state.settings.max_n}, got {n}", param=f"{where}.n")
    options["logprobs_mode"] = state.settings.logprobs_mode
    return options, bool(sp.get("no_stop_trim"))


def _grammar_param(sp: dict, sp_where: str) -> str | None:
    return next((f"{sp_where}.{name}" for name in _GRAMMARS if sp.get(name) is not None), None)


def _engine_param(e: InvalidRequestError, sp_where: str, prompt_where: str, image_where: str,
                  grammar_param: str | None = None) -> str:
    """The /generate field an engine refusal is about."""
    field = e.field or ""
    if field in ("input_ids", "messages"):
        return prompt_where
    if field == "images":
        return image_where
    if field in ("logprobs", "prompt_logprobs"):
        return "top_logprobs_num"
    if field == "lora_name":
        return "lora_path"
    if field.startswith("structured_outputs"):
        return grammar_param or sp_where
    by_engine = {v: k for k, v in _SAMPLING.items()}
    return f"{sp_where}.{by_engine[field]}" if field in by_engine else field


async def generate_items(state: ServerState, req: GenerateRequest) -> tuple[list[Item], bool]:
    """The request's prompts as engine requests (prepared: images processed, placeholders expanded), and whether
    the request was a single prompt. Every refusal is a 400 naming the field, before anything is queued."""
    refuse_unserved(req)
    prompts, single, field = _prompts(state, req)
    count, engine = len(prompts), state.engine
    items = []
    for k, ids in enumerate(prompts):
        prompt_where = field if single else f"{field}[{k}]"
        sp, sp_where = _per_prompt(req, "sampling_params", k, count, single)
        if sp is not None and not isinstance(sp, dict):
            raise APIError(f"{sp_where} must be an object", param=sp_where)
        sp = dict(sp or {})
        raw_images, image_where = _per_prompt(req, "image_data", k, count, single)
        lora, lora_where = _per_prompt(req, "lora_path", k, count, single)
        rid, _ = _per_prompt(req, "rid", k, count, single)
        return_logprob = bool(_per_prompt(req, "return_logprob", k, count, single)[0])
        start, start_where = _per_prompt(req, "logprob_start_len", k, count, single)
        start = -1 if start is None else start
        top = _per_prompt(req, "top_logprobs_num", k, count, single)[0] or 0
        if lora is not None and lora not in state.model_names and lora != state.model_path:
            if lora not in engine.lora_adapters:
                raise APIError(f"The following requested LoRA adapters are not loaded: {lora}", param=lora_where)
        else:
            lora = None
        options, no_stop_trim = _sampling_options(state, sp, sp_where)
        greq = GenerationRequest(input_ids=ids, images=await _images(state, raw_images, image_where) or None,
                                 request_id=f"sglang-{uuid.uuid4().hex}", lora_name=lora)
        expanded = prepare_prompt(state, greq, prompt_where)
        room = completion_room(len(expanded), engine.max_model_len)
        if room <= 0:
            raise APIError(f"The input ({len(expanded)} tokens) is longer than the model's context length "
                           f"({engine.max_model_len} tokens).", param=prompt_where)
        max_new = sp["max_new_tokens"] if "max_new_tokens" in sp else SGLANG_MAX_NEW_TOKENS
        # More than the room the context leaves is SGLang's cap, not an error: the engine ends the sample at
        # max_model_len with "length".
        options["max_new_tokens"] = room if max_new is None else max_new
        if isinstance(max_new, int) and max_new < 0:
            raise APIError(f"{sp_where}.max_new_tokens must be at least 0, got {max_new}",
                           param=f"{sp_where}.max_new_tokens")
        if return_logprob:
            if not isinstance(start, int) or isinstance(start, bool) or not -1 <= start < len(expanded):
                raise APIError(f"logprob_start_len ({start}) must be -1 or in [0, {len(expanded)}) (the number of "
                               "input tokens)", param=start_where)
            options["logprobs"] = top
            if start >= 0 and len(expanded) > 1:
                options["prompt_logprobs"] = top  # the prompt's scores, from the prefill forward
        if options["max_new_tokens"] == 0 and options.get("prompt_logprobs") is None:
            options["prompt_logprobs"] = 0  # the engine takes "no new token" only as a scoring request
        try:
            greq.sampling = sampling_from_options(options, state.default_sampling,
                                                  vocab_size=logits_width(engine.policy))
        except InvalidRequestError as e:
            param = _engine_param(e, sp_where, prompt_where, image_where, _grammar_param(sp, sp_where))
            raise APIError(str(e).replace(e.field, param, 1), param=param) from None
        if not isinstance(rid, str) or not rid:
            rid = greq.request_id
        elif not single and not isinstance(req.rid, list):
            rid = f"{rid}-{k}"  # one rid for a batch: a prefix, as SGLang makes one id per prompt
        if items and greq.sampling.n != items[0].request.sampling.n:  # SGLang's rule: the response layout needs it
            raise APIError(f"{sp_where}.n must be the same for every prompt of a batch", param=f"{sp_where}.n")
        items.append(Item(greq, rid, return_logprob,
                          start if return_logprob else -1, top if return_logprob else 0, no_stop_trim,
                          bool(req.return_text_in_logprobs), _grammar_param(sp, sp_where)))
    return items, single


def engine_refusal(e: InvalidRequestError, items: list[Item]) -> APIError:
    """The engine refused one of ``items`` at submission: a 400 naming the /generate field (a grammar's own field
    when one prompt has a grammar)."""
    grammars = {it.grammar_param for it in items if it.grammar_param}
    param = _engine_param(e, "sampling_params", "input_ids", "image_data",
                          grammars.pop() if len(grammars) == 1 else None)
    return APIError(str(e).replace(e.field, param, 1) if e.field else str(e), param=param)


def _finish_reason(out: GenerationOutput) -> dict | None:
    """SGLang's ``finish_reason``: ``{"type": "stop", "matched": token id or string}``, ``{"type": "length",
    "length": n}`` or ``{"type": "abort", "message"}`` (None while a stream is running)."""
    if out.finish_reason == "stop":
        matched = out.stop_reason
        if matched is None and out.output_ids:  # an EOS: SGLang names the token
            matched = out.output_ids[-1]
        return {"type": "stop", "matched": matched}
    if out.finish_reason == "length":
        return {"type": "length", "length": len(out.output_ids)}
    if out.finish_reason == "abort":
        # SGLang's words for a request that never ran, which AReaL's SGLangBackend reads as "resubmit".
        message = out.error or ("Abort before prefill" if not out.output_ids else "Aborted")
        return {"type": "abort", "message": message}
    return None


def _entry(state: ServerState, item: Item, lp, token: int) -> list:
    return [None if lp is None else _lp(lp), token, state.token_str(token) if item.text_in_logprobs else None]


def _top(state: ServerState, item: Item, d: dict | None) -> list | None:
    if not d:
        return None
    best = sorted(d.items(), key=lambda kv: -kv[1])[:item.top_logprobs_num]
    return [_entry(state, item, v, t) for t, v in best]


def _prompt_scores(state: ServerState, item: Item, out: GenerationOutput) -> tuple[list, list]:
    """``input_token_logprobs`` and ``input_top_logprobs`` for prompt tokens ``logprob_start_len`` onwards: each
    token's logprob given the tokens before it (None at position 0, and for SGLang's default start of -1, which
    asks for no score: its one entry is the last prompt token's)."""
    ids = out.prompt_ids
    start = item.logprob_start_len
    scores = out.prompt_logprobs
    if start < 0 or scores is None:
        return [_entry(state, item, None, ids[-1])], [None]
    tokens, tops = [], []
    for j in range(start, len(ids)):
        d = scores[j]
        tokens.append(_entry(state, item, None if d is None else d[ids[j]], ids[j]))
        tops.append(_top(state, item, d))
    return tokens, tops


def sglang_body(state: ServerState, item: Item, out: GenerationOutput, sample: int = 0, n: int = 1) -> dict:
    """One output (or a stream's output so far) as SGLang's ``{"text", "output_ids", "meta_info"}``."""
    text = out.text
    if item.no_stop_trim and isinstance(out.stop_reason, str):
        text += out.stop_reason
    version = out.output_versions[-1] if out.output_versions else state.engine.version
    meta = {"id": item.rid if n == 1 else f"{item.rid}-{sample}", "finish_reason": _finish_reason(out),
            "prompt_tokens": len(out.prompt_ids), "completion_tokens": len(out.output_ids),
            "weight_version": str(version), "e2e_latency": out.metrics.get("latency_s")}
    if item.return_logprob:
        meta["output_token_logprobs"] = [_entry(state, item, lp, t)
                                         for t, lp in zip(out.output_ids, out.output_logprobs)]
        meta["input_token_logprobs"], input_top = _prompt_scores(state, item, out)
        if item.top_logprobs_num > 0:
            tops = out.top_logprobs or [None] * len(out.output_ids)
            meta["output_top_logprobs"] = [_top(state, item, d) for d in tops]
            meta["input_top_logprobs"] = input_top
    return {"text": text, "output_ids": list(out.output_ids), "meta_info": meta}
