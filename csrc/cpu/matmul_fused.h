// Fused kernels for the weight types of the common models: weight blocks are decoded in
// registers and dotted straight away (no panel), RT rows x TT tokens at a time so each decoded
// block serves TT tokens and each activation block RT rows; the weights stream from memory
// once per TT tokens. Included by matmul_avx2.cpp and matmul_avx512.cpp: with AVX-512 VNNI the
// byte products use vpdpbusd (and two 32-blocks per ZMM), with AVX2 maddubs/madd.
// Anonymous namespace: each file compiles its own copy.
#pragma once
#include <immintrin.h>

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

// y[t][r] for RT rows from r0 and TT tokens from t0.
template <class L, int RT, int TT>
void fused_q32(const MatmulArgs& A, int64_t r0, int64_t t0) {
    using B = typename L::B;
    const int64_t nb = A.cols / QK;
    const B* w[RT];
    for (int i = 0; i < RT; i++) w[i] = (const B*)(A.w + (r0 + i) * A.w_stride);
    const block_q8_a* a[TT];
    for (int j = 0; j < TT; j++) a[j] = (const block_q8_a*)((const uint8_t*)A.act + (t0 + j) * A.act_stride);
    __m256 acc[RT][TT];
    float macc[RT][TT];
    for (int i = 0; i < RT; i++)
        for (int j = 0; j < TT; j++) acc[i][j] = _mm256_setzero_ps(), macc[i][j] = 0;
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
            const __m256i wu = L::u(blk);
            const __m256 dw = _mm256_set1_ps(h2f(blk.d));
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
                if (L::HAS_M) macc[i][j] += mw * a[j][b].s;
            }
        }
    }
    for (int j = 0; j < TT; j++)
        for (int i = 0; i < RT; i++) A.y[(t0 + j) * A.ldy + r0 + i] = hsum256(acc[i][j]) + macc[i][j];
}

#if STOWLM_FUSED_VNNI
// Two blocks per ZMM: the 4/5-bit formats (NIB) place bytes as [lo nibbles of b, of b+1, hi
// nibbles of b, of b+1] (16 bytes each), so the activations are permuted to match once per
// token and block pair; Q8_0 keeps [b, b+1]. Int32 lane l then belongs to block b or b+1 by
// `pair_sel` below, and one multiply applies both blocks' scales.
struct Z4_0 {
    using B = block_q4_0;
    static constexpr int OFF = 8;
    static constexpr bool HAS_M = false, NIB = true;
    static __m512i u2(const B& x, const B& y) { return nib64(x.qs, y.qs); }
    static __m512i nib64(const uint8_t* p, const uint8_t* q) {
        const __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)p)),
                                                  _mm_loadu_si128((const __m128i*)q), 1);
        const __m256i m4 = _mm256_set1_epi8(0x0f);
        return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(v, m4)),
                                  _mm256_and_si256(_mm256_srli_epi16(v, 4), m4), 1);
    }
    static __m512i hib64(const uint8_t* qh0, const uint8_t* qh1) {
        const __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(bits32(qh0)), bits32(qh1), 1);
        return _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 1, 4, 5, 2, 3, 6, 7), z);
    }
};
struct Z4_1 : Z4_0 {
    using B = block_q4_1;
    static constexpr int OFF = 0;
    static constexpr bool HAS_M = true;
    static __m512i u2(const B& x, const B& y) { return nib64(x.qs, y.qs); }
};
struct Z5_0 : Z4_0 {
    using B = block_q5_0;
    static constexpr int OFF = 16;
    static __m512i u2(const B& x, const B& y) { return _mm512_or_si512(nib64(x.qs, y.qs), hib64(x.qh, y.qh)); }
};
struct Z5_1 : Z4_0 {
    using B = block_q5_1;
    static constexpr int OFF = 0;
    static constexpr bool HAS_M = true;
    static __m512i u2(const B& x, const B& y) { return _mm512_or_si512(nib64(x.qs, y.qs), hib64(x.qh, y.qh)); }
};
struct ZIQ4_NL : Z4_0 {
    using B = block_iq4_nl;
    static constexpr int OFF = 128;
    static __m512i u2(const B& x, const B& y) {
        const __m512i tab = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)kIQ4NLValues));
        return _mm512_xor_si512(_mm512_shuffle_epi8(tab, nib64(x.qs, y.qs)), _mm512_set1_epi8((char)0x80));
    }
};
struct Z8_0 {
    using B = block_q8_0;
    static constexpr int OFF = 128;
    static constexpr bool HAS_M = false, NIB = false;
    static __m512i u2(const B& x, const B& y) {
        const __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)x.qs)),
                                             _mm256_loadu_si256((const __m256i*)y.qs), 1);
        return _mm512_xor_si512(z, _mm512_set1_epi8((char)0x80));
    }
};

