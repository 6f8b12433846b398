// Fused kernels for the weight types of the common models: weight blocks are decoded in
// registers and dotted straight away (no panel), RT rows x TT tokens at a time so each decoded
// block serves TT tokens and each activation block RT rows; the weights stream from memory
// once per TT tokens. Included by matmul_avx2.cpp and matmul_avx512.cpp: with AVX-512 VNNI the
// byte products use vpdpbusd (and two 32-blocks per ZMM), with AVX2 maddubs/madd.
// Anonymous namespace: each file compiles its own copy.
#pragma once
#include <immintrin.h>

#include <cmath>
#include <cstddef>
#include <cstring>
#include <type_traits>

#include "cpu/matmul_impl.h"
#include "cpu/matmul_unpack_simd.h"

namespace stowlm::cpu {
namespace {

#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__AVX512BW__)
#define STOWLM_FUSED_VNNI 1
#else
#define STOWLM_FUSED_VNNI 0
#endif

// acc + sum of 4 products u * a per int32 lane (u unsigned bytes, a signed). Without VNNI,
// maddubs pairs must stay below the int16 limit: callers keep u <= 128 there.
inline __m256i dot_u8(__m256i acc, __m256i u, __m256i a) {
#if STOWLM_FUSED_VNNI
    return _mm256_dpbusd_epi32(acc, u, a);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, a), _mm256_set1_epi16(1)));
#endif
}

inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#if STOWLM_FUSED_VNNI
inline float hsum512(__m512 v) {
    return hsum256(_mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1)));
}
#endif
inline int hsum256i(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

// Rows are short streams (a few KB each, RT of them at a time), too short for the hardware
// prefetcher to ramp up: each step prefetches the same bytes of the next tile's rows (RT rows
// further on, i.e. one tile's time ahead). Prefetches never fault past the matrix's end.
template <int BYTES>
inline void prefetch_next(const void* p, size_t dist) {
    for (int off = 0; off < BYTES; off += 64) _mm_prefetch((const char*)p + dist + off, _MM_HINT_T0);
}

// The prologue and epilogue every tile kernel shares. TileRows: RT weight rows of blocks B from
// r0 (w[i][b] is block b of row i) and the prefetch distance (prefetch_next). TileActs: TT rows
// of a quantized activation buffer from t0 (A.act / act_stride, or the regrouped A.act_nib /
// nib_stride). zero_acc clears accumulators; store_tile writes y[t0 + j][r0 + i] = value(i, j).
template <class B, int RT>
struct TileRows {
    const B* w[RT];
    size_t pf;
    TileRows(const MatmulArgs& A, int64_t r0) : pf(RT * A.w_stride) {
#pragma GCC unroll 4
        for (int i = 0; i < RT; i++) w[i] = (const B*)(A.w + (r0 + i) * A.w_stride);
    }
    const B* operator[](int i) const { return w[i]; }
};
template <class Act, int TT>
struct TileActs {
    const Act* a[TT];
    TileActs(const void* base, size_t stride, int64_t t0) {
#pragma GCC unroll 4
        for (int j = 0; j < TT; j++) a[j] = (const Act*)((const uint8_t*)base + (t0 + j) * stride);
    }
    const Act* operator[](int j) const { return a[j]; }
};
template <class V, int RT, int TT>
inline void zero_acc(V (&acc)[RT][TT], V zero) {
#pragma GCC unroll 4
    for (int i = 0; i < RT; i++)
#pragma GCC unroll 4
        for (int j = 0; j < TT; j++) acc[i][j] = zero;
}
template <int RT, int TT, class F>
inline void store_tile(const MatmulArgs& A, int64_t r0, int64_t t0, F&& value) {
#pragma GCC unroll 4
    for (int j = 0; j < TT; j++)
#pragma GCC unroll 4
        for (int i = 0; i < RT; i++) A.y[(t0 + j) * A.ldy + r0 + i] = value(i, j);
}

// 32-element formats as unsigned bytes u = q + OFF (so vpdpbusd applies), w = d * q + m.
struct LQ4_0 {
    using B = block_q4_0;
    static constexpr int OFF = 8;
    static constexpr bool HAS_M = false;
    static __m256i u(const B& b) { return nibbles32(b.qs); }
    static float m(const B&) { return 0; }
};
struct LQ4_1 {
    using B = block_q4_1;
    static constexpr int OFF = 0;
    static constexpr bool HAS_M = true;
    static __m256i u(const B& b) { return nibbles32(b.qs); }
    static float m(const B& b) { return h2f(b.m); }
};
struct LQ5_0 {
    using B = block_q5_0;
    static constexpr int OFF = 16;
    static constexpr bool HAS_M = false;
    static __m256i u(const B& b) { return _mm256_or_si256(nibbles32(b.qs), bits32(b.qh)); }
    static float m(const B&) { return 0; }
};
struct LQ5_1 {
    using B = block_q5_1;
    static constexpr int OFF = 0;
    static constexpr bool HAS_M = true;
    static __m256i u(const B& b) { return _mm256_or_si256(nibbles32(b.qs), bits32(b.qh)); }
    static float m(const B& b) { return h2f(b.m); }
};
struct LQ8_0 {
    using B = block_q8_0;
    static constexpr int OFF = 128;
    static constexpr bool HAS_M = false;
    static __m256i u(const B& b) {
        return _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)b.qs), _mm256_set1_epi8((char)0x80));
    }
    static float m(const B&) { return 0; }
};
struct LIQ4_NL {
    using B = block_iq4_nl;
    static constexpr int OFF = 128;
    static constexpr bool HAS_M = false;
    static __m256i u(const B& b) {
        return _mm256_xor_si256(iq4_lookup(nibbles32(b.qs)), _mm256_set1_epi8((char)0x80));
    }
    static float m(const B&) { return 0; }
};
struct LMXFP4 {
    using B = block_mxfp4;
    static constexpr int OFF = 128;
    static constexpr bool HAS_M = false;
    static __m256i u(const B& b) {
        return _mm256_xor_si256(mxfp4_lookup(nibbles32(b.qs)), _mm256_set1_epi8((char)0x80));
    }
    static float m(const B&) { return 0; }
};

// A 32-element block's scale: fp16 d, or MXFP4's E8M0 exponent (no fp16 field at all).
template <class B>
inline float block_d(const B& b) { return h2f(b.d); }
inline float block_d(const block_mxfp4& b) { return e8m0_to_f32_half(b.e); }
template <class B>
constexpr bool kE8M0 = std::is_same_v<B, block_mxfp4>;
// Whether a block starts with its fp16 scale (MXFP4's exponent byte is read on its own).
template <class B>
constexpr bool fp16_scale_first() {
    if constexpr (kE8M0<B>) return true;
    else return offsetof(B, d) == 0;
}
// e8m0_to_f32_half of eight exponents (int32 lanes).
inline __m256 e8m0_half_ps(__m256i e) {
    const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    const __m256i subnormal = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);  // e = 0, 1
    return _mm256_castsi256_ps(_mm256_blendv_epi8(normal, subnormal, _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e)));
}

// y[t][r] for RT rows from r0 and TT tokens from t0.
template <class L, int RT, int TT>
void fused_q32(const MatmulArgs& A, int64_t r0, int64_t t0) {
    using B = typename L::B;
    const int64_t nb = A.cols / QK;
    const TileRows<B, RT> w(A, r0);
    const TileActs<block_q8_a, TT> a(A.act, A.act_stride, t0);
    __m256 acc[RT][TT];
    float macc[RT][TT];
    zero_acc(acc, _mm256_setzero_ps());
    zero_acc(macc, 0.0f);
    const __m256i offv = _mm256_set1_epi8((char)L::OFF);
    for (int64_t b = 0; b < nb; b++) {
        __m256i av[TT], neg[TT];
        // Without VNNI, bytes up to 255 would saturate maddubs: the OFF = 128 formats go back
        // to signed values and the sign trick (|w| x sign(a, w)) with no offset to remove.
        constexpr bool SIGNED = !STOWLM_FUSED_VNNI && L::OFF == 128;
        for (int j = 0; j < TT; j++) {
            av[j] = _mm256_loadu_si256((const __m256i*)a[j][b].qs);
            // start each dot at -OFF * sum(a), spread over the lanes: exact integer offset removal
            neg[j] = (L::OFF && !SIGNED) ? _mm256_sub_epi32(_mm256_setzero_si256(), dot_u8(_mm256_setzero_si256(), offv, av[j]))
                                         : _mm256_setzero_si256();
        }
        for (int i = 0; i < RT; i++) {
            const B& blk = w[i][b];
            prefetch_next<(int)sizeof(B)>(&blk, w.pf);
            const __m256i wu = L::u(blk);
            const __m256 dw = _mm256_set1_ps(block_d(blk));
            float mw = 0;
            if (L::HAS_M) mw = L::m(blk);
            for (int j = 0; j < TT; j++) {
                __m256i dot;
                if constexpr (SIGNED) {
                    const __m256i q = _mm256_xor_si256(wu, _mm256_set1_epi8((char)0x80));
                    dot = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(av[j], q)),
                                            _mm256_set1_epi16(1));
                } else {
                    dot = dot_u8(neg[j], wu, av[j]);
                }
                const __m256 p = _mm256_mul_ps(_mm256_cvtepi32_ps(dot), dw);
                acc[i][j] = _mm256_fmadd_ps(p, _mm256_set1_ps(a[j][b].d), acc[i][j]);
                // an explicit FMA: contraction would otherwise differ between TT instances, and a
                // token's result with it between batch sizes
                if (L::HAS_M) macc[i][j] = std::fma(mw, a[j][b].s, macc[i][j]);
            }
        }
    }
    store_tile<RT, TT>(A, r0, t0, [&](int i, int j) { return hsum256(acc[i][j]) + macc[i][j]; });
}

