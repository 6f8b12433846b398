// AVX2 products of weights repacked into 16-row groups (repack.h), for CPUs without AVX-512:
// the plan of matmul_r16_avx512.cpp with a group's 16 rows as two halves of 8 (the first and
// last 32 bytes of each 64-byte group vector) and maddubs + madd where that file has vpdpbusd.
// maddubs adds its two products in int16, so each format sums only as many of them before madd
// as cannot saturate (G below); Q8_0, IQ4_NL and IQ4_XS, whose values reach +-127, take the sign trick.
// Every integer is exact and the float operations are matmul_r16_scalar's, so are its bits.
#include <immintrin.h>

#include <cstring>
#include <type_traits>

#include "cpu/matmul_fused.h"  // e8m0_half_ps
#include "cpu/matmul_r16_scales.h"
#include "cpu/repack.h"
#include "quant/legacy.h"
#include "quant/mxfp4.h"

namespace stowlm::cpu {

namespace {

using V = __m256i;
// Half h (rows 8h .. 8h + 7) of a 64-byte group vector.
inline V half(const uint8_t* p, int h) { return _mm256_loadu_si256((const V*)(p + 32 * h)); }
inline V bcast4(const int8_t* p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}
// 0x10 in byte j where bit j of m is set (Q5's fifth bits of 8 rows x 4 elements).
inline V fifth_bytes(uint32_t m) {
    const V spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                      2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const V bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    const V v = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)m), spread), bit);
    return _mm256_and_si256(_mm256_cmpeq_epi8(v, bit), _mm256_set1_epi8(0x10));
}
// fifth_bytes of half h of a 64-bit word of fifth bits, broadcast from memory (no shift, no movd).
inline V fifth_half(const uint64_t& qh, int h) {
    int32_t m;
    memcpy(&m, (const uint8_t*)&qh + 4 * h, 4);
    return fifth_bytes((uint32_t)m);
}
// Rows 8h.. of a group's fp16 values (scales, mins).
inline __m256 fp16x8(const uint16_t* p, int h) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 8 * h))); }
// A 16-byte vector of the 16 rows' bytes as 16 int16 pairs (b0_r, b1_r) of the half's rows r
// (vpmaddwd of pair sums by a row's scale, or of a sub-block pair's sums by its two scales).
template <bool SIGNED>
inline V pairs(__m128i b0, __m128i b1, int h) {
    const __m128i p = h ? _mm_unpackhi_epi8(b0, b1) : _mm_unpacklo_epi8(b0, b1);
    return SIGNED ? _mm256_cvtepi8_epi16(p) : _mm256_cvtepu8_epi16(p);
}
// acc + the dots of N vectors u (unsigned) with the activations at q (4 elements an int32 lane):
// G maddubs added in int16 before one madd by `by` (ones, or a row's scale twice).
template <int N, int G>
inline V dot_g(V acc, const V* u, const int8_t* q, V by) {
    for (int k = 0; k < N; k += G) {
        V p = _mm256_maddubs_epi16(u[k], bcast4(q + 4 * k));
        for (int i = 1; i < G; i++) p = _mm256_add_epi16(p, _mm256_maddubs_epi16(u[k + i], bcast4(q + 4 * (k + i))));
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, by));
    }
    return acc;
}

template <class G>
inline void prefetch_ahead(const G& x, size_t ahead) {
    for (size_t off = 0; off < sizeof(G); off += 64) _mm_prefetch((const char*)&x + ahead + off, _MM_HINT_T1);
}

