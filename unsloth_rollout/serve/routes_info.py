"""Information routes: liveness, version, Prometheus metrics, and ``/server_info`` (the engine's configuration in
the shape of vLLM's resolved ``VllmConfig``, which TRL's clients read to choose their sync path).
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse, Response

from .. import __version__, bitwise
from .metrics import metrics_text
from .state import ServerState


def add_info_routes(app: FastAPI, state: ServerState) -> None:
    engine = state.engine

    @app.get("/health")
    async def health():
        """Liveness: 200, no body, without the API key. Called by: TRL's ``VLLMClient.check_server``, AReaL's
        ``RemotevLLMEngine``, load balancers."""
        return Response(status_code=200)

    @app.get("/ping")
    async def ping():
        """Liveness, as /health (SageMaker's and vLLM's ``/ping``)."""
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        """Returns: ``{"version": "<unsloth_rollout version>"}``, without the API key."""
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics():
        """Prometheus text, without the API key: requests, tokens, running / waiting, KV usage and latency
        histograms under vLLM's metric names, so a vLLM dashboard reads this server unchanged. Called by: Prometheus
        scrapers."""
        return PlainTextResponse(metrics_text(state), media_type="text/plain; version=0.0.4")

    @app.get("/get_world_size")
    async def get_world_size():
        """Returns: ``{"world_size": 1}``. Called by: TRL's ``VLLMClient.get_world_size``."""
        return {"world_size": 1}

    @app.get("/server_info")
    async def server_info(config_format: str = "json"):
        """The engine's configuration in the shape of vLLM's resolved ``VllmConfig``.

        Takes: query ``config_format`` (``json``, as TRL sends).
        Returns: ``{"vllm_config": {"model_config", "cache_config", "parallel_config", "scheduler_config",
        "lora_config", "weight_transfer_config", "device_config"}, "backend", "bitwise", "version"}``: ``bitwise``
        is true when the engine runs the bitwise on-policy mode (``--bitwise``).
        Called by: TRL's ``VLLMClient.get_server_info`` (``lora_config``, ``parallel_config.data_parallel_size``,
        ``model_config.logprobs_mode``, ``weight_transfer_config``: what ``--weight-transfer-config`` set, else
        null, and TRL's ``init_communicator`` then stops by name).
        """
        return {"vllm_config": server_config(state), "backend": getattr(engine.policy, "backend", None),
                "bitwise": bitwise.enabled(engine.policy), "version": __version__}


def server_config(state: ServerState) -> dict:
    """``/server_info``'s ``vllm_config``: vLLM's field names for what this engine is and can do."""
    engine, opts = state.engine, state.settings
    policy, cfg, s = engine.policy, engine.config, engine.stats()
    return {
        "model_config": {"model": state.model_path, "served_model_name": state.model_name,
                         "tokenizer": state.model_path, "dtype": str(policy.dtype),
                         "max_model_len": engine.max_model_len, "logprobs_mode": opts.logprobs_mode,
                         "max_logprobs": opts.max_logprobs,
                         "generation_config": "auto" if state.default_sampling else "vllm",
                         "is_multimodal_model": bool(policy.is_vlm)},
        "cache_config": {"block_size": s["kv_block_size"], "num_gpu_blocks": s["kv_blocks_total"],
                         "num_cpu_blocks": 0, "enable_prefix_caching": cfg.prefix_cache, "cache_dtype": "auto"},
        "parallel_config": {"data_parallel_size": 1, "tensor_parallel_size": 1, "pipeline_parallel_size": 1,
                            "world_size": 1},
        "scheduler_config": {"max_num_seqs": cfg.max_num_seqs, "max_num_batched_tokens": cfg.prefill.max_tokens,
                             "max_model_len": engine.max_model_len, "enable_chunked_prefill": True},
        # Adapters are served by the engine itself (PEFT, any target module, vision tower included).
        # The limits the engine enforces at load (EngineConfig); no max_loras: no limit, so any count a client checks.
        "lora_config": {"max_lora_rank": cfg.lora.max_lora_rank,
                        "max_loras": cfg.lora.max_loras if cfg.lora.max_loras is not None else 2**31 - 1,
                        "max_cpu_loras": None,
                        "fully_sharded_loras": False, "lora_dtype": "auto"},
        # {"backend": "nccl" | "gloo", "timeout_s"} with --weight-transfer-config; None otherwise (TRL then refuses
        # server-mode full-weight sync at start, by name).
        "weight_transfer_config": opts.weight_transfer_config,
        "device_config": {"device": str(policy.device)},
    }
