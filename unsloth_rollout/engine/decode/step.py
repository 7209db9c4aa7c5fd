"""What every decode variant shares: the context it is handed, the step's rows, and the interface it implements.

A decode step is two calls (vLLM v1's attention backends and nano-vllm's ``prepare_decode`` / ``run_model``):

- ``arrange(keys, lengths, block_tables, hint)``: make the variant's storage hold exactly this step's rows (the
  workspace fills a joining sequence's row from the pool once); returns the order the rows run in;
- ``run(rows)``: one new token per row, logits ``[B, V]``, every row's new K/V written into the paged pool.

A variant reads what it needs from a ``DecodeContext`` (the model, the pool, the settings, the attention
arithmetic, the runner's eager forward), never from another object's private attributes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch


@dataclass
class DecodeContext:
    """Everything a decode variant reads, handed whole by the runner."""

    policy: Any  # the PolicyModel: its model (forward, layers, adapters), lock and loader
    kv: Any  # the paged KVCache every step writes its new token into
    config: Any  # the engine's DecodeConfig (engine/config.py)
    device: torch.device
    num_layers: int  # decoder layers of the text model
    text_config: Any  # the decoder's transformers config (its attention implementation is switched per forward)
    inner: str  # the attention arithmetic the model was configured with (attention.inner_implementation)
    kernel: bool  # decode attention runs on the CPU kernel (decode/cpu_kernel.py)
    cache_arg: str  # the forward's cache keyword: "cache" (transformers >= 5.24) or "past_key_values"
    vision: Any  # PromptVision: each row's decode position (M-RoPE deltas included)
    forward: Callable  # the runner's eager forward: adapters per row, the cache-use guard
    weights_clock: Any = None  # the core's WeightsClock: the compiled step re-checks its guards when it moves
    bitwise: bool = False  # the bitwise on-policy mode (unsloth_rollout/bitwise.py): eager steps, whole rows


@dataclass
class DecodeRows:
    """One decode step's rows, in the order ``arrange`` returned."""

    tokens: list[int]  # each row's last token (the one this step feeds in)
    lengths: list[int]  # positions already cached per row (the new token's position)
    deltas: list[int]  # M-RoPE position deltas (0 for text models)
    block_tables: list[list[int]]  # each row's KV blocks in the pool
    adapters: list[str] | None = None  # per-row PEFT adapter names; None: every row uses the model's own
    keys: list[tuple] | None = None  # each row's (seq id, kv_epoch) when arranged; None: not arranged (gather)


def step_inputs(context: DecodeContext, tokens: list[int], lengths: list[int], deltas: list[int]):
    """(input_ids [B, 1], positions [B, 1] or M-RoPE [3, B, 1], lengths [B]) of a decode step's rows."""
    dev, b = context.device, len(tokens)
    lens_t = torch.tensor(lengths, device=dev)
    return torch.tensor(tokens, device=dev).view(b, 1), context.vision.decode_positions(lens_t, deltas), lens_t


def write_slots(block_tables: list[list[int]], lengths: list[int], block_size: int) -> list[int]:
    """Each row's pool slot for its new token (position ``lengths[i]``)."""
    return [t[n // block_size] * block_size + n % block_size for t, n in zip(block_tables, lengths)]


class DecodeStep:
    """The interface of a decode variant (``name``: its ``DecodeConfig.backend`` value)."""

    name = ""

    def arrange(self, keys: list[tuple], lengths: list[int], block_tables: list[list[int]],
                hint: tuple | None = None) -> list[int]:
        """The order this step's rows run in: for each row, the index of its sequence in the arguments."""
        return list(range(len(keys)))

    def run(self, rows: DecodeRows) -> torch.Tensor:
        """Logits ``[B, V]`` of one new token per row."""
        raise NotImplementedError

    def release(self) -> None:
        """Drop what the variant holds beside the pool (offload)."""