// Lane pattern of the two blocks' scales (lanes of block b read element 0, of b+1 element 1).
template <bool NIB>
inline __m512 pair_sel(float s0, float s1) {
    const __m512 v = _mm512_castps128_ps512(_mm_unpacklo_ps(_mm_set_ss(s0), _mm_set_ss(s1)));
    const __m512i idx = NIB ? _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1)
                            : _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    return _mm512_permutexvar_ps(idx, v);
}

template <class L, int RT, int TT>
void fused_q32_x2(const MatmulArgs& A, int64_t r0, int64_t t0) {
    using B = typename L::B;
    const int64_t nb = A.cols / QK;
    const B* w[RT];
    for (int i = 0; i < RT; i++) w[i] = (const B*)(A.w + (r0 + i) * A.w_stride);
    const block_q8_a* a[TT];
    for (int j = 0; j < TT; j++) a[j] = (const block_q8_a*)((const uint8_t*)A.act + (t0 + j) * A.act_stride);
    __m512 acc[RT][TT];
    float macc[RT][TT];
    for (int i = 0; i < RT; i++)
        for (int j = 0; j < TT; j++) acc[i][j] = _mm512_setzero_ps(), macc[i][j] = 0;
    const __m512i offv = _mm512_set1_epi8((char)L::OFF);
    const __m512i aperm = _mm512_setr_epi64(0, 1, 4, 5, 2, 3, 6, 7);
    for (int64_t b = 0; b < nb; b += 2) {
        __m512i av[TT], neg[TT];
        __m512 dav[TT];
        for (int j = 0; j < TT; j++) {
            const __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)a[j][b].qs)),
                                                 _mm256_loadu_si256((const __m256i*)a[j][b + 1].qs), 1);
            av[j] = L::NIB ? _mm512_permutexvar_epi64(aperm, z) : z;
            neg[j] = L::OFF ? _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_dpbusd_epi32(_mm512_setzero_si512(), offv, av[j]))
                            : _mm512_setzero_si512();
            dav[j] = pair_sel<L::NIB>(a[j][b].d, a[j][b + 1].d);
        }
        // The 2 x RT weight scales converted together (fp16 -> f32 once for all rows).
        __m512 dw_all;
        if constexpr (RT == 4) {
            __m128i h = _mm_cvtsi32_si128(w[0][b].d);
            h = _mm_insert_epi16(h, w[0][b + 1].d, 1);
            h = _mm_insert_epi16(h, w[1][b].d, 2);
            h = _mm_insert_epi16(h, w[1][b + 1].d, 3);
            h = _mm_insert_epi16(h, w[2][b].d, 4);
            h = _mm_insert_epi16(h, w[2][b + 1].d, 5);
            h = _mm_insert_epi16(h, w[3][b].d, 6);
            h = _mm_insert_epi16(h, w[3][b + 1].d, 7);
            dw_all = _mm512_castps256_ps512(_mm256_cvtph_ps(h));
        }
        for (int i = 0; i < RT; i++) {
            const B& x0 = w[i][b];
            const B& x1 = w[i][b + 1];
            const __m512i wu = L::u2(x0, x1);
            __m512 dwv;
            if constexpr (RT == 4) {
                // lanes of block b read element 2i, of block b+1 element 2i+1
                const __m512i idx = L::NIB ? _mm512_setr_epi32(2 * i, 2 * i, 2 * i, 2 * i, 2 * i + 1, 2 * i + 1, 2 * i + 1, 2 * i + 1,
                                                               2 * i, 2 * i, 2 * i, 2 * i, 2 * i + 1, 2 * i + 1, 2 * i + 1, 2 * i + 1)
                                           : _mm512_setr_epi32(2 * i, 2 * i, 2 * i, 2 * i, 2 * i, 2 * i, 2 * i, 2 * i,
                                                               2 * i + 1, 2 * i + 1, 2 * i + 1, 2 * i + 1, 2 * i + 1, 2 * i + 1,
                                                               2 * i + 1, 2 * i + 1);
                dwv = _mm512_permutexvar_ps(idx, dw_all);
            } else {
                const __m128 dd = _mm_cvtph_ps(_mm_cvtsi32_si128((int)x0.d | ((int)x1.d << 16)));
                dwv = pair_sel<L::NIB>(_mm_cvtss_f32(dd), _mm_cvtss_f32(_mm_movehdup_ps(dd)));
            }
            float m0 = 0, m1 = 0;
            if constexpr (L::HAS_M) m0 = h2f(x0.m), m1 = h2f(x1.m);
            for (int j = 0; j < TT; j++) {
                const __m512i dot = _mm512_dpbusd_epi32(neg[j], wu, av[j]);
                acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dwv, dav[j]), acc[i][j]);
                if constexpr (L::HAS_M) macc[i][j] += m0 * a[j][b].s + m1 * a[j][b + 1].s;
            }
        }
    }
    for (int j = 0; j < TT; j++)
        for (int i = 0; i < RT; i++) A.y[(t0 + j) * A.ldy + r0 + i] = hsum512(acc[i][j]) + macc[i][j];
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

