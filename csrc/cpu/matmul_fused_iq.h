// Fused row kernels of the grid i-quants (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS,
// IQ3_S): each 32-value sub-block is decoded in registers into its magnitudes u (the grid
// values) and a sign operand, and dotted at once with the activations, RT rows x TT tokens
// per tile, no panel. The weight's signs go onto the activations (sign_epi8), so the byte
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

// ---- per-format sub-block decoders --------------------------------------------------------
// sub(b, ib, u, sgn, s0, s1): u = the 32 magnitudes (unsigned bytes), sgn = a byte operand of
// sign_epi8 whose sign is the weight's (+-1, or the signed value itself), s0/s1 the integer
// scales of the two 16-value halves. The values and scales are those of quant/iquants.h.

// +-1 bytes of the eight signs of a 7-bit IQ2/IQ3_XXS sign field (iq_signs8), as one word.
constexpr uint64_t signs_pm1(uint32_t s7) {
    const uint32_t s = iq_signs8(s7);
    uint64_t v = 0;
    for (int k = 0; k < 8; k++) v |= (uint64_t)((s >> k) & 1 ? 0xFF : 0x01) << (8 * k);
    return v;
}
struct SignTable {
    uint64_t v[128];
    constexpr SignTable() : v() {
        for (uint32_t i = 0; i < 128; i++) v[i] = signs_pm1(i);
    }
};
constexpr SignTable kSignsPM1{};

inline __m256i signs_from_fields(uint32_t f0, uint32_t f1, uint32_t f2, uint32_t f3) {
    return grid64x4(kSignsPM1.v, f0, f1, f2, f3);
}
// +-1 bytes from 32 explicit sign bits (IQ2_S, IQ3_S).
inline __m256i signs_from_bits(uint32_t bits) { return _mm256_or_si256(byte_mask32(bits), _mm256_set1_epi8(1)); }

