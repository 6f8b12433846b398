// CPU kernels of mixture-of-experts routing (the expert products themselves are mul_mat_id in
// matmul.h): top-k selection, the routing weights of the picked experts, and their weighted sum.
#pragma once
#include <cstdint>

#include "cpu/threadpool.h"

namespace stowlm::cpu {

// ids[r * k + j] = index of the j-th largest of x[r * ldx + 0 .. n) (ties: lower index first),
// for r < n_rows. Requires 1 <= k <= n.
void top_k(const float* x, int64_t n_rows, int64_t n, int64_t ldx, int64_t k, int32_t* ids, ThreadPool& pool);

enum class Gating : int32_t { Softmax = 0, Sigmoid = 1 };

// Routing weights of the picked experts of each token: the gating function of the router
// logits (softmax over all n_expert, or a sigmoid each), taken at ids; when `normalize`, divided
// by their sum (clamped below at 2^-14, as llama.cpp does); then times `scale` (0: none).
void moe_weights(const float* logits, int64_t n_tok, int64_t n_expert, const int32_t* ids, int64_t k, Gating gating,
                 bool normalize, float scale, float* w, ThreadPool& pool);

// y[t * d + c] = sum_j w[t * k + j] * e[(t * k + j) * d + c]: the experts' outputs combined.
void moe_sum(const float* e, const float* w, int64_t n_tok, int64_t k, int64_t d, float* y, ThreadPool& pool);

}  // namespace stowlm::cpu
