"""The OpenAI-shaped routes: chat and text completions, the model list, tokenize and detokenize.

Each route's docstring says what it takes, what it returns and which peer client calls it (docs/server.md lists
them all).
"""

from __future__ import annotations

from fastapi import FastAPI, Request

from ..engine import GenerationRequest
from . import completions as comp
from .prompt import chat_prompt, prepare_prompt
from .protocol import APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from .state import ServerState


def add_openai_routes(app: FastAPI, state: ServerState) -> None:
    engine = state.engine

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request):
        """Chat completion: text and images, tools (parsed, or forced by ``tool_choice``), ``n``, logprobs,
        structured outputs, streaming.

        Takes: ``ChatCompletionRequest`` (OpenAI's fields and vLLM's extra sampling fields).
        Returns: an OpenAI ``chat.completion`` (``prompt_token_ids`` / ``token_ids`` with ``return_token_ids``), or
        ``chat.completion.chunk`` server-sent events when ``stream`` is true.
        Called by: the ``openai`` SDK, AReaL's ``ArealOpenAI`` agents (through ``AgentServer``), TRL's
        ``VLLMClient.chat``.

        Example request::

            {"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
        """
        return await comp.chat_completions(state, req, raw)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request):
        """Text completion; ``prompt`` is text, token ids, or a list of either. ``echo`` / ``prompt_logprobs`` score
        the prompt (``max_tokens: 0`` scores without sampling).

        Takes: ``CompletionRequest``.
        Returns: an OpenAI ``text_completion`` (one choice per prompt and sample), or SSE chunks when streaming.
        Called by: AReaL's ``RemotevLLMEngine`` (generation and ``compute_logp``), TRL's ``VLLMClient.generate``
        and ``get_sequence_logprobs``, TRL's async GRPO rollout worker.

        Example request::

            {"prompt": [1, 2, 3], "max_tokens": 8, "logprobs": 0, "return_token_ids": true}
        """
        return await comp.completions(state, req, raw)

    @app.get("/v1/models")
    async def models():
        """The served model and every loaded LoRA adapter.

        Returns: ``{"object": "list", "data": [{"id", "root", "parent", "max_model_len", ...}]}``; an adapter's
        ``parent`` is the served model.
        Called by: TRL's ``VLLMClient`` (the model id it sends), TRL's async GRPO client, the ``openai`` SDK.
        """
        def card(name, root, parent):
            return {"id": name, "object": "model", "created": state.start_time, "owned_by": "unsloth_rollout",
                    "root": root, "parent": parent, "max_model_len": engine.max_model_len, "permission": []}

        data = [card(n, state.model_path or n, None) for n in state.model_names[:1]]
        data += [card(n, p, state.model_name) for n, p in engine.lora_adapters.items()]
        return {"object": "list", "data": data}

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        """The tokens a prompt, or a chat request's messages, become: for messages exactly the tokens
        ``/v1/chat/completions`` runs for the same fields (one route, ``prompt.chat_prompt``), image placeholders
        expanded.

        Takes: ``{"prompt": "text"}`` or ``{"messages": [...], "tools", "add_generation_prompt",
        "continue_final_message", "chat_template_kwargs"}``; ``return_token_strs``.
        Returns: ``{"count", "max_model_len", "tokens", "token_strs"}``.
        Called by: vLLM-style clients counting prompt tokens (vLLM's ``/tokenize``).
        """
        if (req.prompt is None) == (req.messages is None):
            raise APIError("give exactly one of prompt or messages", param="prompt")
        state.adapter_for(req.model)
        if req.prompt is not None:
            ids = state.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens is not False)
        else:
            prompt = await chat_prompt(state, req)
            ids = prepare_prompt(state, GenerationRequest(input_ids=prompt.ids, images=prompt.images or None),
                                 "messages")
        body = {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}
        body["token_strs"] = state.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return body

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        """Token ids -> text.

        Takes: ``{"tokens": [1, 2, 3]}`` (every id inside the vocabulary, else 400 naming ``tokens``).
        Returns: ``{"prompt": text}``.
        Called by: vLLM-style clients (vLLM's ``/detokenize``).
        """
        state.adapter_for(req.model)
        vocab = len(state.tokenizer)
        bad = next((t for t in req.tokens if t < 0 or t >= vocab), None)
        if bad is not None:
            raise APIError(f"tokens holds token id {bad} outside [0, {vocab})", param="tokens")
        return {"prompt": state.tokenizer.decode(req.tokens)}