// Q4_K: nibbles are unsigned (no offset); per 32-group 6-bit scales applied in int16 madd;
// float accumulation stays in vectors until the end of the row.
template <int RT, int TT>
void fused_q4_K(const MatmulArgs& A, int64_t r0, int64_t t0) {
    const int64_t nsb = A.cols / QK_K;
    const block_q4_K* w[RT];
    for (int i = 0; i < RT; i++) w[i] = (const block_q4_K*)(A.w + (r0 + i) * A.w_stride);
    const block_q8_K* a[TT];
    for (int j = 0; j < TT; j++) a[j] = (const block_q8_K*)((const uint8_t*)A.act + (t0 + j) * A.act_stride);
    __m256 acc[RT][TT];
    for (int i = 0; i < RT; i++)
        for (int j = 0; j < TT; j++) acc[i][j] = _mm256_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    for (int64_t b = 0; b < nsb; b++) {
        __m128i bpair[TT];  // sums of the activations of each 32-group
        for (int j = 0; j < TT; j++) {
            const __m128i b0 = _mm_loadu_si128((const __m128i*)a[j][b].bsums);
            const __m128i b1 = _mm_loadu_si128((const __m128i*)(a[j][b].bsums + 8));
            bpair[j] = _mm_hadd_epi16(b0, b1);
        }
        for (int i = 0; i < RT; i++) {
            const block_q4_K& x = w[i][b];
            alignas(16) uint8_t sm[16];
            k4_scales_all(x.scales, sm);
            int16_t sc[8];
            for (int k = 0; k < 8; k++) sc[k] = sm[k];
            const __m128i mins = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i*)(sm + 8)));
            __m256i q[8];
            for (int c = 0; c < 4; c++) {
                const __m256i v = _mm256_loadu_si256((const __m256i*)(x.qs + 32 * c));
                q[2 * c] = _mm256_and_si256(v, m4);
                q[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
            }
            const float d = h2f(x.d), dmin = h2f(x.dmin);
            for (int j = 0; j < TT; j++) {
                const block_q8_K& y = a[j][b];
                __m256i isum = _mm256_setzero_si256();
                for (int k = 0; k < 8; k++) {
                    const __m256i p = _mm256_maddubs_epi16(q[k], _mm256_loadu_si256((const __m256i*)(y.qs + 32 * k)));
                    isum = _mm256_add_epi32(isum, _mm256_madd_epi16(p, _mm256_set1_epi16(sc[k])));
                }
                const __m256i ms = _mm256_zextsi128_si256(_mm_madd_epi16(mins, bpair[j]));
                acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(d * y.d), acc[i][j]);
                acc[i][j] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(ms), _mm256_set1_ps(dmin * y.d), acc[i][j]);
            }
        }
    }
    for (int j = 0; j < TT; j++)
        for (int i = 0; i < RT; i++) A.y[(t0 + j) * A.ldy + r0 + i] = hsum256(acc[i][j]);
}

