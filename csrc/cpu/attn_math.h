// Per-element arithmetic of the transformer ops, shared by the CPU ops and (later) the CUDA
// kernels so both sides compute the same angles, activations and softmax updates.
#pragma once
#include <cmath>

#include "common.h"

namespace stowlm {

// Rotation angle of pair i (0 <= i < n_rot/2) at position pos, llama.cpp's convention:
// theta_i = pos * freq_scale * base^(-2i/n_rot). rope_inv_freq is the per-pair factor, so a
// caller may tabulate it once and get the same bits as rope_theta.
HOST_DEVICE float rope_inv_freq(int i, int n_rot, float freq_base) {
    return powf(freq_base, -2.0f * (float)i / (float)n_rot);
}
HOST_DEVICE float rope_theta_f(int pos, float inv_freq, float freq_scale) {
    return (float)pos * freq_scale * inv_freq;
}
HOST_DEVICE float rope_theta(int pos, int i, int n_rot, float freq_base, float freq_scale) {
    return rope_theta_f(pos, rope_inv_freq(i, n_rot, freq_base), freq_scale);
}

// YaRN (llama.cpp's ggml rope_yarn): the dims between corr_lo and corr_hi blend interpolated
// (theta * freq_scale) and extrapolated angles, and cos/sin are scaled by mscale, times
// 1 + 0.1 ln(1/freq_scale) when ext_factor != 0. i is the pair index (ggml's i0 / 2).
HOST_DEVICE void rope_yarn(float theta_extrap, float freq_scale, float corr_lo, float corr_hi, int i, float ext_factor,
                           float mscale, float* cos_out, float* sin_out) {
    const float theta_interp = freq_scale * theta_extrap;
    float theta = theta_interp;
    if (ext_factor != 0.0f) {
        const float y = ((float)i - corr_lo) / fmaxf(0.001f, corr_hi - corr_lo);
        const float ramp_mix = (1.0f - fminf(1.0f, fmaxf(0.0f, y))) * ext_factor;
        theta = theta_interp * (1.0f - ramp_mix) + theta_extrap * ramp_mix;
        mscale *= 1.0f + 0.1f * logf(1.0f / freq_scale);
    }
    *cos_out = cosf(theta) * mscale;
    *sin_out = sinf(theta) * mscale;
}

// The first and last dims YaRN corrects (ggml_rope_yarn_corr_dims): where a pair's wavelength
// turns n_ctx_orig over beta_fast resp. beta_slow times.
HOST_DEVICE float rope_yarn_corr_dim(int n_rot, int n_ctx_orig, float n_turns, float base) {
    return (float)n_rot * logf((float)n_ctx_orig / (n_turns * 2.0f * 3.14159265358979323846f)) / (2.0f * logf(base));
}
HOST_DEVICE void rope_yarn_corr_dims(int n_rot, int n_ctx_orig, float base, float beta_fast, float beta_slow,
                                     float* lo, float* hi) {
    *lo = fmaxf(0.0f, floorf(rope_yarn_corr_dim(n_rot, n_ctx_orig, beta_fast, base)));
    *hi = fminf((float)(n_rot - 1), ceilf(rope_yarn_corr_dim(n_rot, n_ctx_orig, beta_slow, base)));
}

// gpt-oss's SwiGLU: the gate clamped above and the linear part clamped both ways at `limit`.
HOST_DEVICE float swiglu_oai(float gate, float up, float alpha, float limit) {
    const float g = fminf(gate, limit);
    const float u = fminf(fmaxf(up, -limit), limit);
    return g / (1.0f + expf(-alpha * g)) * (u + 1.0f);
}

// Online softmax: running max m, running sum l (of exp(s - m)). Raising the max to new_m
// returns the factor the accumulated values (and l, done here) must be multiplied by.
HOST_DEVICE float online_softmax_rescale(float& m, float& l, float new_m) {
    if (!(new_m > m)) return 1.0f;
    const float f = (m == -INFINITY) ? 0.0f : expf(m - new_m);
    m = new_m;
    l *= f;
    return f;
}

// One score: updates (m, l) and returns its weight p; *acc_scale is the factor to apply to
// the accumulator before adding p * v.
HOST_DEVICE float online_softmax_update(float& m, float& l, float score, float* acc_scale) {
    *acc_scale = online_softmax_rescale(m, l, score);
    const float p = expf(score - m);
    l += p;
    return p;
}

// Merges state b into a: afterwards acc = fa * acc_a + fb * acc_b with the returned factors.
HOST_DEVICE void online_softmax_merge(float& m_a, float& l_a, float m_b, float l_b, float* fa, float* fb) {
    const float m = m_a > m_b ? m_a : m_b;
    *fa = (m_a == -INFINITY) ? 0.0f : expf(m_a - m);
    *fb = (m_b == -INFINITY) ? 0.0f : expf(m_b - m);
    l_a = l_a * *fa + l_b * *fb;
    m_a = m;
}

// An attention sink (gpt-oss): a logit with no value that joins the softmax's denominator
// once every cell is in (m, l). Returns the factor the accumulated values must be scaled by.
HOST_DEVICE float attn_sink(float& m, float& l, float sink) {
    const float f = online_softmax_rescale(m, l, sink);
    l += expf(sink - m);
    return f;
}

HOST_DEVICE float apply_softcap(float x, float cap) { return cap * tanhf(x / cap); }

HOST_DEVICE float silu(float x) { return x / (1.0f + expf(-x)); }

// GELU, tanh approximation (ggml's GELU).
HOST_DEVICE float gelu_tanh(float x) {
    const float k0 = 0.7978845608028654f;  // sqrt(2/pi)
    const float k1 = 0.044715f;
    return 0.5f * x * (1.0f + tanhf(k0 * x * (1.0f + k1 * x * x)));
}

}  // namespace stowlm
