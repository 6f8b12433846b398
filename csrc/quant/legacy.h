// Decoders for the 32-element formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL). Each writes
// the block's 32 values in GGUF order; the arithmetic order (scale * q, then + min) is the
// one gguf-py and ggml use, so results are bit-identical.
#pragma once
#include <cstdint>

#include "common.h"
#include "quant/blocks.h"
#include "quant/float_types.h"

namespace stowlm {

// The 16 non-linear IQ4 levels (GGUF's kvalues_iq4nl), packed as int8 bytes into two 64-bit
// words so host and device code read them from immediates: a namespace-scope array is not
// addressable from device code, and a local array would spill to local memory.
constexpr uint64_t kIQ4NLPackedLo = 0xf6eaddcfbfad9881ull;  // levels 0..7
constexpr uint64_t kIQ4NLPackedHi = 0x7159453526190d01ull;   // levels 8..15
// Host-side copy for SIMD table setup (pshufb); checked against the packed words below.
constexpr int8_t kIQ4NLValues[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                     1,    13,   25,  38,  53,  69,  89,  113};

// Level i (0..15) of a 16-level int8 codebook packed into two words as above.
HOST_DEVICE int packed_level(uint64_t lo, uint64_t hi, int i) {
    return (int)(int8_t)(uint8_t)((i < 8 ? lo : hi) >> (8 * (i & 7)));
}

// Level i (0..15) of the IQ4 codebook, used by IQ4_NL and IQ4_XS.
HOST_DEVICE int iq4nl_value(int i) { return packed_level(kIQ4NLPackedLo, kIQ4NLPackedHi, i); }

namespace detail {
constexpr bool packing_ok(uint64_t lo, uint64_t hi, const int8_t (&values)[16]) {
    for (int i = 0; i < 16; i++) {
        const uint64_t w = i < 8 ? lo : hi;
        if ((int8_t)(uint8_t)(w >> (8 * (i & 7))) != values[i]) return false;
    }
    return true;
}
static_assert(packing_ok(kIQ4NLPackedLo, kIQ4NLPackedHi, kIQ4NLValues), "IQ4_NL packed levels disagree with the table");
}  // namespace detail

// The 32 5-bit high bits of Q5_0/Q5_1 as one little-endian word (bit j = element j).
HOST_DEVICE uint32_t q5_high_bits(const uint8_t qh[4]) {
    return (uint32_t)qh[0] | ((uint32_t)qh[1] << 8) | ((uint32_t)qh[2] << 16) | ((uint32_t)qh[3] << 24);
}

// Element j (0..31) of a packed 4-bit block: low nibbles hold 0..15, high nibbles 16..31.
HOST_DEVICE int nibble_at(const uint8_t* qs, int j) { return j < 16 ? (qs[j] & 0xF) : (qs[j - 16] >> 4); }

HOST_DEVICE void dequantize_block_q4_0(const block_q4_0* b, float* out) {
    const float d = fp16_to_f32(b->d);
    for (int j = 0; j < QK / 2; j++) {
        out[j] = d * (float)((b->qs[j] & 0xF) - 8);
        out[j + QK / 2] = d * (float)((b->qs[j] >> 4) - 8);
    }
}

HOST_DEVICE void dequantize_block_q4_1(const block_q4_1* b, float* out) {
    const float d = fp16_to_f32(b->d), m = fp16_to_f32(b->m);
    for (int j = 0; j < QK / 2; j++) {
        out[j] = mul_rn(d, (float)(b->qs[j] & 0xF)) + m;
        out[j + QK / 2] = mul_rn(d, (float)(b->qs[j] >> 4)) + m;
    }
}

HOST_DEVICE void dequantize_block_q5_0(const block_q5_0* b, float* out) {
    const float d = fp16_to_f32(b->d);
    const uint32_t qh = q5_high_bits(b->qh);
    for (int j = 0; j < QK / 2; j++) {
        const int h0 = (int)((qh >> j) & 1u) << 4, h1 = (int)((qh >> (j + 16)) & 1u) << 4;
        out[j] = d * (float)(((b->qs[j] & 0xF) | h0) - 16);
        out[j + QK / 2] = d * (float)(((b->qs[j] >> 4) | h1) - 16);
    }
}

HOST_DEVICE void dequantize_block_q5_1(const block_q5_1* b, float* out) {
    const float d = fp16_to_f32(b->d), m = fp16_to_f32(b->m);
    const uint32_t qh = q5_high_bits(b->qh);
    for (int j = 0; j < QK / 2; j++) {
        const int h0 = (int)((qh >> j) & 1u) << 4, h1 = (int)((qh >> (j + 16)) & 1u) << 4;
        out[j] = mul_rn(d, (float)((b->qs[j] & 0xF) | h0)) + m;
        out[j + QK / 2] = mul_rn(d, (float)((b->qs[j] >> 4) | h1)) + m;
    }
}

HOST_DEVICE void dequantize_block_q8_0(const block_q8_0* b, float* out) {
    const float d = fp16_to_f32(b->d);
    for (int j = 0; j < QK; j++) out[j] = d * (float)b->qs[j];
}

HOST_DEVICE void dequantize_block_iq4_nl(const block_iq4_nl* b, float* out) {
    const float d = fp16_to_f32(b->d);
    for (int j = 0; j < QK / 2; j++) {
        out[j] = d * (float)iq4nl_value(b->qs[j] & 0xF);
        out[j + QK / 2] = d * (float)iq4nl_value(b->qs[j] >> 4);
    }
}

}  // namespace stowlm
