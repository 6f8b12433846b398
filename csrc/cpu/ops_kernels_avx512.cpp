// AVX-512 inner loops of the ops (F16C conversions, masked tails so any length works).
// GCC 12 warns inside its own AVX-512 headers (their _mm512_undefined_* placeholders).
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include "cpu/ops_kernels.h"

namespace stowlm::cpu {

namespace {

inline __mmask16 tail_mask(int64_t r) { return (__mmask16)((1u << r) - 1u); }

inline __m512 load_h(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
inline __m512 load_h_mask(const uint16_t* p, __mmask16 m) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
}
inline __m512 load_i8(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
}

float dot_f16(const float* q, const uint16_t* k, int64_t n) {
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        a0 = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), load_h(k + i), a0);
        a1 = _mm512_fmadd_ps(_mm512_loadu_ps(q + i + 16), load_h(k + i + 16), a1);
    }
    for (; i + 16 <= n; i += 16) a0 = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), load_h(k + i), a0);
    if (i < n) {
        const __mmask16 m = tail_mask(n - i);
        a1 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, q + i), load_h_mask(k + i, m), a1);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
}

void axpy_f16(float* acc, float a, const uint16_t* v, int64_t n) {
    const __m512 va = _mm512_set1_ps(a);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(acc + i, _mm512_fmadd_ps(va, load_h(v + i), _mm512_loadu_ps(acc + i)));
    if (i < n) {
        const __mmask16 m = tail_mask(n - i);
        _mm512_mask_storeu_ps(acc + i, m, _mm512_fmadd_ps(va, load_h_mask(v + i, m), _mm512_maskz_loadu_ps(m, acc + i)));
    }
}

float dot_q8_0(const float* q, const block_q8_0* k, int64_t n) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t b = 0; b < n / QK; b++) {
        const float* qb = q + b * QK;
        __m512 t = _mm512_mul_ps(_mm512_loadu_ps(qb), load_i8(k[b].qs));
        t = _mm512_fmadd_ps(_mm512_loadu_ps(qb + 16), load_i8(k[b].qs + 16), t);
        acc = _mm512_fmadd_ps(t, _mm512_set1_ps(_cvtsh_ss(k[b].d)), acc);
    }
    return _mm512_reduce_add_ps(acc);
}

void axpy_q8_0(float* acc, float a, const block_q8_0* v, int64_t n) {
    for (int64_t b = 0; b < n / QK; b++) {
        float* ab = acc + b * QK;
        const __m512 ad = _mm512_set1_ps(a * _cvtsh_ss(v[b].d));
        _mm512_storeu_ps(ab, _mm512_fmadd_ps(ad, load_i8(v[b].qs), _mm512_loadu_ps(ab)));
        _mm512_storeu_ps(ab + 16, _mm512_fmadd_ps(ad, load_i8(v[b].qs + 16), _mm512_loadu_ps(ab + 16)));
    }
}

void scale(float* x, float s, int64_t n) {
    const __m512 vs = _mm512_set1_ps(s);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(x + i, _mm512_mul_ps(_mm512_loadu_ps(x + i), vs));
    if (i < n) {
        const __mmask16 m = tail_mask(n - i);
        _mm512_mask_storeu_ps(x + i, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + i), vs));
    }
}

float sum_sq(const float* x, int64_t n) {
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        const __m512 x0 = _mm512_loadu_ps(x + i), x1 = _mm512_loadu_ps(x + i + 16);
        a0 = _mm512_fmadd_ps(x0, x0, a0);
        a1 = _mm512_fmadd_ps(x1, x1, a1);
    }
    for (; i + 16 <= n; i += 16) {
        const __m512 x0 = _mm512_loadu_ps(x + i);
        a0 = _mm512_fmadd_ps(x0, x0, a0);
    }
    if (i < n) {
        const __m512 x0 = _mm512_maskz_loadu_ps(tail_mask(n - i), x + i);
        a1 = _mm512_fmadd_ps(x0, x0, a1);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
}

void scale_mul(const float* x, float s, const float* w, float* y, int64_t n) {
    const __m512 vs = _mm512_set1_ps(s);
    int64_t i = 0;
    if (w) {
        for (; i + 16 <= n; i += 16)
            _mm512_storeu_ps(y + i, _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(x + i), vs), _mm512_loadu_ps(w + i)));
        if (i < n) {
            const __mmask16 m = tail_mask(n - i);
            _mm512_mask_storeu_ps(y + i, m, _mm512_mul_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + i), vs),
                                                          _mm512_maskz_loadu_ps(m, w + i)));
        }
    } else {
        for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, _mm512_mul_ps(_mm512_loadu_ps(x + i), vs));
        if (i < n) {
            const __mmask16 m = tail_mask(n - i);
            _mm512_mask_storeu_ps(y + i, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + i), vs));
        }
    }
}

void to_f16(const float* x, uint16_t* y, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256((__m256i*)(y + i),
                            _mm512_cvtps_ph(_mm512_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    if (i < n) {
        const __mmask16 m = tail_mask(n - i);
        _mm256_mask_storeu_epi16(y + i, m,
                                 _mm512_cvtps_ph(_mm512_maskz_loadu_ps(m, x + i),
                                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
}

const OpsKernels kAvx512 = {"avx512", dot_f16, axpy_f16, dot_q8_0, axpy_q8_0, scale, sum_sq, scale_mul, to_f16};

}  // namespace

const OpsKernels& ops_kernels_avx512() { return kAvx512; }

}  // namespace stowlm::cpu
