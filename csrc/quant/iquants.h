// Decoder for IQ4_XS: eight 32-element sub-blocks, each with a signed 6-bit scale, over the
// IQ4_NL codebook (quant/legacy.h). Same operation order as gguf-py / ggml.
#pragma once
#include <cstdint>

#include "common.h"
#include "quant/blocks.h"
#include "quant/legacy.h"

namespace stowlm {

// Signed scale (-32..31) of sub-block ib (0..7): low 4 bits from nibble ib%2 of scales_l[ib/2],
// top 2 bits from bits 2*ib.. of scales_h.
HOST_DEVICE int iq4xs_scale(const block_iq4_xs* b, int ib) {
    const int lo = (b->scales_l[ib / 2] >> (4 * (ib % 2))) & 0xF;
    const int hi = (b->scales_h >> (2 * ib)) & 3;
    return (lo | (hi << 4)) - 32;
}

HOST_DEVICE void dequantize_block_iq4_xs(const block_iq4_xs* b, float* out) {
    const float d = fp16_to_f32(b->d);
    for (int ib = 0; ib < QK_K / 32; ib++) {
        const float dl = d * (float)iq4xs_scale(b, ib);
        const uint8_t* qs = b->qs + ib * 16;
        for (int j = 0; j < 16; j++) {
            out[ib * 32 + j] = dl * (float)iq4nl_value(qs[j] & 0xF);
            out[ib * 32 + 16 + j] = dl * (float)iq4nl_value(qs[j] >> 4);
        }
    }
}

}  // namespace stowlm
