// Decode attention on CPU: one query position per row, G query heads per KV head, each row's keys and values
// read in place (any row / head / position strides, the head dimension contiguous), softmax over the keys
// lo[b] .. hi[b] - 1 of row b (its history, or the last `window` of it), online in blocks of W keys as flash
// attention does. Returns the output and each query's natural log-sum-exp (for merging attentions exactly).
// Built at first use by unsloth_rollout/kernels/build.py (g++ -O3 -march=native -fopenmp) and run on
// the OpenMP runtime torch loaded, with torch's thread count; float32 only. decode_attention_prefixed_f32: the same,
// where a row first attends to a shared prefix entry (a GRPO group's prompt, held once), then to its own keys.
//
// W is the machine's vector width in floats: 16 with AVX-512, else 8 (AVX2; the same code in half-width
// vectors: 16-float vectors on a machine without AVX-512 were emulated in pairs and ran ~5x slower).
// Per block of W keys, per query head: the W keys' partial products q * k (C = D / W vectors each, in
// registers) summed across lanes at once (hsum: a shuffle tree, lane j = key j's score), the block's softmax
// update, then each value row loaded once for every head. The K and V rows PFD keys ahead are prefetched into
// L2 (measured on an AMD EPYC (Zen 4): 1.10x a plain read of the history at 2k keys, against 1.16x without and
// 2.0x for the previous layout; benchmarks/cpu_attention_kernel.py).
#include <stdint.h>
#include <math.h>
#include <omp.h>

#define PFD 32  // keys ahead whose K and V rows are prefetched (into L2: locality 1)
#define INL static inline __attribute__((always_inline))

#if defined(__AVX512F__)
#define W 16
#else
#define W 8
#endif
typedef float vf __attribute__((vector_size(4 * W)));
typedef int32_t vi __attribute__((vector_size(4 * W)));
typedef float vfu __attribute__((vector_size(4 * W), aligned(4)));

INL vf ld(const float *p) { return *(const vfu *)p; }
INL vf bc(float x) { return (vf){} + x; }

// exp(x), ~1 ulp (Cephes expf's polynomial); x below -87 gives exp(-87) (callers zero what must be zero).
INL vf vexp(vf x) {
    x = x < -87.0f ? bc(-87.0f) : x;
    const vf magic = bc(12582912.0f);  // 1.5 * 2^23: x + magic rounds to an integer
    vf t = x * 1.44269504088896341f + magic;
    vi n = (vi)t - (vi)magic;
    vf fn = t - magic;
    vf r = x - fn * 0.693359375f + fn * 2.12194440e-4f;
    vf p = bc(1.9875691500E-4f);
    p = p * r + 1.3981999507E-3f;
    p = p * r + 8.3334519073E-3f;
    p = p * r + 4.1665795894E-2f;
    p = p * r + 1.6666665459E-1f;
    p = p * r + 5.0000001201E-1f;
    p = p * r * r + r + 1.0f;
    return p * (vf)((n + 127) << 23);
}

INL vf vmax(vf a, vf b) { return a > b ? a : b; }

