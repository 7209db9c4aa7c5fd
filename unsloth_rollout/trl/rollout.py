"""The ``rollout_func`` TRL's GRPOTrainer calls, and the callback that keeps the engine's version current.

TRL (1.16) calls ``rollout_func(prompts, trainer)`` with the per-process prompts, each repeated
``num_generations`` times in a row, and expects ``prompt_ids`` / ``completion_ids`` / ``logprobs``, one
entry per prompt. Tokenization is TRL's own (``processing_class.apply_chat_template`` with the trainer's
chat template, tools and kwargs), so the ids TRL later scores are the ids the engine sampled from.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import math
import time
from typing import Any

from transformers import TrainerCallback

from .. import bitwise
from ..logs import get_logger
from ..engine import EngineConfig, GenerationRequest, InvalidRequestError, RolloutEngine, SamplingParams
from ..engine.options import sampling_from_options
from ..models import PolicyModel
from ..rewards import finite_reward
from .bitwise import use_bitwise_recompute

logger = get_logger("unsloth_rollout")

# generation_kwargs keys (vLLM SamplingParams or transformers GenerationConfig spelling) -> SamplingParams field.
_KWARG_FIELDS = {
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
    "repetition_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty", "seed": "seed", "stop": "stop", "stop_token_ids": "stop_token_ids",
    "ignore_eos": "ignore_eos", "max_tokens": "max_new_tokens", "max_new_tokens": "max_new_tokens",
    "min_tokens": "min_new_tokens", "min_new_tokens": "min_new_tokens", "skip_special_tokens": "skip_special_tokens",
}
# Keys that describe what the engine does anyway (padding, caching, EOS handled via stop_token_ids).
_KWARG_NO_OPS = {"pad_token_id", "bos_token_id", "cache_implementation", "use_cache", "disable_compile",
                 "return_dict_in_generate", "output_scores", "output_logits", "logprobs"}


def sampling_params_from_trainer(trainer, n: int) -> SamplingParams:
    """The engine's SamplingParams for one group of ``n`` samples, from the trainer's generation settings.

    Example::

        sp = sampling_params_from_trainer(trainer, n=trainer.num_generations)
        sp.max_new_tokens == trainer.max_completion_length
    """
    kw: dict[str, Any] = {
        "max_new_tokens": int(trainer.max_completion_length),
        "temperature": float(trainer.temperature),
        "top_p": float(getattr(trainer, "top_p", None) or 1.0),
        "top_k": getattr(trainer, "top_k", None),
        "min_p": float(getattr(trainer, "min_p", None) or 0.0),
        "repetition_penalty": float(getattr(trainer, "repetition_penalty", None) or 1.0),
        "stop_token_ids": [int(t) for t in getattr(trainer, "eos_token_ids", []) or [] if t is not None],
        "n": int(n),
    }
    gk = trainer.args.generation_kwargs
    if isinstance(gk, str):
        gk = json.loads(gk)
    for key, value in (gk or {}).items():
        if key in _KWARG_FIELDS:
            field = _KWARG_FIELDS[key]
            if field == "stop_token_ids":
                value = sorted(set(kw["stop_token_ids"]) | set(value or []))
            kw[field] = value
        elif key == "eos_token_id":
            extra = value if isinstance(value, (list, tuple)) else [value]
            kw["stop_token_ids"] = sorted(set(kw["stop_token_ids"]) | {int(t) for t in extra if t is not None})
        elif key == "do_sample":
            if not value:
                kw["temperature"] = 0.0
        elif key == "suppress_tokens":
            continue  # TRL suppresses the image token; the engine never samples vision tokens (suppress_vision_tokens)
        elif key not in _KWARG_NO_OPS:
            raise InvalidRequestError(f"generation_kwargs.{key}",
                                      f"generation_kwargs.{key} is not supported by the rollout engine; supported: "
                                      f"{sorted(set(_KWARG_FIELDS) | {'eos_token_id', 'do_sample'} | _KWARG_NO_OPS)}")
    try:
        return sampling_from_options(kw)
    except InvalidRequestError as e:
        raise InvalidRequestError(e.field, f"GRPOConfig / generation_kwargs: {e}") from None


class EngineVersionCallback(TrainerCallback):
    """Stamp tokens sampled after optimizer step k with version k (``state.global_step``); no weights move."""

    def __init__(self, engine: RolloutEngine):
        self.engine = engine

    def on_train_begin(self, args, state, control, **kwargs):
        self.engine.set_version(state.global_step)

    def on_step_end(self, args, state, control, **kwargs):
        self.engine.set_version(state.global_step)


class EngineGeneration:
    """What TRL calls ``vllm_generation`` in its rollout_func path: ``sync_weights()`` is a version bump, and
    ``generate()`` (TRL's tool loop calls it for every post-tool turn) samples from the engine."""

    def __init__(self, rollout: "EngineRollout", trainer):
        self.rollout = rollout
        self.engine = rollout.engine
        self.trainer = trainer

    def sync_weights(self) -> None:
        self.engine.set_version(self.trainer.state.global_step)

    def generate(self, prompts: list[list[int]], images, num_generations: int, profiler=None) -> tuple:
        """TRL's ``VLLMGeneration.generate``: token-id prompts (each repeated ``num_generations`` times in a row)
        -> (prompt_ids, completion_ids, logprobs [seq][token][1], logprob_token_ids [seq][token][1])."""
        trainer, rollout = self.trainer, self.rollout
        requests = []
        for k in range(0, len(prompts), num_generations):
            imgs = images[k] if images is not None else None
            requests.append(GenerationRequest(input_ids=list(prompts[k]), images=list(imgs) if imgs else None,
                                              sampling=sampling_params_from_trainer(trainer, num_generations)))
        outputs = rollout.run(requests, len(prompts), trainer)
        rollout.post_tool_outputs += outputs
        rollout.history.append({"global_step": trainer.state.global_step, "requests": len(requests),
                                "samples": len(outputs), "post_tool": True,
                                "versions": sorted({v for o in outputs for v in o.output_versions})})
        return ([list(o.prompt_ids) for o in outputs], [list(o.output_ids) for o in outputs],
                [[[lp] for lp in o.output_logprobs] for o in outputs], [[[t] for t in o.output_ids] for o in outputs])


def _callable_spec(fn, get_json_schema) -> dict:
    """A Python tool's function spec; its signature takes no other keyword (TRL calls ``fn(**arguments)``)."""
    spec = get_json_schema(fn)["function"]
    params = spec.setdefault("parameters", {"type": "object", "properties": {}})
    if not any(p.kind is p.VAR_KEYWORD for p in inspect.signature(fn).parameters.values()):
        params.setdefault("additionalProperties", False)
    return {"type": "function", "function": spec}


def _finite_rewards(rewards, name: str):
    """A TRL reward function's list with +-inf replaced by 0.0 (logged). None and NaN stay: they are TRL's "no
    reward from this function" marker, which TRL drops in its nansum over functions (and warns when all are)."""
    if not isinstance(rewards, (list, tuple)):
        return rewards
    return [r if r is None or (isinstance(r, float) and math.isnan(r)) else finite_reward(r, name) for r in rewards]


def finite_reward_func(fn):
    """``fn`` (a TRL reward function, sync or async) whose infinite rewards become 0.0 with a warning; reward
    models (``nn.Module``) and already wrapped functions are returned as they are."""
    import torch

    if isinstance(fn, torch.nn.Module) or getattr(fn, "_unsloth_rollout_finite", False) or not callable(fn):
        return fn
    name = getattr(fn, "__name__", type(fn).__name__)
    if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None)):
        @functools.wraps(fn)
        async def wrapped(*args, **kwargs):
            return _finite_rewards(await fn(*args, **kwargs), name)
    else:
        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            return _finite_rewards(fn(*args, **kwargs), name)
    wrapped._unsloth_rollout_finite = True
    return wrapped


