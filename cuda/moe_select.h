// Expert selection and routing weights of the graph's TOP_K and MOE_WEIGHTS ops in their general
// form (cpu/moe.h: gated scores plus a router bias, expert groups, a softmax over the picked),
// for one token, as HOST_DEVICE code: the CUDA kernels run it (cuda/moe.cu), and the CPU tests
// (tests/test_cuda_math.py through stowlm._core.cuda_math) check it against cpu::top_k and
// cpu::moe_weights. Besides the caller's score row nothing is kept per expert: the kept groups
// are a bit mask and the picked ids are read back from the output, so device code needs no
// local arrays.
#pragma once
#include <cmath>
#include <cstdint>

#include "common.h"
#include "moe_router.h"

namespace stowlm {

// cpu::Gating's values (static_assert'ed against it where both are visible: cuda/moe.cu).
constexpr int kGateSoftmax = 0, kGateSigmoid = 1, kGateSoftmaxSelected = 2;
// Most expert groups the selection takes (one bit each).
constexpr int kMaxExpertGroups = 64;

struct ExpertSelect {
    int n = 0;                  // experts
    int k = 1;                  // picked
    int gating = kGateSoftmax;  // a sigmoid gates the score; the softmaxes select on the raw logit
    const float* bias = nullptr;  // optional, per expert: added to the score (selection only)
    int n_groups = 0, n_group_used = 0;  // > 1 groups: only the n_group_used best groups compete
};

// The selection score of expert e (cpu::top_k's: gating(x) + bias).
HOST_DEVICE float expert_score(const float* x, const ExpertSelect& p, int e) {
    float v = x[e];
    if (p.gating == kGateSigmoid) v = 1.0f / (1.0f + expf(-v));
    return p.bias ? v + p.bias[e] : v;
}

// Whether the selection is on the raw logits (no bias, no groups, no sigmoid): router_top_ids.
HOST_DEVICE bool expert_select_plain(const ExpertSelect& p) {
    return !p.bias && p.n_groups <= 1 && p.gating != kGateSigmoid;
}

// The groups that compete, as a bit mask: the n_group_used groups whose two best scores sum
// highest (one expert per group: its score), ties to the lower group, as cpu::top_k ranks them.
HOST_DEVICE uint64_t expert_groups_kept(const float* score, const ExpertSelect& p) {
    if (p.n_groups <= 1) return ~0ull;
    const int per = p.n / p.n_groups;
    uint64_t kept = 0;
    for (int u = 0; u < p.n_group_used; u++) {
        int best = -1;
        float best_s = 0.0f;
        for (int gi = 0; gi < p.n_groups; gi++) {
            if (kept >> gi & 1) continue;
            float b1 = -INFINITY, b2 = -INFINITY;
            for (int e = gi * per; e < (gi + 1) * per; e++) {
                const float s = score[e];
                if (s > b1) b2 = b1, b1 = s;
                else if (s > b2) b2 = s;
            }
            const float gs = per > 1 ? b1 + b2 : b1;
            if (best < 0 || gs > best_s) best = gi, best_s = gs;
        }
        kept |= 1ull << best;
    }
    return kept;
}

// ids[0..k) = the k best experts by their scores score[0..n), best first, ties to the lower id;
// experts of the groups left out score -inf (cpu::top_k masks them so).
HOST_DEVICE void expert_select_scored(const float* score, const ExpertSelect& p, int* ids) {
    const uint64_t kept = expert_groups_kept(score, p);
    const int per = p.n_groups > 1 ? p.n / p.n_groups : p.n;
    for (int j = 0; j < p.k; j++) {
        int best = -1;
        float best_s = 0.0f;
        for (int e = 0; e < p.n; e++) {
            bool taken = false;
            for (int u = 0; u < j; u++) taken = taken || ids[u] == e;
            if (taken) continue;
            const float s = (kept >> (e / per) & 1) ? score[e] : -INFINITY;
            if (best < 0 || s > best_s) best = e, best_s = s;
        }
        ids[j] = best;
    }
}

// The TOP_K op for one row x[0..n) (cpu::top_k): the scores go to score[0..n) (unused on the
// plain path), then ids[0..k). Requires 1 <= k <= n, and with groups: n_groups <=
// kMaxExpertGroups dividing n, 1 <= n_group_used <= n_groups. (The kernel fills the scores with
// a warp's lanes, then runs expert_select_scored on one.)
HOST_DEVICE void expert_select(const float* x, const ExpertSelect& p, float* score, int* ids) {
    if (expert_select_plain(p)) {
        router_top_ids(x, p.n, p.k, ids);
        return;
    }
    for (int e = 0; e < p.n; e++) score[e] = expert_score(x, p, e);
    expert_select_scored(score, p, ids);
}

// The MOE_WEIGHTS op for one token, every gating (cpu::moe_weights' rules): softmax over all
// logits and a sigmoid each as moe_gate_weights, or a softmax over the k picked (in double, as
// the CPU); then normalized (sum clamped below at 2^-14) and scaled (unless 0 or 1).
HOST_DEVICE void moe_gate_weights_any(const float* logits, int n, const int* ids, int k, int gating, bool normalize,
                                      float scale, float* w) {
    if (gating != kGateSoftmaxSelected) {
        moe_gate_weights(logits, n, ids, k, gating == kGateSigmoid, normalize, scale, w);
        return;
    }
    float mx = logits[ids[0]];
    for (int j = 1; j < k; j++) mx = fmaxf(mx, logits[ids[j]]);
    double sum = 0.0;
    for (int j = 0; j < k; j++) sum += moe_softmax_term(logits[ids[j]], mx);
    for (int j = 0; j < k; j++) w[j] = (float)(moe_softmax_term(logits[ids[j]], mx) / sum);
    moe_gate_finish(w, k, normalize, scale);
}

}  // namespace stowlm
