// Batch-invariant float32 kernels for CPU: the ops of the bitwise on-policy mode (unsloth_rollout/bitwise.py,
// kernels/batch_invariant.py). Every output element is computed by one fixed sequence of floating-point
// operations that depends only on that element's own inputs: not on how many rows are computed at once, where a
// row sits in its batch, how much padding surrounds it, how the work is tiled or how many threads run it. So a
// decode step over 1 row, a prefill over a packed prompt and a trainer's padded batch forward give the same bits
// for the same token.
//
// - Reductions over a fixed length (a dot product over K, a row sum over a hidden dimension): 16 lanes, element k
//   into lane k % 16 in order of k, the last partial group of 16 padded with zeros, then one fixed pairwise tree
//   over the lanes. Products are fused multiply-adds (exactly rounded, so AVX-512, AVX2+FMA and plain fmaf give
//   the same bits); the library is built with -ffp-contract=off, so no other multiply-add is fused.
// - Attention: each query's keys one at a time, in position order, skipping keys it does not attend to (a block
//   of one key): the result depends only on the ordered list of attended keys, so keys read from a cache, from
//   the same forward, from a padded row or from a packed row give the same output.
// - Transcendental functions (exp, log, tanh, erf, ...): the C library's scalar function per element, never a
//   vector approximation that a batch's tail would replace by the scalar one.
//
// Built at first use by unsloth_rollout/kernels/build.py and run on the OpenMP runtime torch loaded, with torch's
// thread count; threads split outputs, never a reduction, and only calls of at least GRAIN multiply-adds (or
// elements) start them (as ATen's grain size: waking a team costs more than a small call).
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#define INL static inline __attribute__((always_inline))
#define NL 16  // lanes of every fixed-length reduction
#define GRAIN 32768

typedef float vf __attribute__((vector_size(4 * NL)));
typedef float vfu __attribute__((vector_size(4 * NL), aligned(4)));

INL vf ld(const float *p) { return *(const vfu *)p; }

INL vf ld_tail(const float *p, int64_t n) {  // the first n < 16 floats, zeros after
    vf x = {};
    for (int64_t i = 0; i < n; i++) x[i] = p[i];
    return x;
}

INL vf bc(float x) { return (vf){} + x; }

// c + a * b per lane, exactly rounded once
INL vf vfma(vf a, vf b, vf c) {
#if defined(__AVX512F__)
    return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
    typedef float h8 __attribute__((vector_size(32)));
    union U { vf v; h8 h[2]; } ua, ub, uc, r;
    ua.v = a, ub.v = b, uc.v = c;
    r.h[0] = (h8)_mm256_fmadd_ps((__m256)ua.h[0], (__m256)ub.h[0], (__m256)uc.h[0]);
    r.h[1] = (h8)_mm256_fmadd_ps((__m256)ua.h[1], (__m256)ub.h[1], (__m256)uc.h[1]);
    return r.v;
#else
    vf r;
    for (int i = 0; i < NL; i++) r[i] = fmaf(a[i], b[i], c[i]);
    return r;
#endif
}

// the lanes' sum by one fixed pairwise tree: (i, i + 8), then (i, i + 4), (i, i + 2), (0, 1)
INL float hsum(vf x) {
    float s8[8], s4[4], s2[2];
    for (int i = 0; i < 8; i++) s8[i] = x[i] + x[i + 8];
    for (int i = 0; i < 4; i++) s4[i] = s8[i] + s8[i + 4];
    for (int i = 0; i < 2; i++) s2[i] = s4[i] + s4[i + 2];
    return s2[0] + s2[1];
}

INL float dot(const float *a, const float *b, int64_t K) {
    vf acc = {};
    int64_t k = 0;
    for (; k + NL <= K; k += NL) acc = vfma(ld(a + k), ld(b + k), acc);
    if (k < K) acc = vfma(ld_tail(a + k, K - k), ld_tail(b + k, K - k), acc);
    return hsum(acc);
}

