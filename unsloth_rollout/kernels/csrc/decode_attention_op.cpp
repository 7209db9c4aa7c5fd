// The torch op unsloth_rollout::decode_attention over decode_attention.cpp's kernel, registered in C++ so a call
// (eager, or from an inductor graph's wrapper) reaches the kernel through torch's dispatcher alone: no Python
// frame per call. Built by unsloth_rollout/kernels/build.py against the running torch's headers and linked to
// the kernel's own library; engine/cpu_attention.py falls back to a Python custom op over ctypes (the same
// kernel, the same results) where this does not build. The checks mirror the Python path's.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>

extern "C" int decode_attention_f32(const float *q, const float *k, const float *v, float *out, float *lse,
                                    const int64_t *lo, const int64_t *hi, int64_t B, int64_t KV, int64_t G,
                                    int64_t D, int64_t L, int64_t ksb, int64_t ksh, int64_t ksl, int64_t vsb,
                                    int64_t vsh, int64_t vsl, float scale, int nthreads);
extern "C" int decode_attention_prefixed_f32(
    const float *q, const float *k, const float *v, float *out, float *lse, const int64_t *lo, const int64_t *hi,
    const float *pk, const float *pv, const int64_t *pe, const int64_t *plen, int64_t B, int64_t KV, int64_t G,
    int64_t D, int64_t L, int64_t E, int64_t P, int64_t ksb, int64_t ksh, int64_t ksl, int64_t vsb, int64_t vsh,
    int64_t vsl, int64_t pksb, int64_t pksh, int64_t pksl, int64_t pvsb, int64_t pvsh, int64_t pvsl, float scale,
    int nthreads);

// The checks both ops share: q [B, KV, G, D] (returned contiguous) over k / v [>= B, KV, L, D], float32 on CPU, the
// head dimension contiguous, one key range per row.
static at::Tensor checked_q(const at::Tensor &q_, const at::Tensor &k, const at::Tensor &v, const at::Tensor &lo,
                            const at::Tensor &hi) {
    TORCH_CHECK(q_.dim() == 4 && k.dim() == 4 && v.dim() == 4, "decode attention kernel: q, k, v must be 4-d");
    TORCH_CHECK(q_.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
                "decode attention kernel: float32 only");
    TORCH_CHECK(q_.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu() && lo.device().is_cpu()
                    && hi.device().is_cpu(), "decode attention kernel: CPU tensors only");
    TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1, "decode attention kernel: the head dimension of k and v "
                "must be contiguous");
    at::Tensor q = q_.contiguous();
    const int64_t B = q.size(0), KV = q.size(1), D = q.size(3);
    TORCH_CHECK(k.size(0) >= B && v.size(0) >= B && k.size(1) == KV && v.size(1) == KV && k.size(3) == D
                    && v.size(3) == D, "decode attention kernel: k and v do not match q [B, KV, G, D]");
    TORCH_CHECK(lo.numel() >= B && hi.numel() >= B, "decode attention kernel: one key range per row");
    return q;
}

static void check_rc(int rc) {
    TORCH_CHECK(rc != 1, "decode attention kernel: unsupported head size or query heads per KV head");
    TORCH_CHECK(rc != 3, "decode attention kernel: a row's key range is outside the keys");
    TORCH_CHECK(rc != 4, "decode attention kernel: a row's prefix entry or its length is outside the prefix keys");
    TORCH_CHECK(rc == 0, "decode attention kernel: error ", rc);
}

static std::tuple<at::Tensor, at::Tensor> decode_attention(const at::Tensor &q_, const at::Tensor &k,
                                                           const at::Tensor &v, const at::Tensor &lo_,
                                                           const at::Tensor &hi_, double scale) {
    const at::Tensor q = checked_q(q_, k, v, lo_, hi_);
    const int64_t B = q.size(0), KV = q.size(1), G = q.size(2), D = q.size(3);
    const at::Tensor lo = lo_.to(at::kLong).contiguous(), hi = hi_.to(at::kLong).contiguous();
    at::Tensor out = at::empty(q.sizes(), q.options());
    at::Tensor lse = at::empty({B, KV, G}, q.options());
    check_rc(decode_attention_f32(
        q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), out.data_ptr<float>(), lse.data_ptr<float>(),
        lo.data_ptr<int64_t>(), hi.data_ptr<int64_t>(), B, KV, G, D, std::min(k.size(2), v.size(2)), k.stride(0),
        k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), static_cast<float>(scale),
        at::get_num_threads()));
    return {out, lse};
}

