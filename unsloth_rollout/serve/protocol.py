"""Request models (pydantic) and the OpenAI error schema for the server.

Field names and defaults follow vLLM's OpenAI-compatible server, so existing clients (the ``openai``
package, AReaL's ``RemotevLLMEngine``, TRL's async GRPO) send what they already send. Unknown fields
are ignored, as vLLM does. Range checks live here where they are static; limits that depend on the
server (``n``, ``max_model_len``, images) are checked in ``completions.py``.

Example::

    ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], max_tokens=8)
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 413: "BadRequestError",
               405: "BadRequestError", 409: "BadRequestError", 499: "ClientClosedRequest",
               500: "InternalServerError", 503: "ServiceUnavailableError"}


class APIError(Exception):
    """An error answered in OpenAI's schema: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, type: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.type = type or ERROR_TYPES.get(status, "BadRequestError")


def error_body(message: str, status: int, param: str | None = None, type: str | None = None) -> dict:
    return {"error": {"message": message, "type": type or ERROR_TYPES.get(status, "BadRequestError"),
                      "param": param, "code": status}}


class _Base(BaseModel):
    # JSON has no Infinity / NaN, but Python's parser accepts them: refuse them as numbers.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(_Base):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class FunctionDefinition(_Base):
    model_config = ConfigDict(extra="allow")  # keep e.g. "strict" for the chat template
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolParam(_Base):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Base):
    name: str


class NamedToolChoice(_Base):
    type: Literal["function"] = "function"
    function: NamedFunction


class _Sampling(_Base):
    """Fields shared by chat and text completions (vLLM's extra sampling params included)."""

    model: str | None = None
    n: int | None = Field(1, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    frequency_penalty: float | None = Field(0.0, ge=-2, le=2)
    presence_penalty: float | None = Field(0.0, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = False
    min_tokens: int | None = Field(0, ge=0)
    skip_special_tokens: bool | None = True
    include_stop_str_in_output: bool | None = False
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    use_beam_search: bool | None = False
    logit_bias: dict[str, float] | None = None
    prompt_logprobs: int | None = Field(None, ge=0)  # at most the server's --max-logprobs
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM's: json / regex / choice / grammar
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    request_id: str | None = None
    user: str | None = None
    echo: bool | None = False
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    truncation_side: Literal["left", "right"] | None = None


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions.

    Example body::

        {"model": "tiny", "messages": [{"role": "user", "content": [
            {"type": "text", "text": "What is this?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}]}],
         "max_tokens": 16, "logprobs": true, "top_logprobs": 2}
    """

    messages: list[dict[str, Any]] = Field(min_length=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[ToolParam] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = True
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    add_special_tokens: bool | None = False


class CompletionRequest(_Sampling):
    """POST /v1/completions. ``prompt``: text, token ids, or a list of either.

    Example body (AReaL's VLLMBackend)::

        {"prompt": [151644, 872, 198], "max_tokens": 64, "temperature": 1.0, "logprobs": 0,
         "return_tokens_as_token_ids": true, "stop_token_ids": [151645]}
    """

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)  # 0: score the prompt only (with echo or prompt_logprobs)
    logprobs: int | None = Field(None, ge=0, le=20)
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool | None = True


class TokenizeRequest(_Base):
    """POST /tokenize: ``{"prompt": "text"}`` or ``{"messages": [...]}``."""

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[ToolParam] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool | None = False


class DetokenizeRequest(_Base):
    """POST /detokenize: ``{"tokens": [1, 2, 3]}``."""

    model: str | None = None
    tokens: list[int]


class LoadLoRAAdapterRequest(_Base):
    """POST /v1/load_lora_adapter: ``{"lora_name": "a-v1", "lora_path": "/ckpt/a-v1"}``."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    load_inplace: bool | None = False


class UnloadLoRAAdapterRequest(_Base):
    """POST /v1/unload_lora_adapter: ``{"lora_name": "a-v1"}``."""

    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None


class UpdateWeightsFromDiskRequest(_Base):
    """POST /areal_update_weights: ``{"model_path": "/ckpt/step-100"}``."""

    model_path: str = Field(min_length=1)
    load_format: str | None = "auto"
    abort_all_requests: bool | None = False


class UpdateWeightVersionRequest(_Base):
    """POST /update_weight_version: ``{"version": 3}`` (``weight_version`` / ``new_version`` also read)."""

    version: int | str | None = None
    weight_version: int | str | None = None
    new_version: int | str | None = None
    abort_all_requests: bool | None = False

    def value(self) -> int | str | None:
        for v in (self.version, self.weight_version, self.new_version):
            if v is not None:
                return v
        return None