// The 32-element formats. unpack(x, h, u, s): half h's 8 vectors of values, u[k] elements
// 4k..4k+3 of the rows; SIGNED formats give |value| in u and the value in s (sign trick),
// the others unsigned values carrying OFF (removed as -OFF * sum(activations)). G: maddubs
// results summed in int16 (G * 2 * max(u) * 127 < 2^15).
inline void nibbles(const uint8_t (&qs)[4][64], int h, V (&u)[8]) {
    const V m4 = _mm256_set1_epi8(0x0f);
    for (int k = 0; k < 4; k++) {
        const V z = half(qs[k], h);
        u[k] = _mm256_and_si256(z, m4);
        u[4 + k] = _mm256_and_si256(_mm256_srli_epi16(z, 4), m4);
    }
}
struct R8_0 {
    using G = block_q8_0x16;
    static constexpr bool SIGNED = true;
    static constexpr int OFF = 0, GS = 1;
    static void unpack(const G& x, int h, V (&u)[8], V (&s)[8]) {
        for (int k = 0; k < 8; k++) {
            s[k] = _mm256_xor_si256(half(x.qs[k], h), _mm256_set1_epi8((char)0x80));  // q + 128 -> q
            u[k] = _mm256_abs_epi8(s[k]);
        }
    }
};
template <class Grp, int Off, bool Fifth>
struct RNib {
    using G = Grp;
    static constexpr bool SIGNED = false;
    static constexpr int OFF = Off, GS = Fifth ? 4 : 8;  // max u 31 / 15
    static void unpack(const G& x, int h, V (&u)[8], V (&)[8]) {
        nibbles(x.qs, h, u);
        if constexpr (Fifth)
            for (int k = 0; k < 8; k++) u[k] = _mm256_or_si256(u[k], fifth_bytes((uint32_t)(x.qh[k] >> (32 * h))));
    }
};
using R4_0 = RNib<block_q4_0x16, 8, false>;
using R5_0 = RNib<block_q5_0x16, 16, true>;
using R4_1 = RNib<block_q4_1x16, 0, false>;
using R5_1 = RNib<block_q5_1x16, 0, true>;
// A 16-level table of f(level) as a vpshufb table in both lanes.
template <const int8_t (&Levels)[16], class F>
inline V level_table(F f) {
    alignas(16) int8_t t[16];
    for (int i = 0; i < 16; i++) t[i] = (int8_t)f(Levels[i]);
    return _mm256_broadcastsi128_si256(_mm_load_si128((const __m128i*)t));
}
// IQ4_NL: levels -127..113, sign trick.
struct RIq4 {
    using G = block_q4_0x16;
    static constexpr bool SIGNED = true;
    static constexpr int OFF = 0, GS = 1;
    static void unpack(const G& x, int h, V (&u)[8], V (&s)[8]) { unpack_qs(x.qs, h, u, s); }
    static void unpack_qs(const uint8_t (&qs)[4][64], int h, V (&u)[8], V (&s)[8]) {
        static const V sv = level_table<kIQ4NLValues>([](int v) { return v; });
        static const V av = level_table<kIQ4NLValues>([](int v) { return v < 0 ? -v : v; });
        V n[8];
        nibbles(qs, h, n);
        for (int k = 0; k < 8; k++) s[k] = _mm256_shuffle_epi8(sv, n[k]), u[k] = _mm256_shuffle_epi8(av, n[k]);
    }
};
// MXFP4: the doubled E2M1 levels (-12..12) + 12.
struct RMxfp4 {
    using G = block_mxfp4x16;
    static constexpr bool SIGNED = false;
    static constexpr int OFF = 12, GS = 4;  // max u 24
    static void unpack(const G& x, int h, V (&u)[8], V (&)[8]) {
        static const V tv = level_table<kMXFP4Values>([](int v) { return v + OFF; });
        nibbles(x.qs, h, u);
        for (int k = 0; k < 8; k++) u[k] = _mm256_shuffle_epi8(tv, u[k]);
    }
};
template <class G>
inline __m256 group_scales(const G& x, int h) { return fp16x8(x.d, h); }
inline __m256 group_scales(const block_mxfp4x16& x, int h) {
    return e8m0_half_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(x.e + 8 * h))));
}
template <class G>
constexpr bool kHasMin = std::is_same_v<G, block_q4_1x16> || std::is_same_v<G, block_q5_1x16>;

