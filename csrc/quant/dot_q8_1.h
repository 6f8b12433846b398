// Block arithmetic of the GPU quantized matrix products, written once for host and device so
// the CPU tests check the very functions the CUDA kernels run.
//
// Activations: 32-element blocks of int8 (block_q8_1) with the float scale d and the scaled
// sums of each 16-element half (s0, s1), so weight offsets need no extra integer work. The GPU
// keeps this per-32 rounding for every weight type, also where the CPU rounds per 256 as
// llama.cpp's Q8_K does (K formats, 256-element i-quants): the two devices' products differ by
// that rounding.
// Weights: every type is read as 32-element sub-blocks (WSub): 32 small integers packed four
// to a 32-bit word in element order, plus per 16-element half a scale d[h] and an offset m[h]:
//     w[i] = d[i/16] * q[i] + m[i/16]
// which covers the plain formats (Q4_0: d, m = -8d), the ones with a min (Q4_1, Q4_K: m = -dmin*mn)
// and the K formats whose scales change every 16 elements (Q2_K, Q3_K, Q6_K); the grid
// i-quants come as their integer sub-blocks (quant/iquants.h) and MXFP4 as doubled E2M1 levels
// times half its power-of-two scale. Then
//     sum_i w[i] * a.d * a.q[i] = a.d * (d0 * I0 + d1 * I1) + m0 * a.s0 + m1 * a.s1
// with I0, I1 the integer dot products of the halves: four dp4a each on the GPU (__dp4a), or
// one 16-deep int8 tensor-core step per half (mma m16n8k16) in the tiled kernels.
#pragma once
#include <cstdint>
#include <cstring>

#include "common.h"
#include "quant/blocks.h"
#include "quant/iquants.h"
#include "quant/kquants.h"
#include "quant/legacy.h"
#include "quant/mxfp4.h"
#include "quant/quantize_block.h"
#include "quant/types.h"

