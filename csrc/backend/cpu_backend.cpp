// The CPU backend: kernels of cpu/ops.h and cpu/matmul.h on the device's own thread pool, and a
// hard memory budget so that a "virtual device" refuses allocations exactly as a GPU would.
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>
#include <thread>
#include <unordered_map>

#include "backend/backend.h"
#include "backend/node_params.h"
#include "collective_math.h"
#include "cpu/matmul.h"
#include "cpu/moe.h"
#include "cpu/ops.h"
#include "cpu/repack.h"
#include "quant/dequant.h"
#include "cpu/threadpool.h"
#include "error.h"

namespace stowlm {

BackendBuffer::~BackendBuffer() {
    if (backend) backend->free_buffer(*this);
}

std::string describe_bytes(size_t b) {
    char buf[64];
    snprintf(buf, sizeof buf, "%zu bytes (%.1f MiB)", b, b / 1048576.0);
    return buf;
}

namespace {

size_t physical_ram() {
    const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
    return pages > 0 && page > 0 ? (size_t)pages * (size_t)page : (size_t)1 << 40;
}


float* f32(Tensor* t) { return (float*)t->data; }

// Ops whose kernels work in place: copy the input to the output first unless the planner
// already gave them the same bytes.
void prepare_in_place(Tensor* out) {
    const Tensor* x = out->src[0];
    if (out->data != x->data) memcpy(out->data, x->data, out->nbytes());
}

class CpuBackend final : public Backend {
public:
    CpuBackend(int id, std::string name, int threads, size_t mem_bytes)
        : id_(id), name_(std::move(name)), n_threads_(threads > 0 ? threads : default_threads()),
          budget_(mem_bytes ? mem_bytes : physical_ram()) {}

    const std::string& name() const override { return name_; }
    int id() const override { return id_; }
    bool host_accessible() const override { return true; }
    int64_t batched_min_tokens() const override { return kCpuBatchedMinTokens; }
    size_t memory_total() const override { return budget_; }
    size_t memory_used() const override { return used_; }

    BufferPtr alloc_buffer(size_t bytes, const std::string& purpose) override {
        reserve(bytes, purpose);
        void* p = nullptr;
        if (bytes) {
            p = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
            if (!p) {
                used_ -= bytes;
                throw OutOfDeviceMemory(name_ + ": the system refused " + describe_bytes(bytes) + " for " + purpose);
            }
        }
        auto b = std::make_unique<BackendBuffer>();
        b->backend = this, b->data = p, b->size = bytes, b->purpose = purpose;
        return b;
    }

    BufferPtr import_host(const void* data, size_t bytes, const std::string& purpose) override {
        reserve(bytes, purpose);  // zero copy, but the bytes are this device's to hold
        auto b = std::make_unique<BackendBuffer>();
        b->backend = this, b->data = const_cast<void*>(data), b->size = bytes, b->external = true;
        b->purpose = purpose;
        return b;
    }

    void free_buffer(BackendBuffer& b) override {
        if (!b.external) std::free(b.data);
        used_ -= b.size;
        b.data = nullptr, b.size = 0, b.backend = nullptr;
    }

    bool supports(const Tensor& node) const override { return node.op != Op::NONE; }

    size_t scratch_bytes(const Tensor& n) const override {
        if (n.op == Op::MUL_MAT)
            return cpu::matmul_scratch_bytes(n.src[0]->type, n.src[0]->ne[0], n.src[1]->n_rows(), batched_node(n));
        if (n.op == Op::MUL_MAT_ID)
            return cpu::mul_mat_id_scratch_bytes(n.src[0]->type, n.src[0]->ne[1], n.src[0]->ne[0], n.src[0]->ne[2],
                                                 n.src[2]->ne[0], n.src[2]->ne[1]);
        if (n.op == Op::FLASH_ATTN) {
            const cpu::KvView kv = kv_view(n);
            return cpu::flash_attn_scratch_bytes(n.src[0]->ne[2], n.src[0]->ne[1], kv.hd_k, kv.hd_v, n_threads_, kv.n_kv,
                                                 split_cells_of(n), batched_node(n));
        }
        return 0;
    }

