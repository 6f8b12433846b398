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

#include "cpu/matmul_r16_scales.h"
#include "cpu/repack.h"
#include "quant/legacy.h"
#include "quant/mxfp4.h"

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
// The 4/5-bit formats: nibbles, Q5's fifth bits, an offset (Q4_0, Q5_0) or a min (Q4_1, Q5_1).
template <class Grp, int Off, bool Fifth>
struct RNib {
    using G = Grp;
    static constexpr int OFF = Off;
    static void unpack(const G& x, __m512i (&u)[8]) {
        nibbles(x.qs, u);
        if constexpr (Fifth) fifth_bits(x.qh, u);
    }
};
using R4_0 = RNib<block_q4_0x16, 8, false>;
// IQ4_NL and MXFP4: Q4_0's nibbles looked up (vpshufb) as the format's levels + 128.
template <class Grp, const int8_t (&Levels)[16]>
struct RLut {
    using G = Grp;
    static constexpr int OFF = 128;
    static void unpack(const G& x, __m512i (&u)[8]) { unpack_qs(x.qs, u); }
    static void unpack_qs(const uint8_t (&qs)[4][64], __m512i (&u)[8]) {
        alignas(16) static const auto lut = [] {
            struct { uint8_t v[16]; } t{};
            for (int i = 0; i < 16; i++) t.v[i] = (uint8_t)(Levels[i] + 128);
            return t;
        }();
        const __m512i table = _mm512_broadcast_i32x4(_mm_load_si128((const __m128i*)lut.v));
        nibbles(qs, u);
        for (int k = 0; k < 8; k++) u[k] = _mm512_shuffle_epi8(table, u[k]);
    }
};
using RIq4 = RLut<block_q4_0x16, kIQ4NLValues>;
using RMxfp4 = RLut<block_mxfp4x16, kMXFP4Values>;
using R5_0 = RNib<block_q5_0x16, 16, true>;
using R4_1 = RNib<block_q4_1x16, 0, false>;
using R5_1 = RNib<block_q5_1x16, 0, true>;

// The 16 rows' block scales: fp16 d, or MXFP4's E8M0 exponents as e8m0_to_f32_half gives them.
template <class G>
inline __m512 group_scales(const G& x) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)x.d)); }
inline __m512 group_scales(const block_mxfp4x16& x) {
    const __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)x.e));
    const __m512i normal = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
    const __m512i subnormal = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), e);  // e = 0, 1
    return _mm512_castsi512_ps(_mm512_mask_blend_epi32(_mm512_cmplt_epi32_mask(e, _mm512_set1_epi32(2)), normal, subnormal));
}