#if STOWLM_FUSED_VNNI
// Q4_K with VNNI: two 32-groups per ZMM (vpdpbusd, no int16 step); the groups' integer
// scales become a float pattern per row (d * sc), applied with one FMA per ZMM; the super-block's
// activation scale multiplies the sum once.
template <int RT, int TT>
void fused_q4_K_vnni(const MatmulArgs& A, int64_t r0, int64_t t0) {
    const int64_t nsb = A.cols / QK_K;
    const block_q4_K* w[RT];
    for (int i = 0; i < RT; i++) w[i] = (const block_q4_K*)(A.w + (r0 + i) * A.w_stride);
    const block_q8_K* a[TT];
    for (int j = 0; j < TT; j++) a[j] = (const block_q8_K*)((const uint8_t*)A.act + (t0 + j) * A.act_stride);
    __m512 acc[RT][TT];
    for (int i = 0; i < RT; i++)
        for (int j = 0; j < TT; j++) acc[i][j] = _mm512_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    for (int64_t b = 0; b < nsb; b++) {
        __m128i bpair[TT];  // sums of the activations of each 32-group
        __m512i av[TT][4];
        for (int j = 0; j < TT; j++) {
            const __m128i b0 = _mm_loadu_si128((const __m128i*)a[j][b].bsums);
            const __m128i b1 = _mm_loadu_si128((const __m128i*)(a[j][b].bsums + 8));
            bpair[j] = _mm_hadd_epi16(b0, b1);
            for (int c = 0; c < 4; c++) av[j][c] = _mm512_loadu_si512(a[j][b].qs + 64 * c);
        }
        for (int i = 0; i < RT; i++) {
            const block_q4_K& x = w[i][b];
            alignas(16) uint8_t sm[16];
            k4_scales_all(x.scales, sm);
            const __m128i sm8 = _mm_load_si128((const __m128i*)sm);
            const float d = h2f(x.d), dmin = h2f(x.dmin);
            // d * sc_k in lanes 0..7, then pattern per ZMM c: groups 2c (lanes 0-7), 2c+1 (8-15)
            const __m512 scf = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(sm8)), _mm512_set1_ps(d));
            __m512 scv[4];
            for (int c = 0; c < 4; c++)
                scv[c] = _mm512_permutexvar_ps(_mm512_setr_epi32(2 * c, 2 * c, 2 * c, 2 * c, 2 * c, 2 * c, 2 * c, 2 * c,
                                                                 2 * c + 1, 2 * c + 1, 2 * c + 1, 2 * c + 1, 2 * c + 1,
                                                                 2 * c + 1, 2 * c + 1, 2 * c + 1),
                                               scf);
            const __m128i mins = _mm_cvtepu8_epi16(_mm_srli_si128(sm8, 8));
            __m512i q[4];
            for (int c = 0; c < 4; c++) {
                const __m256i v = _mm256_loadu_si256((const __m256i*)(x.qs + 32 * c));
                q[c] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(v, m4)),
                                          _mm256_and_si256(_mm256_srli_epi16(v, 4), m4), 1);
            }
            for (int j = 0; j < TT; j++) {
                __m512 sb = _mm512_setzero_ps();
                for (int c = 0; c < 4; c++)
                    sb = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), q[c], av[j][c])),
                                         scv[c], sb);
                const float yd = a[j][b].d;
                const __m512 ms = _mm512_castps256_ps512(_mm256_castps128_ps256(_mm_cvtepi32_ps(_mm_madd_epi16(mins, bpair[j]))));
                acc[i][j] = _mm512_fmadd_ps(sb, _mm512_set1_ps(yd), acc[i][j]);
                acc[i][j] = _mm512_fnmadd_ps(ms, _mm512_set1_ps(dmin * yd), acc[i][j]);
            }
        }
    }
    for (int j = 0; j < TT; j++)
        for (int i = 0; i < RT; i++) A.y[(t0 + j) * A.ldy + r0 + i] = hsum512(acc[i][j]);
}
#endif