// Groups [g0, g1) x all tokens, TT tokens a tile.
template <int TT, class Tile>
void groups(const MatmulArgs& A, int64_t g0, int64_t g1, Tile&& tile) {
    for (int64_t g = g0; g < g1; g++) over_token_tiles<TT>(A.n_tok, [&](auto n, int64_t t) { tile(n, g, t); });
}
template <int TT>
inline void store_rows(const MatmulArgs& A, int64_t g, int64_t t0, const __m256 (&acc)[TT][2]) {
    for (int j = 0; j < TT; j++)
        for (int h = 0; h < 2; h++) _mm256_storeu_ps(A.y + (t0 + j) * A.ldy + g * kRepackRows + 8 * h, acc[j][h]);
}

// Group g x tokens [t0, t0 + TT), a 32-element format.
template <class R, int TT>
void r16_tile(const MatmulArgs& A, int64_t g, int64_t t0) {
    using G = typename R::G;
    const int64_t nb = A.cols / QK;
    const G* w = (const G*)(A.w + g * kRepackRows * A.w_stride);
    const block_q8_a* a[TT];
    const int32_t* sum[TT];
    __m256 acc[TT][2];
    for (int j = 0; j < TT; j++) {
        a[j] = (const block_q8_a*)((const uint8_t*)A.act + (t0 + j) * A.act_stride);
        sum[j] = A.asum + (t0 + j) * nb;
        acc[j][0] = acc[j][1] = _mm256_setzero_ps();
    }
    const V ones = _mm256_set1_epi16(1);
    for (int64_t b = 0; b < nb; b++) {
        const G& x = w[b];
        prefetch_ahead(x, 4096);
        for (int h = 0; h < 2; h++) {
            const __m256 dw = group_scales(x, h);
            __m256 mw = _mm256_setzero_ps();
            if constexpr (kHasMin<G>) mw = fp16x8(x.m, h);
            V u[8], s[8];
            R::unpack(x, h, u, s);
#pragma GCC unroll 8
            for (int j = 0; j < TT; j++) {
                const int8_t* q = a[j][b].qs;
                V dot = R::OFF ? _mm256_set1_epi32(-R::OFF * sum[j][b]) : _mm256_setzero_si256();
                if constexpr (R::SIGNED) {
                    for (int k = 0; k < 8; k++)
                        dot = _mm256_add_epi32(dot, _mm256_madd_epi16(_mm256_maddubs_epi16(u[k], _mm256_sign_epi8(bcast4(q + 4 * k), s[k])), ones));
                } else {
                    dot = dot_g<8, R::GS>(dot, u, q, ones);
                }
                const __m256 sc = _mm256_mul_ps(dw, _mm256_set1_ps(a[j][b].d));
                acc[j][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), sc, acc[j][h]);
                if constexpr (kHasMin<G>) acc[j][h] = _mm256_fmadd_ps(mw, _mm256_set1_ps(a[j][b].s), acc[j][h]);
            }
        }
    }
    store_rows<TT>(A, g, t0, acc);
}

