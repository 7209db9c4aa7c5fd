"""Prefix lookups cost O(prompt length) whatever the number of cached prompts (block hash chains, as vLLM's prefix
caching), and find exactly the cached prompt a scan over every entry finds."""

from __future__ import annotations

import random
import statistics
import time

import torch

from unsloth_rollout.engine.prefix_cache import PrefixCache, PrefixEntry

HEADER = [7, 8, 9, 10]  # every chat prompt ends with the assistant header


class _Pool:  # the two things PrefixCache asks of the KV pool
    block_size = 16

    def free(self, blocks):
        pass


def _entry(stamp=(0, 0)) -> PrefixEntry:
    return PrefixEntry([], 0, torch.zeros(1), 0, 0, stamp)


def _scan(cache: PrefixCache, key, stamp):
    """The oracle: the longest proper prefix among all entries, by brute force."""
    ids, images, lora = key
    best = None
    for k, e in cache.entries.items():
        n = len(k[0])
        if (16 <= n < len(ids) and k[1:] == (images, lora) and e.stamp == stamp and tuple(ids[:n]) == k[0]
                and (best is None or n > len(best[0]))):
            best = k
    return best


def test_longest_prefix_equals_a_scan_of_every_entry():
    rng = random.Random(0)
    cache = PrefixCache(_Pool())
    base = [rng.randrange(50) for _ in range(90)]
    for i in range(300):
        n = rng.randrange(1, 90)
        ids = base[:n] if rng.random() < 0.5 else [rng.randrange(3) for _ in range(n)]
        cache.insert((tuple(ids), ("img",) if i % 7 == 0 else (), "a" if i % 5 == 0 else None),
                     _entry((0, 1) if i % 11 == 0 else (0, 0)))
    keys = list(cache.entries)
    for k in keys[::3]:  # drops keep the index in step
        cache.drop(k)
    for i in range(400):
        n = rng.randrange(1, 120)
        ids = tuple(base[:n] + [rng.randrange(3) for _ in range(rng.randrange(3))]) if i % 2 else tuple(
            rng.randrange(3) for _ in range(n))
        key = (ids, ("img",) if i % 7 == 0 else (), "a" if i % 5 == 0 else None)
        hit = cache.longest_prefix(key, (0, 0))
        assert (hit[0] if hit else None) == _scan(cache, key, (0, 0)), ids


def _cache(num_cached: int):
    """A cache of ``num_cached`` 1k-token chat prompts (different contents, the same last tokens), a next turn of
    one of them and a prompt that extends none."""
    g = torch.Generator().manual_seed(num_cached)
    cache = PrefixCache(_Pool())
    for row in torch.randint(0, 1000, (num_cached, 1000), generator=g).tolist():
        cache.insert((tuple([1, 2, 3] + row + HEADER), (), None), _entry())
    target = next(iter(cache.entries))
    miss = (tuple([1, 2, 3] + torch.randint(0, 1000, (1000,), generator=g).tolist() + HEADER + [5]), (), None)
    return cache, (target[0] + (11, 12, 13) * 30, (), None), target, miss


def _lookup_seconds(cache, query, target, miss) -> float:
    t0 = time.perf_counter()
    assert cache.longest_prefix(query, (0, 0))[0] == target
    assert cache.longest_prefix(miss, (0, 0)) is None
    return time.perf_counter() - t0


def test_lookup_time_is_flat_from_10_to_2000_cached_prompts():
    small, large = _cache(10), _cache(2000)
    # Interleaved repeats, medians: robust to a shared, noisy machine.
    times = {10: [], 2000: []}
    for _ in range(30):
        times[10].append(_lookup_seconds(*small))
        times[2000].append(_lookup_seconds(*large))
    ratio = statistics.median(times[2000]) / statistics.median(times[10])
    assert ratio < 2.0, f"lookup with 2000 cached prompts took {ratio:.1f}x the time with 10"
