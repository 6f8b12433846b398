// Decoders for the 256-element K formats (Q2_K..Q6_K, Q8_K) and the scale unpacking the
// matmul kernels share. Elements come out in GGUF order; each value is computed with the
// same operation order as gguf-py / ggml (sub-scale = d * sc, then sub-scale * q - d_min * m),
// so results are bit-identical on host and device.
#pragma once
#include <cstdint>

#include "common.h"
#include "quant/blocks.h"
#include "quant/float_types.h"

namespace stowlm {

// Q4_K / Q5_K: sub-block j (0..7) of the 12 packed bytes holds a 6-bit scale and a 6-bit min.
// Bytes 0..3 hold scales 0..3 (low 6 bits) and the top 2 bits of scales 4..7; bytes 4..7 the
// same for mins; bytes 8..11 the low 4 bits of scale (low nibble) and min (high nibble) 4..7.
HOST_DEVICE void get_scale_min_k4(int j, const uint8_t* q, uint8_t* sc, uint8_t* m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (uint8_t)((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
        *m = (uint8_t)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

// Q3_K: the signed 6-bit scale (-32..31) of sub-block j (0..15). Low 4 bits: byte j (j < 8) or
// the high nibble of byte j-8; top 2 bits: bits 2*(j/4).. of byte 8 + j%4.
HOST_DEVICE int q3k_scale(const uint8_t* scales, int j) {
    const int lo = j < 8 ? (scales[j] & 0xF) : (scales[j - 8] >> 4);
    const int hi = (scales[8 + (j & 3)] >> (2 * (j >> 2))) & 3;
    return (lo | (hi << 4)) - 32;
}

// Q2_K: sub-block j (0..15) has a 4-bit scale (low nibble) and a 4-bit min (high nibble).
HOST_DEVICE int q2k_scale(const uint8_t* scales, int j) { return scales[j] & 0xF; }
HOST_DEVICE int q2k_min(const uint8_t* scales, int j) { return scales[j] >> 4; }

HOST_DEVICE void dequantize_block_q2_K(const block_q2_K* b, float* out) {
    const float d = fp16_to_f32(b->d), dmin = fp16_to_f32(b->dmin);
    // Element h*128 + s*32 + l is bits 2s..2s+1 of qs[h*32 + l]; its sub-block is (that)/16.
    for (int h = 0; h < 2; h++)
        for (int s = 0; s < 4; s++)
            for (int half = 0; half < 2; half++) {
                const int sb = h * 8 + s * 2 + half;
                const float dl = d * (float)q2k_scale(b->scales, sb);
                const float ml = dmin * (float)q2k_min(b->scales, sb);
                for (int l = half * 16; l < half * 16 + 16; l++)
                    out[h * 128 + s * 32 + l] = mul_rn(dl, (float)((b->qs[h * 32 + l] >> (2 * s)) & 3)) - ml;
            }
}

HOST_DEVICE void dequantize_block_q3_K(const block_q3_K* b, float* out) {
    const float d = fp16_to_f32(b->d);
    // Low 2 bits laid out as in Q2_K; the third bit of element h*128 + s*32 + l is bit
    // h*4 + s of hmask[l], and a clear bit means "subtract 4".
    for (int h = 0; h < 2; h++)
        for (int s = 0; s < 4; s++)
            for (int half = 0; half < 2; half++) {
                const int sb = h * 8 + s * 2 + half;
                const float dl = d * (float)q3k_scale(b->scales, sb);
                for (int l = half * 16; l < half * 16 + 16; l++) {
                    const int lo = (b->qs[h * 32 + l] >> (2 * s)) & 3;
                    const int hbit = (b->hmask[l] >> (h * 4 + s)) & 1;
                    out[h * 128 + s * 32 + l] = dl * (float)(lo - (hbit ? 0 : 4));
                }
            }
}

HOST_DEVICE void dequantize_block_q4_K(const block_q4_K* b, float* out) {
    const float d = fp16_to_f32(b->d), dmin = fp16_to_f32(b->dmin);
    // 64 elements per chunk c: the low nibbles of qs[c*32..] then the high nibbles.
    for (int c = 0; c < 4; c++) {
        uint8_t sc0, m0, sc1, m1;
        get_scale_min_k4(2 * c, b->scales, &sc0, &m0);
        get_scale_min_k4(2 * c + 1, b->scales, &sc1, &m1);
        const float d0 = d * (float)sc0, dm0 = dmin * (float)m0;
        const float d1 = d * (float)sc1, dm1 = dmin * (float)m1;
        const uint8_t* qs = b->qs + c * 32;
        for (int l = 0; l < 32; l++) {
            out[c * 64 + l] = mul_rn(d0, (float)(qs[l] & 0xF)) - dm0;
            out[c * 64 + 32 + l] = mul_rn(d1, (float)(qs[l] >> 4)) - dm1;
        }
    }
}

HOST_DEVICE void dequantize_block_q5_K(const block_q5_K* b, float* out) {
    const float d = fp16_to_f32(b->d), dmin = fp16_to_f32(b->dmin);
    // As Q4_K, plus a fifth bit: bit (element / 32) of qh[element % 32].
    for (int c = 0; c < 4; c++) {
        uint8_t sc0, m0, sc1, m1;
        get_scale_min_k4(2 * c, b->scales, &sc0, &m0);
        get_scale_min_k4(2 * c + 1, b->scales, &sc1, &m1);
        const float d0 = d * (float)sc0, dm0 = dmin * (float)m0;
        const float d1 = d * (float)sc1, dm1 = dmin * (float)m1;
        const uint8_t* qs = b->qs + c * 32;
        for (int l = 0; l < 32; l++) {
            const int q0 = (qs[l] & 0xF) | (((b->qh[l] >> (2 * c)) & 1) << 4);
            const int q1 = (qs[l] >> 4) | (((b->qh[l] >> (2 * c + 1)) & 1) << 4);
            out[c * 64 + l] = mul_rn(d0, (float)q0) - dm0;
            out[c * 64 + 32 + l] = mul_rn(d1, (float)q1) - dm1;
        }
    }
}

// Q6_K: element h*128 + k*32 + l (k = 0..3) takes its low 4 bits from ql[h*64 + (k&1)*32 + l]
// (low nibble for k < 2, high for k >= 2) and its top 2 bits from bits 2k.. of qh[h*32 + l].
HOST_DEVICE int q6k_value(const block_q6_K* b, int h, int k, int l) {
    const uint8_t lbyte = b->ql[h * 64 + (k & 1) * 32 + l];
    const int lo = k < 2 ? (lbyte & 0xF) : (lbyte >> 4);
    const int hi = (b->qh[h * 32 + l] >> (2 * k)) & 3;
    return (lo | (hi << 4)) - 32;
}

HOST_DEVICE void dequantize_block_q6_K(const block_q6_K* b, float* out) {
    const float d = fp16_to_f32(b->d);
    for (int h = 0; h < 2; h++)
        for (int k = 0; k < 4; k++)
            for (int half = 0; half < 2; half++) {
                const float dl = d * (float)b->scales[h * 8 + k * 2 + half];
                for (int l = half * 16; l < half * 16 + 16; l++)
                    out[h * 128 + k * 32 + l] = dl * (float)q6k_value(b, h, k, l);
            }
}

HOST_DEVICE void dequantize_block_q8_K(const block_q8_K* b, float* out) {
    for (int j = 0; j < QK_K; j++) out[j] = b->d * (float)b->qs[j];
}

}  // namespace stowlm