    void compute(const Split& split, void* scratch, size_t scratch_bytes) override {
        const std::vector<Tensor*>& nodes = split.nodes;
        for (size_t i = 0; i < nodes.size();) {
            // Products of one activation that follow each other (q, k, v; gate, up) run as one
            // call. Their outputs are live together anyway: none is another's input.
            size_t e = i + 1;
            if (nodes[i]->op == Op::MUL_MAT)
                while (e < nodes.size() && e - i < (size_t)cpu::kMaxMulti && same_product_input(nodes[i], nodes[e])) e++;
            const auto t0 = timing_ ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point{};
            if (e - i > 1) run_products(&nodes[i], (int)(e - i), scratch);
            else run(nodes[i], scratch);
            if (timing_)
                op_times_.add(&nodes[i], e - i, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
            i = e;
        }
        (void)scratch_bytes;
    }

    // Op timing (stowlm-bench -v): each op's wall time, its threads' barrier included.
    void set_kernel_timing(bool on) override { timing_ = on; }
    KernelStats take_kernel_stats() override {
        KernelStats k;
        k.ops = op_times_.take();
        return k;
    }

    void copy_from_host(Tensor& dst, const void* src, size_t bytes, size_t offset) override {
        memcpy((char*)dst.data + offset, src, bytes);
    }
    void copy_to_host(const Tensor& src, void* dst, size_t bytes, size_t offset) override {
        memcpy(dst, (const char*)src.data + offset, bytes);
    }
    void copy_from_peer(Tensor& dst, const Tensor& src, Backend& from) override {
        if (!from.host_accessible()) {
            from.copy_to_host(src, dst.data, src.nbytes());
            return;
        }
        memcpy(dst.data, src.data, src.nbytes());
    }
    void synchronize() override {}

private:
    void reserve(size_t bytes, const std::string& purpose) {
        if (bytes > budget_ - used_)
            throw OutOfDeviceMemory("device " + name_ + " is out of memory: " + purpose + " asked for " +
                                    describe_bytes(bytes) + ", " + describe_bytes(budget_ - used_) +
                                    " available of a " + describe_bytes(budget_) + " budget");
        used_ += bytes;
    }

    // A collective node's first step: publish this shard's part (the node's src[0], on this device:
    // the scheduler copies it here otherwise; final once we meet, the CPU computing synchronously),
    // then wait until every shard has published its own.
    Collective& publish_and_meet(Tensor* n) {
        Collective& c = *n->collective;
        Collective::Published& mine = c.shards[n->iparams[0]];
        mine.backend = this;
        mine.part = n->src[0];
        mine.ready = nullptr;
        c.meet();
        return c;
    }

    // The shards' partials, in shard order, after all are written (meet), summed by the
    // HOST_DEVICE shard_order_sum the CUDA kernel runs too, so CPU and CUDA shards get the same
    // bits; nobody overwrites its partial before every shard has read them all (leave, or the
    // planner keeping it to the next meeting). Partials in host memory (CPU devices) are read in
    // place; one on a device the CPU cannot read (a CUDA shard's) is read out by its backend
    // (copy_to_host, which waits for the kernels that write it) in chunks of at most kReduceChunk
    // floats into a staging buffer.
    void all_reduce(Tensor* n, ThreadPool& pool) {
        Collective& c = publish_and_meet(n);
        float* out = (float*)n->data;
        const int64_t m = n->n_elements();
        std::vector<const Collective::Published*> from;
        int n_remote = 0;
        for (const Collective::Published& p : c.shards)
            if (p.part) {
                if (p.part->n_elements() != m) throw InvalidInput("all_reduce: a partial differs in size");
                from.push_back(&p);
                n_remote += !p.backend->host_accessible();
            }
        if ((int)from.size() > kMaxShards)
            throw InvalidInput("all_reduce: more than " + std::to_string(kMaxShards) + " partials");
        const int64_t chunk = n_remote ? std::min<int64_t>(m, kReduceChunk) : m;
        if (n_remote) reduce_staging_.resize((size_t)(chunk * n_remote));
        const float* ptrs[kMaxShards];
        for (int64_t c0 = 0; c0 < m; c0 += chunk) {
            const int64_t len = std::min(chunk, m - c0);
            int r = 0;
            for (size_t s = 0; s < from.size(); s++) {
                const Collective::Published& p = *from[s];
                if (p.backend->host_accessible()) {
                    ptrs[s] = (const float*)p.part->data + c0;
                } else {
                    float* dst = reduce_staging_.data() + (size_t)(r++ * chunk);
                    p.backend->copy_to_host(*p.part, dst, (size_t)len * sizeof(float), (size_t)c0 * sizeof(float));
                    ptrs[s] = dst;
                }
            }
            const int np = (int)from.size();
            float* o = out + c0;
            pool.parallel_for(len, [&](int64_t b, int64_t e, int) {
                for (int64_t i = b; i < e; i++) o[i] = shard_order_sum(ptrs, np, i);
            });
        }
        c.leave();
    }
    // The shards' rows stacked in shard order, after all are written (meet); every column (token)
    // of the output takes each shard's rows of that column in turn. Nothing is summed, so every
    // shard holds exactly the bits of each part. A part another device holds is read out by its
    // backend whole (copy_to_host) into a staging buffer.
    void all_gather(Tensor* n, ThreadPool& pool) {
        Collective& c = publish_and_meet(n);
        const int64_t d = n->ne[0], cols = n->n_rows();
        float* out = (float*)n->data;
        for (size_t s = 0; s < c.shards.size(); s++) {
            const Collective::Published& p = c.shards[s];
            const int64_t r0 = c.row0[s], w = c.row0[s + 1] - r0;
            if (!p.part || !w) continue;
            if (p.part->ne[0] != w || p.part->n_rows() != cols) throw InvalidInput("all_gather: a part changed shape");
            const float* src = (const float*)p.part->data;
            if (!p.backend->host_accessible()) {
                gather_staging_.resize((size_t)(w * cols));
                p.backend->copy_to_host(*p.part, gather_staging_.data(), (size_t)(w * cols) * sizeof(float));
                src = gather_staging_.data();
            }
            pool.parallel_for(cols, [&](int64_t b, int64_t e, int) {
                for (int64_t t = b; t < e; t++) std::memcpy(out + t * d + r0, src + t * w, (size_t)w * sizeof(float));
            });
        }
        c.leave();
    }
    std::vector<float> gather_staging_;  // host bytes outside the budget: a remote shard's part

    static constexpr int64_t kReduceChunk = 1 << 18;  // floats: 1 MiB of staging per remote partial
    std::vector<float> reduce_staging_;  // host bytes outside the budget, at most 1 MiB per remote partial

    bool timing_ = false;
    OpTimes op_times_;

    static bool same_product_input(const Tensor* a, const Tensor* b) {
        return b->op == Op::MUL_MAT && batched_node(*b) == batched_node(*a) && b->src[1]->data == a->src[1]->data &&
               b->src[1]->ne[0] == a->src[1]->ne[0] && b->src[1]->n_rows() == a->src[1]->n_rows();
    }

    // Rows of a repacked table (no model reads one so now: its embedding keeps the GGUF layout).
    void get_rows16(const Tensor* a, const Tensor* ids, Tensor* out) {
        std::vector<uint8_t> row(row_bytes(a->type, a->ne[0]));
        for (int64_t i = 0; i < ids->ne[0]; i++) {
            const int32_t id = ((const int32_t*)ids->data)[i];
            if (id < 0 || id >= a->ne[1])
                throw InvalidInput("get_rows: id " + std::to_string(id) + " is outside [0, " + std::to_string(a->ne[1]) + ")");
            cpu::unrepack_row16(a->type, a->ne[1], a->ne[0], a->data, id, row.data());
            dequantize_row(a->type, row.data(), f32(out) + i * out->ne[0], a->ne[0]);
        }
    }

    void run_products(Tensor* const* ns, int n, void* scratch) {
        cpu::WeightRef ws[cpu::kMaxMulti];
        float* ys[cpu::kMaxMulti];
        int64_t ldys[cpu::kMaxMulti];
        for (int i = 0; i < n; i++) {
            const Tensor* w = ns[i]->src[0];
            ws[i] = cpu::WeightRef{w->data, w->type, w->ne[1], w->ne[0], w->rows16};
            ys[i] = f32(ns[i]);
            ldys[i] = ns[i]->ne[0];
        }
        Tensor* x = ns[0]->src[1];
        cpu::matmul_multi(ws, n, f32(x), x->n_rows(), x->ne[0], ys, ldys, scratch, pool(), batched_node(*ns[0]));
    }

    void run(Tensor* n, void* scratch) {
        ThreadPool& pool = this->pool();
        Tensor* a = n->src[0];
        Tensor* b = n->src[1];
        switch (n->op) {
            case Op::NONE:
            case Op::VIEW:
                return;
            case Op::COPY:
                return;  // done by the scheduler's copy step before the split runs
            case Op::GET_ROWS:
                if (a->rows16) return get_rows16(a, b, n);
                cpu::get_rows(a->data, a->type, a->ne[1], a->ne[0], (const int32_t*)b->data, b->ne[0], f32(n), n->ne[0],
                              pool);
                return;
            case Op::MUL_MAT: {
                cpu::WeightRef w{a->data, a->type, a->ne[1], a->ne[0], a->rows16};
                cpu::matmul(w, f32(b), b->n_rows(), b->ne[0], f32(n), n->ne[0], scratch, pool, batched_node(*n));
                return;
            }
            case Op::ADD:
                cpu::add(f32(a), a->ne[0], f32(b), b->n_rows() == 1 ? 0 : b->ne[0], a->n_rows(), a->ne[0], f32(n),
                         n->ne[0], pool);
                return;
            case Op::MUL:
                cpu::mul(f32(a), a->ne[0], f32(b), b->n_rows() == 1 ? 0 : b->ne[0], a->n_rows(), a->ne[0], f32(n),
                         n->ne[0], pool);
                return;
            case Op::SCALE:
                prepare_in_place(n);
                cpu::scale(f32(n), n->n_rows(), n->ne[0], n->ne[0], n->fparams[0], pool);
                return;
            case Op::SOFTCAP:
                prepare_in_place(n);
                cpu::softcap(f32(n), n->n_rows(), n->ne[0], n->ne[0], n->fparams[0], pool);
                return;
            case Op::RMS_NORM:
                cpu::rms_norm(f32(a), a->n_rows(), a->ne[0], a->ne[0], b ? f32(b) : nullptr, n->fparams[0], f32(n),
                              n->ne[0], pool);
                return;
            case Op::ROPE: {
                prepare_in_place(n);
                const cpu::RopeParams p = rope_params(*n);
                cpu::rope(f32(n), n->ne[2], n->ne[1], n->ne[0], n->ne[0] * n->ne[1], (const int32_t*)b->data, p, pool);
                return;
            }
            case Op::STORE_KV: {
                Tensor* cache = n->src[1];
                cpu::store_kv(f32(a), a->ne[2], a->ne[0] * a->ne[1], a->ne[1], a->ne[0], cache->type, cache->data,
                              cache->nb[1], (const int32_t*)n->src[2]->data, pool);
                return;
            }
            case Op::FLASH_ATTN: {
                const cpu::KvView kv = kv_view(*n);
                cpu::flash_attn(f32(a), a->ne[2], a->ne[1], a->ne[0] * a->ne[1], kv, (const int32_t*)n->src[3]->data,
                                (const int32_t*)n->src[4]->data, attn_params(*n), f32(n), n->ne[0], scratch, pool);
                return;
            }
            case Op::CONT:
                cpu::cont(f32(a), a->ne, a->nb, f32(n), pool);
                return;
            case Op::CONCAT:
                cpu::concat(f32(a), a->ne, a->nb, f32(b), b->ne[0], b->nb, f32(n), pool);
                return;
            case Op::SWIGLU_OAI:
                cpu::swiglu_oai(f32(a), f32(b), n->n_elements(), n->fparams[0], n->fparams[1], f32(n), pool);
                return;
            case Op::ADD_ID:
                prepare_in_place(n);
                cpu::add_id(f32(n), f32(b), b->ne[1], (const int32_t*)n->src[2]->data, n->ne[2], n->ne[1], n->ne[0],
                            pool);
                return;
            case Op::SWIGLU:
                cpu::swiglu(f32(a), a->ne[0], f32(b), b->ne[0], a->n_rows(), a->ne[0], f32(n), n->ne[0], pool);
                return;
            case Op::GEGLU:
                cpu::geglu(f32(a), a->ne[0], f32(b), b->ne[0], a->n_rows(), a->ne[0], f32(n), n->ne[0], pool);
                return;
            case Op::TOP_K:
                cpu::top_k(f32(a), a->n_rows(), a->ne[0], a->ne[0], top_k_params(*n), (int32_t*)n->data, pool);
                return;
            case Op::MOE_WEIGHTS:
                cpu::moe_weights(f32(a), a->n_rows(), a->ne[0], (const int32_t*)b->data, b->ne[0],
                                 (cpu::Gating)n->iparams[0], n->iparams[1] != 0, n->fparams[0], f32(n), pool);
                return;
            case Op::MUL_MAT_ID: {
                Tensor* ids = n->src[2];
                cpu::WeightRef w{a->data, a->type, a->ne[1], a->ne[0], a->rows16};
                cpu::mul_mat_id(w, a->ne[2], (const int32_t*)ids->data, ids->ne[0], f32(b), b->ne[1], b->ne[0],
                                ids->ne[1], f32(n), n->ne[0], scratch, pool);
                return;
            }
            case Op::MOE_SUM:
                cpu::moe_sum(f32(a), f32(b), a->ne[2], a->ne[1], a->ne[0], f32(n), pool);
                return;
            case Op::LOCAL_IDS: {
                const int32_t* ids = (const int32_t*)a->data;
                int32_t* out = (int32_t*)n->data;
                const int32_t first = n->iparams[0], count = n->iparams[1];
                for (int64_t i = 0; i < n->n_elements(); i++)
                    out[i] = ids[i] >= first && ids[i] < first + count ? ids[i] - first : -1;
                return;
            }
            case Op::ALL_REDUCE:
                all_reduce(n, pool);
                return;
            case Op::ALL_GATHER:
                all_gather(n, pool);
                return;
        }
    }

    int id_;
    std::string name_;
    // Started on the first computation: a model loaded only to project memory (fit) starts no
    // threads.
    ThreadPool& pool() {
        std::call_once(pool_once_, [this] { pool_ = std::make_unique<ThreadPool>(n_threads_); });
        return *pool_;
    }
    int n_threads_;
    std::once_flag pool_once_;
    std::unique_ptr<ThreadPool> pool_;
    size_t budget_;
    std::atomic<size_t> used_{0};
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend(int id, const std::string& name, int threads, size_t mem_bytes) {
    return std::make_unique<CpuBackend>(id, name, threads, mem_bytes);
}

std::unique_ptr<Backend> make_backend(int id, const DeviceSpec& spec) {
    if (spec.kind == "cpu") return make_cpu_backend(id, spec.name(), spec.threads, spec.mem_bytes);
    if (spec.kind == "cuda") {
#ifdef STOWLM_HAVE_CUDA
        return make_cuda_backend(id, spec);
#else
        throw Unsupported("device '" + spec.name() +
                          "': no CUDA device is present (stowlm was built without CUDA: nvcc was not found at "
                          "build time)");
#endif
    }
    throw Unsupported("device '" + spec.name() + "': no backend for kind '" + spec.kind + "' in this build");
}

}  // namespace stowlm
