// Per-block integer arithmetic of the quantized matrix products of the CPU kernels: unpacking
// a weight block into int8 values with integer or float scales, quantizing activations to 8
// bits, and reference block dot products.
//
// Two unpacked forms cover every weight type:
//   32-element formats (Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 IQ4_NL MXFP4): w[i] = d * q[i] + m,
//     dotted with block_q8_a activations (x[i] ~ a.d * a.qs[i], a.s = a.d * sum a.qs): one
//     scale per 32 values, as llama.cpp's Q8_0 activations for these formats.
//   256-element formats (Q2_K..Q8_K, IQ4_XS and the grid i-quants IQ1_S..IQ3_S):
//     w[i] = d * sc[i/16] * q[i] - dmin * mn[i/16], dotted with block_q8_K32 activations
//     quantized as llama.cpp's Q8_K (one scale per 256 values, so that a model's products
//     round like the reference engine's), kept per 32-group and with the sums of each 16
//     values; integer products per 32-group, scaled by d_w * d_act[group].
// Scale unpacking and the codebooks come from the decoders (quant/kquants.h, iquants.h,
// legacy.h, mxfp4.h). Functions here are static so that each instruction-set build of a kernel file keeps its own copy
// (an inline function shared across files compiled with different -m flags could be linked
// into the baseline path from the AVX-512 one).
#pragma once
#include <cmath>
#include <cstdint>

#include "common.h"
#include "quant/blocks.h"
#include "quant/iquants.h"
#include "quant/kquants.h"
#include "quant/legacy.h"
#include "quant/mxfp4.h"
#include "quant/quantize_block.h"
#include "quant/types.h"

#if defined(__CUDACC__)
#define STOWLM_DOT_FN static __host__ __device__ __forceinline__
#else
#define STOWLM_DOT_FN static inline
#endif