// Row b also attends to the keys 0 .. plen[e] - 1 of prefix entry e = pe[b] of pk / pv [E, KV, P, D] (e < 0: none),
// before its own, under one softmax (decode_attention_prefixed_f32).
static std::tuple<at::Tensor, at::Tensor> decode_attention_prefixed(
    const at::Tensor &q_, const at::Tensor &k, const at::Tensor &v, const at::Tensor &lo_, const at::Tensor &hi_,
    const at::Tensor &pk, const at::Tensor &pv, const at::Tensor &pe_, const at::Tensor &plen_, double scale) {
    const at::Tensor q = checked_q(q_, k, v, lo_, hi_);
    const int64_t B = q.size(0), KV = q.size(1), G = q.size(2), D = q.size(3);
    TORCH_CHECK(pk.dim() == 4 && pv.dim() == 4 && pk.scalar_type() == at::kFloat && pv.scalar_type() == at::kFloat
                    && pk.device().is_cpu() && pv.device().is_cpu() && pe_.device().is_cpu()
                    && plen_.device().is_cpu(), "decode attention kernel: pk, pv must be 4-d float32 on CPU");
    TORCH_CHECK(pk.stride(3) == 1 && pv.stride(3) == 1, "decode attention kernel: the head dimension of pk and pv "
                "must be contiguous");
    TORCH_CHECK(pk.size(1) == KV && pv.size(1) == KV && pk.size(3) == D && pv.size(3) == D
                    && pk.size(0) == pv.size(0), "decode attention kernel: pk and pv do not match q [B, KV, G, D]");
    const at::Tensor lo = lo_.to(at::kLong).contiguous(), hi = hi_.to(at::kLong).contiguous();
    const at::Tensor pe = pe_.to(at::kLong).contiguous(), plen = plen_.to(at::kLong).contiguous();
    TORCH_CHECK(pe.numel() >= B, "decode attention kernel: one prefix entry per row");
    TORCH_CHECK(plen.numel() >= pk.size(0), "decode attention kernel: one length per prefix entry");
    at::Tensor out = at::empty(q.sizes(), q.options());
    at::Tensor lse = at::empty({B, KV, G}, q.options());
    check_rc(decode_attention_prefixed_f32(
        q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), out.data_ptr<float>(), lse.data_ptr<float>(),
        lo.data_ptr<int64_t>(), hi.data_ptr<int64_t>(), pk.data_ptr<float>(), pv.data_ptr<float>(),
        pe.data_ptr<int64_t>(), plen.data_ptr<int64_t>(), B, KV, G, D, std::min(k.size(2), v.size(2)), pk.size(0),
        std::min(pk.size(2), pv.size(2)), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1),
        v.stride(2), pk.stride(0), pk.stride(1), pk.stride(2), pv.stride(0), pv.stride(1), pv.stride(2),
        static_cast<float>(scale), at::get_num_threads()));
    return {out, lse};
}

TORCH_LIBRARY_FRAGMENT(unsloth_rollout, m) {
    m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor lo, Tensor hi, float scale) -> (Tensor, Tensor)");
    m.def("decode_attention_prefixed(Tensor q, Tensor k, Tensor v, Tensor lo, Tensor hi, Tensor pk, Tensor pv, "
          "Tensor pe, Tensor plen, float scale) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(unsloth_rollout, CPU, m) {
    m.impl("decode_attention", &decode_attention);
    m.impl("decode_attention_prefixed", &decode_attention_prefixed);
}
