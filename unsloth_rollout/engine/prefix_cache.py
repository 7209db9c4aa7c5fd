"""PrefixCache: the KV of prompts already prefilled, shared by every later identical prompt.

A GRPO group, or a request with n > 1, prefills its prompt once; each member then shares the full
blocks by reference count and gets a private copy of the last, partial block. A later prompt that
extends a cached one (a conversation's next turn: same tokens, same images, then more text) shares
the cached prompt's full blocks and prefills only the rest (``longest_prefix``). Entries are kept in
LRU order, evicted first when memory runs short, and dropped when the weights that computed them
change. This class is the only writer of the entries.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from .kv_cache import KVCache


@dataclass
class PrefixEntry:
    blocks: list[int]
    num_tokens: int
    logits: torch.Tensor  # the last prompt position's logits: every member samples its first token from them
    rope_delta: int
    version: int
    stamp: tuple = ()  # the engine's weights stamp when this KV was computed (stale once it changes)
    scores: object = None  # PromptScores of every prompt position, when a scoring request computed them


def prefix_key(seq) -> tuple:
    """Identical prompts (same tokens, same images, same adapter) share one prefill."""
    return seq.prompt.key + (seq.lora_name,)


class PrefixCache:
    def __init__(self, kv: KVCache, enabled: bool = True):
        self.kv = kv
        self.enabled = enabled
        self.entries: OrderedDict[tuple, PrefixEntry] = OrderedDict()
        self.hits = 0
        self.extensions = 0  # prompts that extended a cached prompt's KV instead of prefilling from 0
        self.reused_tokens = 0  # prompt tokens those prompts did not prefill again

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, key) -> bool:
        return key in self.entries

    def lookup(self, key) -> PrefixEntry | None:
        entry = self.entries.get(key)
        if entry is not None:
            self.entries.move_to_end(key)
        return entry

    def longest_prefix(self, key: tuple, stamp) -> tuple[tuple, PrefixEntry] | None:
        """The cached prompt that is the longest proper prefix of ``key``'s tokens (same images, same adapter,
        computed by the current weights ``stamp``) and spans at least one full block, or None.

        Its full blocks hold exactly the KV a prefill of the longer prompt would compute for those positions
        (each position depends only on the tokens up to it): a multi-turn conversation's next turn, or a prompt
        that extends an earlier one, prefills only what follows them."""
        ids, images, lora = key
        best, best_n = None, self.kv.block_size - 1
        for k, e in self.entries.items():
            n = len(k[0])
            if (best_n < n < len(ids) and k[2] == lora and k[1] == images and e.stamp == stamp
                    and ids[n - 1] == k[0][-1] and ids[:n] == k[0]):
                best, best_n = (k, e), n
        if best is not None:
            self.entries.move_to_end(best[0])
        return best

    def insert(self, key, entry: PrefixEntry) -> None:
        self.entries[key] = entry

    def share(self, entry: PrefixEntry, own_last_block: list[int]) -> list[int]:
        """A member's block table: the entry's full blocks shared, plus its own copy of the partial last one."""
        full, rem = divmod(entry.num_tokens, self.kv.block_size)
        table = self.kv.share(entry.blocks[:full])
        if rem:
            self.kv.copy_block(entry.blocks[full], own_last_block[0], rem)
            table += own_last_block
        return table

    def needs_own_block(self, entry: PrefixEntry) -> bool:
        return entry.num_tokens % self.kv.block_size != 0

    def drop(self, key=None) -> None:
        """Drop one entry (``key``) or all of them, freeing their blocks."""
        for k in list(self.entries) if key is None else [key]:
            entry = self.entries.pop(k, None)
            if entry is not None:
                self.kv.free(entry.blocks)

    def drop_stale(self, stamp_of) -> None:
        """KV computed by old weights is not reused: drop entries whose stamp is not ``stamp_of(lora_name)``
        (the last element of a prefix key)."""
        for k in [k for k, e in self.entries.items() if e.stamp != stamp_of(k[-1])]:
            self.drop(k)

    def evict_for(self, needed: int, keep=None) -> bool:
        """Evict least recently used entries (never ``keep``) until ``needed`` blocks are free."""
        while self.kv.num_free_blocks < needed:
            victim = next((k for k in self.entries if k != keep), None)
            if victim is None:
                return False
            self.drop(victim)
        return True