#if STOWLM_FUSED_VNNI
// Two blocks per ZMM in element order: bytes [b, b+1] (32 each), so the activations load as
// they are and int32 lanes 0-7 belong to block b, 8-15 to b+1 (`pair_sel` below): one multiply
// applies both blocks' scales. The 4/5-bit formats get there with one qword permute that
// doubles each block's 16 packed bytes and one masked shift for the high nibbles.
struct Z4_0 {
    using B = block_q4_0;
    static constexpr int OFF = 8;
    static constexpr bool HAS_M = false;
    static __m512i u2(const B& x, const B& y) { return nib64(x.qs, y.qs); }
    static __m512i nib64(const uint8_t* p, const uint8_t* q) {
        const __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)p)),
                                                  _mm_loadu_si128((const __m128i*)q), 1);
        // [p, p, q, q] by 128-bit lanes, lanes 1 and 3 shifted down a nibble, one mask for all
        const __m512i z = _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 1, 0, 1, 2, 3, 2, 3), _mm512_castsi256_si512(v));
        return _mm512_and_si512(_mm512_mask_srli_epi16(z, (__mmask32)0xff00ff00u, z, 4), _mm512_set1_epi8(0x0f));
    }
};
struct Z4_1 : Z4_0 {
    using B = block_q4_1;
    static constexpr int OFF = 0;
    static constexpr bool HAS_M = true;
    static __m512i u2(const B& x, const B& y) { return nib64(x.qs, y.qs); }
};
// The fifth bits of two blocks (qh bit j is element j) are, in element order, the byte mask
// h0 | h1 << 32: one masked add of 16 sets them, all in scalar registers but the add.
inline __m512i add_fifth_bits(__m512i nib, const uint8_t* qh0, const uint8_t* qh1) {
    uint32_t h0, h1;
    memcpy(&h0, qh0, 4);
    memcpy(&h1, qh1, 4);
    const __mmask64 k = _cvtu64_mask64((uint64_t)h0 | ((uint64_t)h1 << 32));
    return _mm512_mask_add_epi8(nib, k, nib, _mm512_set1_epi8(0x10));
}
struct Z5_0 : Z4_0 {
    using B = block_q5_0;
    static constexpr int OFF = 16;
    static __m512i u2(const B& x, const B& y) { return add_fifth_bits(nib64(x.qs, y.qs), x.qh, y.qh); }
};
struct Z5_1 : Z4_0 {
    using B = block_q5_1;
    static constexpr int OFF = 0;
    static constexpr bool HAS_M = true;
    static __m512i u2(const B& x, const B& y) { return add_fifth_bits(nib64(x.qs, y.qs), x.qh, y.qh); }
};
struct ZIQ4_NL : Z4_0 {
    using B = block_iq4_nl;
    static constexpr int OFF = 128;
    static __m512i u2(const B& x, const B& y) {
        const __m512i tab = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)kIQ4NLValues));
        return _mm512_xor_si512(_mm512_shuffle_epi8(tab, nib64(x.qs, y.qs)), _mm512_set1_epi8((char)0x80));
    }
};
struct ZMXFP4 : Z4_0 {
    using B = block_mxfp4;
    static constexpr int OFF = 128;
    static __m512i u2(const B& x, const B& y) {
        const __m512i tab = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)kMXFP4Values));
        return _mm512_xor_si512(_mm512_shuffle_epi8(tab, nib64(x.qs, y.qs)), _mm512_set1_epi8((char)0x80));
    }
};
struct Z8_0 {
    using B = block_q8_0;
    static constexpr int OFF = 128;
    static constexpr bool HAS_M = false;
    static __m512i u2(const B& x, const B& y) {
        const __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)x.qs)),
                                             _mm256_loadu_si256((const __m256i*)y.qs), 1);
        return _mm512_xor_si512(z, _mm512_set1_epi8((char)0x80));
    }
};

// Lane pattern of the two blocks' scales (lanes of block b read element 0, of b+1 element 1).
inline __m512 pair_sel(float s0, float s1) {
    const __m512 v = _mm512_castps128_ps512(_mm_unpacklo_ps(_mm_set_ss(s0), _mm_set_ss(s1)));
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1), v);
}

// One row x TT tokens, two blocks per ZMM (the rows after the last whole 4-row tile): the float
// operations per output of fused_q32_x2_r4, the min terms included, so the same bits.
template <class L, int TT>
void fused_q32_x2_r1(const MatmulArgs& A, int64_t r0, int64_t t0) {
    using B = typename L::B;
    const int64_t nb = A.cols / QK;
    const B* w = (const B*)(A.w + r0 * A.w_stride);
    const TileActs<block_q8_a, TT> a(A.act, A.act_stride, t0);
    __m512 acc[TT];
    float macc[TT][2];  // the min terms of blocks b and b+1 apart, as fused_q32_x2_r4 sums them
    for (int j = 0; j < TT; j++) acc[j] = _mm512_setzero_ps(), macc[j][0] = macc[j][1] = 0;
    const __m512i offv = _mm512_set1_epi8((char)L::OFF);
    for (int64_t b = 0; b < nb; b += 2) {
        const B& x0 = w[b];
        const B& x1 = w[b + 1];
        const __m512i wu = L::u2(x0, x1);
        const __m512 dwv = pair_sel(block_d(x0), block_d(x1));
        float m0 = 0, m1 = 0;
        if constexpr (L::HAS_M) m0 = h2f(x0.m), m1 = h2f(x1.m);
        for (int j = 0; j < TT; j++) {
            const __m512i av = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)a[j][b].qs)),
                                                  _mm256_loadu_si256((const __m256i*)a[j][b + 1].qs), 1);
            const __m512i neg = L::OFF ? _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_dpbusd_epi32(_mm512_setzero_si512(), offv, av))
                                       : _mm512_setzero_si512();
            const __m512i dot = _mm512_dpbusd_epi32(neg, wu, av);
            acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dwv, pair_sel(a[j][b].d, a[j][b + 1].d)), acc[j]);
            if constexpr (L::HAS_M)
                macc[j][0] = std::fma(m0, a[j][b].s, macc[j][0]), macc[j][1] = std::fma(m1, a[j][b + 1].s, macc[j][1]);
        }
    }
    for (int j = 0; j < TT; j++) A.y[(t0 + j) * A.ldy + r0] = hsum512(acc[j]) + (macc[j][0] + macc[j][1]);
}

// One token, rows [r0, r1) one after another, so the weights are read as one forward stream
// (four rows at a time are four streams, which the hardware prefetcher follows badly: measured
// on Zen 4, 9 GB/s a core where one stream reads 15+). The activations come regrouped
// (PairGroup, made once per call and shared by every row). The float operations per output are
// fused_q32_x2_r4's: the same bits.
template <class L>
void fused_q32_x2_s1(const MatmulArgs& A, int64_t r0, int64_t r1) {
    using B = typename L::B;
    const int64_t nb = A.cols / QK;
    const PairGroup* g = (const PairGroup*)A.act_nib;
    for (int64_t r = r0; r < r1; r++) {
        const B* w = (const B*)(A.w + r * A.w_stride);
        __m512 acc = _mm512_setzero_ps();
        float m0 = 0, m1 = 0;
        for (int64_t b = 0; b < nb; b += 2) {
            prefetch_next<2 * (int)sizeof(B)>(&w[b], 1024);  // 1-4 KB ahead measured alike
            const PairGroup& G = g[b / 2];
            const __m512i dot = _mm512_dpbusd_epi32(_mm512_load_si512(G.neg), L::u2(w[b], w[b + 1]), _mm512_load_si512(G.qs));
            const __m512 sc = _mm512_mul_ps(pair_sel(block_d(w[b]), block_d(w[b + 1])), _mm512_load_ps(G.d));
            acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), sc, acc);
            if constexpr (L::HAS_M) m0 = std::fma(h2f(w[b].m), G.s[0], m0), m1 = std::fma(h2f(w[b + 1].m), G.s[4], m1);
        }
        float y = hsum512(acc);
        if constexpr (L::HAS_M) y += m0 + m1;
        A.y[r] = y;
    }
}

// Element i of each 128-bit lane, broadcast within the lane (i is a constant once unrolled):
// an in-lane shuffle, which on Zen 4 runs beside the multiplies (a cross-lane permute does not).
inline __m512 lane_bcast(__m512 v, int i) {
    switch (i) {
        case 0: return _mm512_permute_ps(v, 0x00);
        case 1: return _mm512_permute_ps(v, 0x55);
        case 2: return _mm512_permute_ps(v, 0xaa);
        default: return _mm512_permute_ps(v, 0xff);
    }
}

