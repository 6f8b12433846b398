// AVX-512 VNNI products of weights repacked into 16-row groups (repack.h): per block, 8
// vpdpbusd of the group's 4-element columns with broadcasts of a token's activations give the
// block's exact integer dots of all 16 rows, one conversion and one FMA scale them. The same
// float operations as matmul_r16_scalar, in the same order, for any number of tokens.
// GCC 12 reports its own _mm512_undefined_*() inside AVX-512 intrinsics as (maybe-)uninitialized.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>

#include <cstring>
#include <type_traits>

#include "cpu/repack.h"

namespace stowlm::cpu {

namespace {

// Each format's 8 vectors of unsigned values: u[k] holds elements 4k..4k+3 of the 16 rows.
inline void nibbles(const uint8_t (&qs)[4][64], __m512i (&u)[8]) {
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    for (int k = 0; k < 4; k++) {
        const __m512i z = _mm512_loadu_si512(qs[k]);
        u[k] = _mm512_and_si512(z, m4);
        u[4 + k] = _mm512_and_si512(_mm512_srli_epi16(z, 4), m4);
    }
}
inline void fifth_bits(const uint64_t (&qh)[8], __m512i (&u)[8]) {
    const __m512i b4 = _mm512_set1_epi8(0x10);
    for (int k = 0; k < 8; k++) u[k] = _mm512_mask_add_epi8(u[k], _cvtu64_mask64(qh[k]), u[k], b4);
}
template <class G>
constexpr bool kHasMin = std::is_same_v<G, block_q4_1x16> || std::is_same_v<G, block_q5_1x16>;
struct R8_0 {
    using G = block_q8_0x16;
    static constexpr int OFF = 128;
    static void unpack(const G& x, __m512i (&u)[8]) {
        for (int k = 0; k < 8; k++) u[k] = _mm512_loadu_si512(x.qs[k]);
    }
};
struct R4_0 {
    using G = block_q4_0x16;
    static constexpr int OFF = 8;
    static void unpack(const G& x, __m512i (&u)[8]) { nibbles(x.qs, u); }
};
struct R5_0 {
    using G = block_q5_0x16;
    static constexpr int OFF = 16;
    static void unpack(const G& x, __m512i (&u)[8]) { nibbles(x.qs, u), fifth_bits(x.qh, u); }
};
struct R4_1 {
    using G = block_q4_1x16;
    static constexpr int OFF = 0;
    static void unpack(const G& x, __m512i (&u)[8]) { nibbles(x.qs, u); }
};
struct R5_1 {
    using G = block_q5_1x16;
    static constexpr int OFF = 0;
    static void unpack(const G& x, __m512i (&u)[8]) { nibbles(x.qs, u), fifth_bits(x.qh, u); }
};

inline __m512i bcast4(const int8_t* p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

// Group g x tokens [t0, t0 + TT).
template <class R, int TT>
void r16_tile(const MatmulArgs& A, int64_t g, int64_t t0) {
    using G = typename R::G;
    const int64_t nb = A.cols / QK;
    const G* w = (const G*)(A.w + g * kRepackRows * A.w_stride);
    const block_q8_a* a[TT];
    const int32_t* sum[TT];
    __m512 acc[TT];
    for (int j = 0; j < TT; j++) {
        a[j] = (const block_q8_a*)((const uint8_t*)A.act + (t0 + j) * A.act_stride);
        sum[j] = A.asum + (t0 + j) * nb;
        acc[j] = _mm512_setzero_ps();
    }
    for (int64_t b = 0; b < nb; b++) {
        const G& x = w[b];
        for (size_t off = 0; off < sizeof(G); off += 64) _mm_prefetch((const char*)&x + 2048 + off, _MM_HINT_T0);
        const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)x.d));
        __m512 mw = _mm512_setzero_ps();
        if constexpr (kHasMin<G>) mw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)x.m));
        __m512i u[8];
        R::unpack(x, u);
