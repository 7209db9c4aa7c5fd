"""UnslothInferenceEngine: AReaL's ``InferenceEngine`` over the in-process RolloutEngine.

``agenerate`` translates AReaL's ``ModelRequest`` into a ``GenerationRequest`` and back; everything
else a trainer drives (submit / wait / rollout_batch / prepare_batch, staleness control, pause /
resume, trajectory checks) is AReaL's own ``WorkflowExecutor``. The engine samples from the same
PolicyModel the trainer updates, so a weight update is a version bump: nothing is copied.

Example::

    from areal.api.cli_args import InferenceEngineConfig
    from unsloth_rollout.areal import UnslothInferenceEngine

    engine = UnslothInferenceEngine(InferenceEngineConfig(backend="unsloth:d1", consumer_batch_size=4),
                                    policy, kv_cache_memory_bytes=64 << 20)
    engine.initialize()
    batch = engine.rollout_batch(data, workflow=RLVRWorkflow(...), group_size=4)
"""

from __future__ import annotations

import asyncio
import os
import shutil
import threading
import time
import uuid
from concurrent.futures import Future
from typing import Any, Callable

from areal.api import InferenceEngine, ModelRequest, ModelResponse, WeightUpdateMeta
from areal.api.cli_args import InferenceEngineConfig
from areal.api.io_struct import get_versioned_lora_name
from areal.infra.utils.concurrent import get_executor
from areal.infra.workflow_executor import WorkflowExecutor
from areal.utils import name_resolve, names, stats_tracker

from ..logs import get_logger
from ..engine import EngineConfig, GenerationRequest, RolloutEngine, SamplingParams
from ..engine.config import DEPRECATED_SETTINGS
from ..engine.omp import release_thread_team
from ..engine.options import completion_room, logits_width, sampling_from_options
from ..models import PolicyModel, load_model
from . import compat
from ._spec import is_unsloth_backend, parse_unsloth_backend
from .openai_compat import UnslothModelResponse, patch_openai

logger = get_logger("unsloth_rollout.areal.inference_engine")

# EngineConfig's fields, and the flat names its nested configs replaced (accepted with a DeprecationWarning).
_ENGINE_CONFIG_KEYS = set(EngineConfig.__dataclass_fields__) | DEPRECATED_SETTINGS
# Keyword arguments newer AReaL releases pass to submit / rollout_batch / prepare_batch.
_FORWARD_COMPAT_KWARGS = ("reward_normalization", "drop_incomplete_group", "callback_addr", "proxy_addr")


