// AVX-512 gated activations (act_kernels.h); masked tails, so any length works.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include "cpu/act_kernels.h"
#include "cpu/vec_exp.h"

namespace stowlm::cpu {

namespace {

// out = g u / (1 + e^t(g)) over n elements
template <class T>
inline void gated(const float* g, const float* u, float* out, int64_t n, T t) {
    const __m512 one = _mm512_set1_ps(1.0f);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 gv = _mm512_loadu_ps(g + i);
        const __m512 d = _mm512_add_ps(one, exp_ps(t(gv)));
        _mm512_storeu_ps(out + i, _mm512_div_ps(_mm512_mul_ps(gv, _mm512_loadu_ps(u + i)), d));
    }
    if (i < n) {
        const __mmask16 m = (__mmask16)((1u << (n - i)) - 1u);
        const __m512 gv = _mm512_maskz_loadu_ps(m, g + i);
        const __m512 d = _mm512_add_ps(one, exp_ps(t(gv)));
        _mm512_mask_storeu_ps(out + i, m, _mm512_div_ps(_mm512_mul_ps(gv, _mm512_maskz_loadu_ps(m, u + i)), d));
    }
}

void swiglu_row(const float* g, const float* u, float* out, int64_t n) {
    gated(g, u, out, n, [](__m512 x) { return _mm512_sub_ps(_mm512_setzero_ps(), x); });
}

void geglu_row(const float* g, const float* u, float* out, int64_t n) {
    gated(g, u, out, n, [](__m512 x) {
        const __m512 x2 = _mm512_mul_ps(x, x);
        // -2 k0 x (1 + k1 x^2), k0 = sqrt(2/pi), k1 = 0.044715
        const __m512 inner = _mm512_fmadd_ps(x2, _mm512_set1_ps(0.044715f), _mm512_set1_ps(1.0f));
        return _mm512_mul_ps(_mm512_mul_ps(x, _mm512_set1_ps(-2.0f * 0.7978845608028654f)), inner);
    });
}

const ActKernels kAvx512 = {swiglu_row, geglu_row};

}  // namespace

const ActKernels& act_kernels_avx512() { return kAvx512; }

}  // namespace stowlm::cpu
