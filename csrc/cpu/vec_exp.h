// Vector exp for the files built with AVX2 / AVX-512 (the attention softmax, the gated
// activations): Cephes-style range reduction x = n ln2 + r and a degree-6 polynomial for
// e^r, ~1-2 ulp over the clamped range, the same accuracy class as libm's expf. Inputs
// below -104 give 0 (up to denormals), above 88.37 the largest finite value.
// Anonymous namespace: each ISA file compiles its own copy.
#pragma once
#include <immintrin.h>

namespace stowlm::cpu {
namespace {

#define STOWLM_EXP_POLY(V, FMA, FNMA, MUL, ADD, SET1, x, r, n, p)                       \
    r = FNMA(n, SET1(0.693359375f), x);                                                 \
    r = FNMA(n, SET1(-2.12194440e-4f), r);                                              \
    p = SET1(1.9875691500E-4f);                                                         \
    p = FMA(p, r, SET1(1.3981999507E-3f));                                              \
    p = FMA(p, r, SET1(8.3334519073E-3f));                                              \
    p = FMA(p, r, SET1(4.1665795894E-2f));                                              \
    p = FMA(p, r, SET1(1.6666665459E-1f));                                              \
    p = FMA(p, r, SET1(5.0000001201E-1f));                                              \
    p = FMA(p, MUL(r, r), ADD(r, SET1(1.0f)))

#if defined(__AVX512F__)
inline __m512 exp_ps(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
    x = _mm512_min_ps(x, _mm512_set1_ps(88.37626f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r, p;
    STOWLM_EXP_POLY(512, _mm512_fmadd_ps, _mm512_fnmadd_ps, _mm512_mul_ps, _mm512_add_ps, _mm512_set1_ps, x, r, n, p);
    return _mm512_scalef_ps(p, n);  // p * 2^n, underflowing to zero
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
inline __m256 exp256_ps(__m256 x) {
    // -87.3 keeps 2^n a normal float for the exponent-field construction below
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.33654f));
    x = _mm256_min_ps(x, _mm256_set1_ps(88.37626f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r, p;
    STOWLM_EXP_POLY(256, _mm256_fmadd_ps, _mm256_fnmadd_ps, _mm256_mul_ps, _mm256_add_ps, _mm256_set1_ps, x, r, n, p);
    // 2^n in two halves so n = 128 (x near the top of the range) stays finite
    const __m256i ni = _mm256_cvtps_epi32(n);
    const __m256i h1 = _mm256_srai_epi32(ni, 1), h2 = _mm256_sub_epi32(ni, h1);
    const __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(h1, _mm256_set1_epi32(127)), 23));
    const __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(h2, _mm256_set1_epi32(127)), 23));
    return _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
}
#endif

#undef STOWLM_EXP_POLY

}  // namespace
}  // namespace stowlm::cpu
