// Scalar inner loops (the portable fallback and the reference for the SIMD ones) and the
// run-time choice between instruction sets.
#include "cpu/ops_kernels.h"

#include <cmath>
#include <vector>

#include "common.h"
#include "cpu/cpu_features.h"

namespace stowlm::cpu {

namespace {

// Every half's float value (256 KiB, built once): the branchy exact conversion per element
// would dominate the scalar attention loops.
const float* half_table() {
    static const std::vector<float> t = [] {
        std::vector<float> v(65536);
        for (uint32_t h = 0; h < 65536; h++) v[h] = fp16_to_f32((uint16_t)h);
        return v;
    }();
    return t.data();
}

float dot_f16(const float* q, const uint16_t* k, int64_t n) {
    const float* ht = half_table();
    float s = 0;
    for (int64_t i = 0; i < n; i++) s += q[i] * ht[k[i]];
    return s;
}
void axpy_f16(float* acc, float a, const uint16_t* v, int64_t n) {
    const float* ht = half_table();
    for (int64_t i = 0; i < n; i++) acc[i] += a * ht[v[i]];
}
float dot_q8_0(const float* q, const block_q8_0* k, int64_t n) {
    float s = 0;
    for (int64_t b = 0; b < n / QK; b++) {
        float sb = 0;
        for (int i = 0; i < QK; i++) sb += q[b * QK + i] * (float)k[b].qs[i];
        s += sb * fp16_to_f32(k[b].d);
    }
    return s;
}
void axpy_q8_0(float* acc, float a, const block_q8_0* v, int64_t n) {
    for (int64_t b = 0; b < n / QK; b++) {
        const float ad = a * fp16_to_f32(v[b].d);
        for (int i = 0; i < QK; i++) acc[b * QK + i] += ad * (float)v[b].qs[i];
    }
}
void scale(float* x, float s, int64_t n) {
    for (int64_t i = 0; i < n; i++) x[i] *= s;
}
float sum_sq(const float* x, int64_t n) {
    // Eight partial sums so the compiler can vectorise without reassociating.
    float p[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) p[j] += x[i + j] * x[i + j];
    float s = 0;
    for (; i < n; i++) s += x[i] * x[i];
    for (int j = 0; j < 8; j++) s += p[j];
    return s;
}
void scale_mul(const float* x, float s, const float* w, float* y, int64_t n) {
    if (w)
        for (int64_t i = 0; i < n; i++) y[i] = x[i] * s * w[i];
    else
        for (int64_t i = 0; i < n; i++) y[i] = x[i] * s;
}
void rope_head(float* x, const float* cc, const float* ss, int64_t n_rot, bool neox) {
    const int64_t half = n_rot / 2;
    for (int64_t i = 0; i < half; i++) {
        const int64_t a = neox ? i : 2 * i, b = neox ? i + half : 2 * i + 1;
        const float x0 = x[a], x1 = x[b];
        x[a] = x0 * cc[a] + x1 * ss[a];
        x[b] = x1 * cc[b] + x0 * ss[b];
    }
}
void to_f16(const float* x, uint16_t* y, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = f32_to_fp16(x[i]);
}

float scores_f16(const float* q, const unsigned char* base, size_t stride, const int32_t* idx, int n, int64_t hd,
                 float scale, float* out) {
    float mx = -INFINITY;
    for (int j = 0; j < n; j++) {
        out[j] = scale * dot_f16(q, (const uint16_t*)(base + idx[j] * stride), hd);
        mx = out[j] > mx ? out[j] : mx;
    }
    return mx;
}
float scores_q8_0(const float* q, const unsigned char* base, size_t stride, const int32_t* idx, int n, int64_t hd,
                  float scale, float* out) {
    float mx = -INFINITY;
    for (int j = 0; j < n; j++) {
        out[j] = scale * dot_q8_0(q, (const block_q8_0*)(base + idx[j] * stride), hd);
        mx = out[j] > mx ? out[j] : mx;
    }
    return mx;
}
void accum_f16(float* acc, const float* w, const unsigned char* base, size_t stride, const int32_t* idx, int n,
               int64_t hd) {
    for (int j = 0; j < n; j++) axpy_f16(acc, w[j], (const uint16_t*)(base + idx[j] * stride), hd);
}
void accum_q8_0(float* acc, const float* w, const unsigned char* base, size_t stride, const int32_t* idx, int n,
                int64_t hd) {
    for (int j = 0; j < n; j++) axpy_q8_0(acc, w[j], (const block_q8_0*)(base + idx[j] * stride), hd);
}
float exp_sum(float* s, int n, float m) {
    float sum = 0;
    for (int j = 0; j < n; j++) {
        s[j] = expf(s[j] - m);
        sum += s[j];
    }
    return sum;
}

const OpsKernels kScalar = {"scalar",   dot_f16,     axpy_f16,  dot_q8_0,   axpy_q8_0, scale,  sum_sq,
                            scale_mul,  rope_head, to_f16,      scores_f16, scores_q8_0, accum_f16, accum_q8_0, exp_sum, nullptr, nullptr, nullptr, nullptr};

}  // namespace

const OpsKernels& ops_kernels_scalar() { return kScalar; }

OpsIsa ops_isa() {
    switch (active_isa()) {
        case Isa::AMX:
        case Isa::AVX512_VNNI: return OpsIsa::Avx512;
        case Isa::AVX2: return OpsIsa::Avx2;
        default: return OpsIsa::Scalar;
    }
}

const char* ops_isa_name(OpsIsa isa) {
    switch (isa) {
        case OpsIsa::Avx512: return "avx512";
        case OpsIsa::Avx2: return "avx2";
        default: return "scalar";
    }
}

const OpsKernels& ops_kernels() {
#if defined(STOWLM_X86)
    switch (ops_isa()) {
        case OpsIsa::Avx512: return ops_kernels_avx512();
        case OpsIsa::Avx2: return ops_kernels_avx2();
        default: break;
    }
#endif
    return kScalar;
}

}  // namespace stowlm::cpu