#pragma GCC unroll 8
        for (int j = 0; j < TT; j++) {
            const int8_t* q = a[j][b].qs;
            // two chains for latency; integer sums, exact in any order
            __m512i s0 = R::OFF ? _mm512_set1_epi32(-R::OFF * sum[j][b]) : _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
            s0 = _mm512_dpbusd_epi32(s0, u[0], bcast4(q + 0));
            s1 = _mm512_dpbusd_epi32(s1, u[1], bcast4(q + 4));
            s0 = _mm512_dpbusd_epi32(s0, u[2], bcast4(q + 8));
            s1 = _mm512_dpbusd_epi32(s1, u[3], bcast4(q + 12));
            s0 = _mm512_dpbusd_epi32(s0, u[4], bcast4(q + 16));
            s1 = _mm512_dpbusd_epi32(s1, u[5], bcast4(q + 20));
            s0 = _mm512_dpbusd_epi32(s0, u[6], bcast4(q + 24));
            s1 = _mm512_dpbusd_epi32(s1, u[7], bcast4(q + 28));
            const __m512 s = _mm512_mul_ps(dw, _mm512_set1_ps(a[j][b].d));
            acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)), s, acc[j]);
            if constexpr (kHasMin<G>) acc[j] = _mm512_fmadd_ps(mw, _mm512_set1_ps(a[j][b].s), acc[j]);
        }
    }
    for (int j = 0; j < TT; j++) _mm512_storeu_ps(A.y + (t0 + j) * A.ldy + g * kRepackRows, acc[j]);
}

// Groups [g0, g1) x all tokens, 8 tokens a tile (a group's blocks stay in L1/L2 between tiles).
template <class R>
void r16_groups(const MatmulArgs& A, int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; g++) {
        int64_t t = 0;
        for (; t + 8 <= A.n_tok; t += 8) r16_tile<R, 8>(A, g, t);
        switch (A.n_tok - t) {
            case 7: r16_tile<R, 7>(A, g, t); break;
            case 6: r16_tile<R, 6>(A, g, t); break;
            case 5: r16_tile<R, 5>(A, g, t); break;
            case 4: r16_tile<R, 4>(A, g, t); break;
            case 3: r16_tile<R, 3>(A, g, t); break;
            case 2: r16_tile<R, 2>(A, g, t); break;
            case 1: r16_tile<R, 1>(A, g, t); break;
            default: break;
        }
    }
}

