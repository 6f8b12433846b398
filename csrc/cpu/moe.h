// CPU kernels of mixture-of-experts routing (the expert products themselves are mul_mat_id in
// matmul.h): top-k selection, the routing weights of the picked experts, and their weighted sum.
#pragma once
#include <cstdint>

#include "cpu/threadpool.h"

namespace stowlm::cpu {

// How router logits become routing weights: softmax over all experts, a sigmoid each, or a
// softmax over the k picked logits only (gpt-oss, llama.cpp's SOFTMAX_WEIGHT).
enum class Gating : int32_t { Softmax = 0, Sigmoid = 1, SoftmaxSelected = 2 };

// Which experts each token takes: ids[r * k + j] = the j-th best expert of row r (ties: lower
// index first), best by the selection score gating(x) + bias (bias may be null; a softmax
// selects on the raw logits, as it is monotonic). With n_groups > 1 the experts form that many
// equal groups and only the n_group_used groups with the largest sum of their two best scores
// compete (DeepSeek-V3). Requires 1 <= k <= n.
struct TopKParams {
    int64_t k = 1;
    Gating gating = Gating::Softmax;
    const float* bias = nullptr;
    int64_t n_groups = 0, n_group_used = 0;
};
void top_k(const float* x, int64_t n_rows, int64_t n, int64_t ldx, const TopKParams& p, int32_t* ids,
           ThreadPool& pool);

// Routing weights of the picked experts of each token: the gating function of the router
// logits (softmax over all n_expert, a sigmoid each, or a softmax over the picked), taken at
// ids; when `normalize`, divided by their sum (clamped below at 2^-14, as llama.cpp does);
// then times `scale` (0: none).
void moe_weights(const float* logits, int64_t n_tok, int64_t n_expert, const int32_t* ids, int64_t k, Gating gating,
                 bool normalize, float scale, float* w, ThreadPool& pool);

// x[(t * k + j) * d + c] += bias[ids[t * k + j] * d + c]: each slot's expert bias (in place);
// nothing for id -1 (the expert lives on another shard).
void add_id(float* x, const float* bias, int64_t n_expert, const int32_t* ids, int64_t n_tok, int64_t k, int64_t d,
            ThreadPool& pool);

// y[t * d + c] = sum_j w[t * k + j] * e[(t * k + j) * d + c]: the experts' outputs combined.
void moe_sum(const float* e, const float* w, int64_t n_tok, int64_t k, int64_t d, float* y, ThreadPool& pool);

}  // namespace stowlm::cpu
