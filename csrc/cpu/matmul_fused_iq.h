// Fused row kernels of the grid i-quants (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS,
// IQ3_S): each 32-value sub-block is decoded in registers into its magnitudes u (the grid
// values) and a sign operand (the decoders of matmul_unpack_simd.h), and dotted at once with
// the activations, RT rows x TT tokens per tile, no panel. The weight's signs go onto the activations (sign_epi8), so the byte
// products are unsigned magnitude x signed activation for maddubs, whose int16 pairs stay far
// below saturation (at most 2 x 62 x 127); madd applies the sub-block's integer scales. The
// integer sums of a whole 256-block are scaled once by d_w * d_act: Q8_K activations have one
// scale per 256 values (quant/dot.h quantize_row_q8_K32), all eight of block_q8_K32's equal.
// Included by matmul_avx2.cpp and matmul_avx512.cpp (AVX2 instructions in both); anonymous
// namespace: each file compiles its own copy.
#pragma once
#include <immintrin.h>

#include <cstdint>

#include "cpu/matmul_fused.h"
#include "cpu/matmul_impl.h"
#include "cpu/matmul_unpack_simd.h"

namespace stowlm::cpu {
namespace {

// ---- the kernel ---------------------------------------------------------------------------

// y[t][r] for RT rows from r0 and TT tokens from t0.
template <class D, int RT, int TT>
void fused_iq(const MatmulArgs& A, int64_t r0, int64_t t0) {
    using B = typename D::B;
    const int64_t nsb = A.cols / QK_K;
    const TileRows<B, RT> w(A, r0);
    const TileActs<block_q8_K32, TT> a(A.act, A.act_stride, t0);
    __m256 acc[RT][TT];
    zero_acc(acc, _mm256_setzero_ps());
    for (int64_t b = 0; b < nsb; b++) {
        __m256i isum[RT][TT];
        for (int i = 0; i < RT; i++) {
            prefetch_next<(int)sizeof(B)>(&w[i][b], w.pf);
            for (int j = 0; j < TT; j++) isum[i][j] = _mm256_setzero_si256();
        }
        for (int ib = 0; ib < QK_K / 32; ib++) {
            __m256i av[TT];
            for (int j = 0; j < TT; j++) av[j] = _mm256_loadu_si256((const __m256i*)(a[j][b].qs + 32 * ib));
            // unrolled so that the accumulators stay in registers
#pragma GCC unroll 4
            for (int i = 0; i < RT; i++) {
                __m256i u, sgn;
                int s0, s1;
                D::sub(w[i][b], ib, u, sgn, s0, s1);
                const __m256i scv = _mm256_set_m128i(_mm_set1_epi16((short)s1), _mm_set1_epi16((short)s0));
#pragma GCC unroll 4
                for (int j = 0; j < TT; j++) {
                    const __m256i p = _mm256_maddubs_epi16(u, _mm256_sign_epi8(av[j], sgn));
                    isum[i][j] = _mm256_add_epi32(isum[i][j], _mm256_madd_epi16(p, scv));
                }
            }
        }
        for (int i = 0; i < RT; i++) {
            const float dw = iq_scale(&w[i][b]);
            for (int j = 0; j < TT; j++)
                acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[i][j]), _mm256_set1_ps(dw * a[j][b].d[0]), acc[i][j]);
        }
    }
    store_tile<RT, TT>(A, r0, t0, [&](int i, int j) { return hsum256(acc[i][j]); });
}

template <int RT, int TT>
void fused_iq_tile(const MatmulArgs& A, int64_t r0, int64_t t0) {
    switch (A.type) {
        case QType::IQ2_XXS: return fused_iq<DIQ2_XXS, RT, TT>(A, r0, t0);
        case QType::IQ2_XS: return fused_iq<DIQ2_XS, RT, TT>(A, r0, t0);
        case QType::IQ2_S: return fused_iq<DIQ2_S, RT, TT>(A, r0, t0);
        case QType::IQ3_XXS: return fused_iq<DIQ3_XXS, RT, TT>(A, r0, t0);
        case QType::IQ3_S: return fused_iq<DIQ3_S, RT, TT>(A, r0, t0);
        case QType::IQ1_S: return fused_iq<DIQ1_S, RT, TT>(A, r0, t0);
        case QType::IQ1_M: return fused_iq<DIQ1_M, RT, TT>(A, r0, t0);
        default: return;
    }
}

inline bool has_fused_iq(QType t) {
    switch (t) {
        case QType::IQ2_XXS: case QType::IQ2_XS: case QType::IQ2_S: case QType::IQ3_XXS: case QType::IQ3_S:
        case QType::IQ1_S: case QType::IQ1_M: return true;
        default: return false;
    }
}

// Rows [r0, r1) x all tokens: 4 rows x up to 4 tokens per tile (2 rows for 4 tokens: registers).
template <int TT>
void fused_iq_rows_tt(const MatmulArgs& A, int64_t r0, int64_t r1, int64_t t0) {
    constexpr int RT = TT >= 4 ? 2 : 4;
    int64_t r = r0;
    for (; r + RT <= r1; r += RT) fused_iq_tile<RT, TT>(A, r, t0);
    for (; r < r1; r++) fused_iq_tile<1, TT>(A, r, t0);
}
inline void fused_iq_rows(const MatmulArgs& A, int64_t r0, int64_t r1) {
    int64_t t = 0;
    for (; t + 4 <= A.n_tok; t += 4) fused_iq_rows_tt<4>(A, r0, r1, t);
    switch (A.n_tok - t) {
        case 3: fused_iq_rows_tt<3>(A, r0, r1, t); break;
        case 2: fused_iq_rows_tt<2>(A, r0, r1, t); break;
        case 1: fused_iq_rows_tt<1>(A, r0, r1, t); break;
        default: break;
    }
}

}  // namespace
}  // namespace stowlm::cpu