// ------------------------------------------------------------------ matmul
// An RT x CT tile of o = a . b^T: each element the same sequence as dot() (a register tile shares the loads).
template <int RT, int CT>
static void tile(const float *a, int64_t lda, const float *b, int64_t ldb, float *o, int64_t ldo, int64_t K) {
    vf acc[RT][CT];
    for (int r = 0; r < RT; r++)
        for (int c = 0; c < CT; c++) acc[r][c] = (vf){};
    int64_t k = 0;
    for (; k + NL <= K; k += NL) {
        vf av[RT], bv[CT];
        for (int r = 0; r < RT; r++) av[r] = ld(a + r * lda + k);
        for (int c = 0; c < CT; c++) bv[c] = ld(b + c * ldb + k);
        for (int r = 0; r < RT; r++)
            for (int c = 0; c < CT; c++) acc[r][c] = vfma(av[r], bv[c], acc[r][c]);
    }
    if (k < K) {
        vf av[RT], bv[CT];
        for (int r = 0; r < RT; r++) av[r] = ld_tail(a + r * lda + k, K - k);
        for (int c = 0; c < CT; c++) bv[c] = ld_tail(b + c * ldb + k, K - k);
        for (int r = 0; r < RT; r++)
            for (int c = 0; c < CT; c++) acc[r][c] = vfma(av[r], bv[c], acc[r][c]);
    }
    for (int r = 0; r < RT; r++)
        for (int c = 0; c < CT; c++) o[r * ldo + c] = hsum(acc[r][c]);
}

typedef void (*tile_fn)(const float *, int64_t, const float *, int64_t, float *, int64_t, int64_t);

#define ROW(r) {tile<r, 1>, tile<r, 2>, tile<r, 3>, tile<r, 4>}
static const tile_fn TILES[4][4] = {ROW(1), ROW(2), ROW(3), ROW(4)};

#define MB 64  // rows of a task's block: its rows of a stay in L2 while the block's columns pass
#define NB 64  // columns of a task's block

// o[i] = a[i] . b[i]^T for i < batch: a [M, K], b [N, K] (the right operand transposed), o [M, N]; the last
// dimension of a and b contiguous, any row and batch strides.
extern "C" int bi_matmul_f32(const float *a, const float *b, float *o, int64_t batch, int64_t M, int64_t N,
                             int64_t K, int64_t sab, int64_t lda, int64_t sbb, int64_t ldb, int64_t sob,
                             int64_t ldo, int nthreads) {
    if (batch < 0 || M < 0 || N < 0 || K < 0) return 1;
    const int64_t mblocks = (M + MB - 1) / MB, nblocks = (N + NB - 1) / NB;
    const int64_t tasks = batch * mblocks * nblocks;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (batch * M * N * K >= GRAIN && tasks > 1)
    for (int64_t t = 0; t < tasks; t++) {
        const int64_t bi = t / (mblocks * nblocks), rem = t % (mblocks * nblocks);
        const int64_t n_lo = (rem / mblocks) * NB, m_lo = (rem % mblocks) * MB;
        const int64_t n_hi = n_lo + NB < N ? n_lo + NB : N, m_hi = m_lo + MB < M ? m_lo + MB : M;
        const float *ab = a + bi * sab, *bb = b + bi * sbb;
        float *ob = o + bi * sob;
        for (int64_t n = n_lo; n < n_hi; n += 4) {
            const int ct = n_hi - n < 4 ? (int)(n_hi - n) : 4;
            for (int64_t m = m_lo; m < m_hi; m += 4) {
                const int rt = m_hi - m < 4 ? (int)(m_hi - m) : 4;
                TILES[rt - 1][ct - 1](ab + m * lda, lda, bb + n * ldb, ldb, ob + m * ldo + n, ldo, K);
            }
        }
    }
    return 0;
}