def _same_model(policy_model, trainer_model) -> bool:
    """True when every parameter the engine reads is a parameter the trainer optimizes (the same tensors)."""
    mine = {id(p) for p in policy_model.parameters()}
    theirs = {id(p) for p in trainer_model.parameters()}
    return bool(mine) and mine <= theirs


def _group_runs(prompts: list) -> list[tuple[int, int]]:
    """(start, count) of each run of identical consecutive prompts (TRL repeats each num_generations times)."""
    runs: list[tuple[int, int]] = []
    for i, p in enumerate(prompts):
        if runs and prompts[runs[-1][0]] == p:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


def _images_of(messages: list[dict]) -> list:
    images = []
    for i, m in enumerate(messages):
        content = m.get("content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                if isinstance(part, dict) and part.get("type") == "image":
                    if part.get("image") is None:
                        raise InvalidRequestError(f"prompt[{i}].content[{j}]",
                                                  "an image part carries no image (dataset image/images column?)")
                    images.append(part["image"])
    return images


class EngineRollout:
    """TRL ``rollout_func``: ``EngineRollout(engine)(prompts, trainer) -> {prompt_ids, completion_ids, logprobs}``.

    Args:
        engine: a RolloutEngine over the model the trainer trains, a PolicyModel (an engine is built
            with ``engine_config``), or ``None`` (built on first call from ``trainer.model`` and
            ``trainer.processing_class``).
        engine_config: EngineConfig for an engine built here.
        importance_sampling: let TRL apply its importance-sampling correction to the engine's behaviour
            logprobs (and log ``sampling/*``). ``None``: follow ``args.vllm_importance_sampling_correction``.
        seed: seed of an engine built here.
        tool_choice: with ``GRPOTrainer(tools=[...])``, "required" holds every first turn to one call of one of
            the trainer's tools with schema-valid arguments, then EOS (a grammar, engine/tool_grammar.py); None lets
            the model choose. Logprobs stay the raw policy's (what TRL recomputes).

    With ``tools=[...]`` every turn is the engine's: TRL's tool loop generates each post-tool turn through
    ``trainer.vllm_generation.generate``, which this hook points at the engine (``post_tool_outputs`` keeps them).
    After each call ``last_outputs`` holds the engine's GenerationOutputs (ids, logprobs, versions), and
    ``history`` gains ``{"global_step", "versions", "requests", "samples", "seconds"}`` (``"post_tool": True`` for
    a post-tool turn).
    """

    def __init__(self, engine: RolloutEngine | PolicyModel | None = None, engine_config: EngineConfig | None = None,
                 importance_sampling: bool | None = None, seed: int | None = None, tool_choice: str | None = None):
        if tool_choice not in (None, "auto", "required"):
            raise InvalidRequestError("tool_choice", f"tool_choice must be None, 'auto' or 'required', got "
                                                     f"{tool_choice!r}")
        self.tool_choice = tool_choice
        if engine is not None and not isinstance(engine, (RolloutEngine, PolicyModel)):
            raise TypeError(f"engine must be a RolloutEngine, a PolicyModel or None; got {type(engine).__name__}")
        self._given = engine
        self.engine: RolloutEngine | None = engine if isinstance(engine, RolloutEngine) else None
        self.engine_config = engine_config
        self.importance_sampling = importance_sampling
        self.seed = seed
        self.last_outputs: list = []
        self.post_tool_outputs: list = []
        self.history: list[dict] = []
        self._attached_to = None

    # ------------------------------------------------------------------ first call: bind to the trainer
    def _attach(self, trainer) -> None:
        model = trainer.accelerator.unwrap_model(trainer.model) if hasattr(trainer, "accelerator") else trainer.model
        if self.engine is None:
            policy = self._given
            if policy is None:
                pc = trainer.processing_class
                tok = getattr(pc, "tokenizer", pc)
                policy = PolicyModel.wrap(model, tok, pc if tok is not pc else None)
            self.engine = RolloutEngine(policy, self.engine_config, seed=self.seed)
        if not _same_model(self.engine.policy.model, model):
            raise ValueError("rollout_func: the engine samples from a different model than the trainer trains; "
                             "build the engine on the model passed to GRPOTrainer (after PEFT wrapping)")
        if not any(isinstance(cb, EngineVersionCallback) and cb.engine is self.engine
                   for cb in trainer.callback_handler.callbacks):
            trainer.add_callback(EngineVersionCallback(self.engine))
        want_is = self.importance_sampling
        if want_is is None:
            want_is = bool(getattr(trainer.args, "vllm_importance_sampling_correction", False))
        tools = bool(getattr(trainer, "tools", None))
        if (want_is or tools) and not getattr(trainer, "use_vllm", False):
            needed = ("use_vllm", "vllm_importance_sampling_correction", "vllm_importance_sampling_mode")
            missing = [a for a in needed if not hasattr(trainer, a)]
            if missing and tools:  # TRL's own generate() would write the post-tool turns, bypassing the engine
                raise RuntimeError(f"rollout_func: this TRL has no {missing}; its tool loop cannot be routed "
                                   "through the rollout engine")
            if missing:
                logger.warning("unsloth_rollout.trl: this TRL has no %s; its importance-sampling correction stays "
                               "off (the engine's logprobs match the trainer's forward anyway)", missing)
            else:
                # TRL gates its IS correction, sampling/* logging and the tool loop's generator on use_vllm; in the
                # rollout_func path that flag adds a sync_weights() call per optimizer step (a version bump) and
                # sends each post-tool turn to vllm_generation.generate (the engine).
                trainer.vllm_generation = EngineGeneration(self, trainer)
                trainer._last_loaded_step = trainer.state.global_step
                trainer.vllm_mode = "server"
                trainer.vllm_importance_sampling_correction = bool(want_is)
                trainer.use_vllm = True
        if bitwise.enabled(self.engine.policy):  # TRL's recompute under the bitwise on-policy mode, as the engine runs
            use_bitwise_recompute(trainer, self.engine.policy)
        if isinstance(getattr(trainer, "reward_funcs", None), list):  # a bad reward never reaches the advantages
            trainer.reward_funcs = [finite_reward_func(f) for f in trainer.reward_funcs]
        self._attached_to = trainer

    # ------------------------------------------------------------------ one generation batch
    def _request(self, prompt, trainer, sampling: SamplingParams) -> GenerationRequest:
        from trl.data_utils import is_conversational, prepare_multimodal_messages

        pc = trainer.processing_class
        if is_conversational({"prompt": prompt}):
            if self.engine.policy.is_vlm:
                prompt = prepare_multimodal_messages(prompt)
            enc = pc.apply_chat_template(
                conversation=[prompt], tools=getattr(trainer, "tools", None) or None,
                chat_template=getattr(trainer, "chat_template", None), add_generation_prompt=True, tokenize=True,
                return_dict=True, **(getattr(trainer, "chat_template_kwargs", None) or {}))
            ids = enc["input_ids"][0]
            images = _images_of(prompt)
        elif isinstance(prompt, str):
            ids = pc(text=[prompt])["input_ids"][0]
            images = []
        else:
            raise InvalidRequestError("prompt", f"prompt must be a string or a list of chat messages; got "
                                                f"{type(prompt).__name__}")
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        return GenerationRequest(input_ids=ids, images=images or None, sampling=sampling)

    def _first_turn_outputs(self, trainer):
        """The grammar of ``tool_choice="required"`` over the trainer's tools (None without)."""
        if self.tool_choice != "required":
            return None
        tools = getattr(trainer, "tools", None)
        if not tools:
            raise InvalidRequestError("tool_choice", "tool_choice='required' needs GRPOTrainer(tools=[...])")
        from transformers.utils import get_json_schema

        from ..engine.tool_grammar import template_format, tool_call_outputs

        specs = [t if isinstance(t, dict) else _callable_spec(t, get_json_schema) for t in tools]
        tok = self.engine.tokenizer
        fmt = template_format(tok, getattr(trainer, "chat_template", None))
        return tool_call_outputs(fmt, specs, "required", False, tok)  # one call, then EOS: bounded turns

    def run(self, requests: list[GenerationRequest], expected: int, trainer) -> list:
        """Generate ``requests`` (``expected`` samples in all) in one batch, with the tokenizers' padding sides as
        TRL left them; a refused or failed sample raises."""
        engine = self.engine
        policy = engine.policy
        toks = [t for t in (policy.tokenizer, getattr(trainer.processing_class, "tokenizer", None),
                            trainer.processing_class) if t is not None and hasattr(t, "padding_side")]
        sides = [t.padding_side for t in toks]
        try:
            with policy.inference():  # one mode switch for the batch, not one per engine step
                outputs = engine.generate(requests)
        finally:
            # The mode switch sets padding sides; TRL's processor call after this pads mm_token_type_ids its
            # own way and must see them as they were. policy.lock: the engine's last step has ended.
            with policy.lock:
                for t, side in zip(toks, sides):
                    t.padding_side = side
        bad = [o for o in outputs if o.error is not None or o.finish_reason == "abort"]
        if bad:
            raise RuntimeError(f"rollout engine refused or failed {len(bad)} of {len(outputs)} samples: "
                               f"{bad[0].error or bad[0].finish_reason}")
        if len(outputs) != expected:
            raise RuntimeError(f"rollout engine returned {len(outputs)} samples for {expected} prompts")
        return outputs

    def __call__(self, prompts: list, trainer) -> dict[str, list]:
        if self._attached_to is not trainer:
            self._attach(trainer)
        engine = self.engine
        if engine.version != trainer.state.global_step:
            engine.set_version(trainer.state.global_step)
        requests = []
        structured = self._first_turn_outputs(trainer)
        for start, count in _group_runs(prompts):
            sampling = sampling_params_from_trainer(trainer, count)
            if structured is not None:
                sampling = dataclasses.replace(sampling, structured_outputs=structured)
            requests.append(self._request(prompts[start], trainer, sampling))
        t0 = time.perf_counter()
        outputs = self.run(requests, len(prompts), trainer)
        self.last_outputs = outputs
        self.history.append({"global_step": trainer.state.global_step, "requests": len(requests),
                             "samples": len(outputs), "seconds": time.perf_counter() - t0,
                             "versions": sorted({v for o in outputs for v in o.output_versions})})
        return {
            "prompt_ids": [list(o.prompt_ids) for o in outputs],
            "completion_ids": [list(o.output_ids) for o in outputs],
            "logprobs": [list(o.output_logprobs) for o in outputs],
        }


def rollout_func(engine: RolloutEngine | PolicyModel | None = None, **kwargs) -> EngineRollout:
    """``GRPOTrainer(..., rollout_func=rollout_func(engine))``: generate through ``engine`` (see EngineRollout)."""
    return EngineRollout(engine, **kwargs)
