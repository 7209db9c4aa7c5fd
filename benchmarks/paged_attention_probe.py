"""Probe: a hand-written CPU decode attention that reads the paged pool in place, against SDPA on the workspace.

Decode attention could read each row's history from the paged pool inside the kernel (block table + lengths),
with no per-row copy. This probe is that kernel for CPU, in C++ with ATen's vector types, compiled by inductor's
toolchain (``CppCodeCache``, the flags and ISA inductor uses for its own kernels) and called through ctypes:
per (row, KV head), the keys of each block are transposed 16 at a time so the query heads that share the KV
head get 16 scores per broadcast multiply-add, an exact softmax over the real positions, then every value row
read once with the heads' accumulators in registers. It checks the kernel against SDPA on a gather of the same
positions (random block tables, GQA ratios, head dims, windows), then times it beside SDPA on the workspace
layout for two shapes: the captured step's (``tiny-lm`` at 36 layers: batch 64, 2 KV heads x 2, head dim 16,
272 keys) and ``--workload long``'s (batch 32, 2 KV heads x 4, head dim 64, 256 and 2048 keys).

    python benchmarks/paged_attention_probe.py [--json benchmarks/cpu/paged_attention_probe.json]

Finding (recorded in the JSON): exact (within ~1.4e-6 of SDPA), but not faster than SDPA on these shapes. The
pool is ``[slots, KV heads, D]`` per layer, so one KV head's keys sit a slot stride apart (every other cache line
at 2 KV heads x 64 B); the workspace rows SDPA reads are contiguous per head. Gathers were slower still (this
machine's AVX-512 gathers), so it is not in the engine; a pool laid out ``[blocks, KV heads, block, D]`` would be
the next thing to try.
"""

import argparse
import ctypes
import json
import statistics
import time

import torch

