#include "models/model.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <numeric>

#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include "cpu/cpu_features.h"
#include "cpu/repack.h"
#include "dist/remote_device.h"
#include "error.h"

namespace stowlm {

namespace {
// A device that gets its weights uploaded packs them in one buffer, each at a 256-byte
// boundary (as cudaMalloc would place it), and that padding is part of its share.
constexpr size_t kWeightAlign = 256;
size_t packed(size_t bytes) { return (bytes + kWeightAlign - 1) / kWeightAlign * kWeightAlign; }
}  // namespace

const ArchDef* find_arch(const std::string& name) {
    for (const ArchDef* a : {&kArchLlama, &kArchQwen2, &kArchQwen3, &kArchGemma3, &kArchQwen3Moe, &kArchQwen2Moe,
                             &kArchGptOss, &kArchDeepseek2, &kArchGlm4Moe})
        if (name == a->name) return a;
    return nullptr;
}

void load_common_hparams(const GGUFFile& f, HParams& hp) {
    const std::string a = hp.arch + ".";
    hp.n_embd = f.get_int(a + "embedding_length");
    hp.n_layer = f.get_int(a + "block_count");
    hp.n_head = f.get_int(a + "attention.head_count");
    hp.n_head_kv = f.get_int(a + "attention.head_count_kv", hp.n_head);
    hp.n_ff = f.get_int(a + "feed_forward_length", 0);
    hp.n_ctx_train = f.get_int(a + "context_length", 4096);
    hp.eps = (float)f.get_float(a + "attention.layer_norm_rms_epsilon", 1e-5);
    if (hp.n_head <= 0 || hp.n_layer <= 0 || hp.n_embd <= 0 || hp.n_head_kv <= 0 || hp.n_head % hp.n_head_kv)
        throw InvalidInput(f.path() + ": inconsistent " + a + "attention.head_count / head_count_kv / block_count");
    hp.head_dim_k = f.get_int(a + "attention.key_length", hp.n_embd / hp.n_head);
    hp.head_dim_v = f.get_int(a + "attention.value_length", hp.head_dim_k);
    hp.n_rot = f.get_int(a + "rope.dimension_count", hp.head_dim_k);
    hp.rope_base = (float)f.get_float(a + "rope.freq_base", 10000.0);
    const std::string scaling = f.get_str(a + "rope.scaling.type", "none");
    if (scaling == "linear") {
        hp.rope_scale = 1.0f / (float)f.get_float(a + "rope.scaling.factor", 1.0);
    } else if (scaling == "yarn") {
        const double factor = f.get_float(a + "rope.scaling.factor", 1.0);
        if (!(factor >= 1.0)) throw InvalidInput(f.path() + ": " + a + "rope.scaling.factor must be >= 1 for yarn");
        hp.rope_scale = (float)(1.0 / factor);
        hp.n_ctx_orig = (int32_t)f.get_int(a + "rope.scaling.original_context_length", hp.n_ctx_train);
        hp.yarn_ext_factor = (float)f.get_float(a + "rope.scaling.yarn_ext_factor", 1.0);
        hp.yarn_beta_fast = (float)f.get_float(a + "rope.scaling.yarn_beta_fast", 32.0);
        hp.yarn_beta_slow = (float)f.get_float(a + "rope.scaling.yarn_beta_slow", 1.0);
        hp.yarn_log_mul = (float)f.get_float(a + "rope.scaling.yarn_log_multiplier", 0.0);
        set_yarn_attn_factor(f, hp, false);
    } else if (scaling != "none" && !scaling.empty()) {
        throw InvalidInput(f.path() + ": " + a + "rope.scaling.type '" + scaling + "' is not supported yet");
    }
    hp.attn_softcap = (float)f.get_float(a + "attn_logit_softcapping", 0.0);
    hp.final_softcap = (float)f.get_float(a + "final_logit_softcapping", 0.0);
    hp.sliding_window = (int32_t)f.get_int(a + "attention.sliding_window", 0);
    hp.swa_layer.assign(hp.n_layer, false);
}

void set_yarn_attn_factor(const GGUFFile& f, HParams& hp, bool deepseek2) {
    // llama_context's derivation: get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dims)
    // with the ext_factor's own 1 + 0.1 ln(factor) cancelled (the rope kernel applies it again).
    auto get_mscale = [](float scale, float mscale) { return scale <= 1.0f ? 1.0f : 0.1f * mscale * logf(scale) + 1.0f; };
    const float factor = 1.0f / hp.rope_scale;
    float attn = 1.0f;
    if (hp.yarn_ext_factor != 0.0f) {
        if (hp.yarn_log_mul != 0.0f) {
            const float mscale_all = hp.yarn_log_mul;
            const float mscale = deepseek2 && mscale_all != 1.0f ? mscale_all : 1.0f;
            attn = get_mscale(factor, mscale) / get_mscale(factor, mscale_all);
        } else {
            attn = get_mscale(factor, 1.0f);
        }
        attn *= 1.0f / (1.0f + 0.1f * logf(factor));
    }
    hp.yarn_attn_factor = attn * (float)f.get_float(hp.arch + ".rope.scaling.attn_factor", 1.0);
}

void load_moe_hparams(const GGUFFile& f, HParams& hp, bool norm_default, int32_t gating_default) {
    const std::string a = hp.arch + ".";
    hp.n_expert = f.get_int(a + "expert_count", 0);
    hp.n_expert_used = f.get_int(a + "expert_used_count", 0);
    if (hp.n_expert < 0 || hp.n_expert_used < 0 || hp.n_expert_used > hp.n_expert ||
        (hp.n_expert > 0 && hp.n_expert_used == 0))
        throw InvalidInput(f.path() + ": " + a + "expert_used_count=" + std::to_string(hp.n_expert_used) +
                           " must be in [1, expert_count=" + std::to_string(hp.n_expert) + "]");
    hp.expert_weights_norm = f.get_int(a + "expert_weights_norm", norm_default ? 1 : 0) != 0;
    hp.expert_weights_scale = (float)f.get_float(a + "expert_weights_scale", 0.0);
    // llama.cpp's ids: 1 softmax, 2 sigmoid, 3 softmax over the picked logits
    const int64_t gating = f.get_int(a + "expert_gating_func", gating_default + 1);
    if (gating < 1 || gating > 3)
        throw InvalidInput(f.path() + ": " + a + "expert_gating_func=" + std::to_string(gating) +
                           " is not supported (1 softmax, 2 sigmoid, 3 softmax over the picked)");
    hp.expert_gating = (int32_t)gating - 1;
    hp.n_layer_dense_lead = f.get_int(a + "leading_dense_block_count", 0);
    hp.n_expert_groups = (int32_t)f.get_int(a + "expert_group_count", 0);
    hp.n_group_used = (int32_t)f.get_int(a + "expert_group_used_count", 0);
    if (hp.n_expert_groups > 1 && (hp.n_expert % hp.n_expert_groups || hp.n_group_used < 1 ||
                                   hp.n_group_used > hp.n_expert_groups ||
                                   hp.n_expert_used > hp.n_expert / hp.n_expert_groups * hp.n_group_used))
        throw InvalidInput(f.path() + ": " + a + "expert_group_count / expert_group_used_count do not fit " +
                           "expert_count and expert_used_count");
    if (hp.n_layer_dense_lead < 0 || hp.n_layer_dense_lead > hp.n_layer)
        throw InvalidInput(f.path() + ": " + a + "leading_dense_block_count is outside [0, block_count]");
}

int effective_interleave(const std::vector<int>& counts, int interleave, bool cpu_only) {
    int holding = 0, fewest = INT32_MAX;
    for (int c : counts)
        if (c > 0) {
            holding++;
            fewest = std::min(fewest, c);
        }
    if (holding < 2) return 1;
    if (interleave <= 0) return fewest >= 2 && cpu_only ? 2 : 1;
    return std::min(interleave, fewest);
}

std::vector<int> layer_devices(const std::vector<int>& counts, int interleave) {
    std::vector<int> out;
    const int v = std::max(interleave, 1);
    for (int c = 0; c < v; c++)
        for (size_t d = 0; d < counts.size(); d++)
            for (int i = counts[d] * c / v; i < counts[d] * (c + 1) / v; i++) out.push_back((int)d);
    return out;
}

std::unique_ptr<Model> Model::load(const std::string& path, const std::vector<DeviceSpec>& devices,
                                   const std::vector<int>& layer_split, bool count_weights,
                                   const std::vector<TensorOverride>& overrides, const std::vector<double>& tensor_split,
                                   int interleave, bool tp_sum) {
    return load(GGUFFile::open_shared(path), devices, layer_split, count_weights, overrides,
                tensor_split, interleave, tp_sum);
}

std::unique_ptr<Model> Model::load(std::shared_ptr<const GGUFFile> file, const std::vector<DeviceSpec>& devices,
                                   const std::vector<int>& layer_split, bool count_weights,
                                   const std::vector<TensorOverride>& overrides, const std::vector<double>& tensor_split,
                                   int interleave, bool tp_sum) {
    if (devices.empty()) throw InvalidInput("Model: devices is empty");
    const bool tp = !tensor_split.empty();
    if (tp) {
        if (tensor_split.size() != devices.size())
            throw InvalidInput("tensor_split has " + std::to_string(tensor_split.size()) + " shares for " +
                               std::to_string(devices.size()) + " devices");
        double total = 0;
        for (double s : tensor_split) {
            if (!(s >= 0) || !std::isfinite(s)) throw InvalidInput("tensor_split: shares must be finite and >= 0");
            total += s;
        }
        if (total <= 0) throw InvalidInput("tensor_split: every share is 0");
        if (!layer_split.empty()) throw InvalidInput("tensor_split and layer_split exclude each other");
        if (!overrides.empty()) throw InvalidInput("tensor overrides are not supported with a tensor split yet");
    }
    std::unique_ptr<Model> m(new Model());
    m->file_ = std::move(file);
    const GGUFFile& f = *m->file_;
    const std::string& path = f.path();
    m->hp_.arch = f.get_str("general.architecture");
    m->arch_ = find_arch(m->hp_.arch);
    if (!m->arch_)
        throw InvalidInput("unknown architecture '" + m->hp_.arch + "' in " + path +
                           " (stowlm knows llama, qwen2, qwen2moe, qwen3, qwen3moe, gemma3)");
    m->arch_->load_hparams(f, m->hp_);
    HParams& hp = m->hp_;

    // dist::make_device: make_backend, or a stand-in for a device of another MPI rank.
    for (size_t d = 0; d < devices.size(); d++) m->backends_.push_back(dist::make_device((int)d, devices[d]));
    for (const TensorOverride& o : overrides) {
        if (o.device < 0 || o.device >= (int)devices.size())
            throw InvalidInput("tensor override '" + o.pattern + "': device index " + std::to_string(o.device) +
                               " is not in the device list");
        try {
            m->overrides_.emplace_back(std::regex(o.pattern), o.device);
        } catch (const std::regex_error& e) {
            throw InvalidInput("tensor override '" + o.pattern + "' is not a valid regular expression: " + e.what());
        }
    }

    // Contiguous layer ranges per device (tensor parallelism: all "on" the first shard's device
    // while loading; the shards carry the real placement).
    std::vector<int> split = layer_split;
    const int n_dev = (int)devices.size();
    if (tp) {
        split.assign(n_dev, 0);
        for (int d = 0; d < n_dev; d++)
            if (tensor_split[d] > 0) {
                split[d] = (int)hp.n_layer;
                break;
            }
    }
    if (split.empty()) {
        for (int d = 0; d < n_dev; d++) split.push_back((int)(hp.n_layer * (d + 1) / n_dev - hp.n_layer * d / n_dev));
    }
    if ((int)split.size() != n_dev)
        throw InvalidInput("layer_split has " + std::to_string(split.size()) + " entries for " + std::to_string(n_dev) +
                           " devices");
    int total = 0;
    for (int s : split) {
        if (s < 0) throw InvalidInput("layer_split: negative layer count");
        total += s;
    }
    if (total != hp.n_layer)
        throw InvalidInput("layer_split sums to " + std::to_string(total) + " but the model has " +
                           std::to_string(hp.n_layer) + " layers");
    // Ranks of an MPI job keep one range each: every range boundary is a message between hosts.
    const bool ranks = std::any_of(devices.begin(), devices.end(), [](const DeviceSpec& d) { return d.rank >= 0; });
    if (ranks && interleave > 1)
        throw InvalidInput("interleave " + std::to_string(interleave) +
                           ": the devices of an MPI job's ranks keep one range of layers each (interleave 1)");
    bool cpu_only = true;
    for (int d = 0; d < n_dev; d++) cpu_only = cpu_only && (split[d] == 0 || devices[d].kind == "cpu");
    m->interleave_ = tp || ranks ? 1 : effective_interleave(split, interleave, cpu_only);
    m->layer_device_ = stowlm::layer_devices(split, m->interleave_);
    int first_dev = 0, last_dev = n_dev - 1;
    while (first_dev < n_dev - 1 && split[first_dev] == 0) first_dev++;
    while (last_dev > 0 && split[last_dev] == 0) last_dev--;

    // Output head first: a tied embedding lives with the output on the last device.
    const bool tied = f.find_tensor("output.weight") == nullptr;
    m->loading_device_ = last_dev;
    m->loading_anchor_ = kAnchorLastDevice;
    m->output_norm_ = m->require("output_norm.weight");
    if (!tied) m->output_ = m->require("output.weight");
    m->loading_device_ = tied ? last_dev : first_dev;
    m->loading_anchor_ = tied ? kAnchorLastDevice : kAnchorFirstDevice;
    m->tok_embd_ = m->require("token_embd.weight");
    if (tied) m->output_ = m->tok_embd_;
    hp.n_vocab = m->tok_embd_->ne[1];
    if (m->tok_embd_->ne[0] != hp.n_embd)
        throw InvalidInput(path + ": token_embd.weight rows have " + std::to_string(m->tok_embd_->ne[0]) +
                           " elements, embedding_length is " + std::to_string(hp.n_embd));

    m->layers_.resize(hp.n_layer);
    for (int il = 0; il < hp.n_layer; il++) {
        m->loading_device_ = m->layer_device_[il];
        m->loading_anchor_ = il;
        m->arch_->load_layer(*m, il, m->layers_[il]);
    }
    for (size_t i = 0; i < overrides.size(); i++) {
        bool hit = false;
        for (const auto& a : m->anchors_) hit = hit || a.second.second == (int)i;
        if (!hit)
            throw InvalidInput("tensor override '" + (overrides[i].label.empty() ? overrides[i].pattern : overrides[i].label) +
                               "' matches no tensor " + m->hp_.arch + " uses in " + path);
    }

    if (tp) {
        m->tp_sum_ = tp_sum;
        m->build_shards(tensor_split);
        m->place_shard_weights(count_weights);
        if (count_weights) {
            // the row shards and experts' rows (not the column slices of -sm tensor-sum): any rows
            // of a matrix repack to the whole's bits; a tied head's rows too (their copies: the
            // embedding's lookups keep reading the file's rows)
            std::vector<Tensor*> rows;
            for (const auto& t : m->shard_store_)
                if (!m->cuts_columns(t.get())) rows.push_back(t.get());
            m->repack_cpu_weights(devices, rows);
        }
        return m;
    }
    auto packed_bytes = [&](const Tensor& t) {
        return m->backends_[t.device]->host_accessible() ? t.nbytes() : packed(t.nbytes());
    };
    m->weight_bytes_.assign(n_dev, 0);
    for (auto& kv : m->weights_) m->weight_bytes_[kv.second.device] += packed_bytes(kv.second);
    if (count_weights) {
        // One reservation per device for its whole share, so that a device too small fails
        // naming the total it was asked for. Host-accessible devices read the mapping in place;
        // others get the bytes uploaded into their buffer.
        for (int d = 0; d < n_dev; d++) {
            Backend& b = *m->backends_[d];
            if (!m->weight_bytes_[d]) continue;
            if (b.host_accessible()) {
                m->weight_buffers_.push_back(b.import_host(nullptr, m->weight_bytes_[d], "model weights"));
                continue;
            }
            BufferPtr buf = b.alloc_buffer(m->weight_bytes_[d], "model weights");
            size_t off = 0;
            for (auto& kv : m->weights_) {
                Tensor& t = kv.second;
                if (t.device != d) continue;
                const void* host = t.data;
                t.data = (char*)buf->data + off;
                b.copy_from_host(t, host, t.nbytes());
                off += packed_bytes(t);
            }
            m->weight_buffers_.push_back(std::move(buf));
        }
        for (auto& kv : m->weights_) kv.second.buffer = nullptr;  // weights stay where the file put them
        std::vector<Tensor*> all;
        // the embedding only where it is the output too: its lookups unrepack their rows (get_rows16)
        for (auto& kv : m->weights_)
            if (&kv.second != m->tok_embd_ || m->output_ == m->tok_embd_) all.push_back(&kv.second);
        m->repack_cpu_weights(devices, all);
    }
    return m;
}

namespace {
// /proc/meminfo's MemAvailable (free memory and what the kernel can reclaim, the model's cached
// pages included), or no limit where it cannot be read.
size_t mem_available() {
    FILE* f = std::fopen("/proc/meminfo", "r");
    if (!f) return SIZE_MAX;
    char line[256];
    size_t kb = 0;
    bool found = false;
    while (!found && std::fgets(line, sizeof line, f)) found = std::sscanf(line, "MemAvailable: %zu kB", &kb) == 1;
    std::fclose(f);
    return found ? kb * 1024 : SIZE_MAX;
}
}  // namespace

// Products of a few tokens (speculative drafts, small batches) are instruction-bound on the
// GGUF layout; the repacked one does a third of the work (cpu/repack.h). Done for the weights a
// CPU device of this process computes with (every rank of an MPI job repacks its own) where the
// AVX2 or AVX-512 row kernels run (batches of 256+ keep their GEMM or AMX tiles, whose panels
// unpack the repacked rows). Beside a GPU, which may stage a stack of experts (copy it in for a large batch,
// Backend::can_stage) and puts a staged copy back in GGUF's layout for its kernels, a stack
// repacks where its 16-row groups fit that unrepacking (kStagedRows16GroupMax) and otherwise
// keeps GGUF's layout. A matrix repacks whatever its rows, and
// its rows give the same bits wherever they are cut; a stack of experts repacks each expert.
// Not where the copies would exceed the memory available (under pressure the mapped pages are
// evicted and read from the file again; anonymous copies could only go to swap).
// STOWLM_REPACK=0 keeps the GGUF layout.
void Model::repack_cpu_weights(const std::vector<DeviceSpec>& devices, const std::vector<Tensor*>& candidates) {
    if (env_is("STOWLM_REPACK", "0")) return;
    const cpu::Isa isa = cpu::active_isa();
    if (isa == cpu::Isa::Scalar) return;
    bool gpu = false;
    for (const auto& d : devices) gpu = gpu || d.kind != "cpu";
    auto padded = [](size_t bytes) { return (bytes + 63) & ~(size_t)63; };  // each tensor 64-byte aligned
    std::vector<Tensor*> todo;
    size_t total = 0;
    for (Tensor* tp : candidates) {
        Tensor& t = *tp;
        const Backend* b = backends_[t.device].get();
        if (dist::is_remote(b) || !b->host_accessible() || t.ne[3] != 1 || !cpu::repack_supported(t.type, t.ne[1], t.ne[0]) ||
            (gpu && t.ne[2] > 1 && rows16_group_bytes(t.type, t.ne[0]) > kStagedRows16GroupMax))
            continue;
        todo.push_back(&t);
        total += padded(t.nbytes());
    }
    if (todo.empty() || total > mem_available()) return;
    // 2 MiB aligned and advised as huge pages: a fault per 2 MiB, not per 4 KiB, while writing
    constexpr size_t kHuge = (size_t)2 << 20;
    const size_t alloc = (total + kHuge - 1) / kHuge * kHuge;
    uint8_t* dst = (uint8_t*)std::aligned_alloc(kHuge, alloc);
    if (!dst) return;  // keep the GGUF layout rather than fail a load that fits
    madvise(dst, alloc, MADV_HUGEPAGE);
    repacked_.reset(dst), repacked_bytes_ = alloc;
    std::vector<uint8_t*> at(todo.size());
    for (size_t i = 0, off = 0; i < todo.size(); i++) at[i] = dst + off, off += padded(todo[i]->nbytes());
    const uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    std::atomic<size_t> next{0};
    auto work = [&] {
        for (size_t i; (i = next.fetch_add(1)) < todo.size();) {
            Tensor& t = *todo[i];
            const uintptr_t b = (uintptr_t)t.data, e = b + t.nbytes();
            // the mapped pages in one call, not a fault each (MADV_POPULATE_READ, Linux 5.14; a
            // no-op error elsewhere)
            madvise((void*)(b & ~(page - 1)), e - (b & ~(page - 1)), 22);
            const size_t per = t.nbytes() / (size_t)t.ne[2];  // experts (ne[2] of them) each on its own
            for (int64_t x = 0; x < t.ne[2]; x++)
                cpu::repack_rows16(t.type, t.ne[1], t.ne[0], (const uint8_t*)t.data + x * per, at[i] + x * per);
            // the whole mapped pages of the old layout leave this process's memory
            const uintptr_t a = (b + page - 1) & ~(page - 1), z = e & ~(page - 1);
            if (z > a) madvise((void*)a, z - a, MADV_DONTNEED);
        }
    };
    const unsigned n = std::max(1u, std::min(8u, std::thread::hardware_concurrency()));
    std::vector<std::thread> threads;
    for (unsigned k = 1; k < n; k++) threads.emplace_back(work);
    work();
    for (auto& th : threads) th.join();
    for (size_t i = 0; i < todo.size(); i++) todo[i]->data = at[i], todo[i]->rows16 = true;
}

std::vector<Backend*> Model::backends() const {
    std::vector<Backend*> r;
    for (auto& b : backends_) r.push_back(b.get());
    return r;
}

double Model::weight_bytes_per_token() const {
    const bool tied = file_->find_tensor("output.weight") == nullptr;
    double bytes = 0;
    for (const GGUFTensor& t : file_->tensors()) {
        if (t.name == "token_embd.weight" && !tied) continue;
        if (t.name.find("_exps.") != std::string::npos && hp_.n_expert > 0)
            bytes += (double)t.nbytes * hp_.n_expert_used / hp_.n_expert;
        else
            bytes += (double)t.nbytes;
    }
    return bytes;
}

double Model::attention_macs(int64_t n_kv) const {
    // per head and cell: q.k over the key dims, then the weight times v over the value dims (MLA's
    // are its compressed KV's: deepseek2.cpp)
    const double dims = (double)(hp_.head_dim_k + hp_.head_dim_v);
    double macs = 0;
    for (int64_t il = 0; il < hp_.n_layer; il++) {
        const bool swa = il < (int64_t)hp_.swa_layer.size() && hp_.swa_layer[il] && hp_.sliding_window > 0;
        const int64_t cells = swa ? std::min<int64_t>(n_kv, hp_.sliding_window) : n_kv;
        macs += (double)hp_.n_head * dims * (double)std::max<int64_t>(cells, 0);
    }
    return macs;
}

std::vector<int64_t> Model::batch_bounds() const {
    std::vector<int64_t> r;
    for (auto& b : backends_) r.push_back(b->batched_min_tokens());
    if (!repacked_weights().empty()) r.push_back(kCpuR16RowsMax);  // (the repacked rows' GEMM from there)
    std::sort(r.begin(), r.end());
    r.erase(std::unique(r.begin(), r.end()), r.end());
    return r;
}

std::vector<WeightInfo> Model::weight_infos() const {
    std::vector<WeightInfo> r;
    for (const auto& kv : weights_) {
        const auto& a = anchors_.at(kv.first);
        r.push_back({kv.first, a.first, kv.second.nbytes(), packed(kv.second.nbytes()), a.second,
                     kv.second.n_elements()});
    }
    return r;
}

bool Model::outlives_backends(const void* p, size_t bytes) const {
    const uint8_t *b = (const uint8_t*)p, *r = repacked_.get();
    return file_->maps(p, bytes) || (r && b >= r && b + bytes <= r + repacked_bytes_);
}

std::vector<std::string> Model::repacked_weights() const {
    std::vector<std::string> r;
    for (const auto& kv : weights_)
        if (kv.second.rows16) r.push_back(kv.first);
    for (const auto& t : shard_store_)  // tensor parallelism: each device's rows
        if (t->rows16) r.push_back(t->name);
    return r;
}

int Model::weight_device(const std::string& name) const {
    auto it = weights_.find(name);
    return it == weights_.end() ? -1 : it->second.device;
}

Tensor* Model::optional(const std::string& name) {
    auto it = weights_.find(name);
    if (it != weights_.end()) return &it->second;
    const GGUFTensor* gt = file_->find_tensor(name);
    if (!gt) return nullptr;
    Tensor t;
    t.name = name;
    t.type = gt->type;
    for (int i = 0; i < 4; i++) t.ne[i] = gt->ne[i];
    set_contiguous_strides(t);
    t.role = TensorRole::WEIGHT;
    t.device = loading_device_;
    int hit = -1;
    for (size_t i = 0; i < overrides_.size() && hit < 0; i++)
        if (std::regex_match(name, overrides_[i].first)) {
            t.device = overrides_[i].second;
            hit = (int)i;
        }
    anchors_[name] = {loading_anchor_, hit};
    t.data = const_cast<uint8_t*>(gt->data);
    return &weights_.emplace(name, std::move(t)).first->second;
}

Tensor* Model::require(const std::string& name) {
    Tensor* t = optional(name);
    if (!t) throw InvalidInput(file_->path() + ": tensor '" + name + "' is missing (" + hp_.arch + " needs it)");
    return t;
}

}  // namespace stowlm
