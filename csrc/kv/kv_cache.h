// The KV cache: per layer, a K and a V tensor of n_ctx cells on that layer's device, F16 by
// default (Q8_0 option). The cells are shared by n_seq independent sequences, each owning an
// equal region of n_ctx / n_seq cells (as llama-server's slots do): a sequence's tokens sit at
// the same offsets of its region whatever the others hold, so the attention kernels, which
// split and block the cells at fixed boundaries, give a token the same numbers alone or among
// other requests. cell_pos[j] / cell_seq[j] are the position and sequence cell j holds (-1:
// empty), and flash attention masks with them (same sequence, causal, and the window of
// sliding-window layers, which keep a full-size cache for now). Truncating a sequence to its
// first n tokens frees the rest, so the next eval continues from that prefix.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "graph/tensor.h"

namespace stowlm {

// One K and one V tensor: a layer's whole cache, or (tensor parallelism) the part of it one
// shard's KV heads own.
struct KVEntry {
    int layer = 0, shard = 0, device = 0;
    int64_t k_embd = 0, v_embd = 0;  // n_head_kv * head_dim of the heads it holds (v 0: V lives in K)
};

struct KVLayout {
    int64_t n_ctx = 0;
    QType type = QType::F16;
    int n_layer = 0;
    std::vector<KVEntry> entries;  // by layer, then shard
};

// KV bytes each device holds for this layout (what KVCache allocates), and each layer's share.
std::vector<size_t> kv_bytes_per_device(const KVLayout& layout, size_t n_devices);
std::vector<size_t> kv_bytes_per_layer(const KVLayout& layout);

QType parse_kv_type(const std::string& name);  // "f16" | "q8_0"; InvalidInput otherwise

// The fixed KV split of attention over several sequences: the largest of 512, 256, 128 that
// divides a region, so every region starts on a split boundary.
inline int32_t kv_split_cells(int64_t seq_ctx) {
    for (int32_t c : {512, 256, 128})
        if (seq_ctx % c == 0) return c;
    return 512;
}

class KVCache {
public:
    // allocate=false: tensors carry shapes and devices only (for planning).
    KVCache(const KVLayout& layout, const std::vector<Backend*>& backends, bool allocate, int n_seq = 1);

    Tensor* k(int layer, int shard = 0) { return &k_[entry(layer, shard)]; }
    Tensor* v(int layer, int shard = 0) { return &v_[entry(layer, shard)]; }
    int64_t n_ctx() const { return layout_.n_ctx; }
    int64_t seq_ctx() const { return layout_.n_ctx / n_seq(); }  // cells of one sequence's region
    // A sequence may hold the regions of the next span - 1 sequences too (a long request using the
    // cells idle slots leave; llama-server's unified cache), set while they hold nothing.
    int span(int seq) const { return span_.at(seq); }
    int64_t capacity(int seq) const { return span(seq) * seq_ctx(); }
    int64_t region_end(int seq) const { return (seq + span(seq)) * seq_ctx(); }
    int borrowed_by(int seq) const { return borrower_.at(seq); }  // -1: its own
    // InvalidInput when a sequence to be held has cells or is held, or the sequence's cells would
    // not fit a smaller span.
    void set_span(int seq, int n);
    int64_t n_used() const { return n_cells_used_; }            // cells in use, every sequence
    int64_t n_used(int seq) const { return (int64_t)seq_cells_.at(seq).size(); }  // tokens of one sequence
    int64_t span() const;  // the highest cell in use + 1: attention looks at cells [0, span)
    int n_seq() const { return (int)seq_cells_.size(); }
    const std::vector<int32_t>& cell_pos() const { return cell_pos_; }
    const std::vector<int32_t>& cell_seq() const { return cell_seq_; }
    const std::vector<int32_t>& cells_of(int seq) const { return seq_cells_.at(seq); }  // in the order taken
    const std::vector<size_t>& device_bytes() const { return device_bytes_; }

    // Takes the next cell of its sequence's region for each of n tokens (sequence seq[i], position
    // pos[i]); writes them to cells. InvalidInput if a region would overflow.
    void take(const int32_t* pos, const int32_t* seq, int64_t n, int32_t* cells);
    void truncate(int seq, int64_t n);  // keep the first n tokens of a sequence
    void clear(int seq) { truncate(seq, 0); }
    void clear_all();

private:
    size_t entry(int layer, int shard) const;
    KVLayout layout_;
    std::vector<std::vector<int>> entry_of_;  // [layer][shard] -> index, -1 none
    std::vector<Tensor> k_, v_;
    std::vector<BufferPtr> buffers_;  // one per device
    std::vector<size_t> device_bytes_;
    std::vector<int32_t> cell_pos_, cell_seq_;
    std::vector<std::vector<int32_t>> seq_cells_;
    std::vector<int> span_, borrower_;
    int64_t n_cells_used_ = 0;
};

}  // namespace stowlm