// The blocks `ahead` bytes on, into L2: T0 prefetches of whole blocks crowded L1 and slowed the
// stream (bench-matmul --types Q6_K --rows 21504 --cols 4864 --layouts r16: 4.7 -> 2.7 ms a token).
template <class G>
inline void prefetch_ahead(const G& x, size_t ahead) {
    for (size_t off = 0; off < sizeof(G); off += 64) _mm_prefetch((const char*)&x + ahead + off, _MM_HINT_T1);
}
inline __m512i bcast4(const int8_t* p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}
// init + the 16 rows' dots of N * 4 elements (u[k]: elements 4k..4k+3) with the activations at
// q, in two chains for latency (integer sums: exact in any order).
template <int N>
inline __m512i dot_rows(__m512i init, const __m512i* u, const int8_t* q) {
    __m512i s0 = init, s1 = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int k = 0; k < N; k += 2) {
        s0 = _mm512_dpbusd_epi32(s0, u[k], bcast4(q + 4 * k));
        s1 = _mm512_dpbusd_epi32(s1, u[k + 1], bcast4(q + 4 * k + 4));
    }
    return _mm512_add_epi32(s0, s1);
}
// dot[j] += the 16 rows' dots of N * 4 elements with token j's activations at q[j]: a token or two
// in dot_rows' two chains each, more tokens interleaved, their chains independent (integer sums:
// the same result either way). 8 tokens of Q6_K 146-162 -> 179-180 GOP/s, Q3_K 178-184 -> 195-201
// (`bench-matmul --rows 512 --cols 4096 --ntok 8 --threads 1 --layouts r16`, Intel Xeon).
template <int N, int TT>
inline void dots(__m512i (&dot)[TT], const __m512i* u, const int8_t* const (&q)[TT]) {
    if constexpr (TT < 3) {
        for (int j = 0; j < TT; j++) dot[j] = dot_rows<N>(dot[j], u, q[j]);
    } else {
#pragma GCC unroll 8
        for (int k = 0; k < N; k++)
#pragma GCC unroll 8
            for (int j = 0; j < TT; j++) dot[j] = _mm512_dpbusd_epi32(dot[j], u[k], bcast4(q[j] + 4 * k));
    }
}
// isum[j] += scv * the 16 rows' dots of N * 4 elements with token j's activations at q[j] (a
// K-format sub-block, scv its rows' scales).
template <int N, int TT>
inline void scaled_dots(__m512i (&isum)[TT], __m512i scv, const __m512i* u, const int8_t* const (&q)[TT]) {
    __m512i dot[TT];
    for (int j = 0; j < TT; j++) dot[j] = _mm512_setzero_si512();
    dots<N>(dot, u, q);
#pragma GCC unroll 8
    for (int j = 0; j < TT; j++) isum[j] = _mm512_add_epi32(isum[j], _mm512_mullo_epi32(dot[j], scv));
}
// The word index that interleaves two 16-word vectors a, b as (a_r, b_r) pairs in lane r (for
// vpmaddwd with a pair of the activations' sums).
inline __m512i pair_index() {
    alignas(64) static const auto idx = [] {
        struct { int16_t v[32]; } t{};
        for (int r = 0; r < 16; r++) t.v[2 * r] = (int16_t)r, t.v[2 * r + 1] = (int16_t)(32 + r);
        return t;
    }();
    return _mm512_load_si512(idx.v);
}
// Groups [g0, g1) x all tokens, 8 tokens a tile (a group's blocks stay in L1/L2 between tiles):
// tile(n, g, t0) with n a compile-time token count.
template <class Tile>
void groups(const MatmulArgs& A, int64_t g0, int64_t g1, Tile&& tile) {
    for (int64_t g = g0; g < g1; g++) over_token_tiles<8>(A.n_tok, [&](auto n, int64_t t) { tile(n, g, t); });
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
        prefetch_ahead(x, 4096);
        const __m512 dw = group_scales(x);
        __m512 mw = _mm512_setzero_ps();
        if constexpr (kHasMin<G>) mw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)x.m));
        __m512i u[8];
        R::unpack(x, u);
        __m512i dot[TT];
        const int8_t* q[TT];
        for (int j = 0; j < TT; j++) {
            dot[j] = R::OFF ? _mm512_set1_epi32(-R::OFF * sum[j][b]) : _mm512_setzero_si512();
            q[j] = a[j][b].qs;
        }
        dots<8>(dot, u, q);
#pragma GCC unroll 8
        for (int j = 0; j < TT; j++) {
            const __m512 s = _mm512_mul_ps(dw, _mm512_set1_ps(a[j][b].d));
            acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[j]), s, acc[j]);
            if constexpr (kHasMin<G>) acc[j] = _mm512_fmadd_ps(mw, _mm512_set1_ps(a[j][b].s), acc[j]);
        }
    }
    for (int j = 0; j < TT; j++) _mm512_storeu_ps(A.y + (t0 + j) * A.ldy + g * kRepackRows, acc[j]);
}

// sum_p vp[p] . (bsum_2p, bsum_2p+1) of a token for the 16 rows (vp: the pairs of pairs16; W16:
// the 16-sums of Q2_K/Q3_K/Q6_K, else the 32-sums of Q4_K/Q5_K/IQ4_XS).
template <bool W16, int NP>
inline __m512i pair_sums(const __m512i (&vp)[NP], const int16_t* bsums) {
    __m512i s = _mm512_setzero_si512();
    for (int p = 0; p < NP; p++) s = _mm512_add_epi32(s, _mm512_madd_epi16(vp[p], _mm512_set1_epi32(bsum_pair<W16>(bsums, p))));
    return s;
}

