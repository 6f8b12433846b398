// Block quantizers (one block of floats -> one GGUF block), usable on host and device. They
// follow gguf-py's quantize (which follows ggml's reference quantizers): the scale comes from
// the block's (signed) absolute maximum, values are scaled by the inverse of the float32
// scale (before that scale is rounded to fp16 for storage), and rounded the same way.
#pragma once
#include <cstdint>

#include "common.h"
#include "quant/blocks.h"
#include "quant/float_types.h"

namespace stowlm {

HOST_DEVICE float abs_f(float x) { return x < 0.0f ? -x : x; }

// (int)t clamped to [lo, hi], with NaN -> lo, so the float->int conversion is always defined.
// For lo <= t < hi + 1 it is exactly C's truncation, which is what the references use.
HOST_DEVICE int trunc_clamp(float t, int lo, int hi) {
    if (!(t > (float)lo)) return lo;
    if (t >= (float)hi) return hi;
    return (int)t;
}

// Round half away from zero (C roundf, gguf-py's np_roundf) for |v| < 2^24, clamped to
// [-lim, lim]; NaN -> 0. a - trunc(a) is exact in float, so the tie test is exact.
HOST_DEVICE int round_half_away(float v, int lim) {
    float a = abs_f(v);
    if (!(a < (float)lim)) return a == a ? (v < 0.0f ? -lim : lim) : 0;
    int i = (int)a;
    if (a - (float)i >= 0.5f) i++;
    return v < 0.0f ? -i : i;
}

// Round half to even for |v| < 2^22 (ggml's nearest_int): adding 1.5 * 2^23 leaves the
// rounded integer in the low mantissa bits.
HOST_DEVICE int round_half_even(float v) {
    const float t = v + 12582912.0f;
    return (int)(f32_to_bits(t) & 0x7fffffu) - 0x400000;
}

// Index of the first element with the largest magnitude (numpy argmax of |x|).
HOST_DEVICE int argmax_abs(const float* x, int n) {
    int im = 0;
    float am = abs_f(x[0]);
    for (int j = 1; j < n; j++)
        if (abs_f(x[j]) > am) am = abs_f(x[j]), im = j;
    return im;
}

HOST_DEVICE void min_max(const float* x, int n, float* mn, float* mx) {
    float lo = x[0], hi = x[0];
    for (int j = 1; j < n; j++) {
        if (x[j] < lo) lo = x[j];
        if (x[j] > hi) hi = x[j];
    }
    *mn = lo, *mx = hi;
}

HOST_DEVICE float inverse_or_zero(float d) { return d != 0.0f ? 1.0f / d : 0.0f; }

// Q8_0: d = max|x| / 127, q = round_half_away(x / d).
HOST_DEVICE void quantize_block_q8_0(const float* x, block_q8_0* y) {
    float amax = 0.0f;
    for (int j = 0; j < QK; j++)
        if (abs_f(x[j]) > amax) amax = abs_f(x[j]);
    const float d = amax / 127.0f, id = inverse_or_zero(d);
    y->d = f32_to_fp16(d);
    for (int j = 0; j < QK; j++) y->qs[j] = (int8_t)round_half_away(mul_rn(x[j], id), 127);
}

// Q4_0 / Q5_0: d = (signed value of largest magnitude) / -2^(bits-1), so that value maps to
// level 0; q = trunc(x / d + 2^(bits-1) + 0.5) clamped to the top level.
HOST_DEVICE void quantize_block_q4_0(const float* x, block_q4_0* y) {
    const float d = x[argmax_abs(x, QK)] / -8.0f, id = inverse_or_zero(d);
    y->d = f32_to_fp16(d);
    for (int j = 0; j < QK / 2; j++) {
        const int q0 = trunc_clamp(mul_rn(x[j], id) + 8.5f, 0, 15);
        const int q1 = trunc_clamp(mul_rn(x[j + QK / 2], id) + 8.5f, 0, 15);
        y->qs[j] = (uint8_t)(q0 | (q1 << 4));
    }
}

HOST_DEVICE void quantize_block_q5_0(const float* x, block_q5_0* y) {
    const float d = x[argmax_abs(x, QK)] / -16.0f, id = inverse_or_zero(d);
    y->d = f32_to_fp16(d);
    uint32_t qh = 0;
    for (int j = 0; j < QK / 2; j++) {
        const int q0 = trunc_clamp(mul_rn(x[j], id) + 16.5f, 0, 31);
        const int q1 = trunc_clamp(mul_rn(x[j + QK / 2], id) + 16.5f, 0, 31);
        y->qs[j] = (uint8_t)((q0 & 0xF) | ((q1 & 0xF) << 4));
        qh |= (uint32_t)(q0 >> 4) << j;
        qh |= (uint32_t)(q1 >> 4) << (j + QK / 2);
    }
    for (int k = 0; k < 4; k++) y->qh[k] = (uint8_t)(qh >> (8 * k));
}

// Q4_1 / Q5_1: d = (max - min) / top level, m = min, q = trunc((x - min) / d + 0.5).
HOST_DEVICE void quantize_block_q4_1(const float* x, block_q4_1* y) {
    float mn, mx;
    min_max(x, QK, &mn, &mx);
    const float d = (mx - mn) / 15.0f, id = inverse_or_zero(d);
    y->d = f32_to_fp16(d);
    y->m = f32_to_fp16(mn);
    for (int j = 0; j < QK / 2; j++) {
        const int q0 = trunc_clamp(mul_rn(x[j] - mn, id) + 0.5f, 0, 15);
        const int q1 = trunc_clamp(mul_rn(x[j + QK / 2] - mn, id) + 0.5f, 0, 15);
        y->qs[j] = (uint8_t)(q0 | (q1 << 4));
    }
}

HOST_DEVICE void quantize_block_q5_1(const float* x, block_q5_1* y) {
    float mn, mx;
    min_max(x, QK, &mn, &mx);
    const float d = (mx - mn) / 31.0f, id = inverse_or_zero(d);
    y->d = f32_to_fp16(d);
    y->m = f32_to_fp16(mn);
    uint32_t qh = 0;
    for (int j = 0; j < QK / 2; j++) {
        const int q0 = trunc_clamp(mul_rn(x[j] - mn, id) + 0.5f, 0, 31);
        const int q1 = trunc_clamp(mul_rn(x[j + QK / 2] - mn, id) + 0.5f, 0, 31);
        y->qs[j] = (uint8_t)((q0 & 0xF) | ((q1 & 0xF) << 4));
        qh |= (uint32_t)(q0 >> 4) << j;
        qh |= (uint32_t)(q1 >> 4) << (j + QK / 2);
    }
    for (int k = 0; k < 4; k++) y->qh[k] = (uint8_t)(qh >> (8 * k));
}

// Q8_K (activations for the K-quant dot products), as ggml's quantize_row_q8_K_ref:
// iscale = -127 / (signed value of largest magnitude), q = min(127, round_half_even(iscale*x)),
// d = 1 / iscale kept in float32, bsums[i] = sum of q over elements 16i..16i+15. An all-zero
// block gets d = 0, q = 0 and bsums = 0.
HOST_DEVICE void quantize_block_q8_K(const float* x, block_q8_K* y) {
    const float mx = x[argmax_abs(x, QK_K)];
    if (mx == 0.0f || mx != mx) {
        y->d = 0.0f;
        for (int j = 0; j < QK_K; j++) y->qs[j] = 0;
        for (int j = 0; j < QK_K / 16; j++) y->bsums[j] = 0;
        return;
    }
    const float iscale = -127.0f / mx;
    for (int j = 0; j < QK_K; j++) {
        // |iscale * x| <= 127 (plus rounding), far inside round_half_even's range.
        const int v = round_half_even(mul_rn(iscale, x[j]));
        y->qs[j] = (int8_t)(v < 127 ? v : 127);
    }
    for (int j = 0; j < QK_K / 16; j++) {
        int s = 0;
        for (int l = 0; l < 16; l++) s += y->qs[16 * j + l];
        y->bsums[j] = (int16_t)s;
    }
    y->d = 1.0f / iscale;
}

// Q3_K, stowlm's own (gguf-py has none): each 16-element sub-block's scale is the best of a few
// that map its value of largest magnitude near -4 or +3, each refined once by least squares
// over the values it rounds to; the 16 scales share d = (largest in magnitude) / -32 and keep 6
// signed bits; the values are rounded against d * scale, to [-4, 3].
// The nearest Q3_K level (-4..3) to t steps, t clamped first (so huge or NaN t stay in range).
HOST_DEVICE int q3_level(float t) {
    return round_half_even(!(t > -4.0f) ? -4.0f : (t > 3.0f ? 3.0f : t));
}
HOST_DEVICE float q3_fit(const float* v, float s, float* err) {
    float num = 0.0f, den = 0.0f;
    for (int l = 0; l < 16; l++) {
        const int q = q3_level(v[l] / s);
        num += v[l] * (float)q, den += (float)(q * q);
    }
    const float best = den > 0.0f ? num / den : s;
    float e = 0.0f;
    for (int l = 0; l < 16; l++) {
        const int q = q3_level(v[l] / best);
        const float r = v[l] - best * (float)q;
        e += r * r;
    }
    *err = e;
    return best;
}
HOST_DEVICE void quantize_block_q3_K(const float* x, block_q3_K* y) {
    float sub[16];
    for (int j = 0; j < 16; j++) {
        const float* v = x + 16 * j;
        const float mx = v[argmax_abs(v, 16)];
        sub[j] = 0.0f;
        if (mx == 0.0f || mx != mx) continue;
        float best_err = 0.0f;
        for (int c = 0; c < 12; c++) {  // the largest to -4.5 .. -3.4, or to +2.6 .. +3.1
            const float to = c < 8 ? -4.5f + 0.15f * (float)c : 2.6f + 0.17f * (float)(c - 8);
            float err;
            const float s = q3_fit(v, mx / to, &err);
            if (c == 0 || err < best_err) best_err = err, sub[j] = s;
        }
    }
    const float big = sub[argmax_abs(sub, 16)];
    const float d = big / -32.0f;
    const float id = inverse_or_zero(d);
    int sc[16];
    for (int j = 0; j < 16; j++) {
        const int v = round_half_even(sub[j] * id);
        sc[j] = v < -32 ? -32 : (v > 31 ? 31 : v);
    }
    y->d = f32_to_fp16(d);
    const float dd = fp16_to_f32(y->d);
    for (int i = 0; i < 12; i++) y->scales[i] = 0;
    for (int j = 0; j < 16; j++) {
        const int u = sc[j] + 32;  // 0..63: the low 4 bits by sub-block, the top 2 in bytes 8..11
        y->scales[j < 8 ? j : j - 8] |= (uint8_t)((u & 0xF) << (j < 8 ? 0 : 4));
        y->scales[8 + (j & 3)] |= (uint8_t)((u >> 4) << (2 * (j >> 2)));
    }
    for (int i = 0; i < 32; i++) y->hmask[i] = 0;
    for (int i = 0; i < 64; i++) y->qs[i] = 0;
    for (int e = 0; e < QK_K; e++) {
        const float step = dd * (float)sc[e / 16];
        const int u = (step != 0.0f ? q3_level(x[e] / step) : 0) + 4;
        const int n = e / 128, s = (e % 128) / 32, l = e % 32;  // element 128n + 32s + l
        y->qs[32 * n + l] |= (uint8_t)((u & 3) << (2 * s));
        if (u & 4) y->hmask[l] |= (uint8_t)(1 << (4 * n + s));
    }
}

}  // namespace stowlm
