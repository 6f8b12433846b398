// Tensor parallelism's arithmetic as HOST_DEVICE code: the CPU backend runs it, the CUDA kernels
// (cuda/collective.cu) run it, and the CPU tests (stowlm._core.cuda_math) check it without a GPU.
// An all-reduce must give every shard the same bits whatever device it is on: the sum of the
// partials is taken in shard order, ((p0 + p1) + p2) + ..., one float add at a time (no FMA to
// contract, no tree), so a CPU shard and a CUDA shard agree bit for bit.
#pragma once
#include <cstdint>

#include "common.h"

namespace stowlm {

// The most shards whose partials one all-reduce sums (the CUDA kernel takes their pointers by value).
constexpr int kMaxShards = 16;

// LOCAL_IDS: an expert id renumbered for the shard holding experts [first, first + count), -1
// (no expert here) for any other, negative ones included.
HOST_DEVICE int32_t local_expert_id(int32_t id, int32_t first, int32_t count) {
    return id >= first && id - first < count ? id - first : -1;
}

// ALL_REDUCE: element i of the sum of n partials in shard order (0 when no shard has one).
HOST_DEVICE float shard_order_sum(const float* const* parts, int n, int64_t i) {
    if (n <= 0) return 0.0f;
    float v = parts[0][i];
    for (int s = 1; s < n; s++) v = v + parts[s][i];
    return v;
}

// ALL_GATHER: where element i of the gathered [d, cols] output comes from. Shard s holds rows
// [row0[s], row0[s + 1]) of every column (row0 has n + 1 entries); returns that shard and sets
// *at to the element's offset in its [row0[s + 1] - row0[s], cols] part.
HOST_DEVICE int gather_source(const int64_t* row0, int n, int64_t d, int64_t i, int64_t* at) {
    const int64_t col = i / d, r = i - col * d;
    int s = 0;
    while (s + 1 < n && row0[s + 1] <= r) s++;
    *at = col * (row0[s + 1] - row0[s]) + (r - row0[s]);
    return s;
}

}  // namespace stowlm
