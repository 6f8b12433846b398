// Decoder for MXFP4 (OCP microscaling FP4): 32 E2M1 values sharing one E8M0 power-of-two
// scale. As in GGUF, the E2M1 levels are stored doubled (integers -12..12) and the scale
// halved, so w = e8m0_to_f32_half(e) * level exactly as gguf-py computes it.
#pragma once
#include <cstdint>

#include "common.h"
#include "quant/blocks.h"
#include "quant/legacy.h"

namespace stowlm {

// The 16 doubled E2M1 levels (GGUF's kvalues_mxfp4), packed like the IQ4 levels (legacy.h).
constexpr uint64_t kMXFP4PackedLo = 0x0c08060403020100ull;  // codes 0..7: 0 1 2 3 4 6 8 12
constexpr uint64_t kMXFP4PackedHi = 0xf4f8fafcfdfeff00ull;  // codes 8..15: the same, negative
constexpr int8_t kMXFP4Values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
static_assert(detail::packing_ok(kMXFP4PackedLo, kMXFP4PackedHi, kMXFP4Values), "MXFP4 packed levels disagree with the table");

HOST_DEVICE int mxfp4_value(int i) { return packed_level(kMXFP4PackedLo, kMXFP4PackedHi, i); }

// 2^(e - 128): half the E8M0 scale 2^(e - 127), to go with the doubled levels. e = 0 and 1
// give float32 subnormals; no code is NaN here (ggml reads 255 as 2^127 too).
HOST_DEVICE float e8m0_to_f32_half(uint8_t e) {
    return bits_to_f32(e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23);
}

HOST_DEVICE void dequantize_block_mxfp4(const block_mxfp4* b, float* out) {
    const float d = e8m0_to_f32_half(b->e);
    for (int j = 0; j < QK / 2; j++) {
        out[j] = d * (float)mxfp4_value(b->qs[j] & 0xF);
        out[j + QK / 2] = d * (float)mxfp4_value(b->qs[j] >> 4);
    }
}

}  // namespace stowlm