namespace stowlm {

struct alignas(16) block_q8_1 {
    int32_t qs[8];  // 32 int8 values, element 4k+i in byte i of word k
    float d;        // x[i] ~ d * q[i]
    float s0, s1;   // d * (sum of q over elements 0..15), d * (sum over 16..31)
    float pad;      // 48 bytes: 16-byte aligned rows for vector loads
};
static_assert(sizeof(block_q8_1) == 48, "q8_1 layout");

struct WSub {
    int32_t q[8];
    float d[2];
    float m[2];
};

// ---- integer helpers -----------------------------------------------------------

// c + sum of the four signed byte products of a and b (the __dp4a instruction).
HOST_DEVICE int dp4a(int a, int b, int c) {
#if defined(__CUDA_ARCH__)
    return __dp4a(a, b, c);
#else
    for (int i = 0; i < 4; i++) c += (int)(int8_t)(a >> (8 * i)) * (int)(int8_t)(b >> (8 * i));
    return c;
#endif
}

// Little-endian 32-bit word at a 2-byte aligned address (GGUF blocks are only 2-aligned).
HOST_DEVICE uint32_t load_u32_a2(const uint8_t* p) {
#if defined(__CUDA_ARCH__)
    const uint16_t* h = (const uint16_t*)p;
    return (uint32_t)h[0] | ((uint32_t)h[1] << 16);
#else
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
#endif
}

// Four bytes, each a level of a packed 16-level codebook (legacy.h) picked by the low nibbles
// of the bytes of idx.
HOST_DEVICE uint32_t packed_level_word(uint64_t lo, uint64_t hi, uint32_t idx) {
    uint32_t w = 0;
    for (int i = 0; i < 4; i++) w |= (uint32_t)(uint8_t)packed_level(lo, hi, (idx >> (8 * i)) & 0xF) << (8 * i);
    return w;
}
HOST_DEVICE uint32_t iq4nl_word(uint32_t idx) { return packed_level_word(kIQ4NLPackedLo, kIQ4NLPackedHi, idx); }

HOST_DEVICE void wsub_set_scales(WSub& w, float d0, float d1, float m0, float m1) {
    w.d[0] = d0, w.d[1] = d1, w.m[0] = m0, w.m[1] = m1;
}

// ---- weight sub-block loaders: one per type ------------------------------------------
// `blk` is the block, `s` the 32-element sub-block inside it (always 0 for 32-element types).

HOST_DEVICE void load_wsub_q4(const uint8_t* qs, float d, float m, WSub& w) {
    for (int k = 0; k < 4; k++) {
        const uint32_t v = load_u32_a2(qs + 4 * k);
        w.q[k] = (int32_t)(v & 0x0F0F0F0Fu);
        w.q[k + 4] = (int32_t)((v >> 4) & 0x0F0F0F0Fu);
    }
    wsub_set_scales(w, d, d, m, m);
}

HOST_DEVICE void load_wsub_q5(const uint8_t* qs, const uint8_t* qhp, float d, float m, WSub& w) {
    const uint32_t qh = q5_high_bits(qhp);
    for (int k = 0; k < 4; k++) {
        const uint32_t v = load_u32_a2(qs + 4 * k);
        w.q[k] = (int32_t)((v & 0x0F0F0F0Fu) | (spread_bits4(qh >> (4 * k)) << 4));
        w.q[k + 4] = (int32_t)(((v >> 4) & 0x0F0F0F0Fu) | (spread_bits4(qh >> (16 + 4 * k)) << 4));
    }
    wsub_set_scales(w, d, d, m, m);
}

HOST_DEVICE void load_wsub_q4_0(const block_q4_0* b, int, WSub& w) {
    const float d = fp16_to_f32(b->d);
    load_wsub_q4(b->qs, d, -8.0f * d, w);
}
HOST_DEVICE void load_wsub_q4_1(const block_q4_1* b, int, WSub& w) {
    load_wsub_q4(b->qs, fp16_to_f32(b->d), fp16_to_f32(b->m), w);
}
HOST_DEVICE void load_wsub_q5_0(const block_q5_0* b, int, WSub& w) {
    const float d = fp16_to_f32(b->d);
    load_wsub_q5(b->qs, b->qh, d, -16.0f * d, w);
}
HOST_DEVICE void load_wsub_q5_1(const block_q5_1* b, int, WSub& w) {
    load_wsub_q5(b->qs, b->qh, fp16_to_f32(b->d), fp16_to_f32(b->m), w);
}
HOST_DEVICE void load_wsub_q8_0(const block_q8_0* b, int, WSub& w) {
    for (int k = 0; k < 8; k++) w.q[k] = (int32_t)load_u32_a2((const uint8_t*)b->qs + 4 * k);
    const float d = fp16_to_f32(b->d);
    wsub_set_scales(w, d, d, 0.0f, 0.0f);
}
HOST_DEVICE void load_wsub_iq4_nl(const block_iq4_nl* b, int, WSub& w) {
    for (int k = 0; k < 4; k++) {
        const uint32_t v = load_u32_a2(b->qs + 4 * k);
        w.q[k] = (int32_t)iq4nl_word(v);
        w.q[k + 4] = (int32_t)iq4nl_word(v >> 4);
    }
    const float d = fp16_to_f32(b->d);
    wsub_set_scales(w, d, d, 0.0f, 0.0f);
}

// Q2_K / Q3_K: sub-block s holds elements h*128 + sh*32 + l (h = s/4, sh = s%4), the 2-bit
// field sh of qs[h*32 + l]; its halves are the scale groups 2s and 2s+1.
HOST_DEVICE void load_wsub_q2_K(const block_q2_K* b, int s, WSub& w) {
    const int h = s >> 2, sh = s & 3;
    for (int k = 0; k < 8; k++) w.q[k] = (int32_t)((load_u32_a2(b->qs + h * 32 + 4 * k) >> (2 * sh)) & 0x03030303u);
    const float d = fp16_to_f32(b->d), dmin = fp16_to_f32(b->dmin);
    wsub_set_scales(w, d * (float)q2k_scale(b->scales, 2 * s), d * (float)q2k_scale(b->scales, 2 * s + 1),
                    -dmin * (float)q2k_min(b->scales, 2 * s), -dmin * (float)q2k_min(b->scales, 2 * s + 1));
}
HOST_DEVICE void load_wsub_q3_K(const block_q3_K* b, int s, WSub& w) {
    const int h = s >> 2, sh = s & 3;
    // value = lo + 4*hbit - 4: q = lo | hbit << 2 here, the -4 goes into m.
    for (int k = 0; k < 8; k++) {
        const uint32_t lo = (load_u32_a2(b->qs + h * 32 + 4 * k) >> (2 * sh)) & 0x03030303u;
        const uint32_t hb = (load_u32_a2(b->hmask + 4 * k) >> s) & 0x01010101u;
        w.q[k] = (int32_t)(lo | (hb << 2));
    }
    const float d = fp16_to_f32(b->d);
    const float d0 = d * (float)q3k_scale(b->scales, 2 * s), d1 = d * (float)q3k_scale(b->scales, 2 * s + 1);
    wsub_set_scales(w, d0, d1, -4.0f * d0, -4.0f * d1);
}

// Q4_K / Q5_K: sub-block j is the low (j even) or high nibbles of qs[32*(j/2) ..], one scale
// and min for all 32 elements; Q5_K's fifth bit is bit j of qh[l].
HOST_DEVICE void load_wsub_q4_K(const block_q4_K* b, int j, WSub& w) {
    const int shift = 4 * (j & 1);
    for (int k = 0; k < 8; k++) w.q[k] = (int32_t)((load_u32_a2(b->qs + 32 * (j >> 1) + 4 * k) >> shift) & 0x0F0F0F0Fu);
    uint8_t sc, mn;
    get_scale_min_k4(j, b->scales, &sc, &mn);
    const float d = fp16_to_f32(b->d) * (float)sc, m = -fp16_to_f32(b->dmin) * (float)mn;
    wsub_set_scales(w, d, d, m, m);
}
HOST_DEVICE void load_wsub_q5_K(const block_q5_K* b, int j, WSub& w) {
    const int shift = 4 * (j & 1);
    for (int k = 0; k < 8; k++) {
        const uint32_t lo = (load_u32_a2(b->qs + 32 * (j >> 1) + 4 * k) >> shift) & 0x0F0F0F0Fu;
        const uint32_t hb = (load_u32_a2(b->qh + 4 * k) >> j) & 0x01010101u;
        w.q[k] = (int32_t)(lo | (hb << 4));
    }
    uint8_t sc, mn;
    get_scale_min_k4(j, b->scales, &sc, &mn);
    const float d = fp16_to_f32(b->d) * (float)sc, m = -fp16_to_f32(b->dmin) * (float)mn;
    wsub_set_scales(w, d, d, m, m);
}

// Q6_K: sub-block s = 4h + k is q6k_value(b, h, k, l) for l < 32 (see kquants.h), stored
// here unsigned (0..63) with the -32 folded into m.
HOST_DEVICE void load_wsub_q6_K(const block_q6_K* b, int s, WSub& w) {
    const int h = s >> 2, k = s & 3;
    const int shift = k < 2 ? 0 : 4;
    for (int i = 0; i < 8; i++) {
        const uint32_t lo = (load_u32_a2(b->ql + h * 64 + (k & 1) * 32 + 4 * i) >> shift) & 0x0F0F0F0Fu;
        const uint32_t hi = (load_u32_a2(b->qh + h * 32 + 4 * i) >> (2 * k)) & 0x03030303u;
        w.q[i] = (int32_t)(lo | (hi << 4));
    }
    const float d = fp16_to_f32(b->d);
    const float d0 = d * (float)b->scales[2 * s], d1 = d * (float)b->scales[2 * s + 1];
    wsub_set_scales(w, d0, d1, -32.0f * d0, -32.0f * d1);
}

HOST_DEVICE void load_wsub_q8_K(const block_q8_K* b, int s, WSub& w) {
    for (int k = 0; k < 8; k++) w.q[k] = (int32_t)load_u32_a2((const uint8_t*)b->qs + 32 * s + 4 * k);
    wsub_set_scales(w, b->d, b->d, 0.0f, 0.0f);
}

HOST_DEVICE void load_wsub_iq4_xs(const block_iq4_xs* b, int s, WSub& w) {
    for (int k = 0; k < 4; k++) {
        const uint32_t v = load_u32_a2(b->qs + 16 * s + 4 * k);
        w.q[k] = (int32_t)iq4nl_word(v);
        w.q[k + 4] = (int32_t)iq4nl_word(v >> 4);
    }
    const float d = fp16_to_f32(b->d) * (float)iq4xs_scale(b, s);
    wsub_set_scales(w, d, d, 0.0f, 0.0f);
}

// MXFP4: the doubled E2M1 levels, scaled by half the E8M0 power of two.
HOST_DEVICE void load_wsub_mxfp4(const block_mxfp4* b, int, WSub& w) {
    for (int k = 0; k < 4; k++) {
        const uint32_t v = (uint32_t)b->qs[4 * k] | ((uint32_t)b->qs[4 * k + 1] << 8) | ((uint32_t)b->qs[4 * k + 2] << 16) |
                           ((uint32_t)b->qs[4 * k + 3] << 24);  // 17-byte blocks: byte loads
        w.q[k] = (int32_t)packed_level_word(kMXFP4PackedLo, kMXFP4PackedHi, v);
        w.q[k + 4] = (int32_t)packed_level_word(kMXFP4PackedLo, kMXFP4PackedHi, v >> 4);
    }
    const float d = e8m0_to_f32_half(b->e);
    wsub_set_scales(w, d, d, 0.0f, 0.0f);
}

// The grid i-quants: their integer sub-block form (iquants.h) is already a WSub.
template <class B>
HOST_DEVICE void load_wsub_iq(const B* b, int s, WSub& w) {
    IQSub t;
    iq_sub(b, s, t);
    for (int k = 0; k < 8; k++) w.q[k] = (int32_t)t.q[k];
    const float d = iq_scale(b);
    wsub_set_scales(w, d * (float)t.sc[0], d * (float)t.sc[1], 0.0f, 0.0f);
}

// Compile-time description of each quantized weight type for the kernels: block bytes,
// sub-blocks per block, and the loader.
template <QType T> struct WTraits;
#define STOWLM_WTRAITS(T, Block, fn, subs)                                                          \
    template <> struct WTraits<QType::T> {                                                      \
        static constexpr int kBlockBytes = (int)sizeof(Block);                                  \
        static constexpr int kSubs = subs;                                                      \
        HOST_DEVICE static void load(const uint8_t* row, int sub, WSub& w) {                    \
            fn((const Block*)(row + (size_t)(sub / kSubs) * sizeof(Block)), sub % kSubs, w);   \
        }                                                                                       \
    };
STOWLM_WTRAITS(Q4_0, block_q4_0, load_wsub_q4_0, 1)
STOWLM_WTRAITS(Q4_1, block_q4_1, load_wsub_q4_1, 1)
STOWLM_WTRAITS(Q5_0, block_q5_0, load_wsub_q5_0, 1)
STOWLM_WTRAITS(Q5_1, block_q5_1, load_wsub_q5_1, 1)
STOWLM_WTRAITS(Q8_0, block_q8_0, load_wsub_q8_0, 1)
STOWLM_WTRAITS(IQ4_NL, block_iq4_nl, load_wsub_iq4_nl, 1)
STOWLM_WTRAITS(Q2_K, block_q2_K, load_wsub_q2_K, 8)
STOWLM_WTRAITS(Q3_K, block_q3_K, load_wsub_q3_K, 8)
STOWLM_WTRAITS(Q4_K, block_q4_K, load_wsub_q4_K, 8)
STOWLM_WTRAITS(Q5_K, block_q5_K, load_wsub_q5_K, 8)
STOWLM_WTRAITS(Q6_K, block_q6_K, load_wsub_q6_K, 8)
STOWLM_WTRAITS(Q8_K, block_q8_K, load_wsub_q8_K, 8)
STOWLM_WTRAITS(IQ4_XS, block_iq4_xs, load_wsub_iq4_xs, 8)
STOWLM_WTRAITS(MXFP4, block_mxfp4, load_wsub_mxfp4, 1)
STOWLM_WTRAITS(IQ2_XXS, block_iq2_xxs, load_wsub_iq, 8)
STOWLM_WTRAITS(IQ2_XS, block_iq2_xs, load_wsub_iq, 8)
STOWLM_WTRAITS(IQ2_S, block_iq2_s, load_wsub_iq, 8)
STOWLM_WTRAITS(IQ3_XXS, block_iq3_xxs, load_wsub_iq, 8)
STOWLM_WTRAITS(IQ3_S, block_iq3_s, load_wsub_iq, 8)
STOWLM_WTRAITS(IQ1_S, block_iq1_s, load_wsub_iq, 8)
STOWLM_WTRAITS(IQ1_M, block_iq1_m, load_wsub_iq, 8)
#undef STOWLM_WTRAITS

// Every weight type the q8_1 products take (WTraits above), for the switches that dispatch on
// them: X(Q4_0) X(Q4_1) ...
#define STOWLM_Q8_1_WEIGHT_TYPES(X)                                                                                \
    X(Q4_0) X(Q4_1) X(Q5_0) X(Q5_1) X(Q8_0) X(IQ4_NL) X(Q2_K) X(Q3_K) X(Q4_K) X(Q5_K) X(Q6_K) X(Q8_K) X(IQ4_XS) \
    X(MXFP4) X(IQ2_XXS) X(IQ2_XS) X(IQ2_S) X(IQ3_XXS) X(IQ3_S) X(IQ1_S) X(IQ1_M)

// Runtime dispatch of the loader (host tests; kernels use WTraits). False for a type that
// is not a quantized weight type.
HOST_DEVICE bool load_wsub(QType t, const uint8_t* row, int sub, WSub& w) {
    switch (t) {
#define STOWLM_CASE(T) case QType::T: WTraits<QType::T>::load(row, sub, w); return true;
        STOWLM_Q8_1_WEIGHT_TYPES(STOWLM_CASE)
#undef STOWLM_CASE
        default: return false;
    }
}

// ---- activations ----------------------------------------------------------------

// One activation value: round half away from zero of x / d, within [-127, 127].
HOST_DEVICE int q8_1_value(float x, float id) { return round_half_away(mul_rn(x, id), 127); }

HOST_DEVICE float q8_1_inverse_scale(float amax) { return inverse_or_zero(amax / 127.0f); }

// 32 floats -> one block: d = max|x| / 127 (NaN inputs give q = 0).
HOST_DEVICE void quantize_block_q8_1(const float* x, block_q8_1* y) {
    float amax = 0.0f;
    for (int j = 0; j < QK; j++)
        if (abs_f(x[j]) > amax) amax = abs_f(x[j]);
    const float d = amax / 127.0f, id = q8_1_inverse_scale(amax);
    int sum[2] = {0, 0};
    for (int k = 0; k < 8; k++) {
        uint32_t word = 0;
        for (int i = 0; i < 4; i++) {
            const int q = q8_1_value(x[4 * k + i], id);
            sum[k >> 2] += q;
            word |= (uint32_t)(uint8_t)(int8_t)q << (8 * i);
        }
        y->qs[k] = (int32_t)word;
    }
    y->d = d;
    y->s0 = d * (float)sum[0];
    y->s1 = d * (float)sum[1];
    y->pad = 0.0f;
}

// ---- the dot product ------------------------------------------------------------------

// Integer dot of the 16-element half h of a weight sub-block and an activation block.
HOST_DEVICE int wsub_half_dot(const WSub& w, const block_q8_1& a, int h) {
    int s = 0;
    for (int k = 0; k < 4; k++) s = dp4a(w.q[4 * h + k], a.qs[4 * h + k], s);
    return s;
}

// One 16-element half in float: weight scale d and offset m of the half, activation scale ad
// and scaled half sum as, integer dot i. The tiled kernel (cuda/mmq.cu) applies exactly this
// to each tensor-core result.
HOST_DEVICE float wsub_half_value(float d, float m, float ad, float as, int i) { return d * ad * (float)i + m * as; }

// Both halves of one sub-block against one activation block.
HOST_DEVICE float wsub_combine(const WSub& w, float ad, float as0, float as1, int i0, int i1) {
    return wsub_half_value(w.d[0], w.m[0], ad, as0, i0) + wsub_half_value(w.d[1], w.m[1], ad, as1, i1);
}

HOST_DEVICE float dot_wsub_q8_1(const WSub& w, const block_q8_1& a) {
    return wsub_combine(w, a.d, a.s0, a.s1, wsub_half_dot(w, a, 0), wsub_half_dot(w, a, 1));
}

}  // namespace stowlm