// The unsigned 32-element formats for one token (decode): a half's values made and taken a vector
// at a time, the fifth bits broadcast from memory, so nothing spills (the tile above, at TT = 1,
// keeps 16 unpacked vectors and its sums on the stack). Same integers and float operations as
// the tile, so the same bits.
template <class R>
void r16_tile1(const MatmulArgs& A, int64_t g) {
    using G = typename R::G;
    constexpr bool kFifth = std::is_same_v<G, block_q5_0x16> || std::is_same_v<G, block_q5_1x16>;
    const int64_t nb = A.cols / QK;
    const G* w = (const G*)(A.w + g * kRepackRows * A.w_stride);
    const block_q8_a* a = (const block_q8_a*)A.act;
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    const V m4 = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    auto value = [&](V nib, const G& x, int k, int h) {
        if constexpr (kFifth) nib = _mm256_or_si256(nib, fifth_half(x.qh[k], h));
        if constexpr (std::is_same_v<R, RMxfp4>) {
            static const V tv = level_table<kMXFP4Values>([](int v) { return v + R::OFF; });
            nib = _mm256_shuffle_epi8(tv, nib);
        }
        return nib;
    };
    for (int64_t b = 0; b < nb; b++) {
        const G& x = w[b];
        prefetch_ahead(x, 4096);
        const int8_t* q = a[b].qs;
        const __m256 da = _mm256_set1_ps(a[b].d);
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            V dot = R::OFF ? _mm256_set1_epi32(-R::OFF * A.asum[b]) : _mm256_setzero_si256();
            V lo = _mm256_setzero_si256(), hi = _mm256_setzero_si256();  // int16 sums, R::GS maddubs at most
#pragma GCC unroll 4
            for (int k = 0; k < 4; k++) {
                const V z = half(x.qs[k], h);
                const V l = _mm256_maddubs_epi16(value(_mm256_and_si256(z, m4), x, k, h), bcast4(q + 4 * k));
                const V u = _mm256_maddubs_epi16(value(_mm256_and_si256(_mm256_srli_epi16(z, 4), m4), x, 4 + k, h), bcast4(q + 16 + 4 * k));
                if constexpr (R::GS >= 8) {
                    lo = _mm256_add_epi16(lo, _mm256_add_epi16(l, u));
                } else {
                    lo = _mm256_add_epi16(lo, l), hi = _mm256_add_epi16(hi, u);
                }
            }
            dot = _mm256_add_epi32(dot, _mm256_madd_epi16(lo, ones));
            if constexpr (R::GS < 8) dot = _mm256_add_epi32(dot, _mm256_madd_epi16(hi, ones));
            acc[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(group_scales(x, h), da), acc[h]);
            if constexpr (kHasMin<G>) acc[h] = _mm256_fmadd_ps(fp16x8(x.m, h), _mm256_set1_ps(a[b].s), acc[h]);
        }
    }
    store_rows<1>(A, g, 0, {{acc[0], acc[1]}});
}

template <class G, int TT>
struct KTile {
    const G* w;
    const block_q8_K32* a[TT];
    KTile(const MatmulArgs& A, int64_t g, int64_t t0) : w((const G*)(A.w + g * kRepackRows * A.w_stride)) {
        for (int j = 0; j < TT; j++) a[j] = (const block_q8_K32*)((const uint8_t*)A.act + (t0 + j) * A.act_stride);
    }
};
// sum_p vp[p] . (bsum_2p, bsum_2p+1) of a token: the 16-sums of its sub-blocks against the
// half's (scale or min) pairs of sub-blocks 2p, 2p + 1.
template <bool W16, int NP>
inline V pair_sums(const V (&vp)[NP], const int16_t* bsums) {
    V s = _mm256_setzero_si256();
    for (int p = 0; p < NP; p++) s = _mm256_add_epi32(s, _mm256_madd_epi16(vp[p], _mm256_set1_epi32(bsum_pair<W16>(bsums, p))));
    return s;
}

// Q4_K/Q5_K: sub-block 2q + hn's values of half h, u[c] elements 4c..4c+3 of its rows.
template <class G>
inline void q45k_values(const G& x, int q, int hn, int h, V (&u)[8]) {
    const V m4 = _mm256_set1_epi8(0x0f);
    for (int c = 0; c < 8; c++) {
        u[c] = _mm256_and_si256(_mm256_srli_epi16(half(x.qs[q][c], h), 4 * hn), m4);
        if constexpr (std::is_same_v<G, block_q5_Kx16>) u[c] = _mm256_or_si256(u[c], fifth_half(x.qh[16 * q + 8 * hn + c], h));
    }
}

