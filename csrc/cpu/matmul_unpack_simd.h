// AVX2 unpacking of weight rows into the panel form of matmul_impl.h (signed int8 values
// plus scales), for the files built with AVX2 or more. Falls back to the scalar unpack of
// quant/dot.h for the types without a vector version here. Anonymous namespace: see
// matmul_impl.h.
#pragma once
#include <immintrin.h>

#include "cpu/matmul_impl.h"
#include "cpu/repack.h"

namespace stowlm::cpu {
namespace {

inline float h2f(uint16_t h) { return _cvtsh_ss(h); }

// 16 bytes -> 32 bytes: low nibbles, then high nibbles (the element order of the 4-bit formats).
inline __m256i nibbles32(const uint8_t* p) {
    const __m128i v = _mm_loadu_si128((const __m128i*)p);
    const __m128i m = _mm_set1_epi8(0x0f);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m), _mm_and_si128(v, m));
}
// Bit j of h -> 0xFF in byte j, 0 elsewhere.
inline __m256i byte_mask32(uint32_t h) {
    const __m256i shuf = _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL, 0x0101010101010101LL, 0);
    const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)h), shuf);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    return _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
}
// Bit j of the 32-bit qh -> 0x10 in byte j (the fifth bit of the 5-bit formats).
inline __m256i bits32(const uint8_t* qh) {
    uint32_t h;
    memcpy(&h, qh, 4);
    return _mm256_and_si256(byte_mask32(h), _mm256_set1_epi8(0x10));
}
inline __m256i iq4_lookup(__m256i idx) {
    const __m256i tab = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)kIQ4NLValues));
    return _mm256_shuffle_epi8(tab, idx);
}
inline __m256i mxfp4_lookup(__m256i idx) {
    const __m256i tab = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)kMXFP4Values));
    return _mm256_shuffle_epi8(tab, idx);
}
inline __m256i grid64x4(const uint64_t* g, uint32_t i0, uint32_t i1, uint32_t i2, uint32_t i3) {
    return _mm256_set_epi64x((long long)g[i3], (long long)g[i2], (long long)g[i1], (long long)g[i0]);
}
// IQ1's +-1 delta bytes for each pattern of the four groups of 8 (bit l set: group l subtracts).
struct alignas(32) IQ1Deltas {
    uint64_t v[16][4];
    constexpr IQ1Deltas() : v() {
        for (int m = 0; m < 16; m++)
            for (int l = 0; l < 4; l++) v[m][l] = (m >> l) & 1 ? 0xFFFFFFFFFFFFFFFFULL : 0x0101010101010101ULL;
    }
};
constexpr IQ1Deltas kIQ1Deltas{};
// The grid times 8 plus the deltas: IQ1's values 8 * grid +- 1.
inline __m256i iq1_add_delta(__m256i grid8, unsigned minus) {
    return _mm256_add_epi8(grid8, _mm256_load_si256((const __m256i*)kIQ1Deltas.v[minus]));
}
// Sub-block ib of a 256-element row block in the panel: 32 values and the two 16-element scales.
inline void put_sub(int8_t* q, int16_t* sc, int16_t* mn, int ib, __m256i v, int s0, int s1) {
    _mm256_storeu_si256((__m256i*)(q + 32 * ib), v);
    sc[2 * ib] = (int16_t)s0, sc[2 * ib + 1] = (int16_t)s1;
    mn[2 * ib] = mn[2 * ib + 1] = 0;
}

// ---- grid i-quant sub-block decoders (the panels below and cpu/matmul_fused_iq.h) ----------
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

// A row of grid i-quant blocks into the panel: the signed values sign(u, sgn).
template <class D>
inline void unpack_iq_row(const uint8_t* src, int64_t nsb, int8_t* q, int16_t* sc, int16_t* mn, float* d, float* m) {
    const typename D::B* b = (const typename D::B*)src;
    for (int64_t i = 0; i < nsb; i++) {
        d[i] = iq_scale(&b[i]), m[i] = 0;
        for (int ib = 0; ib < 8; ib++) {
            __m256i u, sgn;
            int s0, s1;
            D::sub(b[i], ib, u, sgn, s0, s1);
            put_sub(q + QK_K * i, sc + 16 * i, mn + 16 * i, ib, _mm256_sign_epi8(u, sgn), s0, s1);
        }
    }
}

