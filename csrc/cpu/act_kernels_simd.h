// The gated activations of act_kernels.h written once over a float vector (F32x8: AVX2,
// F32x16: AVX-512), for the files built for each instruction set (act_kernels_avx2.cpp,
// act_kernels_avx512.cpp). Anonymous namespace, like vec_exp.h: each of those files compiles
// its own copy with its own instructions.
#pragma once
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "cpu/act_kernels.h"
#include "cpu/vec_exp.h"

namespace stowlm::cpu {
namespace {

#if defined(__AVX2__) && defined(__FMA__)
struct F32x8 {  // the tail through a zero-padded copy
    using reg = __m256;
    static constexpr int64_t width = 8;
    static reg set1(float x) { return _mm256_set1_ps(x); }
    static reg add(reg a, reg b) { return _mm256_add_ps(a, b); }
    static reg sub(reg a, reg b) { return _mm256_sub_ps(a, b); }
    static reg mul(reg a, reg b) { return _mm256_mul_ps(a, b); }
    static reg div(reg a, reg b) { return _mm256_div_ps(a, b); }
    static reg fmadd(reg a, reg b, reg c) { return _mm256_fmadd_ps(a, b, c); }
    static reg exp(reg x) { return exp256_ps(x); }
    static reg load(const float* p) { return _mm256_loadu_ps(p); }
    static void store(float* p, reg v) { _mm256_storeu_ps(p, v); }
    static reg load_part(const float* p, int64_t n) {
        float b[8] = {};
        memcpy(b, p, (size_t)n * sizeof(float));
        return _mm256_loadu_ps(b);
    }
    static void store_part(float* p, reg v, int64_t n) {
        float b[8];
        _mm256_storeu_ps(b, v);
        memcpy(p, b, (size_t)n * sizeof(float));
    }
};
#endif

#if defined(__AVX512F__)
struct F32x16 {  // masked tails
    using reg = __m512;
    static constexpr int64_t width = 16;
    static reg set1(float x) { return _mm512_set1_ps(x); }
    static reg add(reg a, reg b) { return _mm512_add_ps(a, b); }
    static reg sub(reg a, reg b) { return _mm512_sub_ps(a, b); }
    static reg mul(reg a, reg b) { return _mm512_mul_ps(a, b); }
    static reg div(reg a, reg b) { return _mm512_div_ps(a, b); }
    static reg fmadd(reg a, reg b, reg c) { return _mm512_fmadd_ps(a, b, c); }
    static reg exp(reg x) { return exp_ps(x); }
    static reg load(const float* p) { return _mm512_loadu_ps(p); }
    static void store(float* p, reg v) { _mm512_storeu_ps(p, v); }
    static __mmask16 mask(int64_t n) { return (__mmask16)((1u << n) - 1u); }
    static reg load_part(const float* p, int64_t n) { return _mm512_maskz_loadu_ps(mask(n), p); }
    static void store_part(float* p, reg v, int64_t n) { _mm512_mask_storeu_ps(p, mask(n), v); }
};
#endif

// out = g u / (1 + e^t(g)) over n elements
template <class V, class T>
inline void gated(const float* g, const float* u, float* out, int64_t n, T t) {
    using R = typename V::reg;
    const R one = V::set1(1.0f);
    auto step = [&](R gv, R uv) { return V::div(V::mul(gv, uv), V::add(one, V::exp(t(gv)))); };
    int64_t i = 0;
    for (; i + V::width <= n; i += V::width) V::store(out + i, step(V::load(g + i), V::load(u + i)));
    if (i < n) V::store_part(out + i, step(V::load_part(g + i, n - i), V::load_part(u + i, n - i)), n - i);
}

template <class V>
void swiglu_row(const float* g, const float* u, float* out, int64_t n) {
    gated<V>(g, u, out, n, [](typename V::reg x) { return V::sub(V::set1(0.0f), x); });
}

template <class V>
void geglu_row(const float* g, const float* u, float* out, int64_t n) {
    gated<V>(g, u, out, n, [](typename V::reg x) {
        // -2 k0 x (1 + k1 x^2), k0 = sqrt(2/pi), k1 = 0.044715
        const auto inner = V::fmadd(V::mul(x, x), V::set1(0.044715f), V::set1(1.0f));
        return V::mul(V::mul(x, V::set1(-2.0f * 0.7978845608028654f)), inner);
    });
}

template <class V>
const ActKernels& gated_kernels() {
    static const ActKernels k = {swiglu_row<V>, geglu_row<V>};
    return k;
}

}  // namespace
}  // namespace stowlm::cpu
