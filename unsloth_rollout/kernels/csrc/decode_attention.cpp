// Decode attention on CPU: one query position per row, G query heads per KV head, each row's keys and values
// read in place (any row / head / position strides, the head dimension contiguous), softmax over the keys
// lo[b] .. hi[b] - 1 of row b (its history, or the last `window` of it), online in blocks of 16 keys as flash
// attention does. Returns the output and each query's natural log-sum-exp (for merging attentions exactly).
// Built at first use by unsloth_rollout/kernels/build.py (g++ -O3 -march=native -fopenmp) and run on
// the OpenMP runtime torch loaded, with torch's thread count; float32 only.
#include <stdint.h>
#include <math.h>
#include <omp.h>
#define PF 32  // keys ahead whose K and V rows are prefetched (32: best of 0, 32, 64, 128 measured)

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));

static inline v16 ld(const float *p) { return *(const v16u *)p; }
static inline v16 bc(float x) { return (v16){} + x; }

// exp(x), ~1 ulp (Cephes expf's polynomial); x below -87 gives exp(-87) (callers zero what must be zero).
static inline v16 vexp(v16 x) {
    x = x < -87.0f ? bc(-87.0f) : x;
    const v16 magic = bc(12582912.0f);  // 1.5 * 2^23: x + magic rounds to an integer
    v16 t = x * 1.44269504088896341f + magic;
    v16i n = (v16i)t - (v16i)magic;
    v16 fn = t - magic;
    v16 r = x - fn * 0.693359375f + fn * 2.12194440e-4f;
    v16 p = bc(1.9875691500E-4f);
    p = p * r + 1.3981999507E-3f;
    p = p * r + 8.3334519073E-3f;
    p = p * r + 4.1665795894E-2f;
    p = p * r + 1.6666665459E-1f;
    p = p * r + 5.0000001201E-1f;
    p = p * r * r + r + 1.0f;
    return p * (v16)((n + 127) << 23);
}

