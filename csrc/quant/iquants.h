// Decoders for the 256-element i-quants: IQ4_XS (eight 32-element sub-blocks with signed 6-bit
// scales over the IQ4_NL codebook) and the grid formats IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S,
// IQ3_XXS, IQ3_S (groups of 8 or 4 values picked from a codebook, quant/iq_grids.h, with sign
// bits or a +-1/8 delta). Same operation order as gguf-py / ggml, so bit-identical.
#pragma once
#include <cstdint>

#include "common.h"
#include "quant/blocks.h"
#include "quant/iq_grids.h"
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


// ---- grid i-quants ----------------------------------------------------------------------
// Every grid format reads as eight 32-element sub-blocks in integer form,
//     w[32 * ib + i] = d * sc[i / 16] * q[i]
// with one float d per block (iq_scale) and, per sub-block (iq_sub), 32 int8 values q and two
// odd integer scales (one per 16-element half; equal where the format has one per 32). The
// fractional factors of GGUF's formulas go into d: (0.5 + ls) * 0.25 = (2 ls + 1) / 8 for
// IQ2, (2 ls + 1) / 4 for IQ3_XXS, and IQ1's grid + delta = (8 grid +- 1) / 8; d * sc is then
// the same float as GGUF's sub-block scale (a power of two apart from one rounding). The CPU
// panels, the CUDA sub-block loaders and the decoders below all read this one form.

struct IQSub {
    uint32_t q[8];  // element 4k + i in byte i of word k
    int sc[2];
};