// A K-format tile's operands: group g's super-blocks and tokens [t0, t0 + TT)'s activation rows;
// store() writes the accumulators (kept in the caller, in registers) as the rows' outputs.
template <class G, int TT>
struct KTile {
    const G* w;
    const block_q8_K32* a[TT];
    KTile(const MatmulArgs& A, int64_t g, int64_t t0) : w((const G*)(A.w + g * kRepackRows * A.w_stride)) {
        for (int j = 0; j < TT; j++) a[j] = (const block_q8_K32*)((const uint8_t*)A.act + (t0 + j) * A.act_stride);
    }
    static void store(const MatmulArgs& A, int64_t g, int64_t t0, const __m512 (&acc)[TT]) {
        for (int j = 0; j < TT; j++) _mm512_storeu_ps(A.y + (t0 + j) * A.ldy + g * kRepackRows, acc[j]);
    }
};

// Q4_K/Q5_K: group g x tokens [t0, t0 + TT). Per super-block the 16 rows' 6-bit scales and
// mins are unpacked once (scales as int32 lanes, mins as int16 pairs of sub-blocks for vpmaddwd
// with the activations' 32-sums); per sub-block and token 8 vpdpbusd give the rows' dots, one
// vpmulld scales them, and the super-block ends in the two FMAs of repack.h.
template <bool Q5, int TT>
void r16_q45K_tile(const MatmulArgs& A, int64_t g, int64_t t0) {
    using G = std::conditional_t<Q5, block_q5_Kx16, block_q4_Kx16>;
    const int64_t nsb = A.cols / QK_K;
    const KTile<G, TT> tile(A, g, t0);
    const G* w = tile.w;
    const auto& a = tile.a;
    __m512 acc[TT] = {};
    const __m512i m4 = _mm512_set1_epi8(0x0f), b4 = _mm512_set1_epi8(0x10);
    const __m512i pidx = pair_index();
    for (int64_t b = 0; b < nsb; b++) {
        const G& x = w[b];
        prefetch_ahead(x, 8192);
        __m128i scb[8], mnb[8];
        q45k_scale_bytes(x.scales, scb, mnb);
        alignas(64) int32_t sc[8][16];
        __m256i mn16[8];
        for (int s = 0; s < 8; s++) {
            _mm512_store_si512(sc[s], _mm512_cvtepu8_epi32(scb[s]));
            mn16[s] = _mm256_cvtepu8_epi16(mnb[s]);
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
                const int8_t* qa[TT];
                for (int j = 0; j < TT; j++) qa[j] = a[j][b].qs + 32 * s;
                scaled_dots<8>(isum, _mm512_load_si512(sc[s]), u, qa);
            }
        const __m512 dd = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)x.d));
        const __m512 dm = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)x.dmin));
        for (int j = 0; j < TT; j++) {
            const __m512i im = pair_sums<false>(mnp, a[j][b].bsums);
            const __m512 da = _mm512_set1_ps(a[j][b].d[0]);
            acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[j]), _mm512_mul_ps(dd, da), acc[j]);
            acc[j] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(im), _mm512_mul_ps(dm, da), acc[j]);
        }
    }
    KTile<G, TT>::store(A, g, t0, acc);
}