// Q4_K/Q5_K: per sub-block, half and token the values' maddubs sums, one madd by the rows'
// scales (each row's scale twice: sc * (p0 + p1)); the mins leave through vpmaddwd with the
// 32-sums of the activations, as the AVX-512 kernel.
template <bool Q5, int TT>
void r16_q45K_tile(const MatmulArgs& A, int64_t g, int64_t t0) {
    using G = std::conditional_t<Q5, block_q5_Kx16, block_q4_Kx16>;
    const int64_t nsb = A.cols / QK_K;
    const KTile<G, TT> tile(A, g, t0);
    __m256 acc[TT][2] = {};
    for (int64_t b = 0; b < nsb; b++) {
        const G& x = tile.w[b];
        prefetch_ahead(x, 8192);
        __m128i scb[8], mnb[8];
        q45k_scale_bytes(x.scales, scb, mnb);
        V isum[TT][2] = {};
        for (int q = 0; q < 4; q++)
            for (int hn = 0; hn < 2; hn++) {
                const int s = 2 * q + hn;
                for (int h = 0; h < 2; h++) {
                    V u[8];
                    q45k_values(x, q, hn, h, u);
                    const V scv = pairs<false>(scb[s], scb[s], h);
#pragma GCC unroll 8
                    for (int j = 0; j < TT; j++) isum[j][h] = dot_g<8, Q5 ? 4 : 8>(isum[j][h], u, tile.a[j][b].qs + 32 * s, scv);
                }
            }
        for (int h = 0; h < 2; h++) {
            V mnp[4];  // row r: (m of sub-block 2p, of 2p + 1)
            for (int p = 0; p < 4; p++) mnp[p] = pairs<false>(mnb[2 * p], mnb[2 * p + 1], h);
            const __m256 dd = fp16x8(x.d, h), dm = fp16x8(x.dmin, h);
            for (int j = 0; j < TT; j++) {
                const V im = pair_sums<false>(mnp, tile.a[j][b].bsums);
                const __m256 da = _mm256_set1_ps(tile.a[j][b].d[0]);
                acc[j][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[j][h]), _mm256_mul_ps(dd, da), acc[j][h]);
                acc[j][h] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(im), _mm256_mul_ps(dm, da), acc[j][h]);
            }
        }
    }
    store_rows<TT>(A, g, t0, acc);
}

// Group g x one token (decode) of a K format, half by half (one integer sum lives):
// half_product(x, a, h, acc) is acc plus super-block x's product of half h with the token's block a.
template <class G, class Half>
void k_tile1(const MatmulArgs& A, int64_t g, Half&& half_product) {
    const KTile<G, 1> tile(A, g, 0);
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t b = 0; b < A.cols / QK_K; b++) {
        prefetch_ahead(tile.w[b], 8192);
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) acc[h] = half_product(tile.w[b], tile.a[0][b], h, acc[h]);
    }
    store_rows<1>(A, g, 0, {{acc[0], acc[1]}});
}

// Q5_K for one token (Q4_K's tile at TT = 1 runs fewer instructions than this would).
void r16_q5K_tile1(const MatmulArgs& A, int64_t g) {
    k_tile1<block_q5_Kx16>(A, g, [](const block_q5_Kx16& x, const block_q8_K32& a, int h, __m256 acc) {
        __m128i scb[8], mnb[8];
        q45k_scale_bytes(x.scales, scb, mnb);
        V isum = _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int q = 0; q < 4; q++)
#pragma GCC unroll 2
            for (int hn = 0; hn < 2; hn++) {
                const int s = 2 * q + hn;
                V u[8];
                q45k_values(x, q, hn, h, u);
                isum = dot_g<8, 4>(isum, u, a.qs + 32 * s, pairs<false>(scb[s], scb[s], h));
            }
        V mnp[4];
        for (int p = 0; p < 4; p++) mnp[p] = pairs<false>(mnb[2 * p], mnb[2 * p + 1], h);
        const V im = pair_sums<false>(mnp, a.bsums);
        const __m256 da = _mm256_set1_ps(a.d[0]);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(fp16x8(x.d, h), da), acc);
        return _mm256_fnmadd_ps(_mm256_cvtepi32_ps(im), _mm256_mul_ps(fp16x8(x.dmin, h), da), acc);
    });
}