// The fp16 field at byte offset OFF of blocks b and b+1 of 4 rows as
// [row0 b, row1 b, row2 b, row3 b, row0 b+1, ..., row3 b+1] (8 halves).
template <int OFF, class B>
inline __m128i rows_halves4(const B* const* w, int64_t b) {
    __m128i p[4];
    for (int i = 0; i < 4; i++) {
        const __m128i lo = _mm_loadu_si32((const uint8_t*)&w[i][b] + OFF);
        const __m128i hi = _mm_loadu_si32((const uint8_t*)&w[i][b + 1] + OFF - 2);
        p[i] = _mm_blend_epi16(lo, hi, 0x2);
    }
    const __m128i v = _mm_unpacklo_epi64(_mm_unpacklo_epi32(p[0], p[1]), _mm_unpacklo_epi32(p[2], p[3]));
    return _mm_shuffle_epi8(v, _mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15));
}

// The formats whose row kernels read PairGroups when the caller made them (nib_act_kind 2-4;
// Q4_0 and Q4_1 read NibGroups in their own kernels).
template <class Z>
constexpr bool kPairActs = !std::is_same_v<typename Z::B, block_q4_0> && !std::is_same_v<typename Z::B, block_q4_1>;

// 4 rows x TT tokens of the 32-element formats, two blocks per ZMM as fused_q32_x2 (lanes 0-7
// block b, 8-15 block b+1), the 4 rows' scales packed: D holds d of row i, block b in lanes
// i and 4 + i, of block b+1 in lanes 8 + i and 12 + i, so one multiply by a token's
// [d_a b x 8, d_a b+1 x 8] gives the lane scales of all 4 rows and row i's pattern is an
// in-lane broadcast; the min terms of all 4 rows are one FMA per token (lanes i and 4 + i).
// The same float operations per output as fused_q32_x2 and fused_q32_x2_t1 with 4 rows, so
// the results are theirs bit for bit, for any TT.
template <class L, int TT, bool PRE>
void fused_q32_x2_r4(const MatmulArgs& A, int64_t r0, int64_t t0) {
    using B = typename L::B;
    static_assert(fp16_scale_first<B>(), "the rows' d read at byte 0 of their blocks");
    const int64_t nb = A.cols / QK;
    const TileRows<B, 4> w(A, r0);
    const TileActs<block_q8_a, TT> a(A.act, A.act_stride, t0);
    const TileActs<PairGroup, TT> g(A.act_nib, A.nib_stride, t0);
    __m512 acc[4][TT];
    __m256 macc[TT];
    zero_acc(acc, _mm512_setzero_ps());
#pragma GCC unroll 4
    for (int j = 0; j < TT; j++) macc[j] = _mm256_setzero_ps();
    const __m512i offv = _mm512_set1_epi8((char)L::OFF);
    for (int64_t b = 0; b < nb; b += 2) {
        __m256 d8;  // [rows b | rows b+1]
        if constexpr (kE8M0<B>)
            d8 = e8m0_half_ps(_mm256_setr_epi32(w[0][b].e, w[1][b].e, w[2][b].e, w[3][b].e, w[0][b + 1].e, w[1][b + 1].e,
                                                w[2][b + 1].e, w[3][b + 1].e));
        else d8 = _mm256_cvtph_ps(rows_halves4<0>(w.w, b));
        const __m512 D = _mm512_shuffle_f32x4(_mm512_castps256_ps512(d8), _mm512_castps256_ps512(d8), 0x50);
        __m256 M = _mm256_setzero_ps();
        if constexpr (L::HAS_M) M = _mm256_cvtph_ps(rows_halves4<offsetof(B, m)>(w.w, b));
        __m512i wu[4];
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) {
            prefetch_next<2 * (int)sizeof(B)>(&w[i][b], w.pf);
            wu[i] = L::u2(w[i][b], w[i][b + 1]);
        }
#pragma GCC unroll 4
        for (int j = 0; j < TT; j++) {
            // the activations, their offset term and scales: from the regrouped PairGroup, or
            // made here from the blocks (the same values)
            __m512i av, neg;
            __m512 da;
            __m256 sa;
            if constexpr (PRE) {
                const PairGroup& G = g[j][b / 2];
                av = _mm512_load_si512(G.qs), neg = _mm512_load_si512(G.neg), da = _mm512_load_ps(G.d);
                sa = _mm256_load_ps(G.s);
            } else {
                av = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)a[j][b].qs)),
                                        _mm256_loadu_si256((const __m256i*)a[j][b + 1].qs), 1);
                neg = L::OFF ? _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_dpbusd_epi32(_mm512_setzero_si512(), offv, av))
                             : _mm512_setzero_si512();
                da = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_set1_ps(a[j][b].d)), _mm256_set1_ps(a[j][b + 1].d), 1);
                sa = _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_set1_ps(a[j][b].s)), _mm_set1_ps(a[j][b + 1].s), 1);
            }
            const __m512 sc = _mm512_mul_ps(D, da);
            // the min terms: an FMA per block (explicit: contraction could differ between tiles)
            if constexpr (L::HAS_M) macc[j] = _mm256_fmadd_ps(M, sa, macc[j]);
#pragma GCC unroll 4
            for (int i = 0; i < 4; i++) {
                const __m512i dot = _mm512_dpbusd_epi32(neg, wu[i], av);
                acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), lane_bcast(sc, i), acc[i][j]);
            }
        }
    }
#pragma GCC unroll 4
    for (int j = 0; j < TT; j++) {
        alignas(32) float m[8];
        _mm256_store_ps(m, macc[j]);
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) {
            float y = hsum512(acc[i][j]);
            if constexpr (L::HAS_M) y += m[i] + m[4 + i];  // fused_q32_x2: hsum + (block b + block b+1)
            A.y[(t0 + j) * A.ldy + r0 + i] = y;
        }
    }
}

// Q4_0 / Q4_1 rows, four blocks per ZMM (the row kernels of AVX-512 when the caller regrouped
// the activations, MatmulArgs::act_nib), up to 4 rows x TT tokens a tile. The 64 quant bytes
// of four blocks come out of two loads with one word permute; their low and high nibbles meet
// the NibGroup's lo and hi bytes in two vpdpbusd, int32 lanes 4b-4b+3 belonging to block b.
// The scales of the tile's rows are packed, block b of row i in lane 4b + i, so that one
// multiply by a token's activation scales gives the products d d_a of all its rows (an
// in-lane broadcast makes row i's lane pattern) and one FMA adds the min terms m s_a of all its
// rows (summed apart, per block, and added at the end). Each output is the same sequence of
// float operations whatever the tile shape (RT rows x TT tokens), so a token's result does not
// depend on its batch; the decode of the weights is done once per tile for its TT tokens.
template <class B>
struct Nib4 {
    static constexpr bool HAS_M = std::is_same_v<B, block_q4_1>;
    // source word of output word 8i + j: the qs of block i
    static __m512i qs_idx() {
        alignas(64) int16_t v[32];
        for (int i = 0; i < 4; i++)
            for (int j = 0; j < 8; j++) v[8 * i + j] = (int16_t)((sizeof(B) / 2) * i + offsetof(B, qs) / 2 + j);
        return _mm512_load_si512(v);
    }
    // words 0-3: d of blocks 0-3; words 4-7: m of blocks 0-3 (Q4_0: d again)
    static __m512i dm_idx() {
        alignas(64) int16_t v[32] = {};
        for (int i = 0; i < 4; i++) {
            v[i] = (int16_t)((sizeof(B) / 2) * i);
            v[4 + i] = (int16_t)((sizeof(B) / 2) * i + (HAS_M ? 1 : 0));
        }
        return _mm512_load_si512(v);
    }
};