// The (scale or min of sub-block 2p, of 2p + 1) int16 pairs of the 16 rows, from their int16 values.
inline __m512i pairs16(__m256i even, __m256i odd, __m512i pidx) {
    return _mm512_permutex2var_epi16(_mm512_castsi256_si512(even), pidx, _mm512_castsi256_si512(odd));
}
// Q2_K and Q3_K: per sub-block and token 4 vpdpbusd and a vpmulld by its scales, the values of
// a half's sub-blocks 8n + 2j + h taken from the same 4 loads of qs (and of hmask: Q3_K's high
// bits); Q2_K's mins and Q3_K's -4 offset leave through vpmaddwd with the activations' sums.
template <bool Q3, int TT>
void r16_q23K_tile(const MatmulArgs& A, int64_t g, int64_t t0) {
    using G = std::conditional_t<Q3, block_q3_Kx16, block_q2_Kx16>;
    const int64_t nsb = A.cols / QK_K;
    const KTile<G, TT> tile(A, g, t0);
    const G* w = tile.w;
    const auto& a = tile.a;
    __m512 acc[TT] = {};
    const __m512i m3 = _mm512_set1_epi8(3), m4 = _mm512_set1_epi8(4);
    const __m128i m15 = _mm_set1_epi8(15);
    const __m512i pidx = pair_index();
    for (int64_t b = 0; b < nsb; b++) {
        const G& x = w[b];
        prefetch_ahead(x, 8192);
        __m128i sc8[16];  // the rows' scales (Q3_K: signed), byte r of sc8[s]; Q2_K's mins apart
        __m512i mnp[8];   // Q2_K: min pairs; Q3_K: scale pairs (the offset's sums)
        if constexpr (Q3) {
            q3k_scale_bytes(x.scales, sc8);
            for (int p = 0; p < 8; p++)
                mnp[p] = pairs16(_mm256_cvtepi8_epi16(sc8[2 * p]), _mm256_cvtepi8_epi16(sc8[2 * p + 1]), pidx);
        } else {
            for (int s = 0; s < 16; s++) sc8[s] = _mm_loadu_si128((const __m128i*)x.scales[s]);
            for (int p = 0; p < 8; p++)
                mnp[p] = pairs16(_mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(sc8[2 * p], 4), m15)),
                                 _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(sc8[2 * p + 1], 4), m15)), pidx);
            for (int s = 0; s < 16; s++) sc8[s] = _mm_and_si128(sc8[s], m15);
        }
        __m512i isum[TT];
        for (int j = 0; j < TT; j++) isum[j] = _mm512_setzero_si512();
        for (int n = 0; n < 2; n++)
            for (int h = 0; h < 2; h++) {
                __m512i q[4], hm[4];
                for (int c = 0; c < 4; c++) {
                    q[c] = _mm512_loadu_si512(x.qs[n][4 * h + c]);
                    if constexpr (Q3) hm[c] = _mm512_loadu_si512(x.hmask[4 * h + c]);
                }
                for (int jj = 0; jj < 4; jj++) {
                    const int s = 8 * n + 2 * jj + h;
                    __m512i v[4];
                    for (int c = 0; c < 4; c++) {
                        v[c] = _mm512_and_si512(_mm512_srli_epi16(q[c], 2 * jj), m3);
                        if constexpr (Q3) {  // the high bit (4n + jj) to bit 2
                            const int k = 4 * n + jj;
                            const __m512i hb = k >= 2 ? _mm512_srli_epi16(hm[c], k - 2) : _mm512_slli_epi16(hm[c], 2 - k);
                            v[c] = _mm512_ternarylogic_epi32(v[c], hb, m4, 0xf8);  // v | (hb & m4)
                        }
                    }
                    const __m512i scv = Q3 ? _mm512_cvtepi8_epi32(sc8[s]) : _mm512_cvtepu8_epi32(sc8[s]);
                    const int8_t* qa[TT];
                    for (int j = 0; j < TT; j++) qa[j] = a[j][b].qs + 16 * s;
                    scaled_dots<4>(isum, scv, v, qa);
                }
            }
        const __m512 dd = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)x.d));
        for (int j = 0; j < TT; j++) {
            const __m512i ps = pair_sums<true>(mnp, a[j][b].bsums);
            const __m512 da = _mm512_set1_ps(a[j][b].d[0]);
            if constexpr (Q3) {
                const __m512i v = _mm512_sub_epi32(isum[j], _mm512_slli_epi32(ps, 2));
                acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), _mm512_mul_ps(dd, da), acc[j]);
            } else {
                const __m512 dm = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)x.dmin));
                acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[j]), _mm512_mul_ps(dd, da), acc[j]);
                acc[j] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(ps), _mm512_mul_ps(dm, da), acc[j]);
            }
        }
    }
    KTile<G, TT>::store(A, g, t0, acc);
}