// all lanes = the sum / max of x's lanes (a shuffle tree, not a serial chain)
static inline v16 allsum(v16 x) {
    x += __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    x += __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    x += __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    x += __builtin_shufflevector(x, x, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    return x;
}
static inline v16 vmax(v16 a, v16 b) { return a > b ? a : b; }
static inline v16 allmax(v16 x) {
    x = vmax(x, __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
    x = vmax(x, __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
    x = vmax(x, __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
    x = vmax(x, __builtin_shufflevector(x, x, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
    return x;
}

// lane k of the result = sum of the lanes of P[k]
static inline v16 hsum16(const v16 *P) {
    v16 A[8], B[4], C[2];
    for (int i = 0; i < 8; i++) {
        v16 a = P[2 * i], b = P[2 * i + 1];
        A[i] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
             + __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    }
    for (int i = 0; i < 4; i++) {
        v16 a = A[2 * i], b = A[2 * i + 1];
        B[i] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27)
             + __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    }
    for (int i = 0; i < 2; i++) {
        v16 a = B[2 * i], b = B[2 * i + 1];
        C[i] = __builtin_shufflevector(a, b, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29)
             + __builtin_shufflevector(a, b, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    }
    return __builtin_shufflevector(C[0], C[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30)
         + __builtin_shufflevector(C[0], C[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

template <int C, int G>
static void task(const float *qt, const float *kt, const float *vt, float *ot, float *lset, int64_t j_lo,
                 int64_t j_hi, int64_t ksl, int64_t vsl, float scale) {
    v16 q[G][C], acc[G][C];
    float m[G], l[G];
    alignas(64) float p[G][16];
    const v16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    for (int g = 0; g < G; g++) {
        for (int c = 0; c < C; c++) { q[g][c] = ld(qt + g * 16 * C + 16 * c); acc[g][c] = bc(0.0f); }
        m[g] = -INFINITY;
        l[g] = 0.0f;
    }
    for (int64_t j0 = j_lo; j0 < j_hi; j0 += 16) {
        int nb = (int)(j_hi - j0 < 16 ? j_hi - j0 : 16);
        const v16 valid = lane < (float)nb ? bc(1.0f) : bc(0.0f);
        for (int g = 0; g < G; g++) {
            v16 P[16];
            if (g == 0 && j0 + PF < j_hi) {
                int np = (int)(j_hi - j0 - PF < 16 ? j_hi - j0 - PF : 16);
                for (int jj = 0; jj < np; jj++)
                    for (int c = 0; c < C; c++) {
                        __builtin_prefetch(kt + (j0 + PF + jj) * ksl + 16 * c);
                        __builtin_prefetch(vt + (j0 + PF + jj) * vsl + 16 * c);
                    }
            }
            for (int jj = 0; jj < 16; jj++) {
                if (jj < nb) {
                    const float *kr = kt + (j0 + jj) * ksl;
                    v16 a = q[g][0] * ld(kr);
                    for (int c = 1; c < C; c++) a += q[g][c] * ld(kr + 16 * c);
                    P[jj] = a;
                } else {
                    P[jj] = bc(0.0f);
                }
            }
            v16 s = hsum16(P) * scale;
            s = valid > 0.0f ? s : bc(-INFINITY);
            float bm = allmax(s)[0];
            bm = m[g] > bm ? m[g] : bm;
            float alpha = m[g] == -INFINITY ? 0.0f : vexp(bc(m[g] - bm))[0];
            v16 e = vexp(s - bm) * valid;
            l[g] = l[g] * alpha + allsum(e)[0];
            m[g] = bm;
            for (int c = 0; c < C; c++) acc[g][c] *= alpha;
            *(v16 *)p[g] = e;
        }
        // two accumulators per output vector (even and odd keys): two FMA chains, not one
        v16 acc2[G][C];
        for (int g = 0; g < G; g++)
            for (int c = 0; c < C; c++) acc2[g][c] = bc(0.0f);
        int jj = 0;
        for (; jj + 1 < nb; jj += 2) {
            const float *vr = vt + (j0 + jj) * vsl;
            v16 va[C], vb[C];
            for (int c = 0; c < C; c++) { va[c] = ld(vr + 16 * c); vb[c] = ld(vr + vsl + 16 * c); }
            for (int g = 0; g < G; g++) {
                float wa = p[g][jj], wb = p[g][jj + 1];
                for (int c = 0; c < C; c++) { acc[g][c] += wa * va[c]; acc2[g][c] += wb * vb[c]; }
            }
        }
        if (jj < nb) {
            const float *vr = vt + (j0 + jj) * vsl;
            for (int g = 0; g < G; g++)
                for (int c = 0; c < C; c++) acc[g][c] += p[g][jj] * ld(vr + 16 * c);
        }
        for (int g = 0; g < G; g++)
            for (int c = 0; c < C; c++) acc[g][c] += acc2[g][c];
    }
    for (int g = 0; g < G; g++) {
        float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;
        for (int c = 0; c < C; c++) *(v16u *)(ot + g * 16 * C + 16 * c) = acc[g][c] * inv;
        if (lset) lset[g] = l[g] > 0.0f ? m[g] + logf(l[g]) : -INFINITY;
    }
}

typedef void (*task_fn)(const float *, const float *, const float *, float *, float *, int64_t, int64_t,
                        int64_t, int64_t, float);

template <int C>
static task_fn pick_g(int64_t G) {
    switch (G) {
        case 1: return task<C, 1>;
        case 2: return task<C, 2>;
        case 3: return task<C, 3>;
        case 4: return task<C, 4>;
        case 5: return task<C, 5>;
        case 6: return task<C, 6>;
        case 7: return task<C, 7>;
        case 8: return task<C, 8>;
        default: return 0;
    }
}

static task_fn pick(int64_t D, int64_t G) {
    switch (D) {
        case 16: return pick_g<1>(G);
        case 32: return pick_g<2>(G);
        case 48: return pick_g<3>(G);
        case 64: return pick_g<4>(G);
        case 80: return pick_g<5>(G);
        case 96: return pick_g<6>(G);
        case 128: return pick_g<8>(G);
        case 256: return pick_g<16>(G);
        default: return 0;
    }
}

extern "C" int decode_attention_f32(const float *q, const float *k, const float *v, float *out, float *lse,
                                    const int64_t *lo, const int64_t *hi, int64_t B, int64_t KV, int64_t G,
                                    int64_t D, int64_t L, int64_t ksb, int64_t ksh, int64_t ksl, int64_t vsb,
                                    int64_t vsh, int64_t vsl, float scale, int nthreads) {
    task_fn fn = pick(D, G);
    if (!fn) return 1;
    for (int64_t b = 0; b < B; b++)  // never read outside the L keys of each row
        if (lo[b] < 0 || hi[b] > L || lo[b] > hi[b]) return 3;
    int64_t tasks = B * KV;
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1)
    for (int64_t t = 0; t < tasks; t++) {
        int64_t b = t / KV, h = t % KV;
        fn(q + t * G * D, k + b * ksb + h * ksh, v + b * vsb + h * vsh, out + t * G * D, lse ? lse + t * G : 0,
           lo[b], hi[b], ksl, vsl, scale);
    }
    return 0;
}