// Q2_K and Q3_K: a half's sub-blocks 8n + 2jj + hh from the same 4 loads of qs (and hmask).
template <bool Q3, int TT>
void r16_q23K_tile(const MatmulArgs& A, int64_t g, int64_t t0) {
    using G = std::conditional_t<Q3, block_q3_Kx16, block_q2_Kx16>;
    const int64_t nsb = A.cols / QK_K;
    const KTile<G, TT> tile(A, g, t0);
    __m256 acc[TT][2] = {};
    const V m3 = _mm256_set1_epi8(3), m4 = _mm256_set1_epi8(4);
    const __m128i m15 = _mm_set1_epi8(15);
    for (int64_t b = 0; b < nsb; b++) {
        const G& x = tile.w[b];
        prefetch_ahead(x, 8192);
        __m128i sc8[16], mn8[16];  // the rows' scales (Q3_K: signed) and Q2_K's mins, byte r
        if constexpr (Q3) {
            q3k_scale_bytes(x.scales, sc8);
            for (int s = 0; s < 16; s++) mn8[s] = sc8[s];
        } else {
            for (int s = 0; s < 16; s++) {
                const __m128i v = _mm_loadu_si128((const __m128i*)x.scales[s]);
                sc8[s] = _mm_and_si128(v, m15), mn8[s] = _mm_and_si128(_mm_srli_epi16(v, 4), m15);
            }
        }
        V isum[TT][2] = {};
        for (int n = 0; n < 2; n++)
            for (int hh = 0; hh < 2; hh++)
                for (int h = 0; h < 2; h++) {
                    V q[4], hm[4];
                    for (int c = 0; c < 4; c++) {
                        q[c] = half(x.qs[n][4 * hh + c], h);
                        if constexpr (Q3) hm[c] = half(x.hmask[4 * hh + c], h);
                    }
                    for (int jj = 0; jj < 4; jj++) {
                        const int s = 8 * n + 2 * jj + hh;
                        V v[4];
                        for (int c = 0; c < 4; c++) {
                            v[c] = _mm256_and_si256(_mm256_srli_epi16(q[c], 2 * jj), m3);
                            if constexpr (Q3) {  // the high bit (4n + jj) to bit 2
                                const int k = 4 * n + jj;
                                const V hb = k >= 2 ? _mm256_srli_epi16(hm[c], k - 2) : _mm256_slli_epi16(hm[c], 2 - k);
                                v[c] = _mm256_or_si256(v[c], _mm256_and_si256(hb, m4));
                            }
                        }
                        const V scv = pairs<Q3>(sc8[s], sc8[s], h);
#pragma GCC unroll 8
                        for (int j = 0; j < TT; j++) isum[j][h] = dot_g<4, 4>(isum[j][h], v, tile.a[j][b].qs + 16 * s, scv);
                    }
                }
        for (int h = 0; h < 2; h++) {
            V mnp[8];  // Q2_K: min pairs; Q3_K: scale pairs (the offset's sums)
            for (int p = 0; p < 8; p++) mnp[p] = pairs<Q3>(mn8[2 * p], mn8[2 * p + 1], h);
            const __m256 dd = fp16x8(x.d, h);
            for (int j = 0; j < TT; j++) {
                const V ps = pair_sums<true>(mnp, tile.a[j][b].bsums);
                const __m256 da = _mm256_set1_ps(tile.a[j][b].d[0]);
                if constexpr (Q3) {
                    const V v = _mm256_sub_epi32(isum[j][h], _mm256_slli_epi32(ps, 2));
                    acc[j][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), _mm256_mul_ps(dd, da), acc[j][h]);
                } else {
                    const __m256 dm = fp16x8(x.dmin, h);
                    acc[j][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[j][h]), _mm256_mul_ps(dd, da), acc[j][h]);
                    acc[j][h] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(ps), _mm256_mul_ps(dm, da), acc[j][h]);
                }
            }
        }
    }
    store_rows<TT>(A, g, t0, acc);
}