template <class B, int RT, int TT>
void fused_q4_nib(const MatmulArgs& A, int64_t r0, int64_t t0) {
    static_assert(RT >= 1 && RT <= 4, "rows packed four to a ZMM");
    using N = Nib4<B>;
    const int64_t nb = A.cols / QK, ng = (nb + 3) / 4;
    const TileRows<uint8_t, RT> w(A, r0);
    const TileActs<NibGroup, TT> g(A.act_nib, A.nib_stride, t0);
    __m512 acc[RT][TT], macc[TT];
    zero_acc(acc, _mm512_setzero_ps());
    #pragma GCC unroll 4
    for (int j = 0; j < TT; j++) macc[j] = _mm512_setzero_ps();
    const __m512i qidx = N::qs_idx(), didx = N::dm_idx(), m4 = _mm512_set1_epi8(0x0f);
    // one group of four blocks; the last may be partial (FULL false: masked loads)
    auto group = [&](int64_t gi, auto full) __attribute__((always_inline)) {
        constexpr bool FULL = decltype(full)::value;
        const int64_t bytes = std::min<int64_t>(4, nb - 4 * gi) * (int64_t)sizeof(B);
        const __mmask64 k0 = bytes >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << bytes) - 1);
        const __mmask64 k1 = bytes > 64 ? (((__mmask64)1 << (bytes - 64)) - 1) : 0;
        __m512i lo[RT], hi[RT];
        __m128i dm[4];  // per row the fp16 [d0..d3, m0..m3]
        #pragma GCC unroll 4
        for (int i = 0; i < RT; i++) {
            const uint8_t* p = w[i] + 4 * gi * sizeof(B);
            prefetch_next<4 * (int)sizeof(B)>(p, w.pf);
            // a full group spans 72 or 80 bytes; in the last, bytes past the row load as zeros
            __m512i a, b;
            if constexpr (FULL) {
                a = _mm512_loadu_si512(p);
                b = N::HAS_M ? _mm512_castsi128_si512(_mm_loadu_si128((const __m128i*)(p + 64)))
                             : _mm512_castsi128_si512(_mm_loadl_epi64((const __m128i*)(p + 64)));
            } else {
                a = _mm512_maskz_loadu_epi8(k0, p), b = _mm512_maskz_loadu_epi8(k1, p + 64);
            }
            const __m512i z = _mm512_permutex2var_epi16(a, qidx, b);
            lo[i] = _mm512_and_si512(z, m4), hi[i] = _mm512_and_si512(_mm512_srli_epi16(z, 4), m4);
            dm[i] = _mm512_castsi512_si128(_mm512_permutexvar_epi16(didx, a));
        }
        #pragma GCC unroll 4
        for (int i = RT; i < 4; i++) dm[i] = _mm_setzero_si128();
        // the tile's rows packed (a 4 x 4 transpose of words): D = d of block b of row i in
        // lane 4b + i, M the same for m
        const __m128i x01 = _mm_unpacklo_epi16(dm[0], dm[1]), x23 = _mm_unpacklo_epi16(dm[2], dm[3]);
        const __m512 D = _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_unpacklo_epi32(x01, x23)),
                                                                 _mm_unpackhi_epi32(x01, x23), 1));
        __m512 M = _mm512_setzero_ps();
        if constexpr (N::HAS_M) {
            const __m128i y01 = _mm_unpackhi_epi16(dm[0], dm[1]), y23 = _mm_unpackhi_epi16(dm[2], dm[3]);
            M = _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_unpacklo_epi32(y01, y23)),
                                                        _mm_unpackhi_epi32(y01, y23), 1));
        }
        #pragma GCC unroll 4
        for (int j = 0; j < TT; j++) {
            const NibGroup& G = g[j][gi];
            const __m512i glo = _mm512_load_si512(G.lo), ghi = _mm512_load_si512(G.hi);
            // d d_a of every row's blocks; the min terms as one FMA per block (explicit: left to
            // contraction, the sum could differ between tile shapes)
            const __m512 sc = _mm512_mul_ps(D, _mm512_load_ps(G.d4));
            if constexpr (N::HAS_M) macc[j] = _mm512_fmadd_ps(M, _mm512_load_ps(G.s4), macc[j]);
            #pragma GCC unroll 4
            for (int i = 0; i < RT; i++) {
                const __m512i init = N::HAS_M ? _mm512_setzero_si512() : _mm512_load_si512(G.neg8);
                const __m512i dot = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(init, lo[i], glo), hi[i], ghi);
                acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), lane_bcast(sc, i), acc[i][j]);
            }
        }
    };
    const int64_t nfull = nb / 4;
    for (int64_t gi = 0; gi < nfull; gi++) group(gi, std::true_type{});
    if (nfull < ng) group(nfull, std::false_type{});
    #pragma GCC unroll 4
    for (int j = 0; j < TT; j++) {
        alignas(64) float m[16];
        _mm512_store_ps(m, macc[j]);
        #pragma GCC unroll 4
        for (int i = 0; i < RT; i++) {
            float y = hsum512(acc[i][j]);
            if constexpr (N::HAS_M) y += (m[i] + m[4 + i]) + (m[8 + i] + m[12 + i]);
            A.y[(t0 + j) * A.ldy + r0 + i] = y;
        }
    }
}

// Rows [r0, r1) x tokens [t0, t0 + TT) through fused_q4_nib, 4 rows a tile and the rest in one.
template <class B, int TT>
void q4_nib_rows_tt(const MatmulArgs& A, int64_t r0, int64_t r1, int64_t t0) {
    int64_t r = r0;
    for (; r + 4 <= r1; r += 4) fused_q4_nib<B, 4, TT>(A, r, t0);
    switch (r1 - r) {
        case 3: fused_q4_nib<B, 3, TT>(A, r, t0); break;
        case 2: fused_q4_nib<B, 2, TT>(A, r, t0); break;
        case 1: fused_q4_nib<B, 1, TT>(A, r, t0); break;
        default: break;
    }
}
// All tokens in passes of at most 4, as even as possible (5 tokens: 3 + 2); every pass of a
// group of 4 rows runs while those rows are in L1 (see fused_rows).
template <class B>
void q4_nib_rows(const MatmulArgs& A, int64_t r0, int64_t r1) {
    const int64_t passes = (A.n_tok + 3) / 4;
    int64_t first[32], count[32];
    for (int64_t p = 0, t = 0; p < passes && p < 32; p++) {
        const int64_t n = (A.n_tok - t) / (passes - p) + ((A.n_tok - t) % (passes - p) ? 1 : 0);
        first[p] = t, count[p] = n;
        t += n;
    }
    if (passes > 32) {  // more tokens than the row kernels ever take: pass after pass, as before
        for (int64_t t = 0; t < A.n_tok; t += 4) q4_nib_rows_tt<B, 4>(A, r0, r1, t);
        return;
    }
    for (int64_t r = r0; r < r1; r += 4) {
        const int64_t re = std::min(r1, r + 4);
        for (int64_t p = 0; p < passes; p++) switch (count[p]) {
                case 4: q4_nib_rows_tt<B, 4>(A, r, re, first[p]); break;
                case 3: q4_nib_rows_tt<B, 3>(A, r, re, first[p]); break;
                case 2: q4_nib_rows_tt<B, 2>(A, r, re, first[p]); break;
                default: q4_nib_rows_tt<B, 1>(A, r, re, first[p]); break;
            }
    }
}

#endif  // STOWLM_FUSED_VNNI

// The 8 six-bit scales and 8 mins of a Q4_K/Q5_K super-block, unpacked with 32-bit masks
// (same result as get_scale_min_k4 for j = 0..7): sc bytes in out[0..7], mins in out[8..15].
inline void k4_scales_all(const uint8_t* s, uint8_t* out) {
    uint32_t u[3], r[4];
    memcpy(u, s, 12);
    r[0] = u[0] & 0x3f3f3f3fu;                                            // sc 0..3
    r[1] = (u[2] & 0x0f0f0f0fu) | (((u[0] >> 6) & 0x03030303u) << 4);    // sc 4..7
    r[2] = u[1] & 0x3f3f3f3fu;                                            // min 0..3
    r[3] = ((u[2] >> 4) & 0x0f0f0f0fu) | (((u[1] >> 6) & 0x03030303u) << 4);  // min 4..7
    memcpy(out, r, 16);
}

// A K super-block's 8 32-groups against one token: q[k] group k's unsigned values, scv[k] the
// scales of its two 16-element halves (low 8 words, high 8); each group's integer dot scaled by
// d * d_act[k].
inline __m256 k_groups_dot(const __m256i (&q)[8], const __m256i (&scv)[8], const block_q8_K32& y, float d, __m256 acc) {
    for (int k = 0; k < 8; k++) {
        const __m256i p = _mm256_maddubs_epi16(q[k], _mm256_loadu_si256((const __m256i*)(y.qs + 32 * k)));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(p, scv[k])), _mm256_set1_ps(d * y.d[k]), acc);
    }
    return acc;
}

// Q4_K: nibbles are unsigned (no offset); per 32-group 6-bit scales applied in int16 madd;
// float accumulation stays in vectors until the end of the row. Q5_K: the same with bit k of
// qh[l] as bit 4 of 32-group k's element l.
template <bool Q5, int RT, int TT>
void fused_q45_K(const MatmulArgs& A, int64_t r0, int64_t t0) {
    using B = std::conditional_t<Q5, block_q5_K, block_q4_K>;
    const int64_t nsb = A.cols / QK_K;
    const TileRows<B, RT> w(A, r0);
    const TileActs<block_q8_K32, TT> a(A.act, A.act_stride, t0);
    __m256 acc[RT][TT];
    zero_acc(acc, _mm256_setzero_ps());
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    for (int64_t b = 0; b < nsb; b++) {
        __m256 bpf[TT];  // per 32-group: activation sum times activation scale
        for (int j = 0; j < TT; j++) {
            const __m128i b0 = _mm_loadu_si128((const __m128i*)a[j][b].bsums);
            const __m128i b1 = _mm_loadu_si128((const __m128i*)(a[j][b].bsums + 8));
            bpf[j] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm_hadd_epi16(b0, b1))),
                                   _mm256_loadu_ps(a[j][b].d));
        }
        for (int i = 0; i < RT; i++) {
            const B& x = w[i][b];
            prefetch_next<(int)sizeof(B)>(&x, w.pf);
            alignas(16) uint8_t sm[16];
            k4_scales_all(x.scales, sm);
            __m256i scv[8];  // one 6-bit scale a 32-group
            for (int k = 0; k < 8; k++) scv[k] = _mm256_set1_epi16(sm[k]);
            const float d = h2f(x.d), dmin = h2f(x.dmin);
            const __m256 minsf = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(sm + 8)))),
                                               _mm256_set1_ps(dmin));
            __m256i q[8];
            for (int c = 0; c < 4; c++) {
                const __m256i v = _mm256_loadu_si256((const __m256i*)(x.qs + 32 * c));
                q[2 * c] = _mm256_and_si256(v, m4);
                q[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
            }
            if constexpr (Q5) {
                const __m256i h = _mm256_loadu_si256((const __m256i*)x.qh), one = _mm256_set1_epi8(1);
                for (int k = 0; k < 8; k++)
                    q[k] = _mm256_or_si256(q[k], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, k), one), 4));
            }
            for (int j = 0; j < TT; j++) {
                const block_q8_K32& y = a[j][b];
                acc[i][j] = k_groups_dot(q, scv, y, d, acc[i][j]);
                acc[i][j] = _mm256_fnmadd_ps(minsf, bpf[j], acc[i][j]);
            }
        }
    }
    store_tile<RT, TT>(A, r0, t0, [&](int i, int j) { return hsum256(acc[i][j]); });
}

