"""The image processor's outputs for recently seen images, so repeated images are processed once.

A GRPO group arrives as n requests with the same image (AReaL submits each sample on its own; so do agents
that resend a conversation). Each would run the family's image processor again: resize, normalise, patchify,
about 1-2 ms an image on the bench's small images on CPU, on the thread that submits, while the engine steps.
vLLM keeps the same kind of cache (``mm_processor_cache_gb``).

Encoded images (bytes, data URLs, long base64 strings: AReaL sends each sample's image as base64) are decoded
once too, keyed by a hash of the encoded bytes; a file path never is (its file may change between requests).

The key of a processor output is the images' content hashes (the ones the prefix cache keys prompts by) plus
the text the processor expanded, so a hit returns exactly what the processor returned for the same input. Entries are shared, never
copied: nothing downstream writes into a processor output. Bounded by bytes (``EngineConfig.
mm_processor_cache_bytes``; 0 turns it off), least recently used out first.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable

import torch


def _nbytes(enc: dict) -> int:
    """Bytes of a cached entry: its tensors, and its PIL images' pixels."""
    n = 0
    for v in enc.values():
        if isinstance(v, torch.Tensor):
            n += v.numel() * v.element_size()
        elif hasattr(v, "getbands"):  # a PIL image
            n += v.width * v.height * len(v.getbands())
    return n


class ProcessorCache:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[tuple, tuple[dict, int]] = OrderedDict()
        self._lock = threading.Lock()  # front ends prepare requests on several threads

    def get(self, key: tuple, make: Callable[[], dict]) -> dict:
        """``make()``'s result for ``key``: from the cache, or made now (and kept if it fits)."""
        if self.max_bytes <= 0:
            return make()
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                return hit[0]
        enc = make()  # outside the lock: a failure raises to its own caller and caches nothing
        size = _nbytes(enc)
        with self._lock:
            self.misses += 1
            if size <= self.max_bytes and key not in self._entries:
                self._entries[key] = (enc, size)
                self.bytes += size
                while self.bytes > self.max_bytes:
                    _, (_, freed) = self._entries.popitem(last=False)
                    self.bytes -= freed
        return enc

    def __len__(self) -> int:
        return len(self._entries)