namespace stowlm {

// Q8_0-like activation block with its scaled sum (for the offset of Q4_1/Q5_1 and the
// unsigned-weight trick of the VNNI kernels).
struct block_q8_a {
    float d;
    float s;  // d * sum(qs)
    int8_t qs[QK];
};
static_assert(sizeof(block_q8_a) == 40, "q8_a layout");

// 256 activations for the 256-element formats: 8-bit values, a scale per 32 (all eight equal
// with the Q8_K rule of quantize_row_q8_K32: the K-format kernels take them per group, the
// grid i-quant kernels (cpu/matmul_fused_iq.h) d[0] for the whole block), the sums of each 16
// values. The scales first so that qs starts 64 bytes in (aligned loads in 64-byte
// aligned arrays).
struct block_q8_K32 {
    float d[8];
    int16_t bsums[16];
    int8_t qs[256];
};
static_assert(sizeof(block_q8_K32) == 320, "q8_K32 layout");

enum class DotFamily { Float, Q32, QK256 };

STOWLM_DOT_FN DotFamily dot_family(QType t) {
    switch (t) {
        case QType::F32: case QType::F16: case QType::BF16: return DotFamily::Float;
        case QType::Q4_0: case QType::Q4_1: case QType::Q5_0: case QType::Q5_1: case QType::Q8_0:
        case QType::IQ4_NL: case QType::MXFP4: return DotFamily::Q32;
        default: return DotFamily::QK256;
    }
}

STOWLM_DOT_FN int nearest_int(float f) {
    return (int)(f >= 0 ? f + 0.5f : f - 0.5f);
}

// ---- activation quantization -------------------------------------------------

// k elements (multiple of 32) into k/32 blocks; scale = max|x| / 127 per block.
STOWLM_DOT_FN void quantize_row_q8_a(const float* x, block_q8_a* y, int64_t k) {
    for (int64_t b = 0; b < k / QK; b++) {
        const float* xb = x + b * QK;
        float amax = 0;
        for (int i = 0; i < QK; i++) { const float a = fabsf(xb[i]); amax = a > amax ? a : amax; }
        const float d = amax / 127.f, id = d > 0 ? 1.f / d : 0.f;
        int sum = 0;
        for (int i = 0; i < QK; i++) {
            const int q = nearest_int(xb[i] * id);
            y[b].qs[i] = (int8_t)q;
            sum += q;
        }
        y[b].d = d;
        y[b].s = d * (float)sum;
    }
}

// k elements (multiple of 256) into k/256 block_q8_K32 by llama.cpp's Q8_K rule
// (quantize_block_q8_K): one scale per 256 values, d = -(signed value of largest magnitude) / 127,
// ties to even; the eight 32-groups share d. Call it only from code built without FMA
// contraction (the scalar path): a fused iscale * x + round constant would round differently.
STOWLM_DOT_FN void quantize_row_q8_K32(const float* x, block_q8_K32* y, int64_t k) {
    for (int64_t b = 0; b < k / QK_K; b++) {
        block_q8_K q;
        quantize_block_q8_K(x + b * QK_K, &q);
        for (int g = 0; g < 8; g++) y[b].d[g] = q.d;
        for (int j = 0; j < 16; j++) y[b].bsums[j] = q.bsums[j];
        for (int i = 0; i < QK_K; i++) y[b].qs[i] = q.qs[i];
    }
}

// ---- weight unpacking: 32-element formats ------------------------------------

// q[32] in element order; w = d * q + m.
STOWLM_DOT_FN void unpack_q32(QType t, const void* blk, int8_t* q, float* d, float* m) {
    *m = 0;
    switch (t) {
        case QType::Q4_0: {
            const block_q4_0* b = (const block_q4_0*)blk;
            *d = fp16_to_f32(b->d);
            for (int j = 0; j < 16; j++) {
                q[j] = (int8_t)((b->qs[j] & 0xf) - 8);
                q[j + 16] = (int8_t)((b->qs[j] >> 4) - 8);
            }
            break;
        }
        case QType::Q4_1: {
            const block_q4_1* b = (const block_q4_1*)blk;
            *d = fp16_to_f32(b->d);
            *m = fp16_to_f32(b->m);
            for (int j = 0; j < 16; j++) {
                q[j] = (int8_t)(b->qs[j] & 0xf);
                q[j + 16] = (int8_t)(b->qs[j] >> 4);
            }
            break;
        }
        case QType::Q5_0:
        case QType::Q5_1: {
            const uint8_t* qs;
            const uint8_t* qhp;
            int off;
            if (t == QType::Q5_0) {
                const block_q5_0* b = (const block_q5_0*)blk;
                *d = fp16_to_f32(b->d);
                qs = b->qs, qhp = b->qh, off = 16;
            } else {
                const block_q5_1* b = (const block_q5_1*)blk;
                *d = fp16_to_f32(b->d);
                *m = fp16_to_f32(b->m);
                qs = b->qs, qhp = b->qh, off = 0;
            }
            const uint32_t qh = (uint32_t)qhp[0] | ((uint32_t)qhp[1] << 8) | ((uint32_t)qhp[2] << 16) |
                                ((uint32_t)qhp[3] << 24);
            for (int j = 0; j < 16; j++) {
                q[j] = (int8_t)(((qs[j] & 0xf) | (((qh >> j) & 1) << 4)) - off);
                q[j + 16] = (int8_t)(((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - off);
            }
            break;
        }
        case QType::Q8_0: {
            const block_q8_0* b = (const block_q8_0*)blk;
            *d = fp16_to_f32(b->d);
            for (int j = 0; j < 32; j++) q[j] = b->qs[j];
            break;
        }
        case QType::IQ4_NL: {
            const block_iq4_nl* b = (const block_iq4_nl*)blk;
            *d = fp16_to_f32(b->d);
            for (int j = 0; j < 16; j++) {
                q[j] = (int8_t)iq4nl_value(b->qs[j] & 0xf);
                q[j + 16] = (int8_t)iq4nl_value(b->qs[j] >> 4);
            }
            break;
        }
        case QType::MXFP4: {
            const block_mxfp4* b = (const block_mxfp4*)blk;
            *d = e8m0_to_f32_half(b->e);
            for (int j = 0; j < 16; j++) {
                q[j] = (int8_t)mxfp4_value(b->qs[j] & 0xf);
                q[j + 16] = (int8_t)mxfp4_value(b->qs[j] >> 4);
            }
            break;
        }
        default: break;
    }
}

// ---- weight unpacking: 256-element formats -----------------------------------

// A grid i-quant block from its integer sub-blocks (quant/iquants.h); no min term.
template <class B>
STOWLM_DOT_FN void unpack_iq(const void* blk, int8_t* q, int16_t* sc, float* d) {
    const B* b = (const B*)blk;
    *d = iq_scale(b);
    for (int ib = 0; ib < QK_K / 32; ib++) {
        IQSub s;
        iq_sub(b, ib, s);
        for (int i = 0; i < 32; i++) q[32 * ib + i] = (int8_t)iq_value(s, i);
        sc[2 * ib] = (int16_t)s.sc[0];
        sc[2 * ib + 1] = (int16_t)s.sc[1];
    }
}

// q[256] in element order; w = d * sc[i/16] * q[i] - dmin * mn[i/16].
STOWLM_DOT_FN void unpack_qk(QType t, const void* blk, int8_t* q, int16_t* sc, int16_t* mn, float* d,
                             float* dmin) {
    *dmin = 0;
    for (int j = 0; j < 16; j++) mn[j] = 0;
    switch (t) {
        case QType::Q2_K: {
            const block_q2_K* b = (const block_q2_K*)blk;
            *d = fp16_to_f32(b->d);
            *dmin = fp16_to_f32(b->dmin);
            for (int j = 0; j < 16; j++) {
                sc[j] = (int16_t)q2k_scale(b->scales, j);
                mn[j] = (int16_t)q2k_min(b->scales, j);
            }
            for (int n = 0; n < 2; n++)
                for (int s = 0; s < 4; s++)
                    for (int l = 0; l < 32; l++)
                        q[n * 128 + s * 32 + l] = (int8_t)((b->qs[n * 32 + l] >> (2 * s)) & 3);
            break;
        }
        case QType::Q3_K: {
            const block_q3_K* b = (const block_q3_K*)blk;
            *d = fp16_to_f32(b->d);
            for (int j = 0; j < 16; j++) sc[j] = (int16_t)q3k_scale(b->scales, j);
            for (int n = 0; n < 2; n++)
                for (int s = 0; s < 4; s++)
                    for (int l = 0; l < 32; l++) {
                        const int lo = (b->qs[n * 32 + l] >> (2 * s)) & 3;
                        const int hi = (b->hmask[l] >> (n * 4 + s)) & 1;
                        q[n * 128 + s * 32 + l] = (int8_t)(lo - (hi ? 0 : 4));
                    }
            break;
        }
        case QType::Q4_K:
        case QType::Q5_K: {
            const uint8_t *scales, *qs, *qh = nullptr;
            if (t == QType::Q4_K) {
                const block_q4_K* b = (const block_q4_K*)blk;
                *d = fp16_to_f32(b->d), *dmin = fp16_to_f32(b->dmin);
                scales = b->scales, qs = b->qs;
            } else {
                const block_q5_K* b = (const block_q5_K*)blk;
                *d = fp16_to_f32(b->d), *dmin = fp16_to_f32(b->dmin);
                scales = b->scales, qs = b->qs, qh = b->qh;
            }
            for (int j = 0; j < 8; j++) {
                uint8_t s, m;
                get_scale_min_k4(j, scales, &s, &m);
                sc[2 * j] = sc[2 * j + 1] = s;
                mn[2 * j] = mn[2 * j + 1] = m;
            }
            for (int c = 0; c < 4; c++)
                for (int l = 0; l < 32; l++) {
                    int lo = qs[32 * c + l] & 0xf, hi = qs[32 * c + l] >> 4;
                    if (qh) {
                        lo |= ((qh[l] >> (2 * c)) & 1) << 4;
                        hi |= ((qh[l] >> (2 * c + 1)) & 1) << 4;
                    }
                    q[64 * c + l] = (int8_t)lo;
                    q[64 * c + 32 + l] = (int8_t)hi;
                }
            break;
        }
        case QType::Q6_K: {
            const block_q6_K* b = (const block_q6_K*)blk;
            *d = fp16_to_f32(b->d);
            for (int j = 0; j < 16; j++) sc[j] = b->scales[j];
            for (int n = 0; n < 2; n++) {
                const uint8_t* ql = b->ql + 64 * n;
                const uint8_t* qh = b->qh + 32 * n;
                int8_t* o = q + 128 * n;
                for (int l = 0; l < 32; l++) {
                    o[l] = (int8_t)(((ql[l] & 0xf) | (((qh[l] >> 0) & 3) << 4)) - 32);
                    o[l + 32] = (int8_t)(((ql[l + 32] & 0xf) | (((qh[l] >> 2) & 3) << 4)) - 32);
                    o[l + 64] = (int8_t)(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
                    o[l + 96] = (int8_t)(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
                }
            }
            break;
        }
        case QType::Q8_K: {
            const block_q8_K* b = (const block_q8_K*)blk;
            *d = b->d;
            for (int j = 0; j < 16; j++) sc[j] = 1;
            for (int i = 0; i < 256; i++) q[i] = b->qs[i];
            break;
        }
        case QType::IQ4_XS: {
            const block_iq4_xs* b = (const block_iq4_xs*)blk;
            *d = fp16_to_f32(b->d);
            for (int ib = 0; ib < 8; ib++) {
                sc[2 * ib] = sc[2 * ib + 1] = (int16_t)iq4xs_scale(b, ib);
                for (int j = 0; j < 16; j++) {
                    q[32 * ib + j] = (int8_t)iq4nl_value(b->qs[16 * ib + j] & 0xf);
                    q[32 * ib + j + 16] = (int8_t)iq4nl_value(b->qs[16 * ib + j] >> 4);
                }
            }
            break;
        }
        case QType::IQ2_XXS: return unpack_iq<block_iq2_xxs>(blk, q, sc, d);
        case QType::IQ2_XS: return unpack_iq<block_iq2_xs>(blk, q, sc, d);
        case QType::IQ2_S: return unpack_iq<block_iq2_s>(blk, q, sc, d);
        case QType::IQ3_XXS: return unpack_iq<block_iq3_xxs>(blk, q, sc, d);
        case QType::IQ3_S: return unpack_iq<block_iq3_s>(blk, q, sc, d);
        case QType::IQ1_S: return unpack_iq<block_iq1_s>(blk, q, sc, d);
        case QType::IQ1_M: return unpack_iq<block_iq1_m>(blk, q, sc, d);
        default: break;
    }
}

// ---- reference block dot products --------------------------------------------

STOWLM_DOT_FN int32_t dot_i8(const int8_t* a, const int8_t* b, int n) {
    int32_t s = 0;
    for (int i = 0; i < n; i++) s += (int32_t)a[i] * (int32_t)b[i];
    return s;
}

// One unpacked 32-element weight block against one activation block.
STOWLM_DOT_FN float dot_q32(const int8_t* q, float d, float m, const block_q8_a& a) {
    return d * a.d * (float)dot_i8(q, a.qs, QK) + m * a.s;
}

// One unpacked 256-element weight block against one activation block: per 32-group the
// integer sums, scaled by that group's activation scale.
STOWLM_DOT_FN float dot_qk(const int8_t* q, const int16_t* sc, const int16_t* mn, float d, float dmin,
                           const block_q8_K32& a) {
    float s = 0;
    for (int g = 0; g < 8; g++) {
        int32_t isum = 0, msum = 0;
        for (int j = 2 * g; j < 2 * g + 2; j++) {
            isum += (int32_t)sc[j] * dot_i8(q + 16 * j, a.qs + 16 * j, 16);
            msum += (int32_t)mn[j] * a.bsums[j];
        }
        s += a.d[g] * (d * (float)isum - dmin * (float)msum);
    }
    return s;
}

}  // namespace stowlm
