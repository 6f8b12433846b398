// AVX2 gated activations (act_kernels.h); the tail goes through a zero-padded copy.
#include <immintrin.h>

#include <cstring>

#include "cpu/act_kernels.h"
#include "cpu/vec_exp.h"

namespace stowlm::cpu {

namespace {

// out = g u / (1 + e^t(g)) over n elements
template <class T>
inline void gated(const float* g, const float* u, float* out, int64_t n, T t) {
    const __m256 one = _mm256_set1_ps(1.0f);
    auto eight = [&](const float* gp, const float* up, float* op) {
        const __m256 gv = _mm256_loadu_ps(gp);
        const __m256 d = _mm256_add_ps(one, exp256_ps(t(gv)));
        _mm256_storeu_ps(op, _mm256_div_ps(_mm256_mul_ps(gv, _mm256_loadu_ps(up)), d));
    };
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) eight(g + i, u + i, out + i);
    if (i < n) {
        float gb[8] = {}, ub[8] = {}, ob[8];
        memcpy(gb, g + i, (n - i) * sizeof(float));
        memcpy(ub, u + i, (n - i) * sizeof(float));
        eight(gb, ub, ob);
        memcpy(out + i, ob, (n - i) * sizeof(float));
    }
}

void swiglu_row(const float* g, const float* u, float* out, int64_t n) {
    gated(g, u, out, n, [](__m256 x) { return _mm256_sub_ps(_mm256_setzero_ps(), x); });
}

void geglu_row(const float* g, const float* u, float* out, int64_t n) {
    gated(g, u, out, n, [](__m256 x) {
        const __m256 x2 = _mm256_mul_ps(x, x);
        // -2 k0 x (1 + k1 x^2), k0 = sqrt(2/pi), k1 = 0.044715
        const __m256 inner = _mm256_fmadd_ps(x2, _mm256_set1_ps(0.044715f), _mm256_set1_ps(1.0f));
        return _mm256_mul_ps(_mm256_mul_ps(x, _mm256_set1_ps(-2.0f * 0.7978845608028654f)), inner);
    });
}

const ActKernels kAvx2 = {swiglu_row, geglu_row};

}  // namespace

const ActKernels& act_kernels_avx2() { return kAvx2; }

}  // namespace stowlm::cpu
