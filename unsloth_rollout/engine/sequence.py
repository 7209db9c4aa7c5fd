"""Sequence: all per-sample state in one object (tokens, logprobs, versions, KV blocks, stop checks)."""

from __future__ import annotations

import enum
import hashlib
import itertools
import random
import time
from array import array
from typing import Callable

from .config import SamplingParams
from .inputs import PreparedPrompt
from .request import GenerationOutput

_ids = itertools.count()


def sample_stream_seed(seed: int, sample_index: int) -> int:
    """The seed of sample ``sample_index`` of a request seeded ``seed``: a hash of the pair, so (seed, i) and
    (seed + 1, i - 1) get unrelated streams (``seed + i`` made them the same one), whatever else is batched."""
    digest = hashlib.blake2b(f"unsloth_rollout:{int(seed)}:{int(sample_index)}".encode(), digest_size=16).digest()
    return int.from_bytes(digest, "little")


class Status(enum.Enum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2


class Sequence:
    def __init__(self, request_id: str, sample_index: int, prompt: PreparedPrompt, sampling: SamplingParams,
                 on_event: Callable[["Sequence", bool], None] | None = None, lora_name: str | None = None):
        self.seq_id = next(_ids)
        self.request_id = request_id
        self.sample_index = sample_index
        self.prompt = prompt
        self.sampling = sampling
        self.lora_name = lora_name
        self.on_event = on_event  # called (seq, finished) from the engine thread after each new token
        self.stop_text_truncated = False
        self.protected_chars: int | None = None  # length of the min_new_tokens text no stop string may end in
        self.output_ids: list[int] = []
        self.output_logprobs: list[float] = []
        self.output_versions: list[int] = []
        # Per token: the oldest weight version among the cached positions it attended to (== output_versions
        # unless EngineConfig.recompute_on_weight_change is off).
        self.output_kv_versions: list[int] = []
        self.top_logprobs: list[dict[int, float]] | None = [] if sampling.logprobs else None
        self.prompt_scores = None  # PromptScores of the prompt (requests with prompt_logprobs), set at prefill
        # Structured outputs: this sample's grammar state (engine/constraints.py), and per token the logprob
        # renormalised over the tokens the grammar allowed (None for an unconstrained sample).
        self.constraint = None
        self.sampling_row = None  # the sampler's parameter row of this sample, built at its first token (sampler.py)
        self.output_constrained_logprobs: list[float] | None = None
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.error: str | None = None
        self.text = ""
        self.detok = None  # incremental detokenizer state (OutputProcessor.text)
        # KV state: blocks holding this sequence's cached tokens, and how many tokens are cached.
        self.block_table: list[int] = []
        self.num_cached = 0
        self.rope_delta = 0
        # Which weights computed the cached positions: the engine's weights stamp when they were (re)computed,
        # and the oldest weight version among them.
        self.kv_stamp: tuple = ()
        self.kv_version = 0
        # The KV incarnation: bumped by the core each time this sequence's KV is (re)computed (prefill, prefix
        # share, recompute after preemption or a weight change). Decode workspace rows are keyed by it.
        self.kv_epoch = 0
        seed = sampling.seed
        self.rng = random.Random(sample_stream_seed(seed, sample_index)) if seed is not None else None
        self.arrival_time = time.perf_counter()
        self.scheduled_time: float | None = None  # first admitted to a step (queue time ends)
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.token_gaps = array("d")  # seconds between consecutive output tokens (vLLM's inter-token latency)
        self.finish_time: float | None = None
        self.num_preemptions = 0

    @property
    def prompt_ids(self) -> list[int]:
        return self.prompt.prompt_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt.prompt_ids) + len(self.output_ids)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt.prompt_ids + self.output_ids

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt.prompt_ids[-1]

    @property
    def finished(self) -> bool:
        return self.status == Status.FINISHED

    def append(self, token: int, logprob: float, version: int, top: dict[int, float] | None,
               kv_version: int | None = None, constrained_logprob: float | None = None) -> None:
        now = time.perf_counter()
        if self.first_token_time is None:
            self.first_token_time = now
        else:
            self.token_gaps.append(now - self.last_token_time)
        self.last_token_time = now
        self.output_ids.append(token)
        self.output_logprobs.append(logprob)
        self.output_versions.append(version)
        self.output_kv_versions.append(version if kv_version is None else kv_version)
        if self.top_logprobs is not None:
            self.top_logprobs.append(top or {})
        if constrained_logprob is not None:
            if self.output_constrained_logprobs is None:
                self.output_constrained_logprobs = []
            self.output_constrained_logprobs.append(constrained_logprob)

    def finish(self, reason: str, stop_reason=None, error: str | None = None) -> None:
        self.status = Status.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.error = error
        self.finish_time = time.perf_counter()

    def to_output(self) -> GenerationOutput:
        now = self.finish_time or time.perf_counter()
        metrics = {
            "arrival_time": self.arrival_time,
            "ttft_s": None if self.first_token_time is None else self.first_token_time - self.arrival_time,
            "queue_s": None if self.scheduled_time is None else self.scheduled_time - self.arrival_time,
            "latency_s": now - self.arrival_time,
            "num_preemptions": self.num_preemptions,
            "prompt_tokens": len(self.prompt.prompt_ids),
            "output_tokens": len(self.output_ids),
            "inter_token_s": list(self.token_gaps),
        }
        prompt_lps, prompt_ranks = (None, None) if self.prompt_scores is None else \
            self.prompt_scores.as_dicts(self.sampling.prompt_logprobs or 0)
        return GenerationOutput(
            request_id=self.request_id, prompt_ids=list(self.prompt.prompt_ids), output_ids=list(self.output_ids),
            output_logprobs=list(self.output_logprobs), output_versions=list(self.output_versions),
            output_kv_versions=list(self.output_kv_versions),
            top_logprobs=None if self.top_logprobs is None else list(self.top_logprobs),
            finish_reason=self.finish_reason, stop_reason=self.stop_reason, text=self.text, metrics=metrics,
            error=self.error, sample_index=self.sample_index, pixel_values=self.prompt.pixel_values,
            image_grid_thw=self.prompt.image_grid_thw, prompt_logprobs=prompt_lps,
            prompt_logprob_ranks=prompt_ranks, output_constrained_logprobs=None
            if self.output_constrained_logprobs is None else list(self.output_constrained_logprobs))