// Q6_K: per sub-block and token 4 vpdpbusd and a vpmulld by its scales (int32 lanes), the values
// unpacked a quarter super-block at a time into registers; the +32 offset leaves as sum sc_s
// bsum_s through vpmaddwd of the scales as int16 pairs.
template <int TT>
void r16_q6K_tile(const MatmulArgs& A, int64_t g, int64_t t0) {
    using G = block_q6_Kx16;
    const int64_t nsb = A.cols / QK_K;
    const KTile<G, TT> tile(A, g, t0);
    const G* w = tile.w;
    const auto& a = tile.a;
    __m512 acc[TT] = {};
    const __m512i m4 = _mm512_set1_epi8(0x0f), m30 = _mm512_set1_epi8(0x30);
    const __m512i pidx = pair_index();
    for (int64_t b = 0; b < nsb; b++) {
        const G& x = w[b];
        prefetch_ahead(x, 8192);
        __m512i isum[TT];
        for (int j = 0; j < TT; j++) isum[j] = _mm512_setzero_si512();
        // a quarter of the super-block's values at a time, in registers: in half n, columns
        // c = 4 c4 .. 4 c4 + 3 of ql hold sub-blocks 8n + c4 (+2, +4, +6 with qh's other bits)
        for (int n = 0; n < 2; n++)
            for (int c4 = 0; c4 < 2; c4++) {
                __m512i v[4][4];
                for (int i = 0; i < 4; i++) {
                    const int c = 4 * c4 + i;
                    const __m512i h = _mm512_loadu_si512(x.qh[n][c]);
                    const __m512i l0 = _mm512_loadu_si512(x.ql[n][c]), l1 = _mm512_loadu_si512(x.ql[n][c + 8]);
                    v[0][i] = _mm512_ternarylogic_epi32(l0, m4, _mm512_and_si512(_mm512_slli_epi16(h, 4), m30), 0xea);
                    v[1][i] = _mm512_ternarylogic_epi32(l1, m4, _mm512_and_si512(_mm512_slli_epi16(h, 2), m30), 0xea);
                    v[2][i] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(l0, 4), m4, _mm512_and_si512(h, m30), 0xea);
                    v[3][i] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(l1, 4), m4,
                                                        _mm512_and_si512(_mm512_srli_epi16(h, 2), m30), 0xea);
                }
                for (int q = 0; q < 4; q++) {
                    const int s = 8 * n + 2 * q + c4;
                    const __m512i scv = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)x.scales[s]));
                    const int8_t* qa[TT];
                    for (int j = 0; j < TT; j++) qa[j] = a[j][b].qs + 16 * s;
                    scaled_dots<4>(isum, scv, v[q], qa);
                }
            }
        __m512i scp[8];  // lane r: (scale of sub-block 2p, of 2p + 1) of row r, for the +32 offset
        for (int p = 0; p < 8; p++)
            scp[p] = pairs16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)x.scales[2 * p])),
                             _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)x.scales[2 * p + 1])), pidx);
        const __m512 dd = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)x.d));
        for (int j = 0; j < TT; j++) {
            const __m512i corr = pair_sums<true>(scp, a[j][b].bsums);
            const __m512i v = _mm512_sub_epi32(isum[j], _mm512_slli_epi32(corr, 5));
            acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), _mm512_mul_ps(dd, _mm512_set1_ps(a[j][b].d[0])), acc[j]);
        }
    }
    KTile<G, TT>::store(A, g, t0, acc);
}