// Vector unpack of one row; false when the type has no vector version.
inline bool unpack_row_simd(QType t, const uint8_t* src, int64_t cols, uint8_t* dst, const RowLayout& L) {
    int8_t* q = (int8_t*)(dst + L.q_off);
    float* d = (float*)(dst + L.d_off);
    float* m = (float*)(dst + L.m_off);
    int16_t* sc = (int16_t*)(dst + L.sc_off);
    int16_t* mn = (int16_t*)(dst + L.mn_off);
    const int64_t nb = cols / QK, nsb = cols / QK_K;
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    switch (t) {
        case QType::Q4_0: {
            const block_q4_0* b = (const block_q4_0*)src;
            for (int64_t i = 0; i < nb; i++) {
                _mm256_storeu_si256((__m256i*)(q + 32 * i), _mm256_sub_epi8(nibbles32(b[i].qs), _mm256_set1_epi8(8)));
                d[i] = h2f(b[i].d), m[i] = 0;
            }
            return true;
        }
        case QType::Q4_1: {
            const block_q4_1* b = (const block_q4_1*)src;
            for (int64_t i = 0; i < nb; i++) {
                _mm256_storeu_si256((__m256i*)(q + 32 * i), nibbles32(b[i].qs));
                d[i] = h2f(b[i].d), m[i] = h2f(b[i].m);
            }
            return true;
        }
        case QType::Q5_0: {
            const block_q5_0* b = (const block_q5_0*)src;
            for (int64_t i = 0; i < nb; i++) {
                const __m256i v = _mm256_or_si256(nibbles32(b[i].qs), bits32(b[i].qh));
                _mm256_storeu_si256((__m256i*)(q + 32 * i), _mm256_sub_epi8(v, _mm256_set1_epi8(16)));
                d[i] = h2f(b[i].d), m[i] = 0;
            }
            return true;
        }
        case QType::Q5_1: {
            const block_q5_1* b = (const block_q5_1*)src;
            for (int64_t i = 0; i < nb; i++) {
                _mm256_storeu_si256((__m256i*)(q + 32 * i), _mm256_or_si256(nibbles32(b[i].qs), bits32(b[i].qh)));
                d[i] = h2f(b[i].d), m[i] = h2f(b[i].m);
            }
            return true;
        }
        case QType::Q8_0: {
            const block_q8_0* b = (const block_q8_0*)src;
            for (int64_t i = 0; i < nb; i++) {
                _mm256_storeu_si256((__m256i*)(q + 32 * i), _mm256_loadu_si256((const __m256i*)b[i].qs));
                d[i] = h2f(b[i].d), m[i] = 0;
            }
            return true;
        }
        case QType::IQ4_NL: {
            const block_iq4_nl* b = (const block_iq4_nl*)src;
            for (int64_t i = 0; i < nb; i++) {
                _mm256_storeu_si256((__m256i*)(q + 32 * i), iq4_lookup(nibbles32(b[i].qs)));
                d[i] = h2f(b[i].d), m[i] = 0;
            }
            return true;
        }
        case QType::Q4_K:
        case QType::Q5_K: {
            const size_t bb = t == QType::Q4_K ? sizeof(block_q4_K) : sizeof(block_q5_K);
            for (int64_t i = 0; i < nsb; i++) {
                const uint8_t* blk = src + i * bb;
                // Q4_K and Q5_K share d, dmin, scales at the start
                const block_q4_K* h = (const block_q4_K*)blk;
                d[i] = h2f(h->d), m[i] = h2f(h->dmin);
                for (int j = 0; j < 8; j++) {
                    uint8_t s, mm;
                    get_scale_min_k4(j, h->scales, &s, &mm);
                    sc[16 * i + 2 * j] = sc[16 * i + 2 * j + 1] = s;
                    mn[16 * i + 2 * j] = mn[16 * i + 2 * j + 1] = mm;
                }
                const uint8_t* qs = t == QType::Q4_K ? h->qs : ((const block_q5_K*)blk)->qs;
                const __m256i qh = t == QType::Q5_K ? _mm256_loadu_si256((const __m256i*)((const block_q5_K*)blk)->qh)
                                                    : _mm256_setzero_si256();
                int8_t* o = q + QK_K * i;
                for (int c = 0; c < 4; c++) {
                    const __m256i v = _mm256_loadu_si256((const __m256i*)(qs + 32 * c));
                    __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                    if (t == QType::Q5_K) {
                        const __m256i one = _mm256_set1_epi8(1);
                        lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * c), one), 4));
                        hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * c + 1), one), 4));
                    }
                    _mm256_storeu_si256((__m256i*)(o + 64 * c), lo);
                    _mm256_storeu_si256((__m256i*)(o + 64 * c + 32), hi);
                }
            }
            return true;
        }
        case QType::Q6_K: {
            const block_q6_K* b = (const block_q6_K*)src;
            const __m256i m2 = _mm256_set1_epi8(3), off = _mm256_set1_epi8(32);
            for (int64_t i = 0; i < nsb; i++) {
                d[i] = h2f(b[i].d), m[i] = 0;
                _mm256_storeu_si256((__m256i*)(sc + 16 * i),
                                    _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)b[i].scales)));
                _mm256_storeu_si256((__m256i*)(mn + 16 * i), _mm256_setzero_si256());
                for (int n = 0; n < 2; n++) {
                    const __m256i l0 = _mm256_loadu_si256((const __m256i*)(b[i].ql + 64 * n));
                    const __m256i l1 = _mm256_loadu_si256((const __m256i*)(b[i].ql + 64 * n + 32));
                    const __m256i h = _mm256_loadu_si256((const __m256i*)(b[i].qh + 32 * n));
                    int8_t* o = q + QK_K * i + 128 * n;
                    auto hb = [&](int s) { return _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, s), m2), 4); };
                    _mm256_storeu_si256((__m256i*)(o), _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(l0, m4), hb(0)), off));
                    _mm256_storeu_si256((__m256i*)(o + 32), _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(l1, m4), hb(2)), off));
                    _mm256_storeu_si256((__m256i*)(o + 64),
                                        _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), hb(4)), off));
                    _mm256_storeu_si256((__m256i*)(o + 96),
                                        _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4), hb(6)), off));
                }
            }
            return true;
        }
        case QType::Q8_K: {
            const block_q8_K* b = (const block_q8_K*)src;
            for (int64_t i = 0; i < nsb; i++) {
                d[i] = b[i].d, m[i] = 0;
                memcpy(q + QK_K * i, b[i].qs, QK_K);
                for (int j = 0; j < 16; j++) sc[16 * i + j] = 1, mn[16 * i + j] = 0;
            }
            return true;
        }
        case QType::IQ4_XS: {
            const block_iq4_xs* b = (const block_iq4_xs*)src;
            for (int64_t i = 0; i < nsb; i++) {
                d[i] = h2f(b[i].d), m[i] = 0;
                for (int ib = 0; ib < 8; ib++) {
                    const int s = iq4xs_scale(&b[i], ib);
                    put_sub(q + QK_K * i, sc + 16 * i, mn + 16 * i, ib, iq4_lookup(nibbles32(b[i].qs + 16 * ib)), s, s);
                }
            }
            return true;
        }
        case QType::MXFP4: {
            const block_mxfp4* b = (const block_mxfp4*)src;
            for (int64_t i = 0; i < nb; i++) {
                _mm256_storeu_si256((__m256i*)(q + 32 * i), mxfp4_lookup(nibbles32(b[i].qs)));
                d[i] = e8m0_to_f32_half(b[i].e), m[i] = 0;
            }
            return true;
        }
        // The grid i-quants: the integer form of quant/iquants.h (iq_scale, iq_sub).
        case QType::IQ2_XXS: return unpack_iq_row<DIQ2_XXS>(src, nsb, q, sc, mn, d, m), true;
        case QType::IQ2_XS: return unpack_iq_row<DIQ2_XS>(src, nsb, q, sc, mn, d, m), true;
        case QType::IQ2_S: return unpack_iq_row<DIQ2_S>(src, nsb, q, sc, mn, d, m), true;
        case QType::IQ3_XXS: return unpack_iq_row<DIQ3_XXS>(src, nsb, q, sc, mn, d, m), true;
        case QType::IQ3_S: return unpack_iq_row<DIQ3_S>(src, nsb, q, sc, mn, d, m), true;
        case QType::IQ1_S: return unpack_iq_row<DIQ1_S>(src, nsb, q, sc, mn, d, m), true;
        case QType::IQ1_M: return unpack_iq_row<DIQ1_M>(src, nsb, q, sc, mn, d, m), true;
        default: return false;
    }
}

}  // namespace
}  // namespace stowlm::cpu