// Q6_K: 6-bit values as unsigned q + 32, per-16 int8 scales applied in int16 madd, the 32
// offset removed with the activation sums (bsums).
template <int RT, int TT>
void fused_q6_K(const MatmulArgs& A, int64_t r0, int64_t t0) {
    const int64_t nsb = A.cols / QK_K;
    const block_q6_K* w[RT];
    for (int i = 0; i < RT; i++) w[i] = (const block_q6_K*)(A.w + (r0 + i) * A.w_stride);
    const block_q8_K* a[TT];
    for (int j = 0; j < TT; j++) a[j] = (const block_q8_K*)((const uint8_t*)A.act + (t0 + j) * A.act_stride);
    __m256 acc[RT][TT];
    for (int i = 0; i < RT; i++)
        for (int j = 0; j < TT; j++) acc[i][j] = _mm256_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(0x0f), m2 = _mm256_set1_epi8(3);
    for (int64_t b = 0; b < nsb; b++) {
        for (int i = 0; i < RT; i++) {
            const block_q6_K& x = w[i][b];
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
                const block_q8_K& y = a[j][b];
                __m256i isum = _mm256_mullo_epi32(_mm256_madd_epi16(sc16, _mm256_loadu_si256((const __m256i*)y.bsums)),
                                                  _mm256_set1_epi32(-32));
                for (int k = 0; k < 8; k++) {
                    const __m256i p = _mm256_maddubs_epi16(q[k], _mm256_loadu_si256((const __m256i*)(y.qs + 32 * k)));
                    isum = _mm256_add_epi32(isum, _mm256_madd_epi16(p, scv[k]));
                }
                acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(d * y.d), acc[i][j]);
            }
        }
    }
    for (int j = 0; j < TT; j++)
        for (int i = 0; i < RT; i++) A.y[(t0 + j) * A.ldy + r0 + i] = hsum256(acc[i][j]);
}

#if STOWLM_FUSED_VNNI
// Q6_K with VNNI: values as unsigned q + 32 two 32-element vectors per ZMM (four 16-groups),
// float scale pattern d * sc per ZMM, the +32 offset removed with sum_j sc_j * bsum_j.
template <int RT, int TT>
void fused_q6_K_vnni(const MatmulArgs& A, int64_t r0, int64_t t0) {
    const int64_t nsb = A.cols / QK_K;
    const block_q6_K* w[RT];
    for (int i = 0; i < RT; i++) w[i] = (const block_q6_K*)(A.w + (r0 + i) * A.w_stride);
    const block_q8_K* a[TT];
    for (int j = 0; j < TT; j++) a[j] = (const block_q8_K*)((const uint8_t*)A.act + (t0 + j) * A.act_stride);
    __m512 acc[RT][TT];
    for (int i = 0; i < RT; i++)
        for (int j = 0; j < TT; j++) acc[i][j] = _mm512_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(0x0f), m2 = _mm256_set1_epi8(3);
    for (int64_t b = 0; b < nsb; b++) {
        __m512i av[TT][4];
        __m256i bs[TT];
        for (int j = 0; j < TT; j++) {
            for (int c = 0; c < 4; c++) av[j][c] = _mm512_loadu_si512(a[j][b].qs + 64 * c);
            bs[j] = _mm256_loadu_si256((const __m256i*)a[j][b].bsums);
        }
        for (int i = 0; i < RT; i++) {
            const block_q6_K& x = w[i][b];
            const __m128i sc8 = _mm_loadu_si128((const __m128i*)x.scales);
            const __m256i sc16 = _mm256_cvtepi8_epi16(sc8);
            const float d = h2f(x.d);
            const __m512 scf = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc8)), _mm512_set1_ps(d));
            __m512 scv[4];
            for (int c = 0; c < 4; c++) {
                const int g = 4 * c;
                scv[c] = _mm512_permutexvar_ps(_mm512_setr_epi32(g, g, g, g, g + 1, g + 1, g + 1, g + 1, g + 2, g + 2, g + 2,
                                                                 g + 2, g + 3, g + 3, g + 3, g + 3),
                                               scf);
            }
            __m256i q[8];
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
            __m512i qz[4];
            for (int c = 0; c < 4; c++)
                qz[c] = _mm512_inserti64x4(_mm512_castsi256_si512(q[2 * c]), q[2 * c + 1], 1);
            for (int j = 0; j < TT; j++) {
                __m512 sb = _mm512_setzero_ps();
                for (int c = 0; c < 4; c++)
                    sb = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), qz[c], av[j][c])),
                                         scv[c], sb);
                // offset: 32 * d * sum_j sc_j * bsum_j, in 8 lanes
                const __m512 off = _mm512_castps256_ps512(_mm256_cvtepi32_ps(_mm256_madd_epi16(sc16, bs[j])));
                sb = _mm512_fnmadd_ps(off, _mm512_set1_ps(32.f * d), sb);
                acc[i][j] = _mm512_fmadd_ps(sb, _mm512_set1_ps(a[j][b].d), acc[i][j]);
            }
        }
    }
    for (int j = 0; j < TT; j++)
        for (int i = 0; i < RT; i++) A.y[(t0 + j) * A.ldy + r0 + i] = hsum512(acc[i][j]);
}
#endif

