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
// rope_yarn_angle gives the blended angle and the cos/sin magnitude; rope_yarn their cos and sin
// (the CUDA kernel reduces the angle itself before its fast sincos, then scales by *mscale_out).
HOST_DEVICE void rope_yarn_angle(float theta_extrap, float freq_scale, float corr_lo, float corr_hi, int i,
                                 float ext_factor, float mscale, float* theta_out, float* mscale_out) {
    const float theta_interp = freq_scale * theta_extrap;
    float theta = theta_interp;
    if (ext_factor != 0.0f) {
        const float y = ((float)i - corr_lo) / fmaxf(0.001f, corr_hi - corr_lo);
        const float ramp_mix = (1.0f - fminf(1.0f, fmaxf(0.0f, y))) * ext_factor;
        theta = theta_interp * (1.0f - ramp_mix) + theta_extrap * ramp_mix;
        mscale *= 1.0f + 0.1f * logf(1.0f / freq_scale);
    }
    *theta_out = theta;
    *mscale_out = mscale;
}
HOST_DEVICE void rope_yarn(float theta_extrap, float freq_scale, float corr_lo, float corr_hi, int i, float ext_factor,
                           float mscale, float* cos_out, float* sin_out) {
    float theta, m;
    rope_yarn_angle(theta_extrap, freq_scale, corr_lo, corr_hi, i, ext_factor, mscale, &theta, &m);
    *cos_out = cosf(theta) * m;
    *sin_out = sinf(theta) * m;
}
// Whether RoPE parameters ask for YaRN (otherwise plain RoPE): the CPU table's rule.
HOST_DEVICE bool rope_is_yarn(float ext_factor, float attn_factor) { return ext_factor != 0.0f || attn_factor != 1.0f; }

// The angle of pair i at position pos and the magnitude of its cos/sin, as the CUDA rope kernel
// takes them: rope_theta (magnitude 1), or with yarn the CPU table's rope_yarn_angle of
// pos * rope_inv_freq (corr_lo / corr_hi from rope_yarn_corr_dims).
struct RopeAngleParams {
    int n_rot = 0;
    float freq_base = 10000, freq_scale = 1;
    bool yarn = false;
    float ext_factor = 0, attn_factor = 1, corr_lo = 0, corr_hi = 0;
};
HOST_DEVICE void rope_pair_angle(int pos, int i, const RopeAngleParams& p, float* theta, float* mscale) {
    if (p.yarn) {
        rope_yarn_angle((float)pos * rope_inv_freq(i, p.n_rot, p.freq_base), p.freq_scale, p.corr_lo, p.corr_hi, i,
                        p.ext_factor, p.attn_factor, theta, mscale);
    } else {
        *theta = rope_theta(pos, i, p.n_rot, p.freq_base, p.freq_scale);
        *mscale = 1.0f;
    }
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

// Split attention state (m, l, acc) folded in order, as the CUDA kernels merge fixed KV splits:
// the state by online_softmax_merge, each accumulator by one explicit fused multiply-add, so a
// kernel that folds the splits in one block and one that folds the same partials after a
// second launch get the same bits (no contraction left to the compiler).
HOST_DEVICE float attn_fold_acc(float acc, float fa, float part, float fb) { return fmaf(acc, fa, part * fb); }

// The factor a query's accumulated values are multiplied by at the end: the sink (when
// has_sink) joins the denominator, then 1 / l, or 0 when nothing (not even a sink) was seen.
HOST_DEVICE float attn_out_scale(float m, float l, bool has_sink, float sink) {
    float f = 1.0f;
    if (has_sink) f = attn_sink(m, l, sink);
    return l > 0.0f ? f * (1.0f / l) : 0.0f;
}

// The KV cells [*lo, *hi) query sequence q_seq may see when each sequence owns a region of
// seq_cells cells from q_seq * seq_cells (seq_cells 0: all n_kv), up to seq_end[q_seq] where
// given (a sequence holding the regions after its own); clipped to n_kv.
HOST_DEVICE void attn_seq_region(int32_t q_seq, int32_t seq_cells, int64_t n_kv, int64_t* lo, int64_t* hi,
                                 const int32_t* seq_end = nullptr) {
    if (seq_cells > 0) {
        const int64_t a = (int64_t)q_seq * seq_cells, b = seq_end ? (int64_t)seq_end[q_seq] : a + seq_cells;
        *lo = a < n_kv ? a : n_kv;
        *hi = b < n_kv ? b : n_kv;
    } else {
        *lo = 0;
        *hi = n_kv;
    }
}

// The cells [*jb, *je) of split sp (cells [sp * split_len, (sp + 1) * split_len) of n_kv) that
// lie in a query's region [lo, hi); false when none do: that split's state would be empty and
// fold as a no-op, so the kernels neither compute nor fold it.
HOST_DEVICE bool attn_split_cells(int64_t sp, int64_t split_len, int64_t n_kv, int64_t lo, int64_t hi, int64_t* jb,
                                  int64_t* je) {
    const int64_t j0 = sp * split_len, j1 = j0 + split_len < n_kv ? j0 + split_len : n_kv;
    *jb = j0 > lo ? j0 : lo;
    *je = j1 < hi ? j1 : hi;
    return *jb < *je;
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