// Q6_K: values 0..63 (q + 32), two maddubs a madd; the +32 offset leaves as sum sc_s bsum_s.
// In half n, columns c = 4 c4 .. 4 c4 + 3 of ql hold sub-blocks 8n + c4 (+2, +4, +6 with qh's
// other bits); q picks which. v[i]: elements 4i..4i+3 of sub-block 8n + 2q + c4, rows of half h.
inline void q6k_values(const block_q6_Kx16& x, int n, int c4, int h, int q, V (&v)[4]) {
    const V m4 = _mm256_set1_epi8(0x0f), m30 = _mm256_set1_epi8(0x30);
    for (int i = 0; i < 4; i++) {
        const int c = 4 * c4 + i;
        const V l = half(x.ql[n][c + 8 * (q & 1)], h), hb = half(x.qh[n][c], h);
        const V lo = q < 2 ? _mm256_and_si256(l, m4) : _mm256_and_si256(_mm256_srli_epi16(l, 4), m4);
        const V hi = q == 0 ? _mm256_slli_epi16(hb, 4) : q == 1 ? _mm256_slli_epi16(hb, 2) : q == 2 ? hb : _mm256_srli_epi16(hb, 2);
        v[i] = _mm256_or_si256(lo, _mm256_and_si256(hi, m30));
    }
}
// Sub-block s's scale of each row of half h, twice (vpmaddwd of the pair sums).
inline V q6k_scales(const block_q6_Kx16& x, int s, int h) {
    const __m128i sc = _mm_loadu_si128((const __m128i*)x.scales[s]);
    return pairs<true>(sc, sc, h);
}
// Row r of half h: (scale of sub-block 2p, of 2p + 1), for the +32 offset.
inline void q6k_scale_pairs(const block_q6_Kx16& x, int h, V (&scp)[8]) {
    for (int p = 0; p < 8; p++)
        scp[p] = pairs<true>(_mm_loadu_si128((const __m128i*)x.scales[2 * p]), _mm_loadu_si128((const __m128i*)x.scales[2 * p + 1]), h);
}
template <int TT>
void r16_q6K_tile(const MatmulArgs& A, int64_t g, int64_t t0) {
    using G = block_q6_Kx16;
    const int64_t nsb = A.cols / QK_K;
    const KTile<G, TT> tile(A, g, t0);
    __m256 acc[TT][2] = {};
    for (int64_t b = 0; b < nsb; b++) {
        const G& x = tile.w[b];
        prefetch_ahead(x, 8192);
        V isum[TT][2] = {};
        for (int n = 0; n < 2; n++)
            for (int c4 = 0; c4 < 2; c4++)
                for (int h = 0; h < 2; h++)
                    for (int q = 0; q < 4; q++) {
                        V v[4];
                        q6k_values(x, n, c4, h, q, v);
                        const int s = 8 * n + 2 * q + c4;
                        const V scv = q6k_scales(x, s, h);
#pragma GCC unroll 8
                        for (int j = 0; j < TT; j++) isum[j][h] = dot_g<4, 2>(isum[j][h], v, tile.a[j][b].qs + 16 * s, scv);
                    }
        for (int h = 0; h < 2; h++) {
            V scp[8];
            q6k_scale_pairs(x, h, scp);
            const __m256 dd = fp16x8(x.d, h);
            for (int j = 0; j < TT; j++) {
                const V v = _mm256_sub_epi32(isum[j][h], _mm256_slli_epi32(pair_sums<true>(scp, tile.a[j][b].bsums), 5));
                acc[j][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), _mm256_mul_ps(dd, _mm256_set1_ps(tile.a[j][b].d[0])), acc[j][h]);
            }
        }
    }
    store_rows<TT>(A, g, t0, acc);
}

// Q6_K for one token (decode): half by half, so one integer sum lives and the unrolled sub-blocks
// keep their shifts as constants (the tile above, at TT = 1, branched on q and spilled its sums:
// 1.84x the instructions, 896x4864, callgrind). Same integers and float operations, same bits.
void r16_q6K_tile1(const MatmulArgs& A, int64_t g) {
    k_tile1<block_q6_Kx16>(A, g, [](const block_q6_Kx16& x, const block_q8_K32& a, int h, __m256 acc) {
        V isum = _mm256_setzero_si256();
#pragma GCC unroll 2
        for (int n = 0; n < 2; n++)
#pragma GCC unroll 2
            for (int c4 = 0; c4 < 2; c4++)
#pragma GCC unroll 4
                for (int q = 0; q < 4; q++) {
                    V v[4];
                    q6k_values(x, n, c4, h, q, v);
                    const int s = 8 * n + 2 * q + c4;
                    isum = dot_g<4, 2>(isum, v, a.qs + 16 * s, q6k_scales(x, s, h));
                }
        V scp[8];
        q6k_scale_pairs(x, h, scp);
        const V v = _mm256_sub_epi32(isum, _mm256_slli_epi32(pair_sums<true>(scp, a.bsums), 5));
        return _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), _mm256_mul_ps(fp16x8(x.d, h), _mm256_set1_ps(a.d[0])), acc);
    });
}

