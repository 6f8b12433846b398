#include "kv/kv_cache.h"

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

std::vector<size_t> kv_bytes_per_layer(const KVLayout& l) {
    std::vector<size_t> bytes(l.layer_device.size());
    for (size_t il = 0; il < bytes.size(); il++)
        bytes[il] = tensor_bytes(l.type, l.layer_k_embd[il], l.n_ctx) + tensor_bytes(l.type, l.layer_v_embd[il], l.n_ctx);
    return bytes;
}

std::vector<size_t> kv_bytes_per_device(const KVLayout& l, size_t n_devices) {
    std::vector<size_t> bytes(n_devices, 0);
    const std::vector<size_t> per_layer = kv_bytes_per_layer(l);
    for (size_t il = 0; il < per_layer.size(); il++) bytes.at(l.layer_device[il]) += per_layer[il];
    return bytes;
}

KVCache::KVCache(const KVLayout& layout, const std::vector<Backend*>& backends, bool allocate) : layout_(layout) {
    const size_t n_layer = layout.layer_device.size();
    device_bytes_ = kv_bytes_per_device(layout, backends.size());
    buffers_.resize(backends.size());
    if (allocate)
        for (size_t d = 0; d < backends.size(); d++)
            if (device_bytes_[d]) buffers_[d] = backends[d]->alloc_buffer(device_bytes_[d], "KV cache");
    k_.resize(n_layer);
    v_.resize(n_layer);
    std::vector<size_t> offset(backends.size(), 0);
    for (size_t il = 0; il < n_layer; il++) {
        const int dev = layout.layer_device[il];
        for (int kv = 0; kv < 2; kv++) {
            Tensor& t = kv ? v_[il] : k_[il];
            t.name = "cache_" + std::string(kv ? "v" : "k") + std::to_string(il);
            t.type = layout.type;
            t.ne[0] = kv ? layout.layer_v_embd[il] : layout.layer_k_embd[il];
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
    cell_pos_.assign(layout.n_ctx, -1);
}

int64_t KVCache::append(const int32_t* pos, int64_t n) {
    if (n_used_ + n > layout_.n_ctx)
        throw InvalidInput("KV cache: " + std::to_string(n_used_ + n) + " tokens exceed the context of " +
                           std::to_string(layout_.n_ctx));
    const int64_t first = n_used_;
    for (int64_t i = 0; i < n; i++) cell_pos_[first + i] = pos[i];
    n_used_ += n;
    return first;
}

void KVCache::truncate(int64_t n) {
    if (n < 0 || n > n_used_)
        throw InvalidInput("kv_truncate: n=" + std::to_string(n) + " is outside [0, " + std::to_string(n_used_) + "]");
    for (int64_t j = n; j < n_used_; j++) cell_pos_[j] = -1;
    n_used_ = n;
}

}  // namespace stowlm