// Words 2l and 2l+1 of a sub-block: eight grid values with the signs of the bits of s.
HOST_DEVICE void iq_put8(IQSub& s, int l, uint64_t grid, uint32_t signs) {
    s.q[2 * l] = iq_signed4((uint32_t)grid, signs);
    s.q[2 * l + 1] = iq_signed4((uint32_t)(grid >> 32), signs >> 4);
}
// The same for IQ1: eight values of the grid (times 8) plus the delta byte (+1 or -1) each.
HOST_DEVICE void iq1_put8(IQSub& s, int l, uint64_t grid8, bool minus) {
    const uint32_t delta = minus ? 0xFFFFFFFFu : 0x01010101u;
    s.q[2 * l] = add_bytes4((uint32_t)grid8, delta);
    s.q[2 * l + 1] = add_bytes4((uint32_t)(grid8 >> 32), delta);
}
HOST_DEVICE uint32_t u32_from_u16(const uint16_t* p) { return (uint32_t)p[0] | ((uint32_t)p[1] << 16); }
HOST_DEVICE uint32_t u32_from_bytes(const uint8_t* p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

// IQ2_XXS: per sub-block two words, the four grid indices and then 4 x 7 sign bits and a 4-bit scale.
HOST_DEVICE float iq_scale(const block_iq2_xxs* b) { return fp16_to_f32(b->d) * 0.125f; }
HOST_DEVICE void iq_sub(const block_iq2_xxs* b, int ib, IQSub& s) {
    const uint32_t idx = u32_from_u16(b->qs + 4 * ib), aux = u32_from_u16(b->qs + 4 * ib + 2);
    s.sc[0] = s.sc[1] = 2 * (int)(aux >> 28) + 1;
    for (int l = 0; l < 4; l++) iq_put8(s, l, iq2xxs_grid((idx >> (8 * l)) & 255), iq_signs8((aux >> (7 * l)) & 127));
}

// IQ2_XS: per group of 8 a 9-bit grid index and 7 sign bits; a 4-bit scale per 16 elements.
HOST_DEVICE float iq_scale(const block_iq2_xs* b) { return fp16_to_f32(b->d) * 0.125f; }
HOST_DEVICE void iq_sub(const block_iq2_xs* b, int ib, IQSub& s) {
    s.sc[0] = 2 * (b->scales[ib] & 15) + 1;
    s.sc[1] = 2 * (b->scales[ib] >> 4) + 1;
    for (int l = 0; l < 4; l++) {
        const uint32_t v = b->qs[4 * ib + l];
        iq_put8(s, l, iq2xs_grid(v & 511), iq_signs8(v >> 9));
    }
}

// IQ2_S: 10-bit grid indices (low byte in qs, two bits per group in qh), a sign byte per group
// (the second 32 bytes of qs), a 4-bit scale per 16 elements.
HOST_DEVICE float iq_scale(const block_iq2_s* b) { return fp16_to_f32(b->d) * 0.125f; }
HOST_DEVICE void iq_sub(const block_iq2_s* b, int ib, IQSub& s) {
    s.sc[0] = 2 * (b->scales[ib] & 15) + 1;
    s.sc[1] = 2 * (b->scales[ib] >> 4) + 1;
    for (int l = 0; l < 4; l++) {
        const int idx = b->qs[4 * ib + l] | (((b->qh[ib] >> (2 * l)) & 3) << 8);
        iq_put8(s, l, iq2s_grid(idx), b->qs[QK_K / 8 + 4 * ib + l]);
    }
}

// IQ3_XXS: 8-bit indices of 4-value grid entries (64 bytes), then per sub-block a word of
// 4 x 7 sign bits and a 4-bit scale.
HOST_DEVICE float iq_scale(const block_iq3_xxs* b) { return fp16_to_f32(b->d) * 0.25f; }
HOST_DEVICE void iq_sub(const block_iq3_xxs* b, int ib, IQSub& s) {
    const uint32_t aux = u32_from_bytes(b->qs + QK_K / 4 + 4 * ib);
    s.sc[0] = s.sc[1] = 2 * (int)(aux >> 28) + 1;
    for (int l = 0; l < 4; l++) {
        const uint32_t signs = iq_signs8((aux >> (7 * l)) & 127);
        s.q[2 * l] = iq_signed4(iq3xxs_grid(b->qs[8 * ib + 2 * l]), signs);
        s.q[2 * l + 1] = iq_signed4(iq3xxs_grid(b->qs[8 * ib + 2 * l + 1]), signs >> 4);
    }
}

// IQ3_S: 9-bit indices of 4-value grid entries (low byte in qs, one bit each in qh), explicit
// sign bits, a 4-bit scale per 32 elements.
HOST_DEVICE float iq_scale(const block_iq3_s* b) { return fp16_to_f32(b->d); }
HOST_DEVICE void iq_sub(const block_iq3_s* b, int ib, IQSub& s) {
    s.sc[0] = s.sc[1] = 1 + 2 * ((b->scales[ib / 2] >> (4 * (ib % 2))) & 15);
    for (int k = 0; k < 8; k++) {
        const int idx = b->qs[8 * ib + k] | (((b->qh[ib] >> k) & 1) << 8);
        s.q[k] = iq_signed4(iq3s_grid(idx), (uint32_t)b->signs[4 * ib + k / 2] >> (4 * (k % 2)));
    }
}

// IQ1_S: per group of 8 an 11-bit index into the {-1, 0, 1} grid (low byte in qs, three bits
// in qh); per sub-block a 3-bit scale and the sign of the delta (top bits of its qh word).
HOST_DEVICE float iq_scale(const block_iq1_s* b) { return fp16_to_f32(b->d) * 0.125f; }
HOST_DEVICE void iq_sub(const block_iq1_s* b, int ib, IQSub& s) {
    const uint32_t h = b->qh[ib];
    s.sc[0] = s.sc[1] = 2 * (int)((h >> 12) & 7) + 1;
    for (int l = 0; l < 4; l++) iq1_put8(s, l, iq1s_grid8(b->qs[4 * ib + l] | (((h >> (3 * l)) & 7) << 8)), (h & 0x8000u) != 0);
}

// IQ1_M: as IQ1_S with a delta sign per group of 8 (each nibble of qh: three index bits and
// the sign) and a 3-bit scale per 16 elements; the block's fp16 scale is the top nibbles of
// the four 16-bit scale words.
HOST_DEVICE uint32_t iq1m_scale_word(const block_iq1_m* b, int k) { return (uint32_t)b->scales[2 * k] | ((uint32_t)b->scales[2 * k + 1] << 8); }
HOST_DEVICE float iq_scale(const block_iq1_m* b) {
    const uint32_t h = (iq1m_scale_word(b, 0) >> 12) | ((iq1m_scale_word(b, 1) >> 8) & 0x00F0u) |
                       ((iq1m_scale_word(b, 2) >> 4) & 0x0F00u) | (iq1m_scale_word(b, 3) & 0xF000u);
    return fp16_to_f32((uint16_t)h) * 0.125f;
}
HOST_DEVICE void iq_sub(const block_iq1_m* b, int ib, IQSub& s) {
    const uint32_t w = iq1m_scale_word(b, ib / 2) >> (6 * (ib % 2));
    s.sc[0] = 2 * (int)(w & 7) + 1;
    s.sc[1] = 2 * (int)((w >> 3) & 7) + 1;
    for (int l = 0; l < 4; l++) {
        const uint32_t nib = (uint32_t)b->qh[2 * ib + l / 2] >> (4 * (l % 2));
        iq1_put8(s, l, iq1s_grid8(b->qs[4 * ib + l] | ((nib & 7) << 8)), (nib & 8) != 0);
    }
}

// Value i (0..31) of a sub-block.
HOST_DEVICE int iq_value(const IQSub& s, int i) { return (int)(int8_t)(uint8_t)(s.q[i / 4] >> (8 * (i % 4))); }

template <class B>
HOST_DEVICE void dequantize_iq(const B* b, float* out) {
    const float d = iq_scale(b);
    for (int ib = 0; ib < QK_K / 32; ib++) {
        IQSub s;
        iq_sub(b, ib, s);
        for (int h = 0; h < 2; h++) {
            const float dl = d * (float)s.sc[h];
            for (int j = 16 * h; j < 16 * h + 16; j++) out[32 * ib + j] = dl * (float)iq_value(s, j);
        }
    }
}

HOST_DEVICE void dequantize_block_iq2_xxs(const block_iq2_xxs* b, float* out) { dequantize_iq(b, out); }
HOST_DEVICE void dequantize_block_iq2_xs(const block_iq2_xs* b, float* out) { dequantize_iq(b, out); }
HOST_DEVICE void dequantize_block_iq2_s(const block_iq2_s* b, float* out) { dequantize_iq(b, out); }
HOST_DEVICE void dequantize_block_iq3_xxs(const block_iq3_xxs* b, float* out) { dequantize_iq(b, out); }
HOST_DEVICE void dequantize_block_iq3_s(const block_iq3_s* b, float* out) { dequantize_iq(b, out); }
HOST_DEVICE void dequantize_block_iq1_s(const block_iq1_s* b, float* out) { dequantize_iq(b, out); }
HOST_DEVICE void dequantize_block_iq1_m(const block_iq1_m* b, float* out) { dequantize_iq(b, out); }

}  // namespace stowlm
