"""Probe: decode attention formulations on the captured step's shapes, standalone (K/V cache-resident).

One decode step's attention of ``tiny-lm`` at batch 64: 2 KV heads x 2 query rows per KV head (the engine's
grouped-query layout), head dim 16, 272 keys, a boolean length mask. Times, median of 5 batches of calls:
SDPA (what the engine runs), a two-matmul formulation compiled, a formulation with no matmul (products and
reductions that inductor fuses into one pass over K and one over V) compiled, and one read of K + V
(``sum``) as the floor. The tensors stay in the CPU caches here; in a real 36-layer step the history does not,
so these are upper bounds on what a formulation saves:

    python benchmarks/decode_attention_probe.py
"""

import statistics
import time

import torch

B, KVH, G, D, L = 64, 2, 2, 16, 272
SCALE = D ** -0.5


def sdpa(q, k, v, m):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=SCALE)


def two_matmuls(q, k, v, m):
    s = torch.matmul(q, k.transpose(-1, -2)) * SCALE
    p = torch.softmax(s.masked_fill(~m, torch.finfo(s.dtype).min), dim=-1)
    return torch.matmul(p, v)


def reductions(q, k, v, m):
    s = (q.unsqueeze(-2) * k.unsqueeze(-3)).sum(-1) * SCALE  # [B, KVH, G, L]
    p = torch.softmax(s.masked_fill(~m, torch.finfo(s.dtype).min), dim=-1)
    return (p.unsqueeze(-1) * v.unsqueeze(2)).sum(-2)


def per_call_us(fn, args, calls=300):
    for _ in range(10):
        fn(*args)
    ts = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(calls // 5):
            fn(*args)
        ts.append((time.perf_counter() - t) / (calls // 5) * 1e6)
    return statistics.median(ts)


def main():
    torch.manual_seed(0)
    q, k, v = torch.randn(B, KVH, G, D), torch.randn(B, KVH, L, D), torch.randn(B, KVH, L, D)
    lens = torch.randint(200, L, (B,))
    m = (torch.arange(L)[None, :] <= lens[:, None]).view(B, 1, 1, L)
    ref = sdpa(q, k, v, m)
    print(f"torch threads {torch.get_num_threads()}, shapes q {tuple(q.shape)} k/v {tuple(k.shape)}")
    for name, fn in (("sdpa", sdpa), ("two matmuls, compiled", torch.compile(two_matmuls, dynamic=True)),
                     ("reductions, compiled", torch.compile(reductions, dynamic=True))):
        diff = (fn(q, k, v, m) - ref).abs().max().item()
        print(f"{name:24s} {per_call_us(fn, (q, k, v, m)):7.0f} us   max |diff vs sdpa| {diff:.1e}")
    kv = torch.cat([k.flatten(), v.flatten()])
    print(f"{'one read of K + V':24s} {per_call_us(lambda x: x.sum(), (kv,)):7.0f} us")


if __name__ == "__main__":
    main()
