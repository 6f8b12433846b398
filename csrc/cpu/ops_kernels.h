// Internal: the inner loops of ops.cpp / ops_attn.cpp, one table per instruction set
// (ops_kernels.cpp scalar, ops_kernels_avx2.cpp, ops_kernels_avx512.cpp), picked at run time.
#pragma once
#include <cstddef>
#include <cstdint>

#include "quant/blocks.h"

namespace stowlm::cpu {

enum class OpsIsa { Scalar = 0, Avx2 = 1, Avx512 = 2 };

struct OpsKernels {
    const char* name;
    // sum_i q[i] * k[i] over n elements of an F16 row.
    float (*dot_f16)(const float* q, const uint16_t* k, int64_t n);
    // acc[i] += a * v[i]
    void (*axpy_f16)(float* acc, float a, const uint16_t* v, int64_t n);
    // Q8_0 rows: n is a multiple of 32.
    float (*dot_q8_0)(const float* q, const block_q8_0* k, int64_t n);
    void (*axpy_q8_0)(float* acc, float a, const block_q8_0* v, int64_t n);
    // x[i] *= s
    void (*scale)(float* x, float s, int64_t n);
    // sum_i x[i]^2 (accumulated in float lanes)
    float (*sum_sq)(const float* x, int64_t n);
    // y[i] = x[i] * s * w[i]  (w may be null: y[i] = x[i] * s)
    void (*scale_mul)(const float* x, float s, const float* w, float* y, int64_t n);
    // Rope of one head in place: y[j] = x[j] * cc[j] + x[partner(j)] * ss[j] for j < n_rot, where
    // partner(j) = j ^ 1 (adjacent pairs) or j +- n_rot/2 (NeoX); ss carries the sign.
    void (*rope_head)(float* x, const float* cc, const float* ss, int64_t n_rot, bool neox);
    // f32 -> f16 (round to nearest even)
    void (*to_f16)(const float* x, uint16_t* y, int64_t n);

    // Attention over one block of KV cells: the rows are at base + idx[j] * stride (j < n).
    // out[j] = scale * (q . row_j) over head_dim elements; returns max_j out[j] (-inf when n == 0).
    float (*scores_f16)(const float* q, const unsigned char* base, size_t stride, const int32_t* idx, int n,
                        int64_t hd, float scale, float* out);
    float (*scores_q8_0)(const float* q, const unsigned char* base, size_t stride, const int32_t* idx, int n,
                         int64_t hd, float scale, float* out);
    // acc += sum_j w[j] * row_j
    void (*accum_f16)(float* acc, const float* w, const unsigned char* base, size_t stride, const int32_t* idx,
                      int n, int64_t hd);
    void (*accum_q8_0)(float* acc, const float* w, const unsigned char* base, size_t stride, const int32_t* idx,
                       int n, int64_t hd);
    // s[j] = exp(s[j] - m) for j < n; returns the sum of the new s.
    float (*exp_sum)(float* s, int n, float m);

    // Several query heads sharing a KV head (GQA) at once, so each F16 row is converted once:
    // nq queries at q + h * ldq, scores to out + h * ldo, maxima to mx[h]; accumulators at
    // acc + h * lda, weights at w + h * ldw. Null where the ISA has none (callers loop over heads).
    void (*scores_f16_mh)(const float* q, int64_t ldq, int nq, const unsigned char* base, size_t stride,
                          const int32_t* idx, int n, int64_t hd, float scale, float* out, int64_t ldo, float* mx);
    void (*accum_f16_mh)(float* acc, int64_t lda, int nq, const float* w, int64_t ldw, const unsigned char* base,
                         size_t stride, const int32_t* idx, int n, int64_t hd);
    void (*scores_q8_0_mh)(const float* q, int64_t ldq, int nq, const unsigned char* base, size_t stride,
                           const int32_t* idx, int n, int64_t hd, float scale, float* out, int64_t ldo, float* mx);
    void (*accum_q8_0_mh)(float* acc, int64_t lda, int nq, const float* w, int64_t ldw, const unsigned char* base,
                          size_t stride, const int32_t* idx, int n, int64_t hd);
};

const OpsKernels& ops_kernels_scalar();
#if defined(STOWLM_X86)
const OpsKernels& ops_kernels_avx2();
const OpsKernels& ops_kernels_avx512();
#endif

// The path of cpu_features' active_isa() (AMX machines use the AVX-512 kernels here), so
// STOWLM_ISA / set_isa() force the ops and matmul together.
OpsIsa ops_isa();
const OpsKernels& ops_kernels();
const char* ops_isa_name(OpsIsa isa);

}  // namespace stowlm::cpu
