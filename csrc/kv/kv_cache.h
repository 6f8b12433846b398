// The KV cache: per layer, a K and a V tensor of n_ctx cells on that layer's device, F16 by
// default (Q8_0 option). Cells are filled in order; cell_pos[j] is the position cell j holds
// (-1: empty), and flash attention masks with it (causal, and the window of sliding-window
// layers, which keep a full-size cache for now). Truncating to n tokens empties the cells from
// n on, so the next eval continues from that prefix.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "graph/tensor.h"

namespace stowlm {

struct KVLayout {
    int64_t n_ctx = 0;
    QType type = QType::F16;
    std::vector<int> layer_device;      // per layer
    std::vector<int64_t> layer_k_embd;  // n_head_kv * head_dim_k per layer
    std::vector<int64_t> layer_v_embd;
};

// KV bytes each device holds for this layout (what KVCache allocates), and each layer's share.
std::vector<size_t> kv_bytes_per_device(const KVLayout& layout, size_t n_devices);
std::vector<size_t> kv_bytes_per_layer(const KVLayout& layout);

QType parse_kv_type(const std::string& name);  // "f16" | "q8_0"; InvalidInput otherwise

class KVCache {
public:
    // allocate=false: tensors carry shapes and devices only (for planning).
    KVCache(const KVLayout& layout, const std::vector<Backend*>& backends, bool allocate);

    Tensor* k(int layer) { return &k_[layer]; }
    Tensor* v(int layer) { return &v_[layer]; }
    int64_t n_ctx() const { return layout_.n_ctx; }
    int64_t n_used() const { return n_used_; }
    const std::vector<int32_t>& cell_pos() const { return cell_pos_; }
    const std::vector<size_t>& device_bytes() const { return device_bytes_; }

    // Takes the next n cells for tokens at `pos`; returns the first cell.
    int64_t append(const int32_t* pos, int64_t n);
    void truncate(int64_t n);  // keep the first n cells
    void clear() { truncate(0); }

private:
    KVLayout layout_;
    std::vector<Tensor> k_, v_;
    std::vector<BufferPtr> buffers_;  // one per device
    std::vector<size_t> device_bytes_;
    std::vector<int32_t> cell_pos_;
    int64_t n_used_ = 0;
};

}  // namespace stowlm
