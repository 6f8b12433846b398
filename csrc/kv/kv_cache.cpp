#include "kv/kv_cache.h"

#include <algorithm>
#include <string>

#include "error.h"

namespace stowlm {

namespace {
constexpr size_t kAlign = 64;
size_t align_up(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

// Bytes of one layer's K or V tensor, as laid out in the device buffer.
size_t tensor_bytes(QType type, int64_t embd, int64_t n_ctx) { return align_up(row_bytes(type, embd) * n_ctx); }
}  // namespace

QType parse_kv_type(const std::string& name) {
    if (name == "f16") return QType::F16;
    if (name == "q8_0") return QType::Q8_0;
    if (name == "f32") return QType::F32;
    throw InvalidInput("kv_type: '" + name + "' is not one of f16, q8_0, f32");
}

namespace {
size_t entry_bytes(const KVLayout& l, const KVEntry& e) {
    return tensor_bytes(l.type, e.k_embd, l.n_ctx) + tensor_bytes(l.type, e.v_embd, l.n_ctx);
}
}  // namespace

std::vector<size_t> kv_bytes_per_layer(const KVLayout& l) {
    std::vector<size_t> bytes(l.n_layer, 0);
    for (const KVEntry& e : l.entries) bytes.at(e.layer) += entry_bytes(l, e);
    return bytes;
}

std::vector<size_t> kv_bytes_per_device(const KVLayout& l, size_t n_devices) {
    std::vector<size_t> bytes(n_devices, 0);
    for (const KVEntry& e : l.entries) bytes.at(e.device) += entry_bytes(l, e);
    return bytes;
}

KVCache::KVCache(const KVLayout& layout, const std::vector<Backend*>& backends, bool allocate, int n_seq)
    : layout_(layout) {
    if (n_seq < 1) throw InvalidInput("KV cache: n_seq must be >= 1");
    const size_t n_entry = layout.entries.size();
    device_bytes_ = kv_bytes_per_device(layout, backends.size());
    buffers_.resize(backends.size());
    if (allocate)
        for (size_t d = 0; d < backends.size(); d++)
            if (device_bytes_[d]) buffers_[d] = backends[d]->alloc_buffer(device_bytes_[d], "KV cache");
    k_.resize(n_entry);
    v_.resize(n_entry);
    entry_of_.assign(layout.n_layer, {});
    std::vector<size_t> offset(backends.size(), 0);
    for (size_t i = 0; i < n_entry; i++) {
        const KVEntry& e = layout.entries[i];
        const int dev = e.device;
        std::vector<int>& row = entry_of_.at(e.layer);
        if ((int)row.size() <= e.shard) row.resize(e.shard + 1, -1);
        row[e.shard] = (int)i;
        for (int kv = 0; kv < 2; kv++) {
            Tensor& t = kv ? v_[i] : k_[i];
            t.name = "cache_" + std::string(kv ? "v" : "k") + std::to_string(e.layer) +
                     (e.shard ? "." + std::to_string(e.shard) : "");
            t.type = layout.type;
            t.ne[0] = kv ? e.v_embd : e.k_embd;
            t.ne[1] = layout.n_ctx;
            set_contiguous_strides(t);
            t.role = TensorRole::KV;
            t.device = dev;
            if (buffers_[dev]) {
                t.buffer = buffers_[dev].get();
                t.data = (char*)buffers_[dev]->data + offset[dev];
            }
            offset[dev] += tensor_bytes(t.type, t.ne[0], layout.n_ctx);
        }
    }
    seq_cells_.resize(n_seq);
    span_.assign(n_seq, 1);
    borrower_.assign(n_seq, -1);
    clear_all();
}

void KVCache::set_span(int seq, int n) {
    const std::string what = "kv_span(seq=" + std::to_string(seq) + ", n=" + std::to_string(n) + "): ";
    if (seq < 0 || seq >= n_seq()) throw InvalidInput(what + "the sequence is outside [0, " + std::to_string(n_seq()) + ")");
    if (n < 1 || seq + n > n_seq())
        throw InvalidInput(what + "a sequence holds 1 to " + std::to_string(n_seq() - seq) + " regions from its own");
    if (borrower_[seq] >= 0)
        throw InvalidInput(what + "its own region is held by sequence " + std::to_string(borrower_[seq]));
    if (n_used(seq) > n * seq_ctx())
        throw InvalidInput(what + "it holds " + std::to_string(n_used(seq)) + " tokens, more than " +
                           std::to_string(n * seq_ctx()) + " cells");
    for (int q = seq + span_[seq]; q < seq + n; q++) {
        if (borrower_[q] >= 0 && borrower_[q] != seq)
            throw InvalidInput(what + "sequence " + std::to_string(q) + "'s region is held by sequence " +
                               std::to_string(borrower_[q]));
        if (!seq_cells_[q].empty() || span_[q] > 1)
            throw InvalidInput(what + "sequence " + std::to_string(q) + " holds tokens; clear it first");
    }
    for (int q = seq + 1; q < seq + span_[seq]; q++) borrower_[q] = -1;
    for (int q = seq + 1; q < seq + n; q++) borrower_[q] = seq;
    span_[seq] = n;
}

size_t KVCache::entry(int layer, int shard) const {
    if (layer < 0 || layer >= (int)entry_of_.size() || shard < 0 || shard >= (int)entry_of_[layer].size() ||
        entry_of_[layer][shard] < 0)
        throw InvalidInput("KV cache: no cache for layer " + std::to_string(layer) + ", shard " + std::to_string(shard));
    return (size_t)entry_of_[layer][shard];
}

void KVCache::clear_all() {
    cell_pos_.assign(layout_.n_ctx, -1);
    cell_seq_.assign(layout_.n_ctx, -1);
    for (auto& c : seq_cells_) c.clear();
    span_.assign(seq_cells_.size(), 1);  // a cache cleared whole gives every region back
    borrower_.assign(seq_cells_.size(), -1);
    n_cells_used_ = 0;
}

int64_t KVCache::span() const {
    int64_t s = 0;
    for (int q = 0; q < n_seq(); q++)
        if (!seq_cells_[q].empty()) s = std::max<int64_t>(s, seq_cells_[q].back() + 1);
    return s;
}

void KVCache::take(const int32_t* pos, const int32_t* seq, int64_t n, int32_t* cells) {
    std::vector<int64_t> count(n_seq(), 0);
    for (int64_t i = 0; i < n; i++) {
        if (seq[i] < 0 || seq[i] >= n_seq())
            throw InvalidInput("KV cache: sequence " + std::to_string(seq[i]) + " is outside [0, " +
                               std::to_string(n_seq()) + ")");
        count[seq[i]]++;
    }
    for (int q = 0; q < n_seq(); q++) {
        if (count[q] > 0 && borrower_[q] >= 0)
            throw InvalidInput("KV cache: sequence " + std::to_string(q) + "'s region is held by sequence " +
                               std::to_string(borrower_[q]));
        if (n_used(q) + count[q] > capacity(q))
            throw InvalidInput("KV cache: sequence " + std::to_string(q) + " would hold " +
                               std::to_string(n_used(q) + count[q]) + " tokens, more than its " +
                               std::to_string(capacity(q)) + " cells (n_ctx " + std::to_string(n_ctx()) + " / n_seq " +
                               std::to_string(n_seq()) + (span_[q] > 1 ? " x " + std::to_string(span_[q]) : "") + ")");
    }
    for (int64_t i = 0; i < n; i++) {
        std::vector<int32_t>& c = seq_cells_[seq[i]];
        const int32_t j = (int32_t)(seq[i] * seq_ctx() + (int64_t)c.size());
        cell_pos_[j] = pos[i];
        cell_seq_[j] = seq[i];
        c.push_back(j);
        cells[i] = j;
    }
    n_cells_used_ += n;
}

void KVCache::truncate(int seq, int64_t n) {
    if (seq < 0 || seq >= n_seq())
        throw InvalidInput("kv_truncate: sequence " + std::to_string(seq) + " is outside [0, " + std::to_string(n_seq()) +
                           ")");
    std::vector<int32_t>& c = seq_cells_[seq];
    if (n < 0 || n > (int64_t)c.size())
        throw InvalidInput("kv_truncate: n=" + std::to_string(n) + " is outside [0, " + std::to_string(c.size()) + "]");
    for (size_t i = (size_t)n; i < c.size(); i++) {
        cell_pos_[c[i]] = -1;
        cell_seq_[c[i]] = -1;
    }
    n_cells_used_ -= (int64_t)c.size() - n;
    c.resize((size_t)n);
}

}  // namespace stowlm
