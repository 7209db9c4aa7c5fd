"""Requests in, outputs out: the engine's public data types."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from .config import SamplingParams


@dataclass
class GenerationRequest:
    """One prompt to sample from.

    Give exactly one of ``input_ids`` or ``messages``:
      - ``input_ids``: token ids, either already expanded (one image pad token per image patch,
        as AReaL's VisionRLVRWorkflow sends) or with one placeholder per image (the engine expands).
      - ``messages``: OpenAI chat form; the engine applies the chat template (images may be
        given inline as ``{"type": "image", "image": ...}`` / ``image_url`` parts).
    ``images``: PIL images, raw bytes, base64 strings (data URLs too) or file paths.

    Example::

        GenerationRequest(messages=[{"role": "user", "content": "2 + 2 ="}],
                          sampling=SamplingParams(max_new_tokens=8, temperature=0))
    """

    input_ids: list[int] | None = None
    messages: list[dict] | None = None
    images: list[Any] | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    request_id: str | None = None
    chat_template_kwargs: dict | None = None
    tools: list[dict] | None = None
    lora_name: str | None = None
    # A PreparedPrompt a front end already made with ``engine.prepare(request)`` (to count the expanded
    # prompt before queueing); the engine then uses it instead of tokenizing and processing images again.
    prepared: Any = field(default=None, repr=False)

    def __post_init__(self):
        if self.request_id is None:
            self.request_id = uuid.uuid4().hex
        if isinstance(self.sampling, dict):
            self.sampling = SamplingParams.from_dict(self.sampling)


@dataclass
class GenerationOutput:
    """What one sample produced.

    ``output_logprobs[i]`` is ``log_softmax(raw_logits / T)[output_ids[i]]``; ``output_versions[i]``
    the weight version that produced token i (sampled from and scored by those weights: a weight change
    mid-generation recomputes the cached positions first). ``output_kv_versions[i]`` is the oldest weight
    version among the cached positions token i attended to; it differs from ``output_versions[i]`` only
    when ``EngineConfig(recompute_on_weight_change=False)`` kept a stale cache. ``finish_reason`` is
    "stop" (EOS, stop id or stop string; an EOS or stop id stays in ``output_ids``), "length" or "abort".
    ``stop_reason`` is the matched stop string or token id, when there is one. ``error`` is set when the
    request was rejected or failed (then ``finish_reason`` is "abort"; a non-finite logprob fails the sample
    with an error starting "NonFiniteLogprob" rather than being returned). ``prompt_ids`` has every image
    placeholder expanded; ``pixel_values`` / ``image_grid_thw`` are what the model saw for its images (None
    without). With ``SamplingParams.structured_outputs``, ``output_logprobs`` stay the raw policy's (what a trainer
    recomputes) and ``output_constrained_logprobs[i]`` is token i's logprob renormalised over the tokens the
    grammar allowed at that step (the distribution it was drawn from, before top-k/p); None when unconstrained.
    """

    request_id: str
    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_versions: list[int] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    text: str = ""
    metrics: dict = field(default_factory=dict)
    error: str | None = None
    sample_index: int = 0
    output_kv_versions: list[int] = field(default_factory=list)
    # The vision inputs the prompt ran with (VLM requests with images): the exact tensors, for trainers.
    pixel_values: Any = None
    image_grid_thw: Any = None
    # With SamplingParams(prompt_logprobs=k): per prompt position, None at 0, then {prompt token: logprob, top k
    # ...} (the prompt's token first; log_softmax(raw_logits) at T = 1), and the prompt token's rank.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_logprob_ranks: list[int | None] | None = None
    output_constrained_logprobs: list[float] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class StreamDelta:
    """A piece of a streamed sample: the tokens (and text) produced since the last delta."""

    request_id: str
    sample_index: int
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    text: str
    top_logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    output: GenerationOutput | None = None  # the full output, on the last delta
    # With SamplingParams(prompt_logprobs=k), on the first delta only: the prompt's scores, as on GenerationOutput.
    prompt_logprobs: list[dict[int, float] | None] | None = None