_SOURCE = r"""
#include "torch/csrc/inductor/cpp_prefix.h"
#include <vector>
#include <algorithm>

using Vec = at::vec::Vectorized<float>;
using VecI = at::vec::Vectorized<int32_t>;

// Scores of W consecutive keys (one block, slot stride apart) for the G query heads of one KV head: the keys'
// d-th components are gathered into one vector, so no horizontal sum per key.
template <int GC>
static inline void score_chunk(const float* kb, int64_t slot_stride, const float* qb, int64_t D, int64_t Grt,
                               float* tile, float scale, float* sc, int64_t n, int64_t i) {
    // W consecutive keys (one block): transposed into tile [D][W] (shuffles, no gathers), then W scores per
    // query head come from D broadcast multiply-adds, with no horizontal sum per key.
    constexpr int GMAX = GC > 0 ? GC : 16;
    const int64_t W = Vec::size();
    const int64_t G = GC > 0 ? GC : Grt;
    at::vec::transpose_mxn<float>(kb, slot_stride, tile, W, W, D);
    Vec a[GMAX], c[GMAX];
    for (int64_t g = 0; g < G; ++g) { a[g] = Vec(0.0f); c[g] = Vec(0.0f); }
    int64_t d = 0;
    for (; d + 2 <= D; d += 2) {
        const Vec k0 = Vec::loadu(tile + d * W), k1 = Vec::loadu(tile + (d + 1) * W);
        for (int64_t g = 0; g < G; ++g) {
            a[g] = at::vec::fmadd(Vec(qb[g * D + d]), k0, a[g]);
            c[g] = at::vec::fmadd(Vec(qb[g * D + d + 1]), k1, c[g]);
        }
    }
    for (; d < D; ++d) {
        const Vec kd = Vec::loadu(tile + d * W);
        for (int64_t g = 0; g < G; ++g) a[g] = at::vec::fmadd(Vec(qb[g * D + d]), kd, a[g]);
    }
    const Vec sv(scale);
    for (int64_t g = 0; g < G; ++g) ((a[g] + c[g]) * sv).store(sc + g * n + i);
}

// out[g] = sum_i p[g][i] v_i for the G heads of one KV head, every accumulator in a register (GC heads x DWC
// vectors of the head dim), each value row loaded once.
template <int GC, int DWC>
static inline void pv_acc(const float* pv, const int64_t* offs, const float* sc, int64_t n, const float* inv,
                          float* acc) {
    const int64_t W = Vec::size();
    Vec a[GC][DWC];
    for (int g = 0; g < GC; ++g) for (int c = 0; c < DWC; ++c) a[g][c] = Vec(0.0f);
    for (int64_t i = 0; i < n; ++i) {
        const float* vp = pv + offs[i];
        Vec v[DWC];
        for (int c = 0; c < DWC; ++c) v[c] = Vec::loadu(vp + c * W);
        for (int g = 0; g < GC; ++g) {
            const Vec p(sc[g * n + i]);
            for (int c = 0; c < DWC; ++c) a[g][c] = at::vec::fmadd(p, v[c], a[g][c]);
        }
    }
    for (int g = 0; g < GC; ++g) for (int c = 0; c < DWC; ++c) (a[g][c] * Vec(inv[g])).store(acc + (g * DWC + c) * W);
}

template <int GC>
static inline bool pv_dispatch_g(int64_t DW, const float* pv, const int64_t* offs, const float* sc, int64_t n,
                                 const float* inv, float* acc) {
    switch (DW) {
        case 1: pv_acc<GC, 1>(pv, offs, sc, n, inv, acc); return true;
        case 2: pv_acc<GC, 2>(pv, offs, sc, n, inv, acc); return true;
        case 4: pv_acc<GC, 4>(pv, offs, sc, n, inv, acc); return true;
        case 8: if (GC <= 2) { pv_acc<GC, 8>(pv, offs, sc, n, inv, acc); return true; } return false;
        default: return false;
    }
}

static inline bool pv_dispatch(int64_t G, int64_t D, const float* pv, const int64_t* offs, const float* sc,
                               int64_t n, const float* inv, float* acc) {
    const int64_t W = Vec::size();
    if (D % W) return false;
    const int64_t DW = D / W;
    switch (G) {
        case 1: return pv_dispatch_g<1>(DW, pv, offs, sc, n, inv, acc);
        case 2: return pv_dispatch_g<2>(DW, pv, offs, sc, n, inv, acc);
        case 4: return pv_dispatch_g<4>(DW, pv, offs, sc, n, inv, acc);
        default: return false;
    }
}

extern "C" void ur_paged_decode_attn(
    const float* q, const float* pk, const float* pv, const int64_t* bt, int64_t bt_stride,
    const int64_t* lengths, float* out, int64_t B, int64_t H, int64_t KVH, int64_t D,
    int64_t slot_stride, int64_t head_stride, int64_t block_size, int64_t window, float scale,
    int64_t nthreads)
{
    const int64_t W = Vec::size();
    const int64_t G = H / KVH;
    const int64_t DV = D - D % W;
    #pragma omp parallel num_threads(nthreads)
    {
        std::vector<float> sc;
        std::vector<float> acc;
        std::vector<int64_t> offs;
        std::vector<float> tile(D * Vec::size());
        float inv[256];
        #pragma omp for collapse(2) schedule(static)
        for (int64_t b = 0; b < B; ++b) {
            for (int64_t kh = 0; kh < KVH; ++kh) {
                const int64_t pos = lengths[b];
                const int64_t lo = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
                const int64_t n = pos + 1 - lo;
                sc.resize(G * n);
                offs.resize(n);
                acc.assign(G * D, 0.0f);
                const float* qb = q + (b * H + kh * G) * D;
                const int64_t* btb = bt + b * bt_stride;
                for (int64_t i = 0, l = lo; l <= pos; ) {  // the row's slots, block by block (no division per key)
                    const int64_t blk = l / block_size, first = l - blk * block_size;
                    const int64_t base = btb[blk] * block_size;
                    const int64_t last = std::min<int64_t>(block_size, pos + 1 - blk * block_size);
                    for (int64_t j = first; j < last; ++j, ++i, ++l) offs[i] = (base + j) * slot_stride + kh * head_stride;
                }
                for (int64_t i = 0; i < n; ) {
                    bool chunk = i + W <= n && G <= 16;
                    for (int64_t j = 1; chunk && j < W; ++j) chunk = offs[i + j] == offs[i] + j * slot_stride;
                    if (chunk) {
                        const float* kb = pk + offs[i];
                        if (G == 1) score_chunk<1>(kb, slot_stride, qb, D, G, tile.data(), scale, sc.data(), n, i);
                        else if (G == 2) score_chunk<2>(kb, slot_stride, qb, D, G, tile.data(), scale, sc.data(), n, i);
                        else if (G == 4) score_chunk<4>(kb, slot_stride, qb, D, G, tile.data(), scale, sc.data(), n, i);
                        else if (G == 8) score_chunk<8>(kb, slot_stride, qb, D, G, tile.data(), scale, sc.data(), n, i);
                        else score_chunk<0>(kb, slot_stride, qb, D, G, tile.data(), scale, sc.data(), n, i);
                        i += W;
                        continue;
                    }
                    const float* kp = pk + offs[i];
                    for (int64_t g = 0; g < G; ++g) {
                        const float* qg = qb + g * D;
                        Vec a(0.0f);
                        for (int64_t d = 0; d < DV; d += W)
                            a = at::vec::fmadd(Vec::loadu(qg + d), Vec::loadu(kp + d), a);
                        float s = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, a);
                        for (int64_t d = DV; d < D; ++d) s += qg[d] * kp[d];
                        sc[g * n + i] = s * scale;
                    }
                    ++i;
                }
                for (int64_t g = 0; g < G; ++g) {  // softmax numerators, in place; 1 / sum kept per head
                    float* s = sc.data() + g * n;
                    const int64_t nv = n - n % W;
                    Vec mvv(-INFINITY);
                    for (int64_t i = 0; i < nv; i += W) mvv = at::vec::maximum(mvv, Vec::loadu(s + i));
                    float m = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, mvv);
                    for (int64_t i = nv; i < n; ++i) m = std::max(m, s[i]);
                    const Vec mv(m);
                    Vec sumv(0.0f);
                    for (int64_t i = 0; i < nv; i += W) {
                        Vec e = (Vec::loadu(s + i) - mv).exp();
                        e.store(s + i);
                        sumv = sumv + e;
                    }
                    float sum = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, sumv);
                    if (nv < n) {
                        const int64_t r = n - nv;
                        float tail[64];
                        (Vec::loadu(s + nv, r) - mv).exp().store(tail, r);
                        for (int64_t j = 0; j < r; ++j) { s[nv + j] = tail[j]; sum += tail[j]; }
                    }
                    inv[g] = 1.0f / sum;
                }
                if (!pv_dispatch(G, D, pv, offs.data(), sc.data(), n, inv, acc.data()))
                for (int64_t g = 0; g < G; ++g) {  // sum_i p_i v_i / sum_i p_i, four keys in flight per chain
                    const float* p = sc.data() + g * n;
                    float* ag = acc.data() + g * D;
                    for (int64_t d = 0; d < DV; d += W) {
                        Vec a0(0.0f), a1(0.0f), a2(0.0f), a3(0.0f);
                        int64_t i = 0;
                        for (; i + 4 <= n; i += 4) {
                            a0 = at::vec::fmadd(Vec(p[i]), Vec::loadu(pv + offs[i] + d), a0);
                            a1 = at::vec::fmadd(Vec(p[i + 1]), Vec::loadu(pv + offs[i + 1] + d), a1);
                            a2 = at::vec::fmadd(Vec(p[i + 2]), Vec::loadu(pv + offs[i + 2] + d), a2);
                            a3 = at::vec::fmadd(Vec(p[i + 3]), Vec::loadu(pv + offs[i + 3] + d), a3);
                        }
                        for (; i < n; ++i) a0 = at::vec::fmadd(Vec(p[i]), Vec::loadu(pv + offs[i] + d), a0);
                        (((a0 + a1) + (a2 + a3)) * Vec(inv[g])).store(ag + d);
                    }
                    for (int64_t d = DV; d < D; ++d) {
                        float a = 0.0f;
                        for (int64_t i = 0; i < n; ++i) a += p[i] * pv[offs[i] + d];
                        ag[d] = a * inv[g];
                    }
                }
                float* ob = out + (b * H + kh * G) * D;
                std::copy(acc.begin(), acc.end(), ob);
            }
        }
    }
}
"""