// IQ4_XS: per 32-element sub-block Q4_0's nibbles as the IQ4 levels + 128 (RIq4), 8 vpdpbusd and a
// vpmulld by the rows' scales ls - 32; the +128 leaves as 128 sum_s sc_s asum_s through vpmaddwd
// of the scales as int16 pairs with the activations' 32-sums.
template <int TT>
void r16_iq4xs_tile(const MatmulArgs& A, int64_t g, int64_t t0) {
    using G = block_iq4_xsx16;
    const int64_t nsb = A.cols / QK_K;
    const KTile<G, TT> tile(A, g, t0);
    __m512 acc[TT] = {};
    const __m512i pidx = pair_index();
    for (int64_t b = 0; b < nsb; b++) {
        const G& x = tile.w[b];
        prefetch_ahead(x, 8192);
        __m128i sc8[8];
        iq4xs_scale_bytes(x, sc8);
        __m512i scp[4];  // lane r: (scale of sub-block 2p, of 2p + 1) of row r
        for (int p = 0; p < 4; p++) scp[p] = pairs16(_mm256_cvtepi8_epi16(sc8[2 * p]), _mm256_cvtepi8_epi16(sc8[2 * p + 1]), pidx);
        __m512i isum[TT];
        for (int j = 0; j < TT; j++) isum[j] = _mm512_setzero_si512();
        for (int ib = 0; ib < 8; ib++) {
            __m512i u[8];
            RIq4::unpack_qs(x.qs[ib], u);
            const __m512i scv = _mm512_cvtepi8_epi32(sc8[ib]);
            const int8_t* qa[TT];
            for (int j = 0; j < TT; j++) qa[j] = tile.a[j][b].qs + 32 * ib;
            scaled_dots<8>(isum, scv, u, qa);
        }
        const __m512 dd = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)x.d));
        for (int j = 0; j < TT; j++) {
            const __m512i corr = pair_sums<false>(scp, tile.a[j][b].bsums);
            const __m512i v = _mm512_sub_epi32(isum[j], _mm512_slli_epi32(corr, 7));
            acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), _mm512_mul_ps(dd, _mm512_set1_ps(tile.a[j][b].d[0])), acc[j]);
        }
    }
    KTile<G, TT>::store(A, g, t0, acc);
}

}  // namespace

void matmul_r16_avx512(const MatmulArgs& A, int64_t g0, int64_t g1) {
    auto q32 = [&](auto r) {
        using R = decltype(r);
        groups(A, g0, g1, [&](auto n, int64_t g, int64_t t) { r16_tile<R, n()>(A, g, t); });
    };
    switch (A.type) {
        case QType::Q2_K: return groups(A, g0, g1, [&](auto n, int64_t g, int64_t t) { r16_q23K_tile<false, n()>(A, g, t); });
        case QType::Q3_K: return groups(A, g0, g1, [&](auto n, int64_t g, int64_t t) { r16_q23K_tile<true, n()>(A, g, t); });
        case QType::Q4_K: return groups(A, g0, g1, [&](auto n, int64_t g, int64_t t) { r16_q45K_tile<false, n()>(A, g, t); });
        case QType::Q5_K: return groups(A, g0, g1, [&](auto n, int64_t g, int64_t t) { r16_q45K_tile<true, n()>(A, g, t); });
        case QType::Q6_K: return groups(A, g0, g1, [&](auto n, int64_t g, int64_t t) { r16_q6K_tile<n()>(A, g, t); });
        case QType::IQ4_XS: return groups(A, g0, g1, [&](auto n, int64_t g, int64_t t) { r16_iq4xs_tile<n()>(A, g, t); });
        case QType::Q8_0: return q32(R8_0{});
        case QType::Q4_0: return q32(R4_0{});
        case QType::IQ4_NL: return q32(RIq4{});
        case QType::MXFP4: return q32(RMxfp4{});
        case QType::Q5_0: return q32(R5_0{});
        case QType::Q4_1: return q32(R4_1{});
        case QType::Q5_1: return q32(R5_1{});
        default: return matmul_r16_scalar(A, g0, g1);
    }
}

}  // namespace stowlm::cpu