// Q4_K/Q5_K: group g x tokens [t0, t0 + TT). Per super-block the 16 rows' 6-bit scales and
// mins are unpacked once (scales as int32 lanes, mins as int16 pairs of sub-blocks for vpmaddwd
// with the activations' 32-sums); per sub-block and token 8 vpdpbusd give the rows' dots, one
// vpmulld scales them, and the super-block ends in the two FMAs of repack.h.
template <bool Q5, int TT>
void r16_q45K_tile(const MatmulArgs& A, int64_t g, int64_t t0) {
    using G = std::conditional_t<Q5, block_q5_Kx16, block_q4_Kx16>;
    const int64_t nsb = A.cols / QK_K;
    const G* w = (const G*)(A.w + g * kRepackRows * A.w_stride);
    const block_q8_K32* a[TT];
    __m512 acc[TT];
    for (int j = 0; j < TT; j++) {
        a[j] = (const block_q8_K32*)((const uint8_t*)A.act + (t0 + j) * A.act_stride);
        acc[j] = _mm512_setzero_ps();
    }
    const __m128i m63 = _mm_set1_epi8(63), m15 = _mm_set1_epi8(15), m3 = _mm_set1_epi8(3);
    const __m512i m4 = _mm512_set1_epi8(0x0f), b4 = _mm512_set1_epi8(0x10);
    alignas(64) int16_t pair_idx[32];
    for (int r = 0; r < 16; r++) pair_idx[2 * r] = (int16_t)r, pair_idx[2 * r + 1] = (int16_t)(32 + r);
    const __m512i pidx = _mm512_load_si512(pair_idx);
    for (int64_t b = 0; b < nsb; b++) {
        const G& x = w[b];
        for (size_t off = 0; off < sizeof(G); off += 64) _mm_prefetch((const char*)&x + 4096 + off, _MM_HINT_T0);
        __m128i B[12];
        for (int k = 0; k < 12; k++) B[k] = _mm_loadu_si128((const __m128i*)x.scales[k]);
        alignas(64) int32_t sc[8][16];
        __m256i mn16[8];
        for (int s = 0; s < 8; s++) {
            __m128i scb, mnb;
            if (s < 4) {
                scb = _mm_and_si128(B[s], m63), mnb = _mm_and_si128(B[s + 4], m63);
            } else {
                scb = _mm_or_si128(_mm_and_si128(B[s + 4], m15), _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(B[s - 4], 6), m3), 4));
                mnb = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(B[s + 4], 4), m15),
                                   _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(B[s], 6), m3), 4));
            }
            _mm512_store_si512(sc[s], _mm512_cvtepu8_epi32(scb));
            mn16[s] = _mm256_cvtepu8_epi16(mnb);
        }
        __m512i mnp[4];  // lane r: (m of sub-block 2p, of 2p + 1) of row r
        for (int p = 0; p < 4; p++)
            mnp[p] = _mm512_permutex2var_epi16(_mm512_castsi256_si512(mn16[2 * p]), pidx, _mm512_castsi256_si512(mn16[2 * p + 1]));
        __m512i isum[TT];
        for (int j = 0; j < TT; j++) isum[j] = _mm512_setzero_si512();
        for (int q = 0; q < 4; q++)
            for (int h = 0; h < 2; h++) {
                const int s = 2 * q + h;
                __m512i u[8];
                for (int c = 0; c < 8; c++) {
                    u[c] = _mm512_and_si512(_mm512_srli_epi16(_mm512_loadu_si512(x.qs[q][c]), 4 * h), m4);
                    if constexpr (Q5) u[c] = _mm512_mask_add_epi8(u[c], _cvtu64_mask64(x.qh[16 * q + 8 * h + c]), u[c], b4);
                }
                const __m512i scv = _mm512_load_si512(sc[s]);
#pragma GCC unroll 8
                for (int j = 0; j < TT; j++) {
                    const int8_t* qa = a[j][b].qs + 32 * s;
                    __m512i s0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u[0], bcast4(qa));
                    __m512i s1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u[1], bcast4(qa + 4));
                    s0 = _mm512_dpbusd_epi32(s0, u[2], bcast4(qa + 8));
                    s1 = _mm512_dpbusd_epi32(s1, u[3], bcast4(qa + 12));
                    s0 = _mm512_dpbusd_epi32(s0, u[4], bcast4(qa + 16));
                    s1 = _mm512_dpbusd_epi32(s1, u[5], bcast4(qa + 20));
                    s0 = _mm512_dpbusd_epi32(s0, u[6], bcast4(qa + 24));
                    s1 = _mm512_dpbusd_epi32(s1, u[7], bcast4(qa + 28));
                    isum[j] = _mm512_add_epi32(isum[j], _mm512_mullo_epi32(_mm512_add_epi32(s0, s1), scv));
                }
            }
        const __m512 dd = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)x.d));
        const __m512 dm = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)x.dmin));
        for (int j = 0; j < TT; j++) {
            const int16_t* bs = a[j][b].bsums;
            __m512i im = _mm512_setzero_si512();
            for (int p = 0; p < 4; p++) {
                // the 32-sums of sub-blocks 2p and 2p + 1 as one int16 pair
                const uint32_t pr = (uint16_t)(int16_t)(bs[4 * p] + bs[4 * p + 1]) |
                                    ((uint32_t)(uint16_t)(int16_t)(bs[4 * p + 2] + bs[4 * p + 3]) << 16);
                im = _mm512_add_epi32(im, _mm512_madd_epi16(mnp[p], _mm512_set1_epi32((int)pr)));
            }
            const __m512 da = _mm512_set1_ps(a[j][b].d[0]);
            acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[j]), _mm512_mul_ps(dd, da), acc[j]);
            acc[j] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(im), _mm512_mul_ps(dm, da), acc[j]);
        }
    }
    for (int j = 0; j < TT; j++) _mm512_storeu_ps(A.y + (t0 + j) * A.ldy + g * kRepackRows, acc[j]);
}