struct DIQ2_XXS {
    using B = block_iq2_xxs;
    static void sub(const B& b, int ib, __m256i& u, __m256i& sgn, int& s0, int& s1) {
        const uint32_t idx = u32_from_u16(b.qs + 4 * ib), aux = u32_from_u16(b.qs + 4 * ib + 2);
        u = grid64x4(iq_tables::kIQ2XXS, idx & 255, (idx >> 8) & 255, (idx >> 16) & 255, idx >> 24);
        sgn = signs_from_fields(aux & 127, (aux >> 7) & 127, (aux >> 14) & 127, (aux >> 21) & 127);
        s0 = s1 = 2 * (int)(aux >> 28) + 1;
    }
};
struct DIQ2_XS {
    using B = block_iq2_xs;
    static void sub(const B& b, int ib, __m256i& u, __m256i& sgn, int& s0, int& s1) {
        const uint16_t* v = b.qs + 4 * ib;
        u = grid64x4(iq_tables::kIQ2XS, v[0] & 511, v[1] & 511, v[2] & 511, v[3] & 511);
        sgn = signs_from_fields(v[0] >> 9, v[1] >> 9, v[2] >> 9, v[3] >> 9);
        s0 = 2 * (b.scales[ib] & 15) + 1, s1 = 2 * (b.scales[ib] >> 4) + 1;
    }
};
struct DIQ2_S {
    using B = block_iq2_s;
    static void sub(const B& b, int ib, __m256i& u, __m256i& sgn, int& s0, int& s1) {
        const uint8_t* qs = b.qs + 4 * ib;
        const uint32_t h = b.qh[ib];
        u = grid64x4(iq_tables::kIQ2S, qs[0] | ((h << 8) & 0x300), qs[1] | ((h << 6) & 0x300), qs[2] | ((h << 4) & 0x300),
                     qs[3] | ((h << 2) & 0x300));
        sgn = signs_from_bits(u32_from_bytes(qs + QK_K / 8));
        s0 = 2 * (b.scales[ib] & 15) + 1, s1 = 2 * (b.scales[ib] >> 4) + 1;
    }
};
struct DIQ3_XXS {
    using B = block_iq3_xxs;
    static void sub(const B& b, int ib, __m256i& u, __m256i& sgn, int& s0, int& s1) {
        const uint8_t* qs = b.qs + 8 * ib;
        const uint32_t* g = iq_tables::kIQ3XXS;
        const uint32_t aux = u32_from_bytes(b.qs + QK_K / 4 + 4 * ib);
        u = _mm256_set_epi32((int)g[qs[7]], (int)g[qs[6]], (int)g[qs[5]], (int)g[qs[4]], (int)g[qs[3]], (int)g[qs[2]],
                             (int)g[qs[1]], (int)g[qs[0]]);
        sgn = signs_from_fields(aux & 127, (aux >> 7) & 127, (aux >> 14) & 127, (aux >> 21) & 127);
        s0 = s1 = 2 * (int)(aux >> 28) + 1;
    }
};
struct DIQ3_S {
    using B = block_iq3_s;
    static void sub(const B& b, int ib, __m256i& u, __m256i& sgn, int& s0, int& s1) {
        const uint8_t* qs = b.qs + 8 * ib;
        const uint32_t* g = iq_tables::kIQ3S;
        const uint32_t h = b.qh[ib];
        auto e = [&](int k) { return (int)g[qs[k] | ((h << (8 - k)) & 256)]; };
        u = _mm256_set_epi32(e(7), e(6), e(5), e(4), e(3), e(2), e(1), e(0));
        sgn = signs_from_bits(u32_from_bytes(b.signs + 4 * ib));
        s0 = s1 = 1 + 2 * ((b.scales[ib / 2] >> (4 * (ib % 2))) & 15);
    }
};
// IQ1: the values 8 * grid +- 1 are never 0, so they are their own sign operand.
struct DIQ1_S {
    using B = block_iq1_s;
    static void sub(const B& b, int ib, __m256i& u, __m256i& sgn, int& s0, int& s1) {
        const uint8_t* qs = b.qs + 4 * ib;
        const uint32_t h = b.qh[ib];
        const __m256i g = grid64x4(iq_tables::kIQ1S8, qs[0] | ((h << 8) & 0x700), qs[1] | ((h << 5) & 0x700),
                                   qs[2] | ((h << 2) & 0x700), qs[3] | ((h >> 1) & 0x700));
        sgn = _mm256_add_epi8(g, _mm256_set1_epi8((h & 0x8000u) ? -1 : 1));  // one delta for all 32
        u = _mm256_abs_epi8(sgn);
        s0 = s1 = 2 * (int)((h >> 12) & 7) + 1;
    }
};
struct DIQ1_M {
    using B = block_iq1_m;
    static void sub(const B& b, int ib, __m256i& u, __m256i& sgn, int& s0, int& s1) {
        const uint8_t* qs = b.qs + 4 * ib;
        const uint32_t h = (uint32_t)b.qh[2 * ib] | ((uint32_t)b.qh[2 * ib + 1] << 8);  // 4 nibbles
        const __m256i g = grid64x4(iq_tables::kIQ1S8, qs[0] | ((h << 8) & 0x700), qs[1] | ((h << 4) & 0x700),
                                   qs[2] | (h & 0x700), qs[3] | ((h >> 4) & 0x700));
        sgn = iq1_add_delta(g, ((h >> 3) & 1) | ((h >> 6) & 2) | ((h >> 9) & 4) | ((h >> 12) & 8));
        u = _mm256_abs_epi8(sgn);
        const uint32_t w = iq1m_scale_word(&b, ib / 2) >> (6 * (ib % 2));
        s0 = 2 * (int)(w & 7) + 1, s1 = 2 * (int)((w >> 3) & 7) + 1;
    }
};

// ---- the kernel ---------------------------------------------------------------------------

// y[t][r] for RT rows from r0 and TT tokens from t0.
template <class D, int RT, int TT>
void fused_iq(const MatmulArgs& A, int64_t r0, int64_t t0) {
    using B = typename D::B;
    const int64_t nsb = A.cols / QK_K;
    const B* w[RT];
    for (int i = 0; i < RT; i++) w[i] = (const B*)(A.w + (r0 + i) * A.w_stride);
    const size_t pf = RT * A.w_stride;
    const block_q8_K32* a[TT];
    for (int j = 0; j < TT; j++) a[j] = (const block_q8_K32*)((const uint8_t*)A.act + (t0 + j) * A.act_stride);
    __m256 acc[RT][TT];
    for (int i = 0; i < RT; i++)
        for (int j = 0; j < TT; j++) acc[i][j] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nsb; b++) {
        __m256i isum[RT][TT];
        for (int i = 0; i < RT; i++) {
            prefetch_next<(int)sizeof(B)>(&w[i][b], pf);
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
    for (int j = 0; j < TT; j++)
        for (int i = 0; i < RT; i++) A.y[(t0 + j) * A.ldy + r0 + i] = hsum256(acc[i][j]);
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
