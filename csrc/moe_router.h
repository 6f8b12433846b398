// Mixture-of-experts routing for one token, shared by host and device code: pick the k
// experts with the largest router logits and their mixing weights.
#pragma once
#include <cmath>

#include "common.h"

namespace stowlm {

struct RouterParams {
    int k = 1;
    // true: weights are softmax over all experts, taken at the chosen ones (Qwen-MoE, Mixtral
    // when followed by normalize). false: softmax over the k chosen logits only.
    bool softmax_all = true;
    // Rescale the chosen weights to sum to 1 (norm_topk_prob).
    bool normalize = false;
};

// Index of the largest logit not among taken[0..n_taken); ties go to the lower index and NaN
// is never picked over a number. (A scan of the chosen ids rather than a bit set: no local
// array, so device code keeps everything in registers.)
HOST_DEVICE int router_argmax(const float* logits, int n, const int* taken, int n_taken) {
    int best = -1;
    for (int e = 0; e < n; e++) {
        bool used = false;
        for (int u = 0; u < n_taken; u++) used = used || taken[u] == e;
        if (used) continue;
        const float v = logits[e];
        if (best < 0 || v > logits[best] || (logits[best] != logits[best] && v == v)) best = e;
    }
    return best;
}

// Indices of the k (k <= n) largest of x[0..n) into ids[0..k), best first (the TOP_K op).
HOST_DEVICE void router_top_ids(const float* x, int n, int k, int* ids) {
    for (int j = 0; j < k; j++) ids[j] = router_argmax(x, n, ids, j);
}

// The picked experts' gates made final: divided by their sum clamped below at 2^-14 when
// `normalize`, then times `scale` unless it is 0 or 1.
HOST_DEVICE void moe_gate_finish(float* w, int k, bool normalize, float scale) {
    if (normalize) {
        float s = 0.0f;
        for (int j = 0; j < k; j++) s += w[j];
        s = fmaxf(s, 6.103515625e-5f);
        for (int j = 0; j < k; j++) w[j] /= s;
    }
    if (scale != 0.0f && scale != 1.0f)
        for (int j = 0; j < k; j++) w[j] *= scale;
}

// One softmax term over all logits, in double like the CPU op (routers with near-tied experts
// amplify float rounding): the parallel kernels compute each with this and sum in order.
HOST_DEVICE double moe_softmax_term(float logit, float mx) { return exp((double)(logit - mx)); }

// The MOE_WEIGHTS op for one token (same rules as cpu::moe_weights): the gate of each picked
// expert ids[0..k) from the n router logits, softmax over all n (sigmoid_gate false) or a
// sigmoid each; when `normalize`, divided by their sum clamped below at 2^-14 (llama.cpp's
// clamp); then times `scale` unless it is 0 or 1.
HOST_DEVICE void moe_gate_weights(const float* logits, int n, const int* ids, int k, bool sigmoid_gate,
                                  bool normalize, float scale, float* w) {
    if (!sigmoid_gate) {
        // In double like the CPU op: routers with near-tied experts amplify float rounding.
        float mx = logits[0];
        for (int e = 1; e < n; e++) mx = fmaxf(mx, logits[e]);
        double denom = 0.0;
        for (int e = 0; e < n; e++) denom += moe_softmax_term(logits[e], mx);
        for (int j = 0; j < k; j++) w[j] = (float)(moe_softmax_term(logits[ids[j]], mx) / denom);
    } else {
        for (int j = 0; j < k; j++) w[j] = 1.0f / (1.0f + expf(-logits[ids[j]]));
    }
    moe_gate_finish(w, k, normalize, scale);
}

// Experts 0..n-1, top k (k <= n) into ids[0..k), weights into w[0..k), best first.
HOST_DEVICE void router_topk(const float* logits, int n, const RouterParams& p, int* ids, float* w) {
    router_top_ids(logits, n, p.k, ids);
    // Softmax with the largest chosen logit as the shift (it is also the overall maximum).
    const float mx = logits[ids[0]];
    float denom = 0.0f;
    if (p.softmax_all) {
        for (int e = 0; e < n; e++) denom += expf(logits[e] - mx);
    } else {
        for (int j = 0; j < p.k; j++) denom += expf(logits[ids[j]] - mx);
    }
    float total = 0.0f;
    for (int j = 0; j < p.k; j++) {
        w[j] = expf(logits[ids[j]] - mx) / denom;
        total += w[j];
    }
    if (p.normalize && total > 0.0f)
        for (int j = 0; j < p.k; j++) w[j] /= total;
}

}  // namespace stowlm