// Q6_K: per super-block the 16-element scales as int32 lanes and as int16 pairs (the +32 offset
// leaves as sum sc_s bsum_s through vpmaddwd); per sub-block and token 4 vpdpbusd and a vpmulld.
template <int TT>
void r16_q6K_tile(const MatmulArgs& A, int64_t g, int64_t t0) {
    using G = block_q6_Kx16;
    const int64_t nsb = A.cols / QK_K;
    const G* w = (const G*)(A.w + g * kRepackRows * A.w_stride);
    const block_q8_K32* a[TT];
    __m512 acc[TT];
    for (int j = 0; j < TT; j++) {
        a[j] = (const block_q8_K32*)((const uint8_t*)A.act + (t0 + j) * A.act_stride);
        acc[j] = _mm512_setzero_ps();
    }
    const __m512i m4 = _mm512_set1_epi8(0x0f), m30 = _mm512_set1_epi8(0x30);
    alignas(64) int16_t pair_idx[32];
    for (int r = 0; r < 16; r++) pair_idx[2 * r] = (int16_t)r, pair_idx[2 * r + 1] = (int16_t)(32 + r);
    const __m512i pidx = _mm512_load_si512(pair_idx);
    for (int64_t b = 0; b < nsb; b++) {
        const G& x = w[b];
        for (size_t off = 0; off < sizeof(G); off += 64) _mm_prefetch((const char*)&x + 4096 + off, _MM_HINT_T0);
        alignas(64) int32_t sc[16][16];
        __m512i scp[8];
        for (int p = 0; p < 8; p++) {
            const __m128i s0 = _mm_loadu_si128((const __m128i*)x.scales[2 * p]);
            const __m128i s1 = _mm_loadu_si128((const __m128i*)x.scales[2 * p + 1]);
            _mm512_store_si512(sc[2 * p], _mm512_cvtepi8_epi32(s0));
            _mm512_store_si512(sc[2 * p + 1], _mm512_cvtepi8_epi32(s1));
            scp[p] = _mm512_permutex2var_epi16(_mm512_castsi256_si512(_mm256_cvtepi8_epi16(s0)), pidx,
                                               _mm512_castsi256_si512(_mm256_cvtepi8_epi16(s1)));
        }
        // the super-block's 64 vectors of values, unpacked once for all TT tokens: a ql vector
        // holds groups c and c + 16 of its half, a qh vector groups c, c + 8, c + 16, c + 24
        alignas(64) __m512i u[64];
        for (int n = 0; n < 2; n++)
            for (int c = 0; c < 8; c++) {
                const __m512i h = _mm512_loadu_si512(x.qh[n][c]);
                const __m512i l0 = _mm512_loadu_si512(x.ql[n][c]), l1 = _mm512_loadu_si512(x.ql[n][c + 8]);
                __m512i* o = u + 32 * n;
                o[c] = _mm512_ternarylogic_epi32(l0, m4, _mm512_and_si512(_mm512_slli_epi16(h, 4), m30), 0xea);
                o[c + 8] = _mm512_ternarylogic_epi32(l1, m4, _mm512_and_si512(_mm512_slli_epi16(h, 2), m30), 0xea);
                o[c + 16] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(l0, 4), m4, _mm512_and_si512(h, m30), 0xea);
                o[c + 24] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(l1, 4), m4, _mm512_and_si512(_mm512_srli_epi16(h, 2), m30), 0xea);
            }
        __m512i isum[TT];
        for (int j = 0; j < TT; j++) isum[j] = _mm512_setzero_si512();
        for (int s = 0; s < 16; s++) {
            const __m512i scv = _mm512_load_si512(sc[s]);
            const __m512i* us = u + 4 * s;
#pragma GCC unroll 8
            for (int j = 0; j < TT; j++) {
                const int8_t* qa = a[j][b].qs + 16 * s;
                __m512i s0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), us[0], bcast4(qa));
                __m512i s1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), us[1], bcast4(qa + 4));
                s0 = _mm512_dpbusd_epi32(s0, us[2], bcast4(qa + 8));
                s1 = _mm512_dpbusd_epi32(s1, us[3], bcast4(qa + 12));
                isum[j] = _mm512_add_epi32(isum[j], _mm512_mullo_epi32(_mm512_add_epi32(s0, s1), scv));
            }
        }
        const __m512 dd = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)x.d));
        for (int j = 0; j < TT; j++) {
            __m512i corr = _mm512_setzero_si512();
            for (int p = 0; p < 8; p++) {
                int32_t pr;
                memcpy(&pr, a[j][b].bsums + 2 * p, 4);  // the 16-sums of sub-blocks 2p, 2p + 1
                corr = _mm512_add_epi32(corr, _mm512_madd_epi16(scp[p], _mm512_set1_epi32(pr)));
            }
            const __m512i v = _mm512_sub_epi32(isum[j], _mm512_slli_epi32(corr, 5));
            acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), _mm512_mul_ps(dd, _mm512_set1_ps(a[j][b].d[0])), acc[j]);
        }
    }
    for (int j = 0; j < TT; j++) _mm512_storeu_ps(A.y + (t0 + j) * A.ldy + g * kRepackRows, acc[j]);
}

