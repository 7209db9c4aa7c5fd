"""PrefixCache: the KV of prompts already prefilled, shared by every later identical prompt.

A GRPO group, or a request with n > 1, prefills its prompt once; each member then shares the full
blocks by reference count and gets a private copy of the last, partial block. A later prompt that
extends a cached one (a conversation's next turn: same tokens, same images, then more text) shares
the cached prompt's full blocks and prefills only the rest (``longest_prefix``). Entries are kept in
LRU order, evicted first when memory runs short, and dropped when the weights that computed them
change. This class is the only writer of the entries.

Lookups cost O(prompt length), whatever the number of entries (as vLLM's prefix caching): each entry is
indexed by the hash chain of its full blocks (hash of (parent hash, block tokens), the root hashing its
images and adapter) and its partial tail, so ``longest_prefix`` walks the new prompt's own blocks instead of
every cached prompt; the one candidate found is then compared token by token (a hash collision is never
shared).
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
        # chain hash of an entry's full blocks -> {its tail tokens after them: its key}
        self._by_blocks: dict[int, dict[tuple, tuple]] = {}
        self._where: dict[tuple, tuple] = {}  # key -> (its chain hash, its tail): where it is indexed
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

    def _chain(self, ids, extra) -> list[int]:
        """Hashes of ``ids``' full blocks, each over (the previous block's hash, its tokens); the root is
        ``extra`` (images, adapter): entry j is the hash of the first j + 1 blocks."""
        bs, h, out = self.kv.block_size, hash(extra), []
        for j in range(len(ids) // bs):
            h = hash((h, tuple(ids[j * bs:(j + 1) * bs])))
            out.append(h)
        return out

    def longest_prefix(self, key: tuple, stamp) -> tuple[tuple, PrefixEntry] | None:
        """The cached prompt that is the longest proper prefix of ``key``'s tokens (same images, same adapter,
        computed by the current weights ``stamp``) and spans at least one full block, or None.

        Its full blocks hold exactly the KV a prefill of the longer prompt would compute for those positions
        (each position depends only on the tokens up to it): a multi-turn conversation's next turn, or a prompt
        that extends an earlier one, prefills only what follows them. O(len(ids)): the new prompt's block
        hashes find the candidates, never a scan of the entries."""
        ids, images, lora = key
        bs = self.kv.block_size
        chain = self._chain(ids, (images, lora))
        for j in range(len(chain), 0, -1):  # deepest first: the first match is the longest
            tails = self._by_blocks.get(chain[j - 1])
            if not tails:
                continue
            for r in range(min(bs - 1, len(ids) - 1 - j * bs), -1, -1):
                k = tails.get(tuple(ids[j * bs:j * bs + r]))
                if k is None:
                    continue
                e = self.entries[k]
                n = len(k[0])
                if e.stamp == stamp and k[1] == images and k[2] == lora and tuple(ids[:n]) == k[0]:
                    self.entries.move_to_end(k)
                    return k, e
        return None

    def insert(self, key, entry: PrefixEntry) -> None:
        if key in self.entries:
            self.drop(key)
        self.entries[key] = entry
        ids, bs = key[0], self.kv.block_size
        full = len(ids) // bs
        if full:  # a prompt without a full block is never a prefix worth sharing
            where = (self._chain(ids, (key[1], key[2]))[-1], tuple(ids[full * bs:]))
            self._by_blocks.setdefault(where[0], {})[where[1]] = key
            self._where[key] = where

    def _unindex(self, key) -> None:
        where = self._where.pop(key, None)
        if where is not None:
            tails = self._by_blocks[where[0]]
            del tails[where[1]]
            if not tails:
                del self._by_blocks[where[0]]

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
                self._unindex(k)
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