#if STOWLM_FUSED_VNNI
// Patterns of the 8 per-32-group activation scales for the four ZMMs of a super-block: ZMM c
// holds groups 2c (lanes 0-7) and 2c+1 (lanes 8-15).
inline void act_scale_pats(const float* d8, __m512* pat) {
    const __m512 v = _mm512_castps256_ps512(_mm256_loadu_ps(d8));
    const __m512i half = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    for (int c = 0; c < 4; c++) pat[c] = _mm512_permutexvar_ps(_mm512_add_epi32(half, _mm512_set1_epi32(2 * c)), v);
}

// k4_scales_all in vector registers (no store and reload): the 16 bytes from `s` (the 12
// scale bytes and 4 bytes of what follows in the block) -> sc 0..7, min 0..7.
inline __m128i k4_scales_vec(const uint8_t* s) {
    const __m128i v = _mm_loadu_si128((const __m128i*)s);        // dwords u0 u1 u2 -
    const __m128i a = _mm_shuffle_epi32(v, _MM_SHUFFLE(2, 1, 2, 0));  // u0 u2 u1 u2
    const __m128i b = _mm_shuffle_epi32(v, _MM_SHUFFLE(1, 1, 0, 0));  // u0 u0 u1 u1
    const __m128i even = _mm_and_si128(a, _mm_set1_epi8(0x3f));
    const __m128i t = _mm_srlv_epi32(a, _mm_setr_epi32(0, 0, 0, 4));
    const __m128i odd = _mm_or_si128(_mm_and_si128(t, _mm_set1_epi8(0x0f)), _mm_and_si128(_mm_srli_epi32(b, 2), _mm_set1_epi8(0x30)));
    return _mm_blend_epi32(even, odd, 0xa);
}

// Q4_K with VNNI. ZMM k holds two 32-groups: the low nibbles of 64 qs bytes are groups
// {0, 2} (or {4, 6}), the high nibbles {1, 3} ({5, 7}); the activations are loaded in that
// order. Per row and token one multiply makes P = [d sc_g d_act_g | dmin min_g bsum_g d_act_g]
// (g = 0..7 in lanes 0-7 | 8-15); each ZMM's scale pattern is one permute of P, and the mins
// leave with one masked subtract (lanes are summed at the end).
// Q5_K (Q5 = true) is the same with the fifth bit of each value from qh: bit 2c (2c+1) of
// qh[l] belongs to element l of group 2c (2c+1); doubled qh bytes shifted per half bring the
// bits of a ZMM's two groups to bit 4.
// PRE: 2+ tokens with the activations regrouped once per call (K4Group: the quants in the ZMM
// order, read as memory operands, and the [d_act_g | bsum_g d_act_g] vector), the same values.
template <bool Q5, int RT, int TT, bool PRE = false>
void fused_q45_K_vnni(const MatmulArgs& A, int64_t r0, int64_t t0) {
    using BK = std::conditional_t<Q5, block_q5_K, block_q4_K>;
    const int64_t nsb = A.cols / QK_K;
    const TileRows<BK, RT> w(A, r0);
    const TileActs<block_q8_K32, TT> a(A.act, A.act_stride, t0);
    const TileActs<K4Group, TT> g(A.act_nib, A.nib_stride, t0);
    __m512 acc[RT][TT];
    zero_acc(acc, _mm512_setzero_ps());
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    const __m512i halves = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    for (int64_t b = 0; b < nsb; b++) {
        __m512i av[TT][4];
        __m512 V[TT];  // [d_act_g | bsum_g * d_act_g]
#pragma GCC unroll 4
        for (int j = 0; j < TT; j++) {
            if constexpr (PRE) {  // the same values, regrouped once per call (K4Group)
                V[j] = _mm512_load_ps(g[j][b].v);  // the quants: loads in the products below
                continue;
            }
            const int8_t* q = a[j][b].qs;
            auto ld2 = [&](int o0, int o1) {
                return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)(q + o0))),
                                          _mm256_loadu_si256((const __m256i*)(q + o1)), 1);
            };
            av[j][0] = ld2(0, 64), av[j][1] = ld2(32, 96), av[j][2] = ld2(128, 192), av[j][3] = ld2(160, 224);
            const __m128i b0 = _mm_loadu_si128((const __m128i*)a[j][b].bsums);
            const __m128i b1 = _mm_loadu_si128((const __m128i*)(a[j][b].bsums + 8));
            const __m256 da = _mm256_loadu_ps(a[j][b].d);
            const __m256 bs = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm_hadd_epi16(b0, b1))), da);
            V[j] = _mm512_insertf32x8(_mm512_castps256_ps512(da), bs, 1);
        }
#pragma GCC unroll 4
        for (int i = 0; i < RT; i++) {
            const BK& x = w[i][b];
            prefetch_next<(int)sizeof(BK)>(&x, w.pf);
            uint32_t ddm;
            memcpy(&ddm, &x, 4);  // d, dmin
            const __m512 dd = _mm512_permutexvar_ps(halves, _mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi32_si128((int)ddm))));
            const __m512 scf = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(k4_scales_vec(x.scales))), dd);
            const __m512i z0 = _mm512_loadu_si512(x.qs), z1 = _mm512_loadu_si512(x.qs + 64);
            __m512i qz[4] = {_mm512_and_si512(z0, m4), _mm512_and_si512(_mm512_srli_epi16(z0, 4), m4),
                             _mm512_and_si512(z1, m4), _mm512_and_si512(_mm512_srli_epi16(z1, 4), m4)};
            if constexpr (Q5) {
                // ZMM k holds groups (0,2) (1,3) (4,6) (5,7): qh bits (0|2) (1|3) (4|6) (5|7) to bit 4
                const __m512i h = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)x.qh));
                const __m512i m10 = _mm512_set1_epi8(0x10);
                auto lr = [](int lo, int hi) {  // per-half shift counts (words)
                    return _mm512_inserti64x4(_mm512_set1_epi16((short)lo), _mm256_set1_epi16((short)hi), 1);
                };
                qz[0] = _mm512_or_si512(qz[0], _mm512_and_si512(_mm512_sllv_epi16(h, lr(4, 2)), m10));
                qz[1] = _mm512_or_si512(qz[1], _mm512_and_si512(_mm512_sllv_epi16(h, lr(3, 1)), m10));
                qz[2] = _mm512_or_si512(qz[2], _mm512_and_si512(_mm512_srlv_epi16(h, lr(0, 2)), m10));
                qz[3] = _mm512_or_si512(qz[3], _mm512_and_si512(_mm512_srlv_epi16(h, lr(1, 3)), m10));
            }
#pragma GCC unroll 4
            for (int j = 0; j < TT; j++) {
                const __m512 P = _mm512_mul_ps(scf, V[j]);
#pragma GCC unroll 4
                for (int k = 0; k < 4; k++) {
                    // groups g0 = {0, 1, 4, 5}[k] in lanes 0-7, g0 + 2 in lanes 8-15
                    const int g0 = (k & 1) + 4 * (k >> 1);
                    const __m512i idx = _mm512_add_epi32(_mm512_set1_epi32(g0), _mm512_add_epi32(halves, halves));
                    acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), qz[k],
                                                                                    PRE ? _mm512_load_si512(g[j][b].qs + 64 * k) : av[j][k])),
                                                _mm512_permutexvar_ps(idx, P), acc[i][j]);
                }
                acc[i][j] = _mm512_mask_sub_ps(acc[i][j], 0xff00, acc[i][j], P);
            }
        }
    }
    store_tile<RT, TT>(A, r0, t0, [&](int i, int j) { return hsum512(acc[i][j]); });
}
#endif

// Q6_K: 6-bit values as unsigned q + 32, per-16 int8 scales applied in int16 madd, the 32
// offset removed with the activation sums (bsums).
template <int RT, int TT>
void fused_q6_K(const MatmulArgs& A, int64_t r0, int64_t t0) {
    const int64_t nsb = A.cols / QK_K;
    const TileRows<block_q6_K, RT> w(A, r0);
    const TileActs<block_q8_K32, TT> a(A.act, A.act_stride, t0);
    __m256 acc[RT][TT];
    zero_acc(acc, _mm256_setzero_ps());
    const __m256i m4 = _mm256_set1_epi8(0x0f), m2 = _mm256_set1_epi8(3);
    for (int64_t b = 0; b < nsb; b++) {
        for (int i = 0; i < RT; i++) {
            const block_q6_K& x = w[i][b];
            prefetch_next<(int)sizeof(block_q6_K)>(&x, w.pf);
            const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)x.scales));
            __m256i q[8], scv[8];
            for (int n = 0; n < 2; n++) {
                const __m256i l0 = _mm256_loadu_si256((const __m256i*)(x.ql + 64 * n));
                const __m256i l1 = _mm256_loadu_si256((const __m256i*)(x.ql + 64 * n + 32));
                const __m256i h = _mm256_loadu_si256((const __m256i*)(x.qh + 32 * n));
                auto hb = [&](int s) { return _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, s), m2), 4); };
                q[4 * n + 0] = _mm256_or_si256(_mm256_and_si256(l0, m4), hb(0));
                q[4 * n + 1] = _mm256_or_si256(_mm256_and_si256(l1, m4), hb(2));
                q[4 * n + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), hb(4));
                q[4 * n + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4), hb(6));
            }
            // scale pair k: scale 2k on the low 8 words (elements 0..15 of the group of 32),
            // scale 2k+1 on the high 8
            for (int k = 0; k < 8; k++)
