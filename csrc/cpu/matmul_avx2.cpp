// AVX2 path: int8 dot products with maddubs/madd (sign trick: |w| x sign(a, w), both in
// int8, so the pair sums stay below the int16 saturation limit), float types with FMA/F16C.
#include <immintrin.h>

#include "cpu/matmul_impl.h"
#include "cpu/matmul_unpack_simd.h"
#include "cpu/matmul_fused.h"
#include "cpu/matmul_fused_iq.h"

namespace stowlm::cpu {

namespace {

inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
// 16 int16 pair sums of w*a (w, a signed int8).
inline __m256i mul_pairs(__m256i w, __m256i a) {
    return _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(a, w));
}

struct SimdUnpack {
    static void unpack(QType t, DotFamily fam, const uint8_t* src, int64_t cols, uint8_t* dst, const RowLayout& L) {
        if (!unpack_row_simd(t, src, cols, dst, L)) unpack_row(t, fam, src, cols, dst, L);
    }
};

struct Avx2Kern {
    static float dot_q32(const int8_t* q, const float* d, const float* m, const block_q8_a* a, int64_t nb) {
        __m256 acc = _mm256_setzero_ps();
        float macc = 0;
        const __m256i ones = _mm256_set1_epi16(1);
        for (int64_t b = 0; b < nb; b++) {
            const __m256i w = _mm256_loadu_si256((const __m256i*)(q + b * QK));
            const __m256i x = _mm256_loadu_si256((const __m256i*)a[b].qs);
            const __m256i s = _mm256_madd_epi16(mul_pairs(w, x), ones);
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(d[b] * a[b].d), acc);
            macc += m[b] * a[b].s;
        }
        return hsum8(acc) + macc;
    }
    // Per 32-group k: 8 int32 lanes, scaled by d * d_act[k]; the mins of all groups as 8
    // lanes scaled by dmin * d_act; one horizontal sum per row.
    static float dot_qk(const int8_t* q, const int16_t* sc, const int16_t* mn, const float* d, const float* dmin,
                        const block_q8_K32* a, int64_t nsb) {
        __m256 acc = _mm256_setzero_ps();
        for (int64_t b = 0; b < nsb; b++) {
            const int8_t* qb = q + b * QK_K;
            const int16_t* scb = sc + 16 * b;
            for (int k = 0; k < 8; k++) {
                const __m256i w = _mm256_loadu_si256((const __m256i*)(qb + 32 * k));
                const __m256i x = _mm256_loadu_si256((const __m256i*)(a[b].qs + 32 * k));
                const __m256i s = _mm256_set_m128i(_mm_set1_epi16(scb[2 * k + 1]), _mm_set1_epi16(scb[2 * k]));
                const __m256i isum = _mm256_madd_epi16(mul_pairs(w, x), s);
                acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(d[b] * a[b].d[k]), acc);
            }
            const __m256i bs = _mm256_loadu_si256((const __m256i*)a[b].bsums);
            const __m256i msum = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i*)(mn + 16 * b)), bs);
            acc = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(msum),
                                   _mm256_mul_ps(_mm256_loadu_ps(a[b].d), _mm256_set1_ps(dmin[b])), acc);
        }
        return hsum8(acc);
    }
    static float dot_f(const float* w, const float* x, int64_t n) {
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
        int64_t i = 0;
        for (; i + 16 <= n; i += 16) {
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i), _mm256_loadu_ps(x + i), a0);
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i + 8), _mm256_loadu_ps(x + i + 8), a1);
        }
        float s = hsum8(_mm256_add_ps(a0, a1));
        for (; i < n; i++) s += w[i] * x[i];
        return s;
    }
    static void to_f32(QType t, const void* src, float* dst, int64_t n) {
        const uint16_t* h = (const uint16_t*)src;
        int64_t i = 0;
        if (t == QType::F16) {
            for (; i + 8 <= n; i += 8)
                _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(h + i))));
            for (; i < n; i++) dst[i] = _cvtsh_ss(h[i]);
        } else {
            for (; i + 8 <= n; i += 8) {
                const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(h + i)));
                _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)));
            }
            for (; i < n; i++) dst[i] = bf16_to_f32(h[i]);
        }
    }
};

}  // namespace

void quantize_act_avx2(DotFamily fam, const float* x, void* dst, int64_t n) {
    if (fam == DotFamily::Q32) quantize_q8_a_simd(x, (block_q8_a*)dst, n);
    else quantize_q8_K32_simd(x, (block_q8_K32*)dst, n);
}

void matmul_rows_avx2(const MatmulArgs& a, int64_t r0, int64_t r1) {
    // Fused kernels stream raw blocks; the other types go through an unpacked panel.
    if (has_fused(a.type)) fused_rows(a, r0, r1);
    else if (has_fused_iq(a.type)) fused_iq_rows(a, r0, r1);
    else rows_generic<Avx2Kern, SimdUnpack>(a, r0, r1);
}

}  // namespace stowlm::cpu