template <int RT, int TT>
void fused_tile(const MatmulArgs& A, int64_t r0, int64_t t0) {
    switch (A.type) {
#if STOWLM_FUSED_VNNI
    // block pairs in ZMM when the row has an even number of blocks
#define STOWLM_Q32(Z, L) return (A.cols / QK) % 2 == 0 ? fused_q32_x2<Z, RT, TT>(A, r0, t0) : fused_q32<L, RT, TT>(A, r0, t0)
#else
#define STOWLM_Q32(Z, L) return fused_q32<L, RT, TT>(A, r0, t0)
#endif
        case QType::Q4_0: STOWLM_Q32(Z4_0, LQ4_0);
        case QType::Q4_1: STOWLM_Q32(Z4_1, LQ4_1);
        case QType::Q5_0: STOWLM_Q32(Z5_0, LQ5_0);
        case QType::Q5_1: STOWLM_Q32(Z5_1, LQ5_1);
        case QType::Q8_0: STOWLM_Q32(Z8_0, LQ8_0);
        case QType::IQ4_NL: STOWLM_Q32(ZIQ4_NL, LIQ4_NL);
#undef STOWLM_Q32
#if STOWLM_FUSED_VNNI
        case QType::Q4_K: return fused_q4_K_vnni<RT, TT>(A, r0, t0);
#else
        case QType::Q4_K: return fused_q4_K<RT, TT>(A, r0, t0);
#endif
#if STOWLM_FUSED_VNNI
        case QType::Q6_K: return fused_q6_K_vnni<RT, TT>(A, r0, t0);
#else
        case QType::Q6_K: return fused_q6_K<RT, TT>(A, r0, t0);
#endif
        default: return;
    }
}

inline bool has_fused(QType t) {
    switch (t) {
        case QType::Q4_0: case QType::Q4_1: case QType::Q5_0: case QType::Q5_1: case QType::Q8_0:
        case QType::IQ4_NL: case QType::Q4_K: case QType::Q6_K: return true;
        default: return false;
    }
}

// Rows [r0, r1) x all tokens, 4 rows x up to 4 tokens per tile.
template <int TT>
void fused_rows_tt(const MatmulArgs& A, int64_t r0, int64_t r1, int64_t t0) {
    int64_t r = r0;
    for (; r + 4 <= r1; r += 4) fused_tile<4, TT>(A, r, t0);
    for (; r < r1; r++) fused_tile<1, TT>(A, r, t0);
}
inline void fused_rows(const MatmulArgs& A, int64_t r0, int64_t r1) {
    int64_t t = 0;
    for (; t + 4 <= A.n_tok; t += 4) fused_rows_tt<4>(A, r0, r1, t);
    switch (A.n_tok - t) {
        case 3: fused_rows_tt<3>(A, r0, r1, t); break;
        case 2: fused_rows_tt<2>(A, r0, r1, t); break;
        case 1: fused_rows_tt<1>(A, r0, r1, t); break;
        default: break;
    }
}

}  // namespace
}  // namespace stowlm::cpu