#if W == 16
// all lanes = the sum / max of x's lanes (a shuffle tree, not a serial chain)
INL vf allsum(vf x) {
    x += __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    x += __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    x += __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    x += __builtin_shufflevector(x, x, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    return x;
}
INL vf allmax(vf x) {
    x = vmax(x, __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
    x = vmax(x, __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
    x = vmax(x, __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
    x = vmax(x, __builtin_shufflevector(x, x, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
    return x;
}
// lane k of the result = sum of the lanes of P[k]
INL vf hsum(const vf *P) {
    vf A[8], B[4], C[2];
    for (int i = 0; i < 8; i++) {
        vf a = P[2 * i], b = P[2 * i + 1];
        A[i] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
             + __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    }
    for (int i = 0; i < 4; i++) {
        vf a = A[2 * i], b = A[2 * i + 1];
        B[i] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27)
             + __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    }
    for (int i = 0; i < 2; i++) {
        vf a = B[2 * i], b = B[2 * i + 1];
        C[i] = __builtin_shufflevector(a, b, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29)
             + __builtin_shufflevector(a, b, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    }
    return __builtin_shufflevector(C[0], C[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30)
         + __builtin_shufflevector(C[0], C[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}
#else
INL vf allsum(vf x) {
    x += __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3);
    x += __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5);
    x += __builtin_shufflevector(x, x, 1, 0, 3, 2, 5, 4, 7, 6);
    return x;
}
INL vf allmax(vf x) {
    x = vmax(x, __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3));
    x = vmax(x, __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5));
    x = vmax(x, __builtin_shufflevector(x, x, 1, 0, 3, 2, 5, 4, 7, 6));
    return x;
}
INL vf hsum(const vf *P) {
    vf A[4], B[2];
    for (int i = 0; i < 4; i++) {
        vf a = P[2 * i], b = P[2 * i + 1];
        A[i] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11)
             + __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15);
    }
    for (int i = 0; i < 2; i++) {
        vf a = A[2 * i], b = A[2 * i + 1];
        B[i] = __builtin_shufflevector(a, b, 0, 1, 4, 5, 8, 9, 12, 13)
             + __builtin_shufflevector(a, b, 2, 3, 6, 7, 10, 11, 14, 15);
    }
    return __builtin_shufflevector(B[0], B[1], 0, 2, 4, 6, 8, 10, 12, 14)
         + __builtin_shufflevector(B[0], B[1], 1, 3, 5, 7, 9, 11, 13, 15);
}
#endif

template <int C, int G>
struct State {
    vf acc[G][C];
    float m[G], l[G];
};

// One segment of keys j_lo .. j_hi - 1 (rows ksl / vsl floats apart) folded into the running softmax state.
template <int C, int G>
INL void segment(State<C, G> &st, const float *qt, const float *kt, const float *vt, int64_t j_lo, int64_t j_hi,
                 int64_t ksl, int64_t vsl, float scale) {
    constexpr bool two = G * C < 8;  // few accumulators: even and odd keys in two, for two FMA chains
    vf acc2[two ? G : 1][two ? C : 1];
    alignas(64) float p[G][W];
#if W == 16
    const vf lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
#else
    const vf lane = {0, 1, 2, 3, 4, 5, 6, 7};
#endif
    auto &acc = st.acc;
    float *m = st.m, *l = st.l;
    for (int64_t j0 = j_lo; j0 < j_hi; j0 += W) {
        const int nb = (int)(j_hi - j0 < W ? j_hi - j0 : W);
        const float *kb = kt + j0 * ksl;
        for (int g = 0; g < G; g++) {
            vf q[C], P[W];
            for (int c = 0; c < C; c++) q[c] = ld(qt + g * W * C + W * c);
#pragma GCC unroll 16
            for (int jj = 0; jj < W; jj++) {  // keys past nb read key nb - 1 again (masked below): no branches
                const float *kr = kb + (jj < nb ? jj : nb - 1) * ksl;
                if (g == 0 && j0 + PFD + jj < j_hi)
                    for (int c = 0; c < C; c += 64 / (4 * W) > 0 ? 64 / (4 * W) : 1)
                        __builtin_prefetch(kr + PFD * ksl + W * c, 0, 1);
                vf a = q[0] * ld(kr);
#pragma GCC unroll 16
                for (int c = 1; c < C; c++) a += q[c] * ld(kr + W * c);
                P[jj] = a;
            }
            *(vf *)p[g] = hsum(P) * scale;
        }
        const vf valid = lane < (float)nb ? bc(1.0f) : bc(0.0f);
        for (int g = 0; g < G; g++) {
            vf s = valid > 0.0f ? *(vf *)p[g] : bc(-INFINITY);
            float bm = allmax(s)[0];
            bm = m[g] > bm ? m[g] : bm;
            float alpha = m[g] == -INFINITY ? 0.0f : vexp(bc(m[g] - bm))[0];
            vf e = vexp(s - bm) * valid;
            l[g] = l[g] * alpha + allsum(e)[0];
            m[g] = bm;
            for (int c = 0; c < C; c++) acc[g][c] *= alpha;
            *(vf *)p[g] = e;
        }
        int jj = 0;
        if (two) {
            for (int g = 0; g < (two ? G : 1); g++)
                for (int c = 0; c < (two ? C : 1); c++) acc2[g][c] = bc(0.0f);
            for (; jj + 1 < nb; jj += 2) {
                const float *vr = vt + (j0 + jj) * vsl;
                vf va[C], vb[C];
                for (int c = 0; c < C; c++) { va[c] = ld(vr + W * c); vb[c] = ld(vr + vsl + W * c); }
                for (int g = 0; g < G; g++) {
                    float wa = p[g][jj], wb = p[g][jj + 1];
                    for (int c = 0; c < C; c++) {
                        acc[g][c] += wa * va[c];
                        acc2[two ? g : 0][two ? c : 0] += wb * vb[c];
                    }
                }
            }
            for (int g = 0; g < G; g++)
                for (int c = 0; c < C; c++) acc[g][c] += acc2[two ? g : 0][two ? c : 0];
        }
        for (; jj < nb; jj++) {
            const float *vr = vt + (j0 + jj) * vsl;
            if (j0 + PFD + jj < j_hi)
                for (int c = 0; c < C; c += 64 / (4 * W) > 0 ? 64 / (4 * W) : 1)
                    __builtin_prefetch(vr + PFD * vsl + W * c, 0, 1);
            vf va[C];
            for (int c = 0; c < C; c++) va[c] = ld(vr + W * c);
            for (int g = 0; g < G; g++) {
                float w = p[g][jj];
                for (int c = 0; c < C; c++) acc[g][c] += w * va[c];
            }
        }
    }
}

// One (row, KV head): its shared prefix's keys 0 .. p_hi - 1 first when it has one (pkt non-null), then its own
// keys j_lo .. j_hi - 1, under one softmax (PRE: the prefixed op's variant; the plain op's has no prefix branch).
template <int C, int G, bool PRE>
static void task(const float *qt, const float *kt, const float *vt, float *ot, float *lset, int64_t j_lo,
                 int64_t j_hi, int64_t ksl, int64_t vsl, float scale, const float *pkt, const float *pvt,
                 int64_t p_hi, int64_t pksl, int64_t pvsl) {
    State<C, G> st;
    for (int g = 0; g < G; g++) {
        for (int c = 0; c < C; c++) st.acc[g][c] = bc(0.0f);
        st.m[g] = -INFINITY;
        st.l[g] = 0.0f;
    }
    if (PRE && pkt) segment<C, G>(st, qt, pkt, pvt, 0, p_hi, pksl, pvsl, scale);
    segment<C, G>(st, qt, kt, vt, j_lo, j_hi, ksl, vsl, scale);
    for (int g = 0; g < G; g++) {
        float inv = st.l[g] > 0.0f ? 1.0f / st.l[g] : 0.0f;
        for (int c = 0; c < C; c++) *(vfu *)(ot + g * W * C + W * c) = st.acc[g][c] * inv;
        if (lset) lset[g] = st.l[g] > 0.0f ? st.m[g] + logf(st.l[g]) : -INFINITY;
    }
}

typedef void (*task_fn)(const float *, const float *, const float *, float *, float *, int64_t, int64_t,
                        int64_t, int64_t, float, const float *, const float *, int64_t, int64_t, int64_t);

template <int C, bool PRE>
static task_fn pick_g(int64_t G) {
    switch (G) {
        case 1: return task<C, 1, PRE>;
        case 2: return task<C, 2, PRE>;
        case 3: return task<C, 3, PRE>;
        case 4: return task<C, 4, PRE>;
        case 5: return task<C, 5, PRE>;
        case 6: return task<C, 6, PRE>;
        case 7: return task<C, 7, PRE>;
        case 8: return task<C, 8, PRE>;
        default: return 0;
    }
}

template <bool PRE>
static task_fn pick(int64_t D, int64_t G) {
    switch (D) {
        case 16: return pick_g<16 / W, PRE>(G);
        case 32: return pick_g<32 / W, PRE>(G);
        case 48: return pick_g<48 / W, PRE>(G);
        case 64: return pick_g<64 / W, PRE>(G);
        case 80: return pick_g<80 / W, PRE>(G);
        case 96: return pick_g<96 / W, PRE>(G);
        case 128: return pick_g<128 / W, PRE>(G);
        case 256: return pick_g<256 / W, PRE>(G);
        default: return 0;
    }
}

// Rows b < B, each KV head a task: row b's keys lo[b] .. hi[b] - 1, after prefix entry pe[b]'s keys when pe is
// non-null and pe[b] >= 0 (the entry's keys 0 .. plen[e] - 1 of pk / pv, [E, KV, P, D] with strides psb / psh / psl).
static int run(task_fn fn, const float *q, const float *k, const float *v, float *out, float *lse, const int64_t *lo,
               const int64_t *hi, const float *pk, const float *pv, const int64_t *pe, const int64_t *plen, int64_t B,
               int64_t KV, int64_t G, int64_t D, int64_t L, int64_t E, int64_t P, int64_t ksb, int64_t ksh,
               int64_t ksl, int64_t vsb, int64_t vsh, int64_t vsl, int64_t pksb, int64_t pksh, int64_t pksl,
               int64_t pvsb, int64_t pvsh, int64_t pvsl, float scale, int nthreads) {
    if (!fn) return 1;
    for (int64_t b = 0; b < B; b++) {  // never read outside the L keys of each row, the P keys of each entry
        if (lo[b] < 0 || hi[b] > L || lo[b] > hi[b]) return 3;
        if (pe && (pe[b] >= E || (pe[b] >= 0 && (plen[pe[b]] < 0 || plen[pe[b]] > P)))) return 4;
    }
    int64_t tasks = B * KV;
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1)
    for (int64_t t = 0; t < tasks; t++) {
        int64_t b = t / KV, h = t % KV, e = pe ? pe[b] : -1;
        const float *pkt = e >= 0 ? pk + e * pksb + h * pksh : 0, *pvt = e >= 0 ? pv + e * pvsb + h * pvsh : 0;
        fn(q + t * G * D, k + b * ksb + h * ksh, v + b * vsb + h * vsh, out + t * G * D, lse ? lse + t * G : 0,
           lo[b], hi[b], ksl, vsl, scale, pkt, pvt, e >= 0 ? plen[e] : 0, pksl, pvsl);
    }
    return 0;
}

extern "C" int decode_attention_f32(const float *q, const float *k, const float *v, float *out, float *lse,
                                    const int64_t *lo, const int64_t *hi, int64_t B, int64_t KV, int64_t G,
                                    int64_t D, int64_t L, int64_t ksb, int64_t ksh, int64_t ksl, int64_t vsb,
                                    int64_t vsh, int64_t vsl, float scale, int nthreads) {
    return run(pick<false>(D, G), q, k, v, out, lse, lo, hi, 0, 0, 0, 0, B, KV, G, D, L, 0, 0, ksb, ksh, ksl, vsb,
               vsh, vsl, 0, 0, 0, 0, 0, 0, scale, nthreads);
}

// The same, where row b also attends to prefix entry pe[b] (pe[b] < 0: none), before its own keys, under one
// softmax. A GRPO group's samples hold only their own positions and share their prompt's entry; consecutive rows
// of a group read it from cache rather than memory.
extern "C" int decode_attention_prefixed_f32(
    const float *q, const float *k, const float *v, float *out, float *lse, const int64_t *lo, const int64_t *hi,
    const float *pk, const float *pv, const int64_t *pe, const int64_t *plen, int64_t B, int64_t KV, int64_t G,
    int64_t D, int64_t L, int64_t E, int64_t P, int64_t ksb, int64_t ksh, int64_t ksl, int64_t vsb, int64_t vsh,
    int64_t vsl, int64_t pksb, int64_t pksh, int64_t pksl, int64_t pvsb, int64_t pvsh, int64_t pvsl, float scale,
    int nthreads) {
    return run(pick<true>(D, G), q, k, v, out, lse, lo, hi, pk, pv, pe, plen, B, KV, G, D, L, E, P, ksb, ksh, ksl,
               vsb, vsh, vsl, pksb, pksh, pksl, pvsb, pvsh, pvsl, scale, nthreads);
}