#if STOWLM_FUSED_VNNI
                scv[k] = _mm256_permutexvar_epi16(
                    _mm256_set_epi16(2 * k + 1, 2 * k + 1, 2 * k + 1, 2 * k + 1, 2 * k + 1, 2 * k + 1, 2 * k + 1, 2 * k + 1,
                                     2 * k, 2 * k, 2 * k, 2 * k, 2 * k, 2 * k, 2 * k, 2 * k),
                    sc16);
#else
                scv[k] = _mm256_set_m128i(_mm_set1_epi16(x.scales[2 * k + 1]), _mm_set1_epi16(x.scales[2 * k]));
#endif
            const float d = h2f(x.d);
            for (int j = 0; j < TT; j++) {
                const block_q8_K32& y = a[j][b];
                acc[i][j] = k_groups_dot(q, scv, y, d, acc[i][j]);
                // the +32 offset: per 32-group lanes of sum sc * bsum, times 32 * d * d_act
                const __m256i corr = _mm256_madd_epi16(sc16, _mm256_loadu_si256((const __m256i*)y.bsums));
                acc[i][j] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(corr), _mm256_mul_ps(_mm256_loadu_ps(y.d), _mm256_set1_ps(32.f * d)),
                                             acc[i][j]);
            }
        }
    }
    store_tile<RT, TT>(A, r0, t0, [&](int i, int j) { return hsum256(acc[i][j]); });
}

// Q3_K's 16 six-bit scales + 32 (sub-block order) from its 12 packed bytes, in a vector (built
// in memory instead, a 16-byte load of four 4-byte stores could not be forwarded: a stall a row).
inline __m128i q3k_scales_vec(const uint8_t* s12) {
    const __m128i v = _mm_loadl_epi64((const __m128i*)s12), m4 = _mm_set1_epi8(0x0f);
    const __m128i lo = _mm_unpacklo_epi64(_mm_and_si128(v, m4), _mm_and_si128(_mm_srli_epi16(v, 4), m4));
    int32_t h;
    memcpy(&h, s12 + 8, 4);
    const __m128i hi = _mm_and_si128(_mm_srlv_epi32(_mm_set1_epi32(h), _mm_setr_epi32(0, 2, 4, 6)), _mm_set1_epi8(3));
    return _mm_or_si128(lo, _mm_slli_epi16(hi, 4));
}
// Q2_K and Q3_K, the formats of models too big for the machine's memory (their experts kept in
// RAM beside a GPU, whose staged copies keep GGUF's layout). 32-group k (k = 4n + j) holds
// bits 2j..2j+1 of qs[32n .. 32n + 31], Q3_K's third bit in bit 4n + j of hmask[0..31]; its two
// 16-element sub-blocks 2k and 2k + 1 take the low and high 8 words of maddubs' result, as Q6_K's.
// Q2_K: w = d sc_s u - dmin m_s (u 0..3); Q3_K: w = d sc_s (u - 4) (u 0..7, sc_s signed). The
// integer dots scale per 32-group; the mins and Q3_K's -4 leave through the activations' sums.
template <bool Q3, int RT, int TT>
void fused_q23_K(const MatmulArgs& A, int64_t r0, int64_t t0) {
    using B = std::conditional_t<Q3, block_q3_K, block_q2_K>;
    const int64_t nsb = A.cols / QK_K;
    const TileRows<B, RT> w(A, r0);
    const TileActs<block_q8_K32, TT> a(A.act, A.act_stride, t0);
    __m256 acc[RT][TT];
    zero_acc(acc, _mm256_setzero_ps());
    const __m256i m3 = _mm256_set1_epi8(3), m1 = _mm256_set1_epi8(1);
    for (int64_t b = 0; b < nsb; b++) {
        for (int i = 0; i < RT; i++) {
            const B& x = w[i][b];
            prefetch_next<(int)sizeof(B)>(&x, w.pf);
            alignas(16) uint8_t sc[16];
            __m256i sc16, mn16 = _mm256_setzero_si256();
            if constexpr (Q3) {
                const __m128i v = q3k_scales_vec(x.scales);
                _mm_store_si128((__m128i*)sc, v);
                sc16 = _mm256_sub_epi16(_mm256_cvtepu8_epi16(v), _mm256_set1_epi16(32));
            } else {
                const __m128i raw = _mm_loadu_si128((const __m128i*)x.scales);
                _mm_store_si128((__m128i*)sc, _mm_and_si128(raw, _mm_set1_epi8(0x0f)));
                sc16 = _mm256_cvtepu8_epi16(_mm_load_si128((const __m128i*)sc));
                mn16 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(0x0f)));
            }
            __m256i q[8], scv[8];
            __m256i h = _mm256_setzero_si256();
            if constexpr (Q3) h = _mm256_loadu_si256((const __m256i*)x.hmask);
            for (int n = 0; n < 2; n++) {
                const __m256i l = _mm256_loadu_si256((const __m256i*)(x.qs + 32 * n));
                for (int j = 0; j < 4; j++) {
                    __m256i u = _mm256_and_si256(_mm256_srli_epi16(l, 2 * j), m3);
                    if constexpr (Q3)
                        u = _mm256_or_si256(u, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 4 * n + j), m1), 2));
                    q[4 * n + j] = u;
                }
            }
            for (int k = 0; k < 8; k++) {
                const int lo = Q3 ? (int)sc[2 * k] - 32 : (int)sc[2 * k], hi = Q3 ? (int)sc[2 * k + 1] - 32 : (int)sc[2 * k + 1];
                scv[k] = _mm256_set_m128i(_mm_set1_epi16((int16_t)hi), _mm_set1_epi16((int16_t)lo));
            }
            const float d = h2f(x.d);
            for (int j = 0; j < TT; j++) {
                const block_q8_K32& y = a[j][b];
                acc[i][j] = k_groups_dot(q, scv, y, d, acc[i][j]);
                const __m256i bs = _mm256_loadu_si256((const __m256i*)y.bsums);
                if constexpr (Q3)  // the -4 of every value: 4 d sum_s sc_s bsum_s, per 32-group
                    acc[i][j] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(sc16, bs)),
                                                 _mm256_mul_ps(_mm256_loadu_ps(y.d), _mm256_set1_ps(4.f * d)), acc[i][j]);
                else  // the mins: dmin sum_s m_s bsum_s
                    acc[i][j] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(mn16, bs)),
                                                 _mm256_mul_ps(_mm256_loadu_ps(y.d), _mm256_set1_ps(h2f(x.dmin))), acc[i][j]);
            }
        }
    }
    store_tile<RT, TT>(A, r0, t0, [&](int i, int j) { return hsum256(acc[i][j]); });
}

#if STOWLM_FUSED_VNNI
// A super-block's activations as the VNNI K kernels read them: its 4 ZMMs of values, the d_act
// of each 16-group's 32-group (lane g) and the 16-groups' sums times `scale` (the formats' offset).
inline void k_acts_vnni(const block_q8_K32& y, float scale, __m512i (&q)[4], __m512& d16, __m512& bsum) {
    for (int c = 0; c < 4; c++) q[c] = _mm512_loadu_si512(y.qs + 64 * c);
    d16 = _mm512_permutexvar_ps(_mm512_srli_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), 1),
                                _mm512_castps256_ps512(_mm256_loadu_ps(y.d)));
    bsum = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm256_loadu_si256((const __m256i*)y.bsums))),
                         _mm512_set1_ps(scale));
}
// The 4 ZMMs' integer dots of a super-block, lane l scaled by P's entry for its 16-group (ZMM c's
// lanes: 16-groups 4c + l / 4; lane4 = l / 4).
inline __m512 k_dots_vnni(const __m512i (&qz)[4], const __m512i (&av)[4], __m512 P, __m512i lane4, __m512 acc) {
    for (int c = 0; c < 4; c++)
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), qz[c], av[c])),
                              _mm512_permutexvar_ps(_mm512_add_epi32(lane4, _mm512_set1_epi32(4 * c)), P), acc);
    return acc;
}
#endif