// ------------------------------------------------------------------ row reductions
// out[r] = the sum of x[r, 0 .. n - 1] (rows ldx apart, each contiguous).
extern "C" int bi_rowsum_f32(const float *x, float *out, int64_t rows, int64_t n, int64_t ldx, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (rows * n >= GRAIN && rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        const float *p = x + r * ldx;
        vf acc = {};
        int64_t k = 0;
        for (; k + NL <= n; k += NL) acc = acc + ld(p + k);
        if (k < n) acc = acc + ld_tail(p + k, n - k);
        out[r] = hsum(acc);
    }
    return 0;
}

// Per row of x: mode 0 softmax, 1 log_softmax (both [rows, n] into out, rows ldo apart), 2 logsumexp (one value per
// row). m = the row's max (0 if it is infinite, as ATen does), s = the lane-tree sum of exp(x - m),
// logsumexp = m + log(s), log_softmax = x - logsumexp, softmax = exp(x - m) / s.
extern "C" int bi_softmax_f32(const float *x, float *out, int64_t rows, int64_t n, int64_t ldx, int64_t ldo, int mode,
                              int nthreads) {
    if (mode < 0 || mode > 2) return 1;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (rows * n >= GRAIN && rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        const float *p = x + r * ldx;
        float m = -INFINITY;
        for (int64_t j = 0; j < n; j++) m = p[j] > m ? p[j] : m;
        if (isinf(m)) m = 0.0f;
        vf acc = {};
        int64_t k = 0;
        for (; k < n; k += NL) {
            vf e = {};
            const int64_t c = n - k < NL ? n - k : NL;
            for (int64_t l = 0; l < c; l++) e[l] = expf(p[k + l] - m);
            acc = acc + e;
        }
        const float s = hsum(acc);
        const float lse = m + logf(s);
        if (mode == 2) {
            out[r] = lse;
        } else if (mode == 1) {
            float *q = out + r * ldo;
            for (int64_t j = 0; j < n; j++) q[j] = p[j] - lse;
        } else {
            float *q = out + r * ldo;
            for (int64_t j = 0; j < n; j++) q[j] = expf(p[j] - m) / s;
        }
    }
    return 0;
}

// ------------------------------------------------------------------ elementwise functions
enum { EXP, LOG, SIN, COS, TANH, SIGMOID, SILU, GELU, GELU_TANH, RSQRT, ERF, POW, EXPM1, LOG1P, SOFTPLUS, EXP2, LOG2,
       ERFC, TAN, ATAN, NUM_UNARY };

INL float unary(int op, float x, float p0, float p1) {
    switch (op) {
        case EXP: return expf(x);
        case LOG: return logf(x);
        case SIN: return sinf(x);
        case COS: return cosf(x);
        case TANH: return tanhf(x);
        case SIGMOID: return 1.0f / (1.0f + expf(-x));
        case SILU: return x / (1.0f + expf(-x));
        case GELU: return 0.5f * x * (1.0f + erff(x * 0.70710678118654752440f));
        case GELU_TANH: {
            const float inner = 0.79788456080286535588f * (x + 0.044715f * x * x * x);
            return 0.5f * x * (1.0f + tanhf(inner));
        }
        case RSQRT: return 1.0f / sqrtf(x);
        case ERF: return erff(x);
        case POW: return p0 == 2.0f ? x * x : powf(x, p0);
        case EXPM1: return expm1f(x);
        case LOG1P: return log1pf(x);
        case SOFTPLUS: return x * p0 > p1 ? x : log1pf(expf(x * p0)) / p0;  // p0 beta, p1 threshold
        case EXP2: return exp2f(x);
        case LOG2: return log2f(x);
        case ERFC: return erfcf(x);
        case TAN: return tanf(x);
        case ATAN: return atanf(x);
    }
    return NAN;
}

// out[i] = f(x[i]) for contiguous x and out; f the same scalar code for every element.
extern "C" int bi_unary_f32(int op, const float *x, float *out, int64_t n, float p0, float p1, int nthreads) {
    if (op < 0 || op >= NUM_UNARY) return 1;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (n >= GRAIN)
    for (int64_t i = 0; i < n; i++) out[i] = unary(op, x[i], p0, p1);
    return 0;
}

