"""Engine-owned paged KV cache, and the view that lets a stock HF model write into it.

Memory is preallocated once from a byte budget as ``num_blocks * block_size`` token slots per
layer. Sequences own lists of blocks; identical prompts share full blocks by reference count.
A forward pass sees a ``CacheView``: HF attention layers call ``update(k, v, layer_idx)``, the
view scatters the new keys/values into their slots and returns the keys/values the batch attends
to, gathered per row (rows of different lengths, padded and masked).
"""

from __future__ import annotations

import math
import mmap
import os
from collections import deque

import torch

from .attention import legacy_cache_read


def _mapped_zeros(n: int, shape: tuple, dtype: torch.dtype) -> list[torch.Tensor]:
    """``n`` zero tensors of ``shape`` in one anonymous memory map of their own (CPU), touched now.

    Not from malloc's heap: there the pool would take the memory an earlier engine's decode rows and activations
    freed (``engine/malloc.py`` keeps it for reuse), and this engine's first steps would fault theirs in anew, at
    microseconds a page. Unmapped when the last tensor goes."""
    per = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    flat = torch.frombuffer(mmap.mmap(-1, n * per), dtype=torch.uint8)
    flat.zero_()  # the kernel's pages are zeros already: this faults them in at engine start, not in a step
    return [flat[i * per:(i + 1) * per].view(dtype).view(shape) for i in range(n)]


class KVCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device):
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.device = device
        # One extra block past the usable ones is scratch: padded rows of a fixed-shape decode write there.
        self.scratch_slot = num_blocks * block_size
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.refcount = [0] * num_blocks
        # per block: bumped each time it is allocated (new KV), so a copy keyed by (block, generation) is never
        # taken for the KV a later owner writes into the same block
        self.generation = [0] * num_blocks
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.on_release: list = []  # called by release_storage (the decode workspace drops its rows)
        self.allocate_storage()

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def memory_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def allocate_storage(self) -> None:
        if self.k:
            return
        shape = (self.num_slots + self.block_size, self.num_kv_heads, self.head_dim)
        if torch.device(self.device).type == "cpu":
            tensors = _mapped_zeros(2 * self.num_layers, shape, self.dtype)
        else:
            tensors = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(2 * self.num_layers)]
        self.k, self.v = tensors[:self.num_layers], tensors[self.num_layers:]

    def release_storage(self) -> None:
        """Free the tensors (offload); only legal when no block is in use."""
        assert self.num_free_blocks == self.num_blocks, "release_storage with blocks in use"
        self.k, self.v = [], []
        for fn in self.on_release:
            fn()

    # ------------------------------------------------------------------ block accounting
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def allocate(self, n: int) -> list[int] | None:
        if n > len(self.free_blocks):
            return None
        out = [self.free_blocks.popleft() for _ in range(n)]
        for b in out:
            self.refcount[b] = 1
            self.generation[b] += 1
        return out

    def share(self, blocks: list[int]) -> list[int]:
        for b in blocks:
            assert self.refcount[b] > 0
            self.refcount[b] += 1
        return list(blocks)

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            self.refcount[b] -= 1
            assert self.refcount[b] >= 0, "double free of a KV block"
            if self.refcount[b] == 0:
                self.free_blocks.append(b)

    def copy_block(self, src: int, dst: int, num_tokens: int | None = None) -> None:
        n = self.block_size if num_tokens is None else num_tokens
        s, d = src * self.block_size, dst * self.block_size
        for t in self.k + self.v:
            t[d:d + n].copy_(t[s:s + n])

    def slots(self, block_table: list[int], start: int, end: int) -> list[int]:
        """Flat slot indices of token positions [start, end) of a sequence."""
        bs = self.block_size
        return [block_table[p // bs] * bs + p % bs for p in range(start, end)]


class CacheView:
    """What the HF model sees as ``past_key_values`` for one engine forward.

    prefill: ``gather_index`` is None; keys/values of the new tokens are written and returned as
    they are (a fresh prompt attends only to itself, with the model's own causal mask).
    decode: one new token per row; returns the gathered history of each row, ``[B, H, L, D]``.
    """

    is_compileable = False
    is_sliding = [False]

    def __init__(self, cache: KVCache, write_slots: torch.Tensor, gather_index: torch.Tensor | None = None,
                 seq_length: int = 0, ctx=None):
        self.cache = cache
        self.ctx = ctx  # attention.ForwardContext: records that each layer wrote through this view
        self.write_slots = write_slots
        self.gather_index = gather_index
        self._seq_length = seq_length

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        # transformers >= 5.24 calls update(k, v, layer_idx, kwargs=<the attention's kwargs>); nothing in them
        # changes what is written or read here.
        keys, values = self._update(key_states, value_states, layer_idx)
        if self.ctx is not None:
            self.ctx.record_write(layer_idx, keys)
        return keys, values

    def _write_pool(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int) -> None:
        """Scatter the new tokens' keys/values ([B, H, Q, D]) into their slots of the paged pool."""
        kc, vc = self.cache.k[layer_idx], self.cache.v[layer_idx]
        b, h, q, d = key_states.shape
        kc.index_copy_(0, self.write_slots, key_states.transpose(1, 2).reshape(b * q, h, d).to(kc.dtype))
        vc.index_copy_(0, self.write_slots, value_states.transpose(1, 2).reshape(b * q, h, d).to(vc.dtype))

    def _update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int):
        self._write_pool(key_states, value_states, layer_idx)
        kc, vc = self.cache.k[layer_idx], self.cache.v[layer_idx]
        h, d = key_states.shape[1], key_states.shape[3]
        if self.gather_index is None:
            return key_states, value_states
        # index_select on the flat index: several times faster on CPU than advanced indexing kc[idx].
        flat = self.gather_index.view(-1)
        bl = self.gather_index.shape
        keys = kc.index_select(0, flat).view(*bl, h, d).permute(0, 2, 1, 3)  # [B, H, L, D]
        values = vc.index_select(0, flat).view(*bl, h, d).permute(0, 2, 1, 3)
        return keys.to(key_states.dtype), values.to(value_states.dtype)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._seq_length

    def __len__(self) -> int:
        return self.cache.num_layers

    def __getitem__(self, layer_idx):
        # A forward that indexes the cache like a legacy tuple (Unsloth's text fast path) bypasses it: refuse.
        raise legacy_cache_read("prefill" if self.gather_index is None else "decode")


def _available_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    try:
        import psutil

        return psutil.virtual_memory().available
    except ImportError:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def build_kv_cache(dims: tuple[int, int, int], dtype: torch.dtype, device: torch.device, config) -> KVCache:
    """The paged KV cache of a model with ``dims`` (layers, kv heads, head dim), sized from the EngineConfig's
    ``kv_cache_memory_bytes`` (or a fraction of free memory); a quantized model's cache is float16."""
    layers, kv_heads, head_dim = dims
    dtype = dtype if dtype in (torch.float32, torch.float16, torch.bfloat16) else torch.float16
    per_token = KVCache.bytes_per_token(layers, kv_heads, head_dim, dtype)
    budget = config.kv_cache_memory_bytes
    if budget is None:
        budget = int(_available_memory_bytes(device) * config.kv_cache_memory_fraction)
        if device.type != "cuda":
            budget = min(budget, 1 << 30)
    num_blocks = max(1, budget // (per_token * config.block_size))
    return KVCache(layers, kv_heads, head_dim, num_blocks, config.block_size, dtype, device)