#if STOWLM_FUSED_VNNI
// Q6_K with VNNI: values as unsigned q + 32, four 16-groups per ZMM in element order. The
// 64 ql bytes of a half give its low nibbles (elements 0-63) and high nibbles (64-127); its
// 32 qh bytes, doubled, give the two high bits with per-half shifts. Per row and token one
// multiply makes P = d sc_g d_act[g/2] (16-group g in lane g); each ZMM's pattern is one
// permute of P, and the +32 offset leaves as one FMA of P with 32 * bsum_g.
template <int RT, int TT>
void fused_q6_K_vnni(const MatmulArgs& A, int64_t r0, int64_t t0) {
    const int64_t nsb = A.cols / QK_K;
    const TileRows<block_q6_K, RT> w(A, r0);
    const TileActs<block_q8_K32, TT> a(A.act, A.act_stride, t0);
    __m512 acc[RT][TT];
    zero_acc(acc, _mm512_setzero_ps());
    const __m512i m4 = _mm512_set1_epi8(0x0f), m30 = _mm512_set1_epi8(0x30);
    // words of the first 32 bytes shift by (4 | 0), of the second by (2 | 2): bits (0-1 | 4-5)
    // of qh for elements 0-31, bits (2-3 | 6-7) for 32-63, to bits 4-5
    const __m512i shl_lo = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
    const __m512i shr_hi = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
    const __m512i lane4 = _mm512_srli_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), 2);
    for (int64_t b = 0; b < nsb; b++) {
        __m512i av[TT][4];
        __m512 V[TT], Bf[TT];  // d_act of each 16-group's 32-group; 32 * bsum
        for (int j = 0; j < TT; j++) k_acts_vnni(a[j][b], 32.f, av[j], V[j], Bf[j]);
        for (int i = 0; i < RT; i++) {
            const block_q6_K& x = w[i][b];
            prefetch_next<(int)sizeof(block_q6_K)>(&x, w.pf);
            const __m512 scf = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)x.scales))),
                                             _mm512_set1_ps(h2f(x.d)));
            __m512i qz[4];
            for (int n = 0; n < 2; n++) {
                const __m512i l = _mm512_loadu_si512(x.ql + 64 * n);
                const __m512i h = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(x.qh + 32 * n)));
                const __m512i hlo = _mm512_and_si512(_mm512_sllv_epi16(h, shl_lo), m30);
                const __m512i hhi = _mm512_and_si512(_mm512_srlv_epi16(h, shr_hi), m30);
                qz[2 * n] = _mm512_ternarylogic_epi32(l, m4, hlo, 0xea);  // (l & m4) | hlo
                qz[2 * n + 1] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(l, 4), m4, hhi, 0xea);
            }
            for (int j = 0; j < TT; j++) {
                const __m512 P = _mm512_mul_ps(scf, V[j]);
                acc[i][j] = k_dots_vnni(qz, av[j], P, lane4, acc[i][j]);
                acc[i][j] = _mm512_fnmadd_ps(P, Bf[j], acc[i][j]);
            }
        }
    }
    store_tile<RT, TT>(A, r0, t0, [&](int i, int j) { return hsum512(acc[i][j]); });
}
#endif

#if STOWLM_FUSED_VNNI
// Q2_K / Q3_K with VNNI, as Q6_K's: ZMM c holds 32-groups 2c and 2c + 1 (elements 64c..64c+63,
// 16-groups 4c..4c+3), their 2-bit fields shifted per half from one broadcast of 32 qs bytes,
// Q3_K's third bits (bit k of hmask for 32-group k) likewise. P = d sc_g d_act (16-group g in
// lane g) scales the dots; Q3_K's -4 leaves as P times 4 bsum_g, Q2_K's mins as dmin m_g d_act
// times bsum_g.
template <bool Q3, int RT, int TT>
void fused_q23_K_vnni(const MatmulArgs& A, int64_t r0, int64_t t0) {
    using B = std::conditional_t<Q3, block_q3_K, block_q2_K>;
    const int64_t nsb = A.cols / QK_K;
    const TileRows<B, RT> w(A, r0);
    const TileActs<block_q8_K32, TT> a(A.act, A.act_stride, t0);
    __m512 acc[RT][TT];
    zero_acc(acc, _mm512_setzero_ps());
    const __m512i m3 = _mm512_set1_epi8(3), m1 = _mm512_set1_epi8(1);
    const __m512i lane4 = _mm512_srli_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), 2);
    auto halves = [](int lo, int hi) { return _mm512_inserti64x4(_mm512_set1_epi16((int16_t)lo), _mm256_set1_epi16((int16_t)hi), 1); };
    const __m512i sh01 = halves(0, 2), sh23 = halves(4, 6);
    const __m512i shh[4] = {halves(0, 1), halves(2, 3), halves(4, 5), halves(6, 7)};  // hmask bits of ZMM c
    for (int64_t b = 0; b < nsb; b++) {
        __m512i av[TT][4];
        __m512 V[TT], Bf[TT];  // d_act of each 16-group's 32-group; bsum (Q3_K: 4 bsum)
        for (int j = 0; j < TT; j++) k_acts_vnni(a[j][b], Q3 ? 4.f : 1.f, av[j], V[j], Bf[j]);
        for (int i = 0; i < RT; i++) {
            const B& x = w[i][b];
            prefetch_next<(int)sizeof(B)>(&x, w.pf);
            __m512 scf, mnf = _mm512_setzero_ps();
            if constexpr (Q3) {
                scf = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(q3k_scales_vec(x.scales)),
                                                                        _mm512_set1_epi32(32))),
                                    _mm512_set1_ps(h2f(x.d)));
            } else {
                const __m512i raw = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)x.scales));
                scf = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_and_si512(raw, _mm512_set1_epi32(15))), _mm512_set1_ps(h2f(x.d)));
                mnf = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(raw, 4)), _mm512_set1_ps(h2f(x.dmin)));
            }
            __m512i qz[4];
            __m512i h = _mm512_setzero_si512();
            if constexpr (Q3) h = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)x.hmask));
            for (int n = 0; n < 2; n++) {
                const __m512i l = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(x.qs + 32 * n)));
                for (int e = 0; e < 2; e++) {
                    const int c = 2 * n + e;  // 32-groups 2c, 2c + 1: bits (4e | 4e + 2) of qs
                    __m512i u = _mm512_and_si512(_mm512_srlv_epi16(l, e ? sh23 : sh01), m3);
                    if constexpr (Q3)
                        u = _mm512_or_si512(u, _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(h, shh[c]), m1), 2));
                    qz[c] = u;
                }
            }
            for (int j = 0; j < TT; j++) {
                const __m512 P = _mm512_mul_ps(scf, V[j]);
                acc[i][j] = k_dots_vnni(qz, av[j], P, lane4, acc[i][j]);
                acc[i][j] = _mm512_fnmadd_ps(Q3 ? P : _mm512_mul_ps(mnf, V[j]), Bf[j], acc[i][j]);
            }
        }
    }
    store_tile<RT, TT>(A, r0, t0, [&](int i, int j) { return hsum512(acc[i][j]); });
}
#endif

// IQ4_XS: per 32-group k a 6-bit scale ls_k (4 low bits in scales_l, 2 high in scales_h),
// w = d (ls_k - 32) level(nibble), the nibbles of qs[16k .. 16k + 15] as IQ4_NL's (low: elements
// 0-15, high: 16-31). Its groups' scales, d (ls_k - 32), into dl[8].
inline void iq4xs_scales(const block_iq4_xs& x, float* dl) {
    uint32_t lo;
    memcpy(&lo, x.scales_l, 4);
    const float d = h2f(x.d);
    for (int k = 0; k < 8; k++)
        dl[k] = d * (float)((int)(((lo >> (4 * k)) & 0xF) | (((x.scales_h >> (2 * k)) & 3) << 4)) - 32);
}
// AVX2: the levels signed, multiplied as |w| by a with w's sign (maddubs' operands).
template <int RT, int TT>
void fused_iq4_xs(const MatmulArgs& A, int64_t r0, int64_t t0) {
    const int64_t nsb = A.cols / QK_K;
    const TileRows<block_iq4_xs, RT> w(A, r0);
    const TileActs<block_q8_K32, TT> a(A.act, A.act_stride, t0);
    __m256 acc[RT][TT];
    zero_acc(acc, _mm256_setzero_ps());
    const __m256i tab = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)kIQ4NLValues));
    const __m128i m4 = _mm_set1_epi8(0x0f);
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t b = 0; b < nsb; b++) {
        for (int i = 0; i < RT; i++) {
            const block_iq4_xs& x = w[i][b];
            prefetch_next<(int)sizeof(block_iq4_xs)>(&x, w.pf);
            float dl[8];
            iq4xs_scales(x, dl);
            __m256i lv[8];
            for (int k = 0; k < 8; k++) {
                const __m128i v = _mm_loadu_si128((const __m128i*)(x.qs + 16 * k));
                lv[k] = _mm256_shuffle_epi8(tab, _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m4), _mm_and_si128(v, m4)));
            }
            for (int j = 0; j < TT; j++) {
                const block_q8_K32& y = a[j][b];
                for (int k = 0; k < 8; k++) {
                    const __m256i av = _mm256_loadu_si256((const __m256i*)(y.qs + 32 * k));
                    const __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(lv[k], lv[k]), _mm256_sign_epi8(av, lv[k]));
                    acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(p, ones)), _mm256_set1_ps(dl[k] * y.d[k]),
                                                acc[i][j]);
                }
            }
        }
    }
    store_tile<RT, TT>(A, r0, t0, [&](int i, int j) { return hsum256(acc[i][j]); });
}

