// AVX2 + FMA + F16C inner loops of the ops; tails fall back to scalar code.
#include <immintrin.h>

#include "common.h"
#include "cpu/ops_kernels.h"

namespace stowlm::cpu {

namespace {

inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
inline __m256 load_h(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
inline __m256 load_i8(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}

float dot_f16(const float* q, const uint16_t* k, int64_t n) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load_h(k + i), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i + 8), load_h(k + i + 8), a1);
    }
    for (; i + 8 <= n; i += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load_h(k + i), a0);
    float s = hsum(_mm256_add_ps(a0, a1));
    for (; i < n; i++) s += q[i] * fp16_to_f32(k[i]);
    return s;
}

void axpy_f16(float* acc, float a, const uint16_t* v, int64_t n) {
    const __m256 va = _mm256_set1_ps(a);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(va, load_h(v + i), _mm256_loadu_ps(acc + i)));
    for (; i < n; i++) acc[i] += a * fp16_to_f32(v[i]);
}

float dot_q8_0(const float* q, const block_q8_0* k, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < n / QK; b++) {
        const float* qb = q + b * QK;
        __m256 t = _mm256_mul_ps(_mm256_loadu_ps(qb), load_i8(k[b].qs));
        t = _mm256_fmadd_ps(_mm256_loadu_ps(qb + 8), load_i8(k[b].qs + 8), t);
        t = _mm256_fmadd_ps(_mm256_loadu_ps(qb + 16), load_i8(k[b].qs + 16), t);
        t = _mm256_fmadd_ps(_mm256_loadu_ps(qb + 24), load_i8(k[b].qs + 24), t);
        acc = _mm256_fmadd_ps(t, _mm256_set1_ps(_cvtsh_ss(k[b].d)), acc);
    }
    return hsum(acc);
}

void axpy_q8_0(float* acc, float a, const block_q8_0* v, int64_t n) {
    for (int64_t b = 0; b < n / QK; b++) {
        float* ab = acc + b * QK;
        const __m256 ad = _mm256_set1_ps(a * _cvtsh_ss(v[b].d));
        for (int j = 0; j < QK; j += 8)
            _mm256_storeu_ps(ab + j, _mm256_fmadd_ps(ad, load_i8(v[b].qs + j), _mm256_loadu_ps(ab + j)));
    }
}

void scale(float* x, float s, int64_t n) {
    const __m256 vs = _mm256_set1_ps(s);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), vs));
    for (; i < n; i++) x[i] *= s;
}

float sum_sq(const float* x, int64_t n) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m256 x0 = _mm256_loadu_ps(x + i), x1 = _mm256_loadu_ps(x + i + 8);
        a0 = _mm256_fmadd_ps(x0, x0, a0);
        a1 = _mm256_fmadd_ps(x1, x1, a1);
    }
    for (; i + 8 <= n; i += 8) {
        const __m256 x0 = _mm256_loadu_ps(x + i);
        a0 = _mm256_fmadd_ps(x0, x0, a0);
    }
    float s = hsum(_mm256_add_ps(a0, a1));
    for (; i < n; i++) s += x[i] * x[i];
    return s;
}

void scale_mul(const float* x, float s, const float* w, float* y, int64_t n) {
    const __m256 vs = _mm256_set1_ps(s);
    int64_t i = 0;
    if (w) {
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), vs), _mm256_loadu_ps(w + i)));
        for (; i < n; i++) y[i] = x[i] * s * w[i];
    } else {
        for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), vs));
        for (; i < n; i++) y[i] = x[i] * s;
    }
}

void to_f16(const float* x, uint16_t* y, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i*)(y + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    for (; i < n; i++) y[i] = f32_to_fp16(x[i]);
}

const OpsKernels kAvx2 = {"avx2", dot_f16, axpy_f16, dot_q8_0, axpy_q8_0, scale, sum_sq, scale_mul, to_f16};

}  // namespace

const OpsKernels& ops_kernels_avx2() { return kAvx2; }

}  // namespace stowlm::cpu
