"""Weight routes: LoRA adapters by name, full weights from disk, the weight version, and vLLM's full-weight transfer
routes (``weight_transfer.py``: over gloo with ``--weight-transfer-config``, 501 naming the alternatives otherwise).
"""

from __future__ import annotations

import asyncio

from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse

from ..engine import InvalidRequestError
from ..models.adapters import AdapterNotFoundError
from .protocol import APIError, LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest, UpdateWeightsFromDiskRequest, \
    UpdateWeightVersionRequest
from .state import ServerState
from .weight_transfer import install_weight_transfer_routes

def _require_runtime_lora(state: ServerState) -> None:
    if not state.settings.enable_runtime_lora:  # vLLM does not even register these routes then: 404
        raise APIError("loading LoRA adapters at runtime is off: start the server with --enable-runtime-lora "
                       "(or VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)", 404)


def add_weight_routes(app: FastAPI, state: ServerState) -> None:
    engine = state.engine

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(req: LoadLoRAAdapterRequest):
        """Load a PEFT adapter folder; requests then select it with ``"model": lora_name``.

        Off unless runtime LoRA updating is on (``--enable-runtime-lora`` or ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``,
        as in vLLM; 404 otherwise). An adapter the engine cannot serve exactly is refused with 400 and the reason, a
        missing one with 404; either way everything loaded before keeps serving. ``load_inplace`` replaces a loaded
        adapter's weights.

        Takes: ``{"lora_name": "policy-v3", "lora_path": "/ckpt/v3", "load_inplace": false}``.
        Returns: text ``Success: LoRA adapter 'policy-v3' added successfully.``
        Called by: AReaL's ``RemotevLLMEngine`` (LoRA updates from disk), TRL's async GRPO and distillation
        ``VLLMClient``.
        """
        _require_runtime_lora(state)
        name = req.lora_name
        if name in state.model_names:
            raise APIError(f"lora_name {name!r} is the served model's name", param="lora_name")
        try:
            await asyncio.to_thread(engine.load_lora_adapter, name, req.lora_path, bool(req.load_inplace))
        except AdapterNotFoundError as e:
            raise APIError(str(e), 404, param=e.field) from None
        except InvalidRequestError as e:
            raise APIError(str(e), param=e.field) from None
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(req: UnloadLoRAAdapterRequest):
        """Unload an adapter by name; its in-flight requests finish with finish_reason "abort".

        Takes: ``{"lora_name": "policy-v2"}`` (404 when not loaded).
        Returns: text ``Success: LoRA adapter 'policy-v2' removed successfully.``
        Called by: TRL's async GRPO and distillation ``VLLMClient`` (the previous version's adapter).
        """
        _require_runtime_lora(state)
        if req.lora_name not in engine.lora_adapters:
            raise APIError(f"The lora adapter '{req.lora_name}' cannot be found.", 404, param="lora_name")
        await asyncio.to_thread(engine.unload_lora_adapter, req.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")

    @app.post("/areal_update_weights")
    async def areal_update_weights(req: UpdateWeightsFromDiskRequest):
        """Full-model update from disk: copy a ``save_pretrained`` folder of the same model into the served policy
        (in-flight requests are aborted and return their partial output; the prefix cache is dropped).

        Takes: ``{"model_path": "/ckpt/step-100"}``.
        Returns: ``{"success": true, "message"}``; ``{"success": false, "message"}`` with 400 for a checkpoint
        that does not fit the model.
        Called by: AReaL's ``RemotevLLMEngine.update_weights_from_disk``.
        """
        from .weights import load_weights_from_disk

        try:
            n = await asyncio.to_thread(load_weights_from_disk, engine, req.model_path)
        except InvalidRequestError as e:
            return JSONResponse({"success": False, "message": str(e)}, status_code=400)
        return {"success": True, "message": f"Loaded {n} weights from {req.model_path}"}

    @app.get("/weight_info")
    async def weight_info():
        """Returns: ``{"weight_version": int, "lora_adapters": {name: path}}``. Called by: scripts and tests."""
        return {"weight_version": engine.version, "lora_adapters": dict(engine.lora_adapters)}

    @app.get("/get_weight_version")
    async def get_weight_version():
        """Returns: ``{"weight_version": int}``. Called by: scripts (SGLang's route of that name)."""
        return {"weight_version": engine.version}

    @app.post("/update_weight_version")
    async def update_weight_version(req: UpdateWeightVersionRequest):
        """Stamp tokens sampled from now on with a new weight version (no weights move).

        Takes: ``{"version": 3}`` (``weight_version`` / ``new_version`` also read); ``abort_all_requests``.
        Returns: ``{"success": true, "weight_version": 3, "message"}``.
        Called by: trainers that move weights themselves (SGLang's route of that name).
        """
        value = req.value()
        try:
            version = int(value)
        except (TypeError, ValueError):
            raise APIError(f"version must be an integer, got {value!r}", param="version") from None
        if req.abort_all_requests:
            await asyncio.to_thread(engine.abort_all)
        engine.set_version(version)
        return {"success": True, "weight_version": version, "message": f"Weight version updated to {version}"}

    install_weight_transfer_routes(app, state)