#if STOWLM_FUSED_VNNI
// IQ4_XS with VNNI: ZMM c holds 32-groups 2c and 2c + 1 as IQ4_NL's block pairs (Z4_0::nib64,
// the levels + 128); lanes 0-7 take group 2c's scale, 8-15 group 2c + 1's. The +128 leaves per
// group through the activations' sums, in a YMM of the 8 groups.
template <int RT, int TT>
void fused_iq4_xs_vnni(const MatmulArgs& A, int64_t r0, int64_t t0) {
    const int64_t nsb = A.cols / QK_K;
    const TileRows<block_iq4_xs, RT> w(A, r0);
    const TileActs<block_q8_K32, TT> a(A.act, A.act_stride, t0);
    __m512 acc[RT][TT];
    __m256 off[RT][TT];
    zero_acc(acc, _mm512_setzero_ps());
    zero_acc(off, _mm256_setzero_ps());
    const __m512i tab = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)kIQ4NLValues));
    __m512i pick[4];  // ZMM c's lanes: group 2c's scale, then 2c + 1's
    for (int c = 0; c < 4; c++)
        pick[c] = _mm512_inserti64x4(_mm512_set1_epi32(2 * c), _mm256_set1_epi32(2 * c + 1), 1);
    for (int64_t b = 0; b < nsb; b++) {
        __m512i av[TT][4];
        __m256 D[TT], S[TT];  // d_act per 32-group; 128 x its sum
        for (int j = 0; j < TT; j++) {
            for (int c = 0; c < 4; c++) av[j][c] = _mm512_loadu_si512(a[j][b].qs + 64 * c);
            D[j] = _mm256_loadu_ps(a[j][b].d);
            const __m256i sums = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i*)a[j][b].bsums), _mm256_set1_epi16(1));
            S[j] = _mm256_mul_ps(_mm256_cvtepi32_ps(sums), _mm256_set1_ps(128.f));
        }
        for (int i = 0; i < RT; i++) {
            const block_iq4_xs& x = w[i][b];
            prefetch_next<(int)sizeof(block_iq4_xs)>(&x, w.pf);
            uint32_t lo;  // iq4xs_scales in a vector (no store-forwarding stall)
            memcpy(&lo, x.scales_l, 4);
            const __m256i ls = _mm256_or_si256(
                _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)lo), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)),
                                 _mm256_set1_epi32(15)),
                _mm256_slli_epi32(_mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(x.scales_h), _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14)),
                                                   _mm256_set1_epi32(3)), 4));
            const __m256 scf = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(ls, _mm256_set1_epi32(32))), _mm256_set1_ps(h2f(x.d)));
            __m512i u[4];
            for (int c = 0; c < 4; c++)
                u[c] = _mm512_xor_si512(_mm512_shuffle_epi8(tab, Z4_0::nib64(x.qs + 32 * c, x.qs + 32 * c + 16)),
                                        _mm512_set1_epi8((char)0x80));
            for (int j = 0; j < TT; j++) {
                const __m256 P = _mm256_mul_ps(scf, D[j]);
                const __m512 P16 = _mm512_castps256_ps512(P);
                for (int c = 0; c < 4; c++)
                    acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), u[c], av[j][c])),
                                                _mm512_permutexvar_ps(pick[c], P16), acc[i][j]);
                off[i][j] = _mm256_fnmadd_ps(P, S[j], off[i][j]);
            }
        }
    }
    store_tile<RT, TT>(A, r0, t0, [&](int i, int j) { return hsum512(acc[i][j]) + hsum256(off[i][j]); });
}
#endif

template <int RT, int TT>
void fused_tile(const MatmulArgs& A, int64_t r0, int64_t t0) {
    switch (A.type) {
#if STOWLM_FUSED_VNNI
    // block pairs in ZMM when the row has an even number of blocks
#define STOWLM_Q32(Z, L)                                                                  \
    if ((A.cols / QK) % 2) return fused_q32<L, RT, TT>(A, r0, t0);                     \
    if constexpr (RT == 4) {                                                            \
        if constexpr (kPairActs<Z>)                                                     \
            if (A.act_nib && A.n_tok > 1) return fused_q32_x2_r4<Z, TT, true>(A, r0, t0); \
        return fused_q32_x2_r4<Z, TT, false>(A, r0, t0);                                \
    }                                                                                   \
    else return fused_q32_x2_r1<Z, TT>(A, r0, t0)
#else
#define STOWLM_Q32(Z, L) return fused_q32<L, RT, TT>(A, r0, t0)
#endif
        case QType::Q4_0: STOWLM_Q32(Z4_0, LQ4_0);
        case QType::Q4_1: STOWLM_Q32(Z4_1, LQ4_1);
        case QType::Q5_0: STOWLM_Q32(Z5_0, LQ5_0);
        case QType::Q5_1: STOWLM_Q32(Z5_1, LQ5_1);
        case QType::Q8_0: STOWLM_Q32(Z8_0, LQ8_0);
        case QType::IQ4_NL: STOWLM_Q32(ZIQ4_NL, LIQ4_NL);
        case QType::MXFP4: STOWLM_Q32(ZMXFP4, LMXFP4);
#undef STOWLM_Q32
#if STOWLM_FUSED_VNNI
        case QType::Q4_K:
            if (A.act_nib && A.n_tok > 1) return fused_q45_K_vnni<false, RT, TT, true>(A, r0, t0);
            return fused_q45_K_vnni<false, RT, TT>(A, r0, t0);
        case QType::Q5_K:
            if (A.act_nib && A.n_tok > 1) return fused_q45_K_vnni<true, RT, TT, true>(A, r0, t0);
            return fused_q45_K_vnni<true, RT, TT>(A, r0, t0);
#else
        case QType::Q4_K: return fused_q45_K<false, RT, TT>(A, r0, t0);
        case QType::Q5_K: return fused_q45_K<true, RT, TT>(A, r0, t0);
#endif
#if STOWLM_FUSED_VNNI
        case QType::Q6_K: return fused_q6_K_vnni<RT, TT>(A, r0, t0);
#else
        case QType::Q6_K: return fused_q6_K<RT, TT>(A, r0, t0);
#endif
#if STOWLM_FUSED_VNNI
        case QType::IQ4_XS: return fused_iq4_xs_vnni<RT, TT>(A, r0, t0);
#else
        case QType::IQ4_XS: return fused_iq4_xs<RT, TT>(A, r0, t0);
#endif
#if STOWLM_FUSED_VNNI
        case QType::Q2_K: return fused_q23_K_vnni<false, RT, TT>(A, r0, t0);
        case QType::Q3_K: return fused_q23_K_vnni<true, RT, TT>(A, r0, t0);
#else
        case QType::Q2_K: return fused_q23_K<false, RT, TT>(A, r0, t0);
        case QType::Q3_K: return fused_q23_K<true, RT, TT>(A, r0, t0);
#endif
        default: return;
    }
}

inline bool has_fused(QType t) {
    switch (t) {
        case QType::Q4_0: case QType::Q4_1: case QType::Q5_0: case QType::Q5_1: case QType::Q8_0:
        case QType::IQ4_NL: case QType::MXFP4: case QType::Q4_K: case QType::Q6_K: case QType::Q2_K:
        case QType::Q3_K: case QType::IQ4_XS: case QType::Q5_K: return true;
        default: return false;
    }
}

// RT rows from r x all tokens, up to 4 tokens per tile.
template <int RT>
void fused_tokens(const MatmulArgs& A, int64_t r) {
    int64_t t = 0;
    for (; t + 4 <= A.n_tok; t += 4) fused_tile<RT, 4>(A, r, t);
    switch (A.n_tok - t) {
        case 3: fused_tile<RT, 3>(A, r, t); break;
        case 2: fused_tile<RT, 2>(A, r, t); break;
        case 1: fused_tile<RT, 1>(A, r, t); break;
        default: break;
    }
}
// Rows [r0, r1) x all tokens, 4 rows x up to 4 tokens per tile. A group of 4 rows serves every
// token tile while it is in L1, so the weights stream from memory once per call, not once per 4
// tokens (a pass of 8 tokens, a speculative draft's, costs little more than one of 4); which tile
// computes a (row, token) is what it was, so are the bits.
inline void fused_rows(const MatmulArgs& A, int64_t r0, int64_t r1) {
    int64_t r = r0;
    if (A.n_tok == 1) {  // decoding: one row after another, one forward stream (fused_q32_x2_s1)
#if STOWLM_FUSED_VNNI
        if (A.act_nib) switch (A.type) {
                case QType::Q4_0: for (; r < r1; r++) fused_q4_nib<block_q4_0, 1, 1>(A, r, 0); return;
                case QType::Q4_1: for (; r < r1; r++) fused_q4_nib<block_q4_1, 1, 1>(A, r, 0); return;
                case QType::Q5_0: return fused_q32_x2_s1<Z5_0>(A, r0, r1);
                case QType::Q5_1: return fused_q32_x2_s1<Z5_1>(A, r0, r1);
                // Q8_0 (no nibbles to regroup) streams faster through the tiles' one-row kernel:
                // 21504 x 4864, 1 token, 2 Zen 4 threads 4.0-4.2 -> 3.0-3.2 ms (151936 x 896: equal)
                case QType::IQ4_NL: return fused_q32_x2_s1<ZIQ4_NL>(A, r0, r1);
                case QType::MXFP4: return fused_q32_x2_s1<ZMXFP4>(A, r0, r1);
                default: break;
            }
#endif
        for (; r < r1; r++) fused_tokens<1>(A, r);
        return;
    }
#if STOWLM_FUSED_VNNI
    if (A.act_nib && A.type == QType::Q4_0) return q4_nib_rows<block_q4_0>(A, r0, r1);
    if (A.act_nib && A.type == QType::Q4_1) return q4_nib_rows<block_q4_1>(A, r0, r1);
#endif
    for (; r + 4 <= r1; r += 4) fused_tokens<4>(A, r);
    for (; r < r1; r++) fused_tokens<1>(A, r);
}

}  // namespace
}  // namespace stowlm::cpu