class UnslothInferenceEngine(InferenceEngine):
    """AReaL InferenceEngine running rollouts in this process on a PolicyModel.

    Args:
        config: AReaL's ``InferenceEngineConfig`` (``backend: "unsloth:d1"``; staleness fields as usual).
        policy: a ``PolicyModel`` (shared with the trainer) or a model folder to load.
        rollout_engine: an existing ``RolloutEngine`` to share (e.g. the eval engine shares the
            training one: one KV cache, one model). Not shut down by ``destroy()``.
        load_options: ``load_model`` keyword arguments when ``policy`` is a path.
        seed: the sampler's seed (None: from the OS).
        **engine_options: ``EngineConfig`` fields (``kv_cache_memory_bytes``, ``max_model_len``, ...).

    Example::

        engine = UnslothInferenceEngine(InferenceEngineConfig(backend="unsloth:d1"), policy)
        engine.initialize()
        resp = asyncio.run(engine.agenerate(ModelRequest(input_ids=ids, gconfig=gconfig)))
    """

    _resolve_should_accept_fn = compat.RESOLVE_SHOULD_ACCEPT_FN.get()

    def _resolve_workflow(self, workflow, workflow_kwargs, group_size: int = 1, proxy_addr: str | None = None):
        """AReaL's own workflow resolution (instance / class / "module.Class", group_size through
        GroupedRolloutWorkflow); agent workflows (``async def run``) go to this engine's in-process server. Every
        episode's non-finite rewards become 0.0, logged (finite_rewards.py)."""
        from .agent_server import IN_PROCESS
        from .finite_rewards import FiniteRewardWorkflow

        return FiniteRewardWorkflow(compat.RESOLVE_WORKFLOW.get()(self, workflow, workflow_kwargs, group_size,
                                                                  proxy_addr=proxy_addr or IN_PROCESS))

    def _wrap_openai_agent(self, agent, proxy_addr: str | None = None):
        """An agent workflow as an ``UnslothAgentWorkflow`` on this engine's ``AgentServer``."""
        from .agent_server import UnslothAgentWorkflow

        cfg = self.config.agent
        if cfg is None:
            from areal.api.cli_args import AgentConfig

            cfg = AgentConfig()
        if agent is None:
            raise NotImplementedError("agent.mode='online' (external users through AReaL's proxy gateway) is not "
                                      "supported by the unsloth backend; pass an agent workflow")
        timeout = float(cfg.session_timeout_seconds) if cfg.session_timeout_seconds else None
        return UnslothAgentWorkflow(agent, lambda: self.agent_server, mode=cfg.mode, discount=cfg.turn_discount,
                                    export_style=cfg.export_style, subproc_max_workers=cfg.subproc_max_workers,
                                    timeout_s=timeout)

    @property
    def agent_server(self):
        """The OpenAI-compatible server agent workflows talk to (started on first use, on 127.0.0.1)."""
        with self._agent_lock:
            if self._agent_server is None:
                from .agent_server import AgentServer

                cfg = self.config.agent
                from areal.api.cli_args import GenerationHyperparameters

                self._agent_server = AgentServer(
                    self.rollout_engine, tool_call_parser=cfg.tool_call_parser if cfg is not None else "qwen",
                    served_adapter=lambda: self._served_lora(GenerationHyperparameters()),  # as agenerate picks it
                    chat_template_type=cfg.chat_template_type if cfg is not None else "hf")
            return self._agent_server

    def __init__(self, config: InferenceEngineConfig, policy: PolicyModel | str | None = None, *,
                 rollout_engine: RolloutEngine | None = None, load_options: dict | None = None,
                 seed: int | None = None, **engine_options):
        if not isinstance(config, InferenceEngineConfig):
            raise TypeError(f"config must be an areal InferenceEngineConfig, got {type(config).__name__}")
        backend = config.backend if isinstance(config.backend, str) else None
        if backend is not None and backend not in ("", "???") and not is_unsloth_backend(backend):
            raise ValueError(f"rollout.backend: UnslothInferenceEngine serves 'unsloth:d<N>', got {backend!r}")
        unknown = set(engine_options) - _ENGINE_CONFIG_KEYS
        if unknown:
            raise TypeError(f"unknown engine option(s) {sorted(unknown)}; EngineConfig fields: "
                            f"{sorted(_ENGINE_CONFIG_KEYS)}")
        if policy is None and rollout_engine is None:
            raise ValueError("policy: give a PolicyModel, a model folder, or rollout_engine=")
        if rollout_engine is not None and policy is not None and rollout_engine.policy is not policy:
            raise ValueError("policy: rollout_engine samples from a different PolicyModel than policy")
        self.config = config
        self._policy_arg = policy
        self._load_options = dict(load_options or {})
        self._engine_options = engine_options
        self._seed = seed
        self._engine: RolloutEngine | None = rollout_engine
        self._owns_engine = rollout_engine is None
        # The version before the RolloutEngine exists (it is built lazily); afterwards the engine's own counter.
        self._pending_version = rollout_engine.version if rollout_engine is not None else 0
        self._version_lock = threading.Lock()
        self._workflow_executor: WorkflowExecutor | None = None
        self._initialized = False
        self._proxy_gateway_addr: str | None = None
        self._colocated_train_engine = None  # set by attach_trainer (ColocatedTrainEngine.connect_engine)
        self._agent_server = None  # started by the first agent workflow
        self._agent_lock = threading.Lock()
        self._warned: set[str] = set()
        self.logger = logger

    # ------------------------------------------------------------------ lifecycle
    def initialize(self, engine_id: str | None = None, addr: str | list[str] | None = None,
                   train_data_parallel_size: int | None = None, **kwargs) -> None:
        """Build the RolloutEngine (unless one was given) and start AReaL's WorkflowExecutor.

        ``addr`` is accepted for signature compatibility with remote engines and ignored.
        """
        if self._initialized:
            return
        patch_openai()  # ArealOpenAI on this engine: tool calls without sglang/vllm, pixels in VLM trajectories
        self.engine_id = engine_id or uuid.uuid4().hex[:8]
        self.logger = get_logger(f"unsloth_rollout.areal.inference_engine.{self.engine_id}")
        if self._engine is None:
            policy = self._policy_arg
            if not isinstance(policy, PolicyModel):
                policy = load_model(os.fspath(policy), **self._load_options)
            self._engine = RolloutEngine(policy, EngineConfig(**self._engine_options), seed=self._seed)
            self._engine.set_version(self._pending_version)  # a version set before initialize()
        if train_data_parallel_size is None:
            train_data_parallel_size = self._dp_from_backend()
        self._workflow_executor = WorkflowExecutor(config=self.config, inference_engine=self)
        self._workflow_executor.initialize(logger=self.logger, train_data_parallel_size=train_data_parallel_size)
        self._initialized = True

    def _dp_from_backend(self) -> int:
        backend = self.config.backend
        if isinstance(backend, str) and is_unsloth_backend(backend):
            return parse_unsloth_backend(backend).dp
        return 1

    def destroy(self) -> None:
        """Stop the workflow executor; shut the RolloutEngine down if this object created it."""
        self._initialized = False
        if self._workflow_executor is not None:
            self._workflow_executor.destroy()
            self._workflow_executor = None
        if self._agent_server is not None:
            self._agent_server.close()
            self._agent_server = None
        if self._engine is not None and self._owns_engine:
            self._engine.shutdown()

    @property
    def initialized(self) -> bool:
        return self._initialized

    @property
    def workflow_executor(self) -> WorkflowExecutor:
        if self._workflow_executor is None:
            raise RuntimeError("WorkflowExecutor is not initialized; call initialize() first")
        return self._workflow_executor

    @property
    def staleness_manager(self):
        return self.workflow_executor.staleness_manager

    @property
    def rollout_engine(self) -> RolloutEngine:
        """The RolloutEngine underneath (continuous batching, KV cache, sampler)."""
        if self._engine is None:
            raise RuntimeError("the RolloutEngine is built by initialize(); call it first")
        return self._engine

    @property
    def policy(self) -> PolicyModel:
        if self._engine is not None:
            return self._engine.policy
        if isinstance(self._policy_arg, PolicyModel):
            return self._policy_arg
        raise RuntimeError("the policy is loaded by initialize(); call it first")

    def set_proxy_gateway_addr(self, addr: str) -> None:
        self._proxy_gateway_addr = addr

    # ------------------------------------------------------------------ generation
    def _sampling(self, gconfig, max_new_tokens: int) -> SamplingParams:
        if gconfig.use_beam_search:
            raise NotImplementedError("gconfig.use_beam_search: beam search is not supported by the unsloth backend")
        greedy = bool(gconfig.greedy) or gconfig.temperature == 0
        return sampling_from_options(dict(
            max_new_tokens=max_new_tokens,
            min_new_tokens=min(int(gconfig.min_new_tokens), max_new_tokens),
            temperature=0.0 if greedy else float(gconfig.temperature),
            top_p=float(gconfig.top_p),
            top_k=int(gconfig.top_k),
            frequency_penalty=float(gconfig.frequency_penalty),
            stop=list(gconfig.stop or []),
            stop_token_ids=[int(t) for t in (gconfig.stop_token_ids or []) if t is not None],
            ignore_eos=bool(gconfig.ignore_eos),
            skip_special_tokens=bool(gconfig.skip_special_tokens),
        ), vocab_size=logits_width(self.rollout_engine.policy))

    def _served_lora(self, gconfig) -> str | None:
        """The versioned adapter loaded by update_weights_from_disk for this version, if any."""
        engine = self.rollout_engine
        if not engine.lora_adapters:
            return None
        name = get_versioned_lora_name(gconfig.lora_name or self.config.lora_name, self.get_version())
        return name if name in engine.lora_adapters else None

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        """Generate one sample, following ``RemoteInfEngine.agenerate``'s contract.

        ``input_tokens`` is the prompt as the model ran it (``req.input_ids``, with any one-per-image
        placeholder expanded to the image's pad tokens) and, with images, ``multi_modal_input`` holds
        the engine's own ``pixel_values`` / ``image_grid_thw``; ``output_tokens`` includes the final
        EOS, ``output_logprobs`` are ``log_softmax(raw_logits / T)`` of the sampled tokens,
        ``output_versions`` the weight version of each token, ``stop_reason`` is "stop" or "length".
        """
        gconfig = req.gconfig
        if gconfig.n_samples != 1:
            raise ValueError("Inference engines do not support n_samples > 1. "
                             "Please call generate multiple times with n_samples = 1.")
        prompt = [int(t) for t in req.input_ids]
        engine = self.rollout_engine
        max_new_tokens = min(gconfig.max_tokens - len(prompt), gconfig.max_new_tokens,
                             completion_room(len(prompt), engine.max_model_len))
        if max_new_tokens <= 0:
            raise RuntimeError(
                f"max_new_tokens ({max_new_tokens}) is non-positive! max_tokens={gconfig.max_tokens}, "
                f"prompt_len={len(prompt)}, max_new_tokens={gconfig.max_new_tokens}, "
                f"max_model_len={engine.max_model_len}.")
        images = list(req.image_data) if req.image_data else None
        lora_name = self._served_lora(gconfig)
        start = time.perf_counter()
        tokens: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        ttft = None
        stop_reason = None
        first = None
        # An "abort" without error (someone aborted in-flight requests) keeps the tokens and continues,
        # as the remote engines do; pause_generation() itself keeps sequences in place.
        while stop_reason not in ("stop", "length") and len(tokens) < max_new_tokens:
            sampling = self._sampling(gconfig, max_new_tokens - len(tokens))
            out = await engine.agenerate(GenerationRequest(
                input_ids=prompt + tokens, images=images, sampling=sampling,
                request_id=f"{req.rid}-{uuid.uuid4().hex[:8]}", lora_name=lora_name))
            if out.error:
                raise RuntimeError(f"unsloth rollout engine failed request {req.rid}: {out.error}")
            if ttft is None and out.metrics.get("ttft_s") is not None:
                ttft = float(out.metrics["ttft_s"])
            if first is None:
                first = out
            tokens += out.output_ids
            logprobs += [float(x) for x in out.output_logprobs]
            versions += [int(v) for v in out.output_versions]
            stop_reason = out.finish_reason
            if stop_reason == "abort" and not out.output_ids and not engine.is_paused:
                await asyncio.sleep(0.05)  # aborted before its first token: try again shortly
        if stop_reason not in ("stop", "length"):
            stop_reason = "length"
        latency = time.perf_counter() - start
        mm = None
        input_tokens = list(req.input_ids)
        if first is not None and first.pixel_values is not None:
            # The prompt as the model ran it (placeholders expanded) and the exact pixels it saw: what the
            # trainer needs to recompute these logprobs (ArealOpenAI sends one placeholder per image).
            input_tokens = list(first.prompt_ids)
            mm = {"pixel_values": first.pixel_values, "image_grid_thw": first.image_grid_thw}
        return UnslothModelResponse(
            multi_modal_input=mm,
            input_tokens=input_tokens,
            input_images=req.image_data if req.image_data is not None else [],
            output_tokens=tokens,
            output_logprobs=logprobs,
            output_versions=versions,
            stop_reason=stop_reason,
            latency=latency,
            ttft=ttft if ttft is not None else latency,
            tokenizer=req.tokenizer,
            processor=req.processor,
        )

    def compute_logp(self, data: list[dict[str, Any]]) -> list:
        """Teacher scoring (AReaL's on-policy distillation): per trajectory, ``[B, T]`` logprobs of each token
        given the ones before it at ``loss_mask`` positions (0 elsewhere), ``log_softmax(raw_logits)`` of the
        served policy; rows run as prefill-only engine requests, batched (``unsloth_rollout.areal.scoring``)."""
        from .scoring import compute_logp

        engine = self.rollout_engine
        name = get_versioned_lora_name(self.config.lora_name, self.get_version()) if engine.lora_adapters else None
        return compute_logp(engine, data, name if name in engine.lora_adapters else None)

    # ------------------------------------------------------------------ versions
    def set_version(self, version: int) -> None:
        """Stamp later tokens with ``version``, and wake AReaL's dispatcher so staleness capacity is re-read."""
        with self._version_lock:
            if self._engine is None:
                self._pending_version = int(version)
            else:
                self._engine.set_version(int(version))
        self._wake_dispatcher()

    def get_version(self) -> int:
        with self._version_lock:
            return self._engine.version if self._engine is not None else self._pending_version

    def attach_trainer(self, train_engine) -> None:
        """The colocated train engine that trains this engine's very PolicyModel (its update_weights is a
        version bump); called by ``ColocatedTrainEngine.connect_engine``."""
        self._colocated_train_engine = train_engine

    def _wake_dispatcher(self) -> None:
        # The producer thread waits on an un-timed condition that set_version() alone never notifies.
        if self._workflow_executor is None or compat.executor_dispatcher(self._workflow_executor) is None:
            return
        cv = compat.dispatcher_input_cv(self._workflow_executor.dispatcher)
        if cv is not None:
            with cv:
                cv.notify_all()
        elif not self._workflow_executor.is_paused():
            self._workflow_executor.resume()

    # ------------------------------------------------------------------ rollout orchestration (AReaL's)
    def _note_unused(self, kwargs: dict) -> None:
        for k, v in kwargs.items():
            if k not in _FORWARD_COMPAT_KWARGS:
                raise TypeError(f"unexpected keyword argument {k!r}")
            if v and k in ("reward_normalization", "drop_incomplete_group") and k not in self._warned:
                self._warned.add(k)
                self.logger.warning(f"{k}=True is not implemented by areal 1.0.4's WorkflowExecutor; ignored")

    def submit(self, data: dict[str, Any], workflow, workflow_kwargs: dict[str, Any] | None = None,
               should_accept_fn: Callable[[dict[str, Any]], bool] | str | None = None, group_size: int = 1,
               task_id: int | None = None, callback_addr: str | None = None, is_eval: bool = False,
               proxy_addr: str | None = None, **kwargs) -> int:
        """Enqueue one episode (``group_size`` samples of ``workflow`` on ``data``); returns its task id."""
        self._note_unused(kwargs)
        if workflow is None and (self.config.agent is None or self.config.agent.mode != "online"):
            raise ValueError("workflow must be specified for submit (unless mode='online')")
        if callback_addr:
            self.workflow_executor.dispatcher.register_callback(task_id, callback_addr)
        resolved = self._resolve_workflow(workflow, workflow_kwargs, group_size, proxy_addr=proxy_addr)
        accept = self._resolve_should_accept_fn(should_accept_fn)
        return self.workflow_executor.submit(data, workflow=resolved, should_accept_fn=accept, task_id=task_id,
                                             is_eval=is_eval)

    def wait(self, count: int, timeout: float | None = None, raise_timeout: bool = True) -> list[dict | None]:
        release_thread_team()  # the trainer thread waits while the engine's worker generates
        return self.workflow_executor.wait(count, timeout=timeout, raise_timeout=raise_timeout)

    def wait_for_task(self, task_id: int, timeout: float | None = None, raise_timeout: bool = True):
        release_thread_team()
        return self.workflow_executor.wait_for_task(task_id, timeout, raise_timeout)

    def rollout_batch(self, data: list[dict[str, Any]], workflow, workflow_kwargs: dict[str, Any] | None = None,
                      group_size: int = 1, **kwargs) -> list[dict[str, Any]]:
        """Submit every item, wait for all of them; returns the accepted trajectories."""
        self._note_unused(kwargs)
        if workflow is None:
            raise ValueError("workflow must be specified for rollout_batch")
        resolved = self._resolve_workflow(workflow, workflow_kwargs, group_size)
        release_thread_team()
        return self.workflow_executor.rollout_batch(data=data, workflow=resolved)

    def prepare_batch(self, dataloader, workflow, workflow_kwargs: dict[str, Any] | None = None,
                      should_accept_fn: Callable[[dict[str, Any]], bool] | str | None = None, group_size: int = 1,
                      dynamic_bs: bool = False, **kwargs) -> list[dict[str, Any]]:
        """Staleness-controlled batch from ``dataloader`` (AReaL caches the generator on the first call)."""
        self._note_unused(kwargs)
        if workflow is None:
            raise ValueError("workflow must be specified for prepare_batch")
        resolved = self._resolve_workflow(workflow, workflow_kwargs, group_size)
        accept = self._resolve_should_accept_fn(should_accept_fn)
        release_thread_team()
        return self.workflow_executor.prepare_batch(dataloader=dataloader, workflow=resolved,
                                                    should_accept_fn=accept, dynamic_bs=dynamic_bs)

    def pause(self) -> None:
        """Stop starting new episodes (in-flight ones continue)."""
        self.workflow_executor.pause()

    def resume(self) -> None:
        self.workflow_executor.resume()

    def pause_generation(self) -> None:
        """Stop decoding at a step boundary; in-flight sequences keep their tokens (partial rollout).

        The pause is AReaL's own ("areal"): continue_generation() releases it and no other (an offload, a
        trainer's hold or a user's pause stay in place)."""
        self.rollout_engine.pause("keep", holder="areal")

    def continue_generation(self) -> None:
        self.rollout_engine.resume(holder="areal")

    # ------------------------------------------------------------------ weights
    def update_weights_from_disk(self, meta: WeightUpdateMeta) -> Future[None]:
        """Colocated (the trainer updates this very model): an already-completed Future.

        Otherwise (a trainer in another process saved a PEFT adapter to ``meta.path``): wait for its
        name_resolve key, load it as ``<lora_name>-v<version>`` and serve it from then on.
        """
        if meta.type != "disk":
            raise ValueError(f"meta.type: update_weights_from_disk needs type='disk', got {meta.type!r}")
        if self._colocated_train_engine is not None:
            fut: Future[None] = Future()
            fut.set_result(None)
            return fut
        if not meta.use_lora:
            raise NotImplementedError(
                "update_weights_from_disk: only LoRA adapters (meta.use_lora=True) can be loaded into a running "
                "unsloth engine; full-weight trainers should share the PolicyModel (ColocatedTrainEngine)")
        return get_executor().submit(self._load_adapter_from_disk, meta, self.get_version())

    def _load_adapter_from_disk(self, meta: WeightUpdateMeta, version: int) -> float:
        tik = time.perf_counter()
        if self.config.experiment_name is not None and self.config.trial_name is not None:
            key = names.update_weights_from_disk(self.config.experiment_name, self.config.trial_name, version)
            name_resolve.wait(key, timeout=self.config.request_timeout)
        new_version = meta.version if meta.version is not None else version + 1
        name = get_versioned_lora_name(meta.lora_name or self.config.lora_name, new_version)
        engine = self.rollout_engine
        # The weights are in memory from here on; an update re-sent for the same version replaces them.
        engine.load_lora_adapter(name, meta.path, load_inplace=True)
        if meta.clear_checkpoint_after_load:
            shutil.rmtree(meta.path, ignore_errors=True)
        keep = getattr(meta, "lora_keep_versions", 0)
        if keep and keep > 0:
            stale = get_versioned_lora_name(meta.lora_name or self.config.lora_name, new_version - keep)
            if stale in engine.lora_adapters:
                engine.unload_lora_adapter(stale)
        return time.perf_counter() - tik

    def update_weights_from_distributed(self, meta: WeightUpdateMeta, param_specs) -> Future[None]:
        raise NotImplementedError("the unsloth backend shares the trained model in-process: use "
                                  "weight_update_mode='disk' (a version bump, nothing is transferred)")

    def init_weights_update_group(self, meta: WeightUpdateMeta, *args, **kwargs) -> Future[None]:
        raise NotImplementedError("the unsloth backend needs no weight-update process group")

    def offload(self) -> None:
        """Free the KV cache (the model is shared with the trainer and stays)."""
        self.rollout_engine.offload()

    def onload(self, tags: list[str] | None = None) -> None:
        self.rollout_engine.onload()

    # ------------------------------------------------------------------ stats
    def export_stats(self) -> dict[str, float]:
        stats = stats_tracker.export_all(reduce_group=None)
        if self._engine is not None:
            for k, v in self._engine.stats().items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    stats[f"unsloth_rollout/{k}"] = float(v)
        return stats