// ------------------------------------------------------------------ attention
// out[b, h, i] = softmax_j(s_ij) . v[b, h / G, j] over the keys j that query i attends to, in order of j, where
// s_ij = scale * q[b, h, i] . k[b, h / G, j] (soft-capped as cap * tanh(s / cap) when softcap > 0). Attended: mask[b,
// h, i, j] != 0 (strides may be 0 to broadcast), or without a mask j <= i when causal (top-left aligned, as SDPA's
// is_causal), every key otherwise. A query that attends to nothing gets zeros and a log-sum-exp of -inf. q / out
// [B, H, Q, D], k / v [B, KV, Lk, D], lse [B, H, Q] (contiguous); the head dimension of q, k, v and out contiguous.
extern "C" int bi_attention_f32(const float *q, const float *k, const float *v, const uint8_t *mask, float *out,
                                float *lse, int64_t B, int64_t H, int64_t KV, int64_t Q, int64_t Lk, int64_t D,
                                int64_t qsb, int64_t qsh, int64_t qsq, int64_t ksb, int64_t ksh, int64_t ksl,
                                int64_t vsb, int64_t vsh, int64_t vsl, int64_t msb, int64_t msh, int64_t msq,
                                int64_t msl, int64_t osb, int64_t osh, int64_t osq, int causal, float scale,
                                float softcap, int nthreads) {
    if (KV <= 0 || H % KV != 0 || D <= 0) return 1;
    const int64_t G = H / KV, tasks = B * H * Q, chunks = (D + NL - 1) / NL;
    int bad = 0;
#pragma omp parallel num_threads(nthreads) if (tasks * Lk * D >= GRAIN && tasks > 1)
    {
        float *s = (float *)malloc(sizeof(float) * (Lk > 0 ? Lk : 1));
        int64_t *idx = (int64_t *)malloc(sizeof(int64_t) * (Lk > 0 ? Lk : 1));
        vf *acc = (vf *)aligned_alloc(64, sizeof(vf) * chunks);
        if (!s || !idx || !acc) {
#pragma omp atomic write
            bad = 1;
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tasks; t++) {
            if (bad) continue;
            const int64_t b = t / (H * Q), h = (t / Q) % H, i = t % Q, hk = h / G;
            const float *qr = q + b * qsb + h * qsh + i * qsq;
            const float *kb = k + b * ksb + hk * ksh, *vb = v + b * vsb + hk * vsh;
            const uint8_t *mr = mask ? mask + b * msb + h * msh + i * msq : 0;
            float *orow = out + b * osb + h * osh + i * osq;
            int64_t n = 0;
            float m = -INFINITY;
            for (int64_t j = 0; j < Lk; j++) {
                const int attend = mr ? mr[j * msl] != 0 : (!causal || j <= i);
                if (!attend) continue;
                float sc = dot(qr, kb + j * ksl, D) * scale;
                if (softcap > 0.0f) sc = tanhf(sc / softcap) * softcap;
                s[n] = sc;
                idx[n++] = j;
                m = sc > m ? sc : m;
            }
            if (n == 0) {
                for (int64_t d = 0; d < D; d++) orow[d] = 0.0f;
                lse[t] = -INFINITY;
                continue;
            }
            for (int64_t c = 0; c < chunks; c++) acc[c] = (vf){};
            float sum = 0.0f;
            for (int64_t a = 0; a < n; a++) {
                const float p = expf(s[a] - m);
                sum = sum + p;
                const float *vr = vb + idx[a] * vsl;
                const vf pv = bc(p);
                int64_t c = 0;
                for (; (c + 1) * NL <= D; c++) acc[c] = vfma(pv, ld(vr + c * NL), acc[c]);
                if (c < chunks) acc[c] = vfma(pv, ld_tail(vr + c * NL, D - c * NL), acc[c]);
            }
            for (int64_t d = 0; d < D; d++) orow[d] = acc[d / NL][d % NL] / sum;
            lse[t] = m + logf(sum);
        }
        free(s);
        free(idx);
        free(acc);
    }
    return bad ? 2 : 0;
}