def kernel():
    from torch._inductor.codecache import CppCodeCache

    fn = CppCodeCache.load(_SOURCE).ur_paged_decode_attn
    i64, p = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [p, p, p, p, i64, p, p, i64, i64, i64, i64, i64, i64, i64, i64, ctypes.c_float, i64]
    return fn


def paged(fn, q, pk, pv, bt, lens, bs, window, scale):
    b, h, _, d = q.shape
    q, bt, lens = q.reshape(b, h, d).contiguous(), bt.contiguous(), lens.contiguous()
    out = torch.empty((b, 1, h, d))
    fn(q.data_ptr(), pk.data_ptr(), pv.data_ptr(), bt.data_ptr(), bt.stride(0), lens.data_ptr(), out.data_ptr(),
       b, h, pk.shape[1], d, pk.stride(0), pk.stride(1), bs, window, scale, torch.get_num_threads())
    return out


def reference(q, pk, pv, bt, lens, bs, window, scale):
    b = q.shape[0]
    n = int(lens.max()) + 1
    pos = torch.arange(n)
    slots = bt.gather(1, (pos // bs).view(1, -1).expand(b, -1)) * bs + pos % bs
    k, v = pk[slots].permute(0, 2, 1, 3), pv[slots].permute(0, 2, 1, 3)
    m = pos.view(1, -1) <= lens.view(-1, 1)
    if window:
        m = m & (pos.view(1, -1) > lens.view(-1, 1) - window)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m.view(b, 1, 1, n), scale=scale,
                                                            enable_gqa=True).transpose(1, 2)


def median_us(f, n=50):
    for _ in range(5):
        f()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return 1e6 * statistics.median(ts)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    t = time.perf_counter()
    fn = kernel()
    build_s = time.perf_counter() - t
    worst = 0.0
    for trial in range(48):
        b, kvh, g = int(torch.randint(1, 9, ())), int(torch.randint(1, 4, ())), [1, 2, 4][trial % 3]
        d, bs, window = [8, 16, 24, 64, 72, 128][trial % 6], [1, 4, 16][trial % 3], [0, 0, 5, 33][trial % 4]
        pk = torch.randn(64 * bs + bs, kvh, d)
        pv = torch.randn_like(pk)
        lens = torch.randint(0, min(32 * bs, 300), (b,))
        bt = torch.stack([torch.randperm(64)[: int(lens.max()) // bs + 1] for _ in range(b)])
        q = torch.randn(b, kvh * g, 1, d)
        scale = d ** -0.5
        worst = max(worst, (paged(fn, q, pk, pv, bt, lens, bs, window, scale)
                            - reference(q, pk, pv, bt, lens, bs, window, scale)).abs().max().item())
    rows = []
    for name, b, kvh, g, d, n in (("captured step (tiny-lm x36)", 64, 2, 2, 16, 272),
                                  ("long, 256", 32, 2, 4, 64, 256), ("long, 2048", 32, 2, 4, 64, 2048)):
        bs, nb = 16, n // 16 + 1
        pk = torch.randn(b * nb * bs + bs, kvh, d)
        pv = torch.randn_like(pk)
        bt = torch.arange(b * nb).view(b, nb)
        lens = torch.full((b,), n - 1)
        q = torch.randn(b, kvh * g, 1, d)
        wk, wv = torch.randn(b, kvh, n + 128, d)[:, :, :n], torch.randn(b, kvh, n + 128, d)[:, :, :n]
        m = torch.ones(b, 1, 1, n, dtype=torch.bool)
        qg = q.view(b, kvh, g, d)
        rows.append({"shape": name, "batch": b, "kv_heads": kvh, "group": g, "head_dim": d, "keys": n,
                     "paged_kernel_us": median_us(lambda: paged(fn, q, pk, pv, bt, lens, bs, 0, d ** -0.5)),
                     "sdpa_workspace_us": median_us(lambda: torch.nn.functional.scaled_dot_product_attention(
                         qg, wk, wv, attn_mask=m)),
                     "one_read_us": median_us(lambda: (wk.sum(), wv.sum()))})
        print(rows[-1])
    rec = {"command": "python benchmarks/paged_attention_probe.py", "threads": torch.get_num_threads(),
           "torch": torch.__version__, "build_s": build_s, "max_abs_diff_vs_sdpa": worst, "rows": rows}
    print(f"build {build_s:.1f}s, max |paged - SDPA| over 48 random cases {worst:.2e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rec, f, indent=1)


if __name__ == "__main__":
    main()