namespace stowlm::cpu {
namespace {

// Activation quantization with AVX2 (same scales as quant/dot.h; ties round to even here).
inline __m256i quant8x4(const float* x, __m256 id) {
    // 32 floats -> 32 int8 in element order
    const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x), id));
    const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8), id));
    const __m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 16), id));
    const __m256i d = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 24), id));
    const __m256i ab = _mm256_packs_epi32(a, b), cd = _mm256_packs_epi32(c, d);
    const __m256i v = _mm256_packs_epi16(ab, cd);
    // packs works per 128-bit lane: restore the order of the 8 dword groups
    return _mm256_permutevar8x32_epi32(v, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}
inline float absmax(const float* x, int n) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 m = _mm256_setzero_ps();
    for (int i = 0; i < n; i += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)));
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
inline int hsum_i8x32(__m256i v) {
    const __m256i s16 = _mm256_maddubs_epi16(_mm256_set1_epi8(1), v);
    const __m256i s32 = _mm256_madd_epi16(s16, _mm256_set1_epi16(1));
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(s32), _mm256_extracti128_si256(s32, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

inline void quantize_q8_a_simd(const float* x, block_q8_a* y, int64_t k) {
    for (int64_t b = 0; b < k / QK; b++) {
        const float* xb = x + b * QK;
        const float d = absmax(xb, QK) / 127.f, id = d > 0 ? 1.f / d : 0.f;
        const __m256i q = quant8x4(xb, _mm256_set1_ps(id));
        _mm256_storeu_si256((__m256i*)y[b].qs, q);
        y[b].d = d;
        y[b].s = d * (float)hsum_i8x32(q);
    }
}

// 32 int8 values and their two sums of 16 into a block_q8_K32's group j.
inline void put_q8_K32_group(block_q8_K32& y, int j, __m256i q) {
    _mm256_storeu_si256((__m256i*)(y.qs + 32 * j), q);
    // sums of each 16 (maddubs needs unsigned first: ones x q)
    const __m256i s16 = _mm256_maddubs_epi16(_mm256_set1_epi8(1), q);
    const __m256i s32 = _mm256_madd_epi16(s16, _mm256_set1_epi16(1));  // 8 sums of 4
    const __m256i s2 = _mm256_hadd_epi32(s32, s32);                     // per lane: sums of 8
    const __m256i s4 = _mm256_hadd_epi32(s2, s2);                       // per lane: sum of 16
    y.bsums[2 * j] = (int16_t)_mm256_extract_epi32(s4, 0);
    y.bsums[2 * j + 1] = (int16_t)_mm256_extract_epi32(s4, 4);
}

// llama.cpp's Q8_K rule, the same bits as quantize_row_q8_K32 (quant/dot.h): per 256 values
// iscale = -127 / (the first value of largest magnitude), q = iscale * x rounded to even (the
// conversion's default mode), d = 1 / iscale for all eight groups.
inline void quantize_q8_K32_simd(const float* x, block_q8_K32* y, int64_t k) {
    for (int64_t b = 0; b < k / QK_K; b++) {
        const float* xb = x + b * QK_K;
        const float amax = absmax(xb, QK_K);
        int first = -1;
        if (amax > 0) {
            const __m256 am = _mm256_set1_ps(amax), sign = _mm256_set1_ps(-0.0f);
            for (int i = 0; i < QK_K && first < 0; i += 8) {
                const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(xb + i)), am, _CMP_EQ_OQ));
                if (hit) first = i + __builtin_ctz((unsigned)hit);
            }
        }
        if (first < 0) {  // all zero, or a NaN hid the maximum: the scalar rule decides
            quantize_row_q8_K32(xb, y + b, QK_K);
            continue;
        }
        const float iscale = -127.f / xb[first];
        for (int j = 0; j < 8; j++) put_q8_K32_group(y[b], j, quant8x4(xb + 32 * j, _mm256_set1_ps(iscale)));
        const float d = 1.f / iscale;
        for (int j = 0; j < 8; j++) y[b].d[j] = d;
    }
}

// The batched kernels' panels: `count` rows from r0 unpacked into layout L at `un` (row n at
// un + n * L.bytes); rows past the matrix end are zero weights.
inline void unpack_panel_rows(const MatmulArgs& A, const RowLayout& L, int64_t r0, int count, uint8_t* un) {
    const DotFamily fam = dot_family(A.type);
    static thread_local Panel row16;  // a repacked matrix's row in its GGUF bytes again
    for (int n = 0; n < count; n++) {
        uint8_t* dst = un + n * L.bytes;
        if (r0 + n < A.rows) {
            const uint8_t* src = A.w + (r0 + n) * A.w_stride;
            if (A.rows16) {
                uint8_t* row = (uint8_t*)row16.get(A.w_stride);
                unrepack_row16(A.type, A.rows, A.cols, A.w, r0 + n, row);
                src = row;
            }
            if (!unpack_row_simd(A.type, src, A.cols, dst, L)) unpack_row(A.type, fam, src, A.cols, dst, L);
        } else {
            memset(dst, 0, L.bytes);
        }
    }
}

}  // namespace
}  // namespace stowlm::cpu
