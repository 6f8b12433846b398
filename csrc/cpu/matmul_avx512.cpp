// AVX-512 VNNI path: vpdpbusd multiplies unsigned by signed bytes, so unpacked signed weights
// are flipped to w + 128 (xor 0x80) and the excess 128 * sum(a) is taken off per block, using
// the activation sums quantization already made (a.s for 32-blocks, bsums for the K formats).
// GCC 12 reports its own _mm512_undefined_*() inside AVX-512 intrinsics as (maybe-)uninitialized.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>

#include "cpu/cpu_features.h"
#include "cpu/matmul_impl.h"
#include "cpu/matmul_unpack_simd.h"
#include "cpu/matmul_fused.h"
#include "cpu/matmul_fused_iq.h"

namespace stowlm::cpu {

namespace {

struct SimdUnpack {
    static void unpack(QType t, DotFamily fam, const uint8_t* src, int64_t cols, uint8_t* dst, const RowLayout& L) {
        if (!unpack_row_simd(t, src, cols, dst, L)) unpack_row(t, fam, src, cols, dst, L);
    }
};

struct Avx512Kern {
    static float dot_q32(const int8_t* q, const float* d, const float* m, const block_q8_a* a, int64_t nb) {
        __m256 acc = _mm256_setzero_ps();
        float macc = 0;
        const __m256i flip = _mm256_set1_epi8((char)0x80);
        for (int64_t b = 0; b < nb; b++) {
            const __m256i w = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(q + b * QK)), flip);
            const __m256i x = _mm256_loadu_si256((const __m256i*)a[b].qs);
            // starts at -128 * (sums of 4 activations): the offset leaves in integers, exactly
            const __m256i neg = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_dpbusd_epi32(_mm256_setzero_si256(), flip, x));
            const __m256i s = _mm256_dpbusd_epi32(neg, w, x);
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(d[b] * a[b].d), acc);
            macc += m[b] * a[b].s;
        }
        return hsum8(acc) + macc;
    }
    static float hsum8(__m256 v) {
        __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        s = _mm_add_ss(s, _mm_movehdup_ps(s));
        return _mm_cvtss_f32(s);
    }
    // Product k (64 bytes) covers 32-groups 2k (lanes 0-7) and 2k+1 (lanes 8-15): its int32
    // lanes times the integer 16-group scales, then times d * d_act of the lane's group. The
    // mins are per-32-group lanes of madd over the 16-group sums.
    static float dot_qk(const int8_t* q, const int16_t* sc, const int16_t* mn, const float* d, const float* dmin,
                        const block_q8_K32* a, int64_t nsb) {
        __m512 acc = _mm512_setzero_ps();
        __m256 acc8 = _mm256_setzero_ps();
        const __m512i flip = _mm512_set1_epi8((char)0x80);
        const __m512i lane4 = _mm512_srli_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), 2);
        const __m512i lane8 = _mm512_srli_epi32(lane4, 1);
        for (int64_t b = 0; b < nsb; b++) {
            const int8_t* qb = q + b * QK_K;
            const __m256i sc16 = _mm256_loadu_si256((const __m256i*)(sc + 16 * b));
            const __m512i sc32 = _mm512_cvtepi16_epi32(sc16);
            const __m256 dact = _mm256_loadu_ps(a[b].d);
            const __m512 dd = _mm512_castps256_ps512(_mm256_mul_ps(dact, _mm256_set1_ps(d[b])));
            for (int k = 0; k < 4; k++) {
                const __m512i w = _mm512_xor_si512(_mm512_loadu_si512(qb + 64 * k), flip);
                const __m512i x = _mm512_loadu_si512(a[b].qs + 64 * k);
                // starts at -128 * (sums of 4 activations): the offset leaves in integers, exactly
                const __m512i s = _mm512_dpbusd_epi32(_mm512_sub_epi32(_mm512_setzero_si512(), _mm512_dpbusd_epi32(_mm512_setzero_si512(), flip, x)), w, x);
                // lane l of this product belongs to 16-group 4k + l/4, 32-group 2k + l/8
                const __m512i is = _mm512_mullo_epi32(s, _mm512_permutexvar_epi32(_mm512_add_epi32(_mm512_set1_epi32(4 * k), lane4), sc32));
                const __m512 ds = _mm512_permutexvar_ps(_mm512_add_epi32(_mm512_set1_epi32(2 * k), lane8), dd);
                acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is), ds, acc);
            }
            const __m256i bs = _mm256_loadu_si256((const __m256i*)a[b].bsums);
            const __m256i mins = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i*)(mn + 16 * b)), bs);
            acc8 = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(mins), _mm256_mul_ps(dact, _mm256_set1_ps(dmin[b])), acc8);
        }
        return _mm512_reduce_add_ps(acc) + hsum8(acc8);
    }
    static float dot_f(const float* w, const float* x, int64_t n) {
        __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
        int64_t i = 0;
        for (; i + 32 <= n; i += 32) {
            a0 = _mm512_fmadd_ps(_mm512_loadu_ps(w + i), _mm512_loadu_ps(x + i), a0);
            a1 = _mm512_fmadd_ps(_mm512_loadu_ps(w + i + 16), _mm512_loadu_ps(x + i + 16), a1);
        }
        float s = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
        for (; i < n; i++) s += w[i] * x[i];
        return s;
    }
    static void to_f32(QType t, const void* src, float* dst, int64_t n) {
        const uint16_t* h = (const uint16_t*)src;
        int64_t i = 0;
        if (t == QType::F16) {
            for (; i + 16 <= n; i += 16)
                _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(h + i))));
            for (; i < n; i++) dst[i] = _cvtsh_ss(h[i]);
        } else {
            for (; i + 16 <= n; i += 16) {
                const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(h + i)));
                _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)));
            }
            for (; i < n; i++) dst[i] = bf16_to_f32(h[i]);
        }
    }
};

}  // namespace

void matmul_rows_avx512(const MatmulArgs& a, int64_t r0, int64_t r1) {
    // Fused kernels stream raw blocks (measured faster than the panel at every batch size);
    // the other types go through an unpacked panel. Large batches go to AMX before this.
    if (has_fused(a.type)) fused_rows(a, r0, r1);
    else if (has_fused_iq(a.type)) {
        if (!cpu_features().avx512vbmi || !iq_rows_avx512vbmi(a, r0, r1)) fused_iq_rows(a, r0, r1);
    }
    else rows_generic<Avx512Kern, SimdUnpack>(a, r0, r1);
}

}  // namespace stowlm::cpu