// IQ4_XS: per sub-block and half the IQ4 levels with the sign trick (RIq4), each maddubs's pairs
// taken by madd with the rows' scales ls - 32 (twice a row).
template <int TT>
void r16_iq4xs_tile(const MatmulArgs& A, int64_t g, int64_t t0) {
    using G = block_iq4_xsx16;
    const int64_t nsb = A.cols / QK_K;
    const KTile<G, TT> tile(A, g, t0);
    __m256 acc[TT][2] = {};
    for (int64_t b = 0; b < nsb; b++) {
        const G& x = tile.w[b];
        prefetch_ahead(x, 8192);
        __m128i sc8[8];
        iq4xs_scale_bytes(x, sc8);
        V isum[TT][2] = {};
        for (int ib = 0; ib < 8; ib++)
            for (int h = 0; h < 2; h++) {
                V u[8], s[8];
                RIq4::unpack_qs(x.qs[ib], h, u, s);
                const V scv = pairs<true>(sc8[ib], sc8[ib], h);
#pragma GCC unroll 8
                for (int j = 0; j < TT; j++) {
                    const int8_t* q = tile.a[j][b].qs + 32 * ib;
                    for (int k = 0; k < 8; k++)
                        isum[j][h] = _mm256_add_epi32(
                            isum[j][h], _mm256_madd_epi16(_mm256_maddubs_epi16(u[k], _mm256_sign_epi8(bcast4(q + 4 * k), s[k])), scv));
                }
            }
        for (int h = 0; h < 2; h++) {
            const __m256 dd = fp16x8(x.d, h);
            for (int j = 0; j < TT; j++)
                acc[j][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[j][h]), _mm256_mul_ps(dd, _mm256_set1_ps(tile.a[j][b].d[0])), acc[j][h]);
        }
    }
    store_rows<TT>(A, g, t0, acc);
}

// Tokens a tile (8 ahead of 2 and 4 from 16 tokens, equal at 1 and 4: bench-matmul --isa avx2 --layouts r16).
constexpr int kTileTokens = 8;

}  // namespace

void matmul_r16_avx2(const MatmulArgs& A, int64_t g0, int64_t g1) {
    constexpr int T = kTileTokens;
    auto one_token = [&](void (*tile)(const MatmulArgs&, int64_t)) {  // decode: the single-token kernels
        for (int64_t g = g0; g < g1; g++) tile(A, g);
    };
    auto q32 = [&](auto r) {
        using R = decltype(r);
        if constexpr (!R::SIGNED)
            if (A.n_tok == 1) return one_token(r16_tile1<R>);
        groups<T>(A, g0, g1, [&](auto n, int64_t g, int64_t t) { r16_tile<R, n()>(A, g, t); });
    };
    switch (A.type) {
        case QType::Q2_K: return groups<T>(A, g0, g1, [&](auto n, int64_t g, int64_t t) { r16_q23K_tile<false, n()>(A, g, t); });
        case QType::Q3_K: return groups<T>(A, g0, g1, [&](auto n, int64_t g, int64_t t) { r16_q23K_tile<true, n()>(A, g, t); });
        case QType::Q4_K:  // its tile at TT = 1 runs fewer instructions than a single-token one
            return groups<T>(A, g0, g1, [&](auto n, int64_t g, int64_t t) { r16_q45K_tile<false, n()>(A, g, t); });
        case QType::Q5_K:
            if (A.n_tok == 1) return one_token(r16_q5K_tile1);
            return groups<T>(A, g0, g1, [&](auto n, int64_t g, int64_t t) { r16_q45K_tile<true, n()>(A, g, t); });
        case QType::Q6_K:
            if (A.n_tok == 1) return one_token(r16_q6K_tile1);
            return groups<T>(A, g0, g1, [&](auto n, int64_t g, int64_t t) { r16_q6K_tile<n()>(A, g, t); });
        case QType::IQ4_XS: return groups<T>(A, g0, g1, [&](auto n, int64_t g, int64_t t) { r16_iq4xs_tile<n()>(A, g, t); });
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