// Groups [g0, g1) x all tokens, 8 tokens a tile: a tile's kernel is K<TT>::run.
template <template <int> class K>
void groups8(const MatmulArgs& A, int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; g++) {
        int64_t t = 0;
        for (; t + 8 <= A.n_tok; t += 8) K<8>::run(A, g, t);
        switch (A.n_tok - t) {
            case 7: K<7>::run(A, g, t); break;
            case 6: K<6>::run(A, g, t); break;
            case 5: K<5>::run(A, g, t); break;
            case 4: K<4>::run(A, g, t); break;
            case 3: K<3>::run(A, g, t); break;
            case 2: K<2>::run(A, g, t); break;
            case 1: K<1>::run(A, g, t); break;
            default: break;
        }
    }
}
template <int TT> struct Q4K { static void run(const MatmulArgs& A, int64_t g, int64_t t) { r16_q45K_tile<false, TT>(A, g, t); } };
template <int TT> struct Q5K { static void run(const MatmulArgs& A, int64_t g, int64_t t) { r16_q45K_tile<true, TT>(A, g, t); } };
template <int TT> struct Q6K { static void run(const MatmulArgs& A, int64_t g, int64_t t) { r16_q6K_tile<TT>(A, g, t); } };

}  // namespace

void matmul_r16_avx512(const MatmulArgs& A, int64_t g0, int64_t g1) {
    switch (A.type) {
        case QType::Q4_K: return groups8<Q4K>(A, g0, g1);
        case QType::Q5_K: return groups8<Q5K>(A, g0, g1);
        case QType::Q6_K: return groups8<Q6K>(A, g0, g1);
        case QType::Q8_0: return r16_groups<R8_0>(A, g0, g1);
        case QType::Q4_0: return r16_groups<R4_0>(A, g0, g1);
        case QType::Q5_0: return r16_groups<R5_0>(A, g0, g1);
        case QType::Q4_1: return r16_groups<R4_1>(A, g0, g1);
        case QType::Q5_1: return r16_groups<R5_1>(A, g0, g1);
        default: return matmul_r16_scalar(A, g0, g1);
    }
}

}  // namespace stowlm::cpu
