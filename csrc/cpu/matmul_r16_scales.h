// The 16 rows' sub-block scales of a repacked K-format super-block as bytes (byte r: row r),
// unpacked from the group's scale bytes with SSE: shared by the AVX2 and AVX-512 kernels.
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "quant/rows16.h"

namespace stowlm::cpu {
namespace {

// Q4_K/Q5_K: the 6-bit scales and mins of the 8 sub-blocks (12 packed bytes a row).
inline void q45k_scale_bytes(const uint8_t (&scales)[12][16], __m128i (&sc)[8], __m128i (&mn)[8]) {
    const __m128i m63 = _mm_set1_epi8(63), m15 = _mm_set1_epi8(15), m3 = _mm_set1_epi8(3);
    __m128i B[12];
    for (int k = 0; k < 12; k++) B[k] = _mm_loadu_si128((const __m128i*)scales[k]);
    for (int s = 0; s < 8; s++) {
        if (s < 4) {
            sc[s] = _mm_and_si128(B[s], m63), mn[s] = _mm_and_si128(B[s + 4], m63);
        } else {
            sc[s] = _mm_or_si128(_mm_and_si128(B[s + 4], m15), _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(B[s - 4], 6), m3), 4));
            mn[s] = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(B[s + 4], 4), m15),
                                 _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(B[s], 6), m3), 4));
        }
    }
}

// Q3_K: the 16 sub-blocks' signed 6-bit scales (12 packed bytes a row, minus 32).
inline void q3k_scale_bytes(const uint8_t (&scales)[12][16], __m128i (&sc)[16]) {
    const __m128i m15 = _mm_set1_epi8(15), m3 = _mm_set1_epi8(3), b32 = _mm_set1_epi8(32);
    __m128i B[12];
    for (int k = 0; k < 12; k++) B[k] = _mm_loadu_si128((const __m128i*)scales[k]);
    for (int s = 0; s < 16; s++) {
        const int i = s & 3, q = s >> 2;
        const __m128i lo = s < 8 ? _mm_and_si128(B[s], m15) : _mm_and_si128(_mm_srli_epi16(B[s - 8], 4), m15);
        const __m128i hi = _mm_and_si128(_mm_srli_epi16(B[8 + i], 2 * q), m3);
        sc[s] = _mm_sub_epi8(_mm_or_si128(lo, _mm_slli_epi16(hi, 4)), b32);
    }
}

// IQ4_XS: the 8 sub-blocks' scales ls - 32 (signed; low nibbles in scales_l, high bits in scales_h).
inline void iq4xs_scale_bytes(const block_iq4_xsx16& x, __m128i (&sc)[8]) {
    const __m128i m15 = _mm_set1_epi8(15), m3 = _mm_set1_epi16(3), b32 = _mm_set1_epi8(32);
    const __m128i h0 = _mm_loadu_si128((const __m128i*)x.scales_h), h1 = _mm_loadu_si128((const __m128i*)(x.scales_h + 8));
    for (int ib = 0; ib < 8; ib++) {
        const __m128i l = _mm_loadu_si128((const __m128i*)x.scales_l[ib / 2]);
        const __m128i lo = _mm_and_si128(ib % 2 ? _mm_srli_epi16(l, 4) : l, m15);
        const __m128i hi = _mm_packus_epi16(_mm_and_si128(_mm_srli_epi16(h0, 2 * ib), m3), _mm_and_si128(_mm_srli_epi16(h1, 2 * ib), m3));
        sc[ib] = _mm_sub_epi8(_mm_or_si128(lo, _mm_slli_epi16(hi, 4)), b32);
    }
}

// A token's activation sums of sub-blocks 2p and 2p + 1 as one int16 pair (for vpmaddwd with the
// rows' pairs of scales or mins): Q2_K/Q3_K/Q6_K's 16-sums (W16), Q4_K/Q5_K's 32-sums (else).
template <bool W16>
inline int32_t bsum_pair(const int16_t* bs, int p) {
    if constexpr (W16) {
        int32_t pr;
        memcpy(&pr, bs + 2 * p, 4);
        return pr;
    } else {
        return (int32_t)((uint32_t)(uint16_t)(int16_t)(bs[4 * p] + bs[4 * p + 1]) |
                         ((uint32_t)(uint16_t)(int16_t)(bs[4 * p + 2] + bs[4 * p + 3]) << 16));
    }
}

}  // namespace
}  // namespace stowlm::cpu
