// The CUDA device behind the engine's Backend table (backend/backend.h): buffers are exact
// cudaMalloc allocations of a CudaDevice (what the planner projects is what is allocated),
// weights are uploaded, and compute() enqueues one launcher of cuda_backend.h per node on the
// device's compute stream, with the same arguments the CPU backend passes to cpu/ops.h.
// Graph inputs (token ids, positions, KV cells) live in host memory: the scheduler gives this
// device COPY nodes for them (host_accessible() is false) and the context uploads those before
// the split runs. Every copy goes through the compute stream, so copies and kernels are
// ordered without extra events; only a peer copy waits on the other device's stream. With
// pipeline parallelism (engine/pipeline.h) the device that produced a tensor pushes it into
// this device's copy slot from its own thread: the CudaDevice calls set the current device.
// With tensor parallelism a shard's ALL_REDUCE / ALL_GATHER meets the other shards' (CPU or CUDA)
// inside its split and fetches their parts itself (collective below); the sum is the kernel of
// cuda/collective.cu, the CPU backend's arithmetic, so every shard holds the same bits.
// A split run a second time is captured as a CUDA graph and replayed from then on (one launch
// instead of hundreds): every graph (ShapeGraph) is placed once, so its kernels' arguments are
// the same each time, and what changes per step (tokens, positions, cells, sequence ends) is in
// the inputs the context uploads first. STOWLM_CUDA_GRAPHS=0 turns graphs off; STOWLM_CUDA_FUSION=0
// runs every node as its own kernels (the fusions of run_at off).
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "backend/backend.h"
#include "backend/node_params.h"
#include "collective_math.h"
#include "cpu/moe.h"
#include "cuda_backend.h"
#include "error.h"
#include "moe_select.h"
#include "quant/dot_q8_1.h"
#include "quant/rows16.h"

namespace stowlm {

namespace {

namespace cu = cuda;

float* f32(const Tensor* t) { return (float*)t->data; }
const int32_t* i32(const Tensor* t) { return (const int32_t*)t->data; }

using cu::is_float_type;

// Weight types the vector/tiled product kernels and the row decoder take (mmvq.cu, mmq.cu,
// elementwise.cu get_rows).
bool is_kernel_qtype(QType t) {
    switch (t) {
#define STOWLM_CASE(T) case QType::T:
        STOWLM_Q8_1_WEIGHT_TYPES(STOWLM_CASE)
#undef STOWLM_CASE
            return true;
        default:
            return false;
    }
}

// A node reading bytes that cannot move (weights, KV cache) must run where they are.
bool pinned(const Tensor& n) {
    for (int i = 0; i < n.n_src(); i++) {
        const Tensor* s = n.src[i];
        if (!s) continue;
        const TensorRole r = s->storage_root()->role;
        if (r == TensorRole::WEIGHT || r == TensorRole::KV) return true;
    }
    return false;
}

// The row-wise launchers take at most 65535 rows (one grid row each): run them in chunks.
constexpr int64_t kMaxRows = 65535;
template <typename F>
void in_row_chunks(int64_t n, F&& f) {
    for (int64_t r0 = 0; r0 < n; r0 += kMaxRows) f(r0, std::min(kMaxRows, n - r0));
}

// The host copy of a device tensor the context uploaded from a graph input, if it is one
// (lets get_rows reject a bad id with a clear error instead of reading out of bounds).
const int32_t* host_ids(const Tensor* t) {
    if (t->op != Op::COPY || !t->src[0]) return nullptr;
    const Tensor* s = t->src[0];
    return s->storage_root()->role == TensorRole::INPUT ? (const int32_t*)s->data : nullptr;
}

class CudaBackend final : public Backend {
public:
    CudaBackend(int id, const DeviceSpec& spec)
        : id_(id), dev_(std::make_unique<cu::CudaDevice>(spec.index)), name_(dev_->name()) {
        // A budget below the device's memory makes it refuse allocations past it, as a CPU
        // virtual device does; the device's own size is the limit otherwise.
        budget_ = spec.mem_bytes ? std::min(spec.mem_bytes, dev_->memory_total()) : dev_->memory_total();
        graphs_on_ = !env_is("STOWLM_CUDA_GRAPHS", "0");
        fusion_on_ = !env_is("STOWLM_CUDA_FUSION", "0");
    }
    ~CudaBackend() override {
        try {
            dev_->synchronize();
        } catch (...) {
        }
        for (auto& kv : graphs_) dev_->destroy_graph(kv.second.exec);
    }

    const std::string& name() const override { return name_; }
    int id() const override { return id_; }
    bool host_accessible() const override { return false; }
    int64_t batched_min_tokens() const override { return kCudaBatchedMinTokens; }
    size_t memory_total() const override { return budget_; }
    size_t memory_used() const override { return dev_->memory_used(); }

    BufferPtr alloc_buffer(size_t bytes, const std::string& purpose) override {
        const size_t avail = budget_ - std::min(dev_->memory_used(), budget_);
        if (bytes > avail)
            throw OutOfDeviceMemory("device " + name_ + " is out of memory: " + purpose + " asked for " +
                                    describe_bytes(bytes) + ", " + describe_bytes(avail) + " available of a " +
                                    describe_bytes(budget_) + " budget");
        auto b = std::make_unique<BackendBuffer>();
        b->data = dev_->alloc(bytes, purpose);  // exactly `bytes`; OutOfDeviceMemory if the driver refuses
        b->backend = this, b->size = bytes, b->purpose = purpose;
        return b;
    }

    BufferPtr import_host(const void* data, size_t bytes, const std::string& purpose) override {
        BufferPtr b = alloc_buffer(bytes, purpose);
        if (data && bytes) {
            dev_->copy_to_device(b->data, data, bytes, dev_->compute_stream());
            dev_->synchronize();  // the caller may release the host bytes on return
        }
        return b;
    }

    void free_buffer(BackendBuffer& b) override {
        // Called from BackendBuffer's destructor: never throw (cudaFree waits for the device).
        try {
            dev_->free(b.data);
        } catch (...) {
        }
        b.data = nullptr, b.size = 0, b.backend = nullptr;
    }

    bool can_stage(const Tensor& n) const override {
        const Tensor* w = staged_weight(n);
        if (!w || !unsupported_reason(n).empty()) return false;
        if (n.op == Op::ADD_ID) return w->type == QType::F32 && w->is_contiguous();  // gpt-oss's expert biases
        // repacked experts come back to GGUF's layout a group at a time in shared memory
        return !w->rows16 || rows16_group_bytes(w->type, w->ne[0]) <= kStagedRows16GroupMax;
    }
    size_t staging_bytes(const Tensor& n) const override {
        return n.staged ? (staged_weight(n)->nbytes() + 255) & ~(size_t)255 : 0;  // the slot: 256-byte aligned
    }

    size_t pin_host(const std::vector<std::pair<const void*, size_t>>& ranges) override {
        size_t n = 0;
        for (const auto& r : ranges) {
            auto it = pins_.find(r.first);
            if (it == pins_.end()) it = pins_.emplace(r.first, dev_->pin_host(r.first, r.second)).first;
            if (it->second) n += r.second;
        }
        return n;
    }

    bool supports(const Tensor& n) const override {
        const std::string why = unsupported_reason(n);
        if (why.empty()) return true;
        // The scheduler can move a node elsewhere only when it reads no weight or KV bytes of
        // this device; otherwise say why here instead of a vaguer placement error later.
        if (pinned(n)) throw Unsupported(name_ + ": cannot run " + op_name(n.op) + " '" + n.name + "': " + why);
        return false;
    }

    size_t scratch_bytes(const Tensor& n) const override {
        const Tensor* a = n.src[0];
        switch (n.op) {
            case Op::MUL_MAT:
                return cu::matmul_scratch_bytes(a->type, a->ne[0], n.src[1]->n_rows());
            case Op::MUL_MAT_ID:
                return moe_scratch(n);
            case Op::FLASH_ATTN: {
                // The plan is made on the largest graph, but a smaller one (decoding) may split
                // the KV range more. Free splits: the launcher's choice keeps n_tok * n_head *
                // n_split below 4 * sm_count whenever it splits (it aims at two blocks per SM).
                // Fixed splits: it runs them in blocks of their own only below 2 * sm_count
                // (token, head) blocks, and no graph has more cells than the planned one.
                const int64_t hd_v = kv_view(n).hd_v;
                const int64_t per_block =
                    split_cells_of(n) > 0 ? 2 * cu::flash_attn_fixed_splits(n.src[1]->ne[1], split_cells_of(n)) : 4;
                const size_t any_shape = (size_t)per_block * dev_->sm_count() * (size_t)(hd_v + 2) * sizeof(float);
                return std::max(any_shape, attn_scratch(n));
            }
            case Op::ALL_REDUCE:
            case Op::ALL_GATHER:
                return reduce_scratch_bytes(n);
            default:
                return 0;
        }
    }

    void compute(const Split& split, void* scratch, size_t scratch_bytes) override {
        dev_->set_current();
        // A collective waits on the host inside the split, and staged experts are copied from the
        // host in it: such splits are never captured nor held.
        const bool host_bound = has_collective(split) || has_staged(split);
        if (graphs_on_ && !host_bound) {
            std::lock_guard<std::mutex> lk(graphs_mu_);
            if (const Captured* g = graph_of(split, scratch, scratch_bytes)) return replay(*g);
        }
        const uint64_t first = cu::launches_on_this_thread();
        if (!timing_ || host_bound) {
            ScratchHolds held;
            Stager stager;
            if (has_staged(split)) stage_begin(split, scratch, scratch_bytes, stager), held.stager = &stager;
            try {
                for (size_t i = 0; i < split.nodes.size();)
                    i = run_at(split.nodes, i, scratch, scratch_bytes, dev_->compute_stream(), held);
            } catch (...) {
                stage_end(stager);
                throw;
            }
            stage_end(stager);
        } else {
            timed_splits_++;
            run_timed(split, scratch, scratch_bytes);
        }
        launches_ += cu::launches_on_this_thread() - first;
    }

    void set_kernel_timing(bool on) override { timing_ = on; }
    KernelStats take_kernel_stats() override {
        KernelStats k;
        k.counted = true;
        const cu::CudaDevice::TimedTotal t = dev_->take_timed();
        k.launches = launches_.exchange(0);
        k.graph_launches = graph_launches_.exchange(0);
        k.graph_kernels = graph_kernels_.exchange(0);
        k.timed_splits = timed_splits_.exchange(0);
        k.kernel_s = t.seconds;
        k.late_splits = t.late;
        // each timed span under its label (an op's kernels, or a replayed graph's)
        OpTimes ops;
        for (size_t i = 0; i < t.span_s.size() && i < span_labels_.size(); i++) ops.add(span_labels_[i], t.span_s[i]);
        span_labels_.clear();
        k.ops = ops.take();
        return k;
    }

    void copy_from_host(Tensor& dst, const void* src, size_t bytes, size_t offset) override {
        dev_->copy_to_device((char*)dst.data + offset, src, bytes, dev_->compute_stream());
    }
    void copy_to_host(const Tensor& src, void* dst, size_t bytes, size_t offset) override {
        // On the compute stream, so it waits for the kernels that produce src; returns when done.
        dev_->copy_to_host(dst, (const char*)src.data + offset, bytes, dev_->compute_stream());
    }
    void copy_from_peer(Tensor& dst, const Tensor& src, Backend& from) override {
        if (from.host_accessible()) {
            // A host device computes synchronously: src is final.
            dev_->copy_to_device(dst.data, src.data, src.nbytes(), dev_->compute_stream());
            return;
        }
        auto* other = dynamic_cast<CudaBackend*>(&from);
        if (!other)
            throw Unsupported(name_ + ": cannot copy '" + src.name + "' from device " + from.name() +
                              " (neither host memory nor a CUDA device)");
        // This stream waits (on the device, not the host) for the kernels that produced src;
        // then the other device waits for the copy, since the planner may hand src's bytes to
        // that device's next split as soon as the copy is its last use.
        cu::Event produced = other->dev_->record(other->dev_->compute_stream());
        dev_->wait(dev_->compute_stream(), produced);
        other->dev_->release(produced);  // destroying a recorded event keeps the wait
        dev_->copy_from_peer(dst.data, *other->dev_, src.data, src.nbytes(), dev_->compute_stream());
        cu::Event copied = dev_->record(dev_->compute_stream());
        other->dev_->wait(other->dev_->compute_stream(), copied);
        dev_->release(copied);
    }
    void synchronize() override { dev_->synchronize(); }

private:
    static bool has_collective(const Split& split) {
        for (const Tensor* n : split.nodes)
            if (n->op == Op::ALL_REDUCE || n->op == Op::ALL_GATHER) return true;
        return false;
    }
    static bool has_staged(const Split& split) {
        for (const Tensor* n : split.nodes)
            if (n->staged) return true;
        return false;
    }
    // The expert product's scratch (scratch_bytes; staged experts go in the staging slots).
    static size_t moe_scratch(const Tensor& n) {
        const Tensor *a = n.src[0], *x = n.src[1], *ids = n.src[2];
        const int64_t slots = ids->ne[0] * ids->ne[1];
        return cu::moe_scratch_bytes(weight(a), (int)a->ne[2], x->ne[1] == 1 ? ids->ne[1] : slots, slots);
    }

    // ---- CUDA graphs ---------------------------------------------------------------------------
    struct Captured {
        void* scratch = nullptr;       // the scratch it was captured with
        cu::CudaDevice::GraphExec exec = nullptr;
        uint64_t kernels = 0;          // the kernels it replays
        uint64_t last_use = 0;
        int runs = 0;
        bool failed = false;           // the capture failed: run this split's kernels directly
    };
    // Graphs kept at most: a context's decode shapes (one per 256 cells of depth and copy slot);
    // the least recently used goes first (a freed context's splits are never run again).
    static constexpr size_t kMaxGraphs = 128;

    // The graph to replay for this split, captured on its second run (a shape run once, as most
    // prompt batches are, is not worth a capture); nullptr: run the nodes directly.
    const Captured* graph_of(const Split& split, void* scratch, size_t scratch_bytes) {
        if (!graphs_on_) return nullptr;
        Captured& c = graphs_[split.uid];
        c.last_use = ++graph_clock_;
        if (c.scratch != scratch) {  // not the same arguments: start over
            dev_->destroy_graph(c.exec);
            c = Captured{scratch, nullptr, 0, graph_clock_, 0, false};
        }
        if (c.exec || c.failed) return c.exec ? &c : nullptr;
        if (timing_) return nullptr;  // a capture's kernels would count in the timed run's
        if (++c.runs < 2) return nullptr;
        evict_graphs();
        // Captured on a stream of its own: work another thread enqueues on the compute stream
        // meanwhile (a second shard of a tensor split on this device) runs, not joins the graph.
        const cu::Stream s = dev_->capture_stream();
        const uint64_t first = cu::launches_on_this_thread();
        dev_->begin_capture(s);
        try {
            ScratchHolds held;
            for (size_t i = 0; i < split.nodes.size();) i = run_at(split.nodes, i, scratch, scratch_bytes, s, held);
        } catch (...) {
            dev_->destroy_graph(dev_->end_capture(s));
            c.failed = true;  // run directly (an argument error then says what it is)
            return nullptr;
        }
        c.exec = dev_->end_capture(s);
        c.kernels = cu::launches_on_this_thread() - first;
        if (!c.exec) c.failed = true;
        return c.exec ? &c : nullptr;
    }

    // Enqueues the graph on the compute stream (held and timed as one span with kernel timing on).
    void replay(const Captured& g) {
        const cu::Stream s = dev_->compute_stream();
        const bool timed = timing_;
        if (timed) {
            timed_splits_++;
            span_labels_.push_back("CUDA graph of " + std::to_string(g.kernels) + " kernels");
            dev_->begin_timed(s);
        }
        try {
            dev_->launch_graph(g.exec, s);
        } catch (...) {
            if (timed) dev_->end_timed(s);
            throw;
        }
        if (timed) dev_->end_timed(s);
        // the kernels were counted on this thread when captured: count the replay's here
        launches_ += g.kernels;
        graph_kernels_ += g.kernels;
        graph_launches_++;
    }

    void evict_graphs() {
        while (graphs_.size() > kMaxGraphs) {
            auto oldest = graphs_.begin();
            for (auto it = graphs_.begin(); it != graphs_.end(); ++it)
                if (it->second.last_use < oldest->second.last_use) oldest = it;
            dev_->destroy_graph(oldest->second.exec);
            graphs_.erase(oldest);
        }
    }

    // Each op (or fused group) of the split in a held span of its own, so that its kernels run
    // back to back and its time is labelled (stowlm-bench -v's table; STOWLM_CUDA_GRAPHS=0 times
    // a decode step's ops, else its replayed graph).
    void run_timed(const Split& split, void* scratch, size_t scratch_bytes) {
        const cu::Stream s = dev_->compute_stream();
        ScratchHolds held;
        for (size_t i = 0; i < split.nodes.size();) {
            const size_t at = i;
            dev_->begin_timed(s);
            try {
                i = run_at(split.nodes, i, scratch, scratch_bytes, s, held);
            } catch (...) {
                try {
                    dev_->end_timed(s);  // never leave the stream held
                } catch (...) {
                }
                throw;
            }
            dev_->end_timed(s);
            span_labels_.push_back(OpTimes::label(&split.nodes[at], i - at));
        }
    }
    std::vector<std::string> span_labels_;  // the timed spans' labels, in order (take_kernel_stats)

    static cu::DeviceWeight weight(const Tensor* w) {
        cu::DeviceWeight d;
        d.data = w->data, d.type = w->type, d.rows = w->ne[1], d.cols = w->ne[0];
        return d;
    }

    int attn_splits(const Tensor& n) const {
        const Tensor* q = n.src[0];
        return cu::flash_attn_auto_splits(q->ne[2], q->ne[1], n.src[1]->ne[1], dev_->sm_count(), split_cells_of(n));
    }
    size_t attn_scratch(const Tensor& n) const {
        const Tensor* q = n.src[0];
        return cu::flash_attn_scratch_bytes(q->ne[2], q->ne[1], kv_view(n).hd_v, attn_splits(n));
    }

    // Empty when the kernels take node n, else why not.
    std::string unsupported_reason(const Tensor& n) const {
        const Tensor* a = n.src[0];
        switch (n.op) {
            case Op::NONE:
                return "not an op";
            case Op::GET_ROWS:
                if (!is_float_type(a->type) && !is_kernel_qtype(a->type))
                    return std::string("no CUDA row decoder for ") + qtype_name(a->type);
                return "";
            case Op::MUL_MAT:
            case Op::MUL_MAT_ID:
                if (!is_float_type(a->type) && !is_kernel_qtype(a->type))
                    return std::string("no CUDA product kernel for ") + qtype_name(a->type) + " weights";
                if (n.op == Op::MUL_MAT_ID && (a->ne[0] % 32 || a->ne[2] > 65535))
                    return "expert rows must have a multiple of 32 elements and at most 65535 experts";
                return "";
            case Op::STORE_KV:
            case Op::FLASH_ATTN: {
                const Tensor* cache = n.src[1];
                if (cache->type != QType::F16 && cache->type != QType::Q8_0)
                    return std::string("the KV cache type ") + qtype_name(cache->type) +
                           " has no CUDA kernel (use kv_type f16 or q8_0)";
                if (n.op == Op::FLASH_ATTN) {
                    const cpu::KvView kv = kv_view(n);
                    if (kv.hd_k > cu::kFlashAttnMaxHeadDimK || kv.hd_v > cu::kFlashAttnMaxHeadDimV)
                        return "head widths " + std::to_string(kv.hd_k) + " (K) / " + std::to_string(kv.hd_v) +
                               " (V) exceed the CUDA kernel's " + std::to_string(cu::kFlashAttnMaxHeadDimK) + " / " +
                               std::to_string(cu::kFlashAttnMaxHeadDimV);
                }
                return "";
            }
            case Op::TOP_K: {
                const int64_t groups = n.iparams[2];
                if (groups > kMaxExpertGroups)
                    return std::to_string(groups) + " expert groups exceed the CUDA kernel's " +
                           std::to_string(kMaxExpertGroups);
                const bool plain = !n.src[1] && groups <= 1 && n.iparams[1] != (int32_t)cpu::Gating::Sigmoid;
                if (!plain && a->ne[0] > cu::kTopKMaxScored)
                    return std::to_string(a->ne[0]) + " experts with gated, biased or grouped scores exceed the CUDA "
                           "kernel's " + std::to_string(cu::kTopKMaxScored);
                return "";
            }
            case Op::VIEW:
            case Op::COPY:
            case Op::ADD:
            case Op::MUL:
            case Op::SCALE:
            case Op::SOFTCAP:
            case Op::RMS_NORM:
            case Op::ROPE:
            case Op::SWIGLU:
            case Op::GEGLU:
            case Op::CONT:
            case Op::CONCAT:
            case Op::SWIGLU_OAI:
            case Op::MOE_WEIGHTS:
            case Op::ADD_ID:
            case Op::MOE_SUM:
            case Op::LOCAL_IDS:
                return "";
            case Op::ALL_REDUCE:
            case Op::ALL_GATHER:
                if (n.collective && (int)n.collective->parts.size() > kMaxShards)
                    return "more than " + std::to_string(kMaxShards) + " shards";
                return "";
            default:  // an op added to the graph without a kernel here: the CPU runs it, or a clear error
                return std::string(op_name(n.op)) + " has no CUDA kernel";
        }
    }

    // Ops whose kernels work in place: copy the input to the output first unless the planner
    // already gave them the same bytes.
    void prepare_in_place(Tensor* out, cu::Stream s) {
        const Tensor* x = out->src[0];
        if (out->data != x->data) dev_->copy_device(out->data, x->data, out->nbytes(), s);
    }

    // Staged experts (Tensor::staged) of a split: each node's weights go by the copy stream into
    // one of the two staging slots at the end of the scratch (the planner's), the next node's
    // while this one's product runs; events keep a slot's copy after its last reader and before
    // its next. (A split that stages is never captured nor timed.)
    struct Stager {
        std::vector<const Tensor*> nodes;  // the split's staged nodes, in order
        char* slot[2] = {nullptr, nullptr};
        size_t next = 0;  // the staged node to run next
        cu::Event copied[2] = {nullptr, nullptr}, used[2] = {nullptr, nullptr};
    };
    // What the split's scratch holds: the block_q8_1 rows of this activation tensor, left by a
    // product of quantized weights or a norm, until a node that writes the scratch otherwise runs;
    // and the split's stager, if it stages.
    struct ScratchHolds {
        const Tensor* x = nullptr;
        Stager* stager = nullptr;
    };

    void stage_begin(const Split& split, void* scratch, size_t scratch_bytes, Stager& st) {
        size_t slot = 0;
        for (const Tensor* n : split.nodes)
            if (n->staged) st.nodes.push_back(n), slot = std::max(slot, staging_bytes(*n));  // the planner's slot
        if (2 * slot > scratch_bytes)
            throw InvalidInput(name_ + ": staging " + std::to_string(slot) + "-byte experts needs two slots, the plan's "
                               "scratch has " + std::to_string(scratch_bytes) + " bytes");
        st.slot[0] = (char*)scratch + scratch_bytes - 2 * slot, st.slot[1] = st.slot[0] + slot;
        // the slots' bytes may have been read by this stream's earlier work: copies wait for it
        for (int k = 0; k < 2; k++) st.used[k] = dev_->record(dev_->compute_stream());
        stage_copy(st, 0);
    }
    // Starts the copy of staged node k's weights into slot k % 2, after that slot's last reader.
    void stage_copy(Stager& st, size_t k) {
        const int s = (int)(k % 2);
        const cu::Stream cs = dev_->copy_stream();
        const Tensor* w = staged_weight(*st.nodes[k]);
        if (st.used[s]) dev_->wait(cs, st.used[s]), dev_->release(st.used[s]), st.used[s] = nullptr;
        dev_->copy_to_device(st.slot[s], w->data, w->nbytes(), cs);
        // experts the CPU keeps repacked for its own products: GGUF's layout again for the GPU's
        if (w->rows16) cuda::unrepack_rows16(st.slot[s], w->type, w->ne[2], w->ne[1], w->ne[0], cs);
        st.copied[s] = dev_->record(cs);
    }
    // Where node n's staged weights are: its copy is waited for on stream s.
    const void* stage_take(Stager& st, const Tensor* n, cu::Stream s) {
        if (st.next >= st.nodes.size() || st.nodes[st.next] != n)
            throw InvalidInput(name_ + ": staged node " + n->name + " runs out of order");
        const int k = (int)(st.next % 2);
        dev_->wait(s, st.copied[k]), dev_->release(st.copied[k]), st.copied[k] = nullptr;
        return st.slot[k];
    }
    // After node n's product is enqueued: its slot is free once that is done; the next copy starts.
    void stage_done(Stager& st, cu::Stream s) {
        const int k = (int)(st.next % 2);
        st.used[k] = dev_->record(s);
        if (++st.next < st.nodes.size()) stage_copy(st, st.next);
    }
    void stage_end(Stager& st) {
        for (int k = 0; k < 2; k++) {
            if (st.used[k]) dev_->release(st.used[k]);
            if (st.copied[k]) dev_->release(st.copied[k]);
        }
    }

    // ---- fused kernels ---------------------------------------------------------------------------
    // Whole contiguous rows of t's shape.
    static bool same_rows(const Tensor* t, const Tensor* like) {
        return t->is_contiguous() && t->ne[0] == like->ne[0] && t->n_rows() == like->n_rows();
    }
    // A residual ADD whose sum the next node, an RMS_NORM, reads: one add_rms_norm kernel.
    static bool add_then_norm(const std::vector<Tensor*>& nodes, size_t i) {
        if (i + 1 >= nodes.size()) return false;
        const Tensor *add = nodes[i], *norm = nodes[i + 1];
        if (add->op != Op::ADD || norm->op != Op::RMS_NORM || norm->src[0] != add) return false;
        return same_rows(add->src[0], add) && same_rows(add->src[1], add) && same_rows(add, add) &&
               same_rows(norm, add) && norm->data != add->data;
    }
    // An RMS_NORM (nodes[i]) whose output the next node multiplies by quantized weights: the norm
    // writes the product's q8_1 rows into the scratch too (the product then reuses them).
    static bool norm_feeds_product(const std::vector<Tensor*>& nodes, size_t i, void* scratch, size_t scratch_bytes) {
        const Tensor* norm = nodes[i];
        if (i + 1 >= nodes.size() || !scratch || !same_rows(norm, norm) || norm->ne[0] % 32) return false;
        const Tensor* mm = nodes[i + 1];
        return mm->op == Op::MUL_MAT && mm->src[1] == norm && !is_float_type(mm->src[0]->type) &&
               cu::q8_1_bytes(norm->n_rows(), norm->ne[0]) <= scratch_bytes;
    }

    // The gate and up products of one x (quantized weights of one type and shape, a decode-sized
    // batch) and the SWIGLU or GEGLU of the two right after them: one matmul_glu kernel.
    static bool gate_up_glu(const std::vector<Tensor*>& nodes, size_t i) {
        if (i + 2 >= nodes.size()) return false;
        const Tensor *g = nodes[i], *u = nodes[i + 1], *act = nodes[i + 2];
        if (g->op != Op::MUL_MAT || u->op != Op::MUL_MAT || (act->op != Op::SWIGLU && act->op != Op::GEGLU))
            return false;
        const Tensor *wg = g->src[0], *wu = u->src[0], *x = g->src[1];
        return u->src[1] == x && act->src[0] == g && act->src[1] == u && !is_float_type(wg->type) &&
               wg->type == wu->type && wg->ne[0] == wu->ne[0] && wg->ne[1] == wu->ne[1] && wg->ne[0] % 32 == 0 &&
               x->n_rows() < kCudaBatchedMinTokens && same_rows(x, x) && same_rows(u, g) && same_rows(act, g) &&
               same_rows(g, g);
    }

    // Consecutive products of one x (a layer's q, k and v) by quantized weights of one type and
    // width, a decode-sized batch: how many (2..kMmvMulti, 0: none) take one matmul_multi kernel.
    static int products_of_one_x(const std::vector<Tensor*>& nodes, size_t i) {
        const Tensor* a = nodes[i];
        if (a->op != Op::MUL_MAT || is_float_type(a->src[0]->type)) return 0;
        const Tensor* x = a->src[1];
        if (x->n_rows() >= kCudaBatchedMinTokens || !same_rows(x, x) || x->ne[0] % 32) return 0;
        int n = 0;
        for (; n < cu::kMmvMulti && i + n < nodes.size(); n++) {
            const Tensor* m = nodes[i + n];
            if (m->op != Op::MUL_MAT || m->src[1] != x || m->src[0]->type != a->src[0]->type ||
                m->src[0]->ne[0] != x->ne[0] || !same_rows(m, m) || m->ne[0] != m->src[0]->ne[1])
                break;
        }
        return n >= 2 ? n : 0;
    }

    // An attention whose output the next node multiplies by quantized weights (attn_output): the
    // attention kernel writes the product's q8_1 rows into the scratch too.
    bool attn_feeds_product(const std::vector<Tensor*>& nodes, size_t i, size_t scratch_bytes) const {
        const Tensor* n = nodes[i];
        if (n->op != Op::FLASH_ATTN || i + 1 >= nodes.size() || !same_rows(n, n) || n->ne[0] % 32) return false;
        const Tensor* mm = nodes[i + 1];
        const int64_t hd_v = kv_view(*n).hd_v;
        return mm->op == Op::MUL_MAT && mm->src[1] == n && !is_float_type(mm->src[0]->type) && hd_v % 32 == 0 &&
               n->ne[0] == n->src[0]->ne[1] * hd_v && q8_1_span(*n) <= scratch_bytes;
    }

    // Two ROPEs of the same tokens, head width, positions and angles (a layer's q and k).
    static bool rope_pair(const std::vector<Tensor*>& nodes, size_t i) {
        if (i + 1 >= nodes.size()) return false;
        const Tensor *q = nodes[i], *k = nodes[i + 1];
        if (q->op != Op::ROPE || k->op != Op::ROPE || q->src[1] != k->src[1]) return false;
        return q->ne[0] == k->ne[0] && q->ne[2] == k->ne[2] && q->is_contiguous() && k->is_contiguous() &&
               std::equal(q->iparams, q->iparams + 3, k->iparams) && std::equal(q->fparams, q->fparams + 6, k->fparams);
    }
    // Two STORE_KVs into caches of one type at the same cells (a layer's K and V).
    static bool store_pair(const std::vector<Tensor*>& nodes, size_t i) {
        if (i + 1 >= nodes.size()) return false;
        const Tensor *k = nodes[i], *v = nodes[i + 1];
        if (k->op != Op::STORE_KV || v->op != Op::STORE_KV || k->src[2] != v->src[2]) return false;
        return k->src[1]->type == v->src[1]->type && k->src[0]->ne[2] == v->src[0]->ne[2] &&
               k->src[0]->ne[2] <= kMaxRows;
    }
    static cu::KvRows kv_rows(const Tensor* store) {
        const Tensor *x = store->src[0], *cache = store->src[1];
        return cu::KvRows{(const float*)x->data, x->ne[0] * x->ne[1], x->ne[1], x->ne[0], cache->data, cache->nb[1]};
    }

    // The router's TOP_K (plain selection over contiguous rows) and the MOE_WEIGHTS of its picks.
    static bool topk_then_weights(const std::vector<Tensor*>& nodes, size_t i) {
        if (i + 1 >= nodes.size()) return false;
        const Tensor *tk = nodes[i], *mw = nodes[i + 1];
        if (tk->op != Op::TOP_K || mw->op != Op::MOE_WEIGHTS || mw->src[1] != tk) return false;
        const Tensor* logits = mw->src[0];
        return same_rows(tk->src[0], tk->src[0]) && same_rows(logits, logits) && logits->ne[0] == tk->src[0]->ne[0] &&
               logits->n_rows() == tk->src[0]->n_rows() && cu::top_k_is_plain(tk->src[0]->ne[0], top_k_params(*tk));
    }

    // One token's gate and up expert products (one x, one ids, quantized experts of one type and
    // shape, weights on this device) and the SWIGLU or GEGLU of the two: one moe_matmul_glu.
    static bool experts_glu(const std::vector<Tensor*>& nodes, size_t i) {
        if (i + 2 >= nodes.size()) return false;
        const Tensor *g = nodes[i], *u = nodes[i + 1], *act = nodes[i + 2];
        if (g->op != Op::MUL_MAT_ID || u->op != Op::MUL_MAT_ID || (act->op != Op::SWIGLU && act->op != Op::GEGLU))
            return false;
        const Tensor *wg = g->src[0], *wu = u->src[0], *x = g->src[1], *ids = g->src[2];
        return !g->staged && !u->staged && u->src[1] == x && u->src[2] == ids && act->src[0] == g &&
               act->src[1] == u && !is_float_type(wg->type) && wg->type == wu->type && wg->ne[0] == wu->ne[0] &&
               wg->ne[1] == wu->ne[1] && wg->ne[2] == wu->ne[2] && x->ne[1] == 1 && ids->ne[1] == 1 &&
               x->ne[0] == wg->ne[0] && x->is_contiguous() && same_rows(g, g) && same_rows(u, g) &&
               same_rows(act, g) && ids->is_contiguous();
    }

    // Runs nodes[i] on stream s, fused with the nodes after it where they fuse; the index of the
    // next node. Fused: [residual ADD +] RMS_NORM [+ its q8_1 rows for the product after it];
    // gate and up products + their GLU; products of one x (q, k, v); attention + its output's
    // q8_1 rows; q and k ROPEs [+ the K and V stores after them]; K and V stores.
    size_t run_at(const std::vector<Tensor*>& nodes, size_t i, void* scratch, size_t scratch_bytes, cu::Stream s,
                  ScratchHolds& held) {
        if (!fusion_on_) {  // every node its own kernels (STOWLM_CUDA_FUSION=0: to compare, or to isolate a fault)
            run(nodes[i], scratch, scratch_bytes, s, held);
            return i + 1;
        }
        if (experts_glu(nodes, i)) {
            Tensor *g = nodes[i], *u = nodes[i + 1], *act = nodes[i + 2];
            const Tensor* ids = g->src[2];
            cu::moe_matmul_glu(weight(g->src[0]), weight(u->src[0]), (int)g->src[0]->ne[2], f32(g->src[1]), i32(ids),
                               (int)ids->ne[0], f32(g), f32(u), f32(act), g->ne[0], act->op == Op::GEGLU, scratch, s);
            held.x = nullptr;  // the scratch holds the expert product's rows now
            return i + 3;
        }
        if (topk_then_weights(nodes, i)) {
            Tensor *tk = nodes[i], *mw = nodes[i + 1];
            const Tensor *x = tk->src[0], *logits = mw->src[0];
            cu::top_k_weights(f32(x), x->n_rows(), x->ne[0], x->ne[0], top_k_params(*tk), (int32_t*)tk->data,
                              f32(logits), (cpu::Gating)mw->iparams[0], mw->iparams[1] != 0, mw->fparams[0], f32(mw), s);
            return i + 2;
        }
        if (rope_pair(nodes, i) && store_pair(nodes, i + 2) && nodes[i + 2]->src[0] == nodes[i + 1]) {  // the rotated k stored, and v
            Tensor *q = nodes[i], *k = nodes[i + 1];
            prepare_in_place(q, s), prepare_in_place(k, s);
            const Tensor* ks = nodes[i + 2];
            cu::rope_store(f32(q), q->ne[1], q->ne[0] * q->ne[1], kv_rows(ks), kv_rows(nodes[i + 3]), q->ne[2],
                           i32(q->src[1]), rope_params(*q), ks->src[1]->type, i32(ks->src[2]), s);
            return i + 4;
        }
        if (rope_pair(nodes, i)) {
            Tensor *q = nodes[i], *k = nodes[i + 1];
            prepare_in_place(q, s), prepare_in_place(k, s);
            cu::rope_pair(f32(q), q->ne[1], q->ne[0] * q->ne[1], f32(k), k->ne[1], k->ne[0] * k->ne[1], q->ne[2],
                          q->ne[0], i32(q->src[1]), rope_params(*q), s);
            return i + 2;
        }
        if (store_pair(nodes, i)) {
            const Tensor *k = nodes[i], *v = nodes[i + 1];
            cu::store_kv_pair(kv_rows(k), kv_rows(v), k->src[0]->ne[2], k->src[1]->type, i32(k->src[2]), s);
            return i + 2;
        }
        if (gate_up_glu(nodes, i)) {
            Tensor *g = nodes[i], *u = nodes[i + 1], *act = nodes[i + 2];
            Tensor* x = g->src[1];
            cu::matmul_glu(weight(g->src[0]), weight(u->src[0]), f32(x), x->n_rows(), x->ne[0], f32(g), f32(u), f32(act),
                           g->ne[0], act->op == Op::GEGLU, scratch, s, held.x == x);
            held.x = x;
            return i + 3;
        }
        if (scratch && attn_feeds_product(nodes, i, scratch_bytes)) {
            attention(nodes[i], scratch, scratch_bytes, s, scratch);
            held.x = nodes[i];  // the product after it finds its q8_1 rows in the scratch
            return i + 1;
        }
        if (const int n = products_of_one_x(nodes, i)) {
            cu::DeviceWeight ws[cu::kMmvMulti];
            float* ys[cu::kMmvMulti];
            int64_t ldys[cu::kMmvMulti];
            for (int j = 0; j < n; j++)
                ws[j] = weight(nodes[i + j]->src[0]), ys[j] = f32(nodes[i + j]), ldys[j] = nodes[i + j]->ne[0];
            Tensor* x = nodes[i]->src[1];
            cu::matmul_multi(ws, n, f32(x), x->n_rows(), x->ne[0], ys, ldys, scratch, s, held.x == x);
            held.x = x;
            return i + n;
        }
        const bool with_add = add_then_norm(nodes, i);
        const size_t ni = with_add ? i + 1 : i;
        Tensor* norm = nodes[ni];
        if (norm->op == Op::RMS_NORM && (with_add || same_rows(norm->src[0], norm))) {
            void* yq = norm_feeds_product(nodes, ni, scratch, scratch_bytes) ? scratch : nullptr;
            if (with_add || yq) {
                const Tensor* add = with_add ? nodes[i] : nullptr;
                cu::add_rms_norm(f32(with_add ? add->src[0] : norm->src[0]), with_add ? f32(add->src[1]) : nullptr,
                                 norm->n_rows(), norm->ne[0], with_add ? f32(add) : nullptr,
                                 norm->src[1] ? f32(norm->src[1]) : nullptr, norm->fparams[0], f32(norm), yq, s);
                if (yq) held.x = norm;
                return ni + 1;
            }
        }
        run(nodes[i], scratch, scratch_bytes, s, held);
        return i + 1;
    }

    // Attention; with yq (the scratch's start) its output's q8_1 rows too, the split partials then
    // after them.
    void attention(Tensor* n, void* scratch, size_t scratch_bytes, cu::Stream s, void* yq) {
        const Tensor* q = n->src[0];
        const size_t skip = yq ? q8_1_span(*n) : 0;
        char* part = scratch ? (char*)scratch + skip : nullptr;
        const size_t part_bytes = scratch_bytes > skip ? scratch_bytes - skip : 0;
        // Split the KV range when the scratch the plan reserved holds the partials (with fixed
        // splits, not splitting gives the same bits).
        int n_split = attn_splits(*n);
        if (n_split > 1 && (!part || attn_scratch(*n) > part_bytes)) n_split = 1;
        cu::flash_attn(f32(q), q->ne[2], q->ne[1], q->ne[0] * q->ne[1], kv_view(*n), i32(n->src[3]), i32(n->src[4]),
                       attn_params(*n), f32(n), n->ne[0], n_split, n_split > 1 ? part : nullptr, s, yq);
    }
    // The scratch bytes an attention's q8_1 output rows take (the partials start 256-aligned after).
    static size_t q8_1_span(const Tensor& n) { return (cu::q8_1_bytes(n.n_rows(), n.ne[0]) + 255) & ~(size_t)255; }

    // Enqueues node n on stream s (the compute stream, or the capture stream while capturing).
    void run(Tensor* n, void* scratch, size_t scratch_bytes, cu::Stream s, ScratchHolds& held) {
        Tensor* a = n->src[0];
        Tensor* b = n->src[1];
        if (n->op == Op::MUL_MAT_ID || n->op == Op::FLASH_ATTN || n->op == Op::ALL_REDUCE || n->op == Op::ALL_GATHER)
            held.x = nullptr;
        switch (n->op) {
            case Op::CONT:
                cu::cont(f32(a), a->ne, a->nb, f32(n), s);
                return;
            case Op::CONCAT:
                cu::concat(f32(a), a->ne, a->nb, f32(b), b->ne[0], b->nb, f32(n), s);
                return;
            case Op::SWIGLU_OAI:
                cu::swiglu_oai(f32(a), f32(b), n->n_elements(), n->fparams[0], n->fparams[1], f32(n), s);
                return;
            case Op::ADD_ID: {
                prepare_in_place(n, s);
                const float* bias = f32(b);
                if (n->staged) {  // the biases live in host memory: the stager copied them in
                    if (!held.stager) throw InvalidInput(name_ + ": staged node " + n->name + " outside a staging split");
                    bias = (const float*)stage_take(*held.stager, n, s);
                }
                cu::add_id(f32(n), bias, b->ne[1], i32(n->src[2]), n->ne[2], n->ne[1], n->ne[0], s);
                if (n->staged) stage_done(*held.stager, s);
                return;
            }
            case Op::NONE:
            case Op::VIEW:
            case Op::COPY:  // done by the context's copy step before the split runs
                return;
            case Op::GET_ROWS: {
                const int32_t* ids_host = host_ids(b);
                in_row_chunks(b->ne[0], [&](int64_t r0, int64_t nr) {
                    cu::get_rows(a->data, a->type, a->ne[1], a->ne[0], i32(b) + r0, ids_host ? ids_host + r0 : nullptr,
                                 nr, f32(n) + r0 * n->ne[0], n->ne[0], s);
                });
                return;
            }
            case Op::MUL_MAT: {
                // a graph tensor's bytes hold its value until its last reader: the same tensor, the same rows
                const bool quantized = !is_float_type(a->type);
                cu::matmul(weight(a), f32(b), b->n_rows(), b->ne[0], f32(n), n->ne[0], scratch, s, cu::MatmulPath::Auto,
                           quantized && fusion_on_ && held.x == b);
                if (quantized) held.x = b;
                return;
            }
            case Op::ADD:
            case Op::MUL: {
                const int64_t ld_b = b->n_rows() == 1 ? 0 : b->ne[0];
                in_row_chunks(a->n_rows(), [&](int64_t r0, int64_t nr) {
                    const auto op = n->op == Op::ADD ? cu::add : cu::mul;
                    op(f32(a) + r0 * a->ne[0], a->ne[0], f32(b) + r0 * ld_b, ld_b, nr, a->ne[0], f32(n) + r0 * n->ne[0],
                       n->ne[0], s);
                });
                return;
            }
            case Op::SCALE:
            case Op::SOFTCAP:
                prepare_in_place(n, s);
                in_row_chunks(n->n_rows(), [&](int64_t r0, int64_t nr) {
                    const auto op = n->op == Op::SCALE ? cu::scale : cu::softcap;
                    op(f32(n) + r0 * n->ne[0], nr, n->ne[0], n->ne[0], n->fparams[0], s);
                });
                return;
            case Op::RMS_NORM:
                cu::rms_norm(f32(a), a->n_rows(), a->ne[0], a->ne[0], b ? f32(b) : nullptr, n->fparams[0], f32(n),
                             n->ne[0], s);
                return;
            case Op::ROPE: {
                prepare_in_place(n, s);
                const cpu::RopeParams p = rope_params(*n);
                cu::rope(f32(n), n->ne[2], n->ne[1], n->ne[0], n->ne[0] * n->ne[1], i32(b), p, s);
                return;
            }
            case Op::STORE_KV: {
                const Tensor *cache = n->src[1], *cells = n->src[2];
                const int64_t ld_x = a->ne[0] * a->ne[1];
                in_row_chunks(a->ne[2], [&](int64_t r0, int64_t nr) {
                    cu::store_kv(f32(a) + r0 * ld_x, nr, ld_x, a->ne[1], a->ne[0], cache->type, cache->data,
                                 cache->nb[1], i32(cells) + r0, s);
                });
                return;
            }
            case Op::FLASH_ATTN:
                attention(n, scratch, scratch_bytes, s, nullptr);
                return;
            case Op::SWIGLU:
            case Op::GEGLU:
                in_row_chunks(a->n_rows(), [&](int64_t r0, int64_t nr) {
                    const auto op = n->op == Op::SWIGLU ? cu::swiglu : cu::geglu;
                    op(f32(a) + r0 * a->ne[0], a->ne[0], f32(b) + r0 * b->ne[0], b->ne[0], nr, a->ne[0],
                       f32(n) + r0 * n->ne[0], n->ne[0], s);
                });
                return;
            case Op::TOP_K:
                cu::top_k(f32(a), a->n_rows(), a->ne[0], a->ne[0], top_k_params(*n), (int32_t*)n->data, s);
                return;
            case Op::MOE_WEIGHTS:
                cu::moe_weights(f32(a), a->n_rows(), a->ne[0], i32(b), b->ne[0], (cpu::Gating)n->iparams[0],
                                n->iparams[1] != 0, n->fparams[0], f32(n), s);
                return;
            case Op::MUL_MAT_ID: {
                Tensor* ids = n->src[2];
                cu::DeviceWeight w = weight(a);
                if (n->staged) {  // the experts live in host memory: the stager copied them in
                    if (!held.stager) throw InvalidInput(name_ + ": staged node " + n->name + " outside a staging split");
                    w.data = stage_take(*held.stager, n, s);
                }
                // x [cols, 1, n]: every slot of a token reads its row (gate/up); x [cols, k, n]:
                // each slot its own row (down). With k = 1 both read row t.
                cu::moe_matmul(w, (int)a->ne[2], f32(b), b->ne[0], b->ne[1] != 1, i32(ids), ids->ne[1],
                               (int)ids->ne[0], f32(n), n->ne[0], scratch, s);
                if (n->staged) stage_done(*held.stager, s);
                return;
            }
            case Op::LOCAL_IDS:
                cu::local_ids(i32(a), n->n_elements(), n->iparams[0], n->iparams[1], (int32_t*)n->data, s);
                return;
            case Op::ALL_REDUCE:
            case Op::ALL_GATHER:
                collective(n, scratch, scratch_bytes);  // never captured: on the compute stream
                return;
            case Op::MOE_SUM: {
                const int64_t d = a->ne[0], k = a->ne[1];
                in_row_chunks(a->ne[2], [&](int64_t t0, int64_t nt) {
                    cu::moe_combine(f32(a) + t0 * k * d, d, f32(b) + t0 * k, nt, (int)k, d, f32(n) + t0 * n->ne[0],
                                    n->ne[0], s);
                });
                return;
            }
            default:  // supports() said no
                throw Unsupported(name_ + ": " + op_name(n->op) + " has no CUDA kernel");
        }
    }

    // ---- tensor parallelism ----------------------------------------------------------------
    // The other shards' parts are fetched into this device's scratch (one slot each, in shard
    // order), then summed with this shard's own in shard order (ALL_REDUCE) or their rows placed
    // in the output (ALL_GATHER).
    static size_t reduce_scratch_bytes(const Tensor& n) {
        const Collective& c = *n.collective;
        size_t bytes = 0;
        for (size_t t = 0; t < c.parts.size(); t++)
            if (c.parts[t] && (int)t != n.iparams[0]) bytes += c.parts[t]->nbytes();
        return bytes;
    }

    // One shard's ALL_REDUCE or ALL_GATHER (graph.h Collective). Before meeting: publish the part
    // (the node's src[0], on this device) with an event after the kernels that write it. After:
    // fetch each other part into a scratch slot on this stream (a CUDA shard's by a peer copy once
    // its event has passed, after which its stream waits for the copy before anything of its own
    // may overwrite the part; a host shard's by an upload, which returns when the host bytes
    // have been read), sum them all in shard order or place their rows, and leave: every read of
    // this shard's part by the others is then done (CPU shards read it with copy_to_host,
    // synchronously) or ordered before this stream's next kernels. Nothing here waits on the host
    // for the device except those CPU reads. With NCCL (found at build time, STOWLM_NCCL not 0)
    // the CUDA shards' parts move by NCCL sends and receives instead of peer copies; the
    // arithmetic is the same kernel, so the bits do not change.
    void collective(Tensor* n, void* scratch, size_t scratch_bytes) {
        Collective& c = *n->collective;
        const bool gather = n->op == Op::ALL_GATHER;
        const int me = n->iparams[0];
        const cu::Stream s = dev_->compute_stream();
        Collective::Published& mine = c.shards.at(me);
        if (mine.ready) dev_->release(mine.ready);  // left over by a run that failed before leaving
        mine.backend = this;
        mine.part = n->src[0];
        mine.ready = n->src[0] ? dev_->record(s) : nullptr;
        c.meet();
        const int n_shards = (int)c.shards.size();
        for (int t = 0; t < n_shards; t++) {
            const Tensor* p = c.shards[t].part;
            if (!p) continue;
            const bool fits = gather ? p->ne[0] == c.row0[t + 1] - c.row0[t] && p->n_rows() == n->n_rows()
                                     : p->nbytes() == n->nbytes();
            if (!fits) throw InvalidInput(name_ + ": " + op_name(n->op) + " parts differ in shape");
        }
        if (reduce_scratch_bytes(*n) > scratch_bytes)
            throw InvalidInput(name_ + ": " + op_name(n->op) + " has less scratch than its parts need");
        // the scratch slot of each other shard's part
        std::vector<void*> slot(n_shards, nullptr);
        {
            char* at = (char*)scratch;
            for (int t = 0; t < n_shards; t++)
                if (c.shards[t].part && t != me) slot[t] = at, at += c.shards[t].part->nbytes();
        }
        std::vector<char> moved(n_shards, 0);
#ifdef STOWLM_HAVE_NCCL
        nccl_gather(c, me, slot, moved);
#endif
        std::vector<char> host;  // a part of another kind of device passes through here
        for (int t = 0; t < n_shards; t++) {
            const Collective::Published& p = c.shards[t];
            if (t == me || !p.part || moved[t]) continue;
            const size_t bytes = p.part->nbytes();
            if (p.backend->host_accessible()) {
                dev_->copy_to_device(slot[t], p.part->data, bytes, s);
            } else if (auto* other = dynamic_cast<CudaBackend*>(p.backend)) {
                dev_->wait(s, p.ready);
                dev_->copy_from_peer(slot[t], *other->dev_, p.part->data, bytes, s);
                cu::Event copied = dev_->record(s);
                other->dev_->wait(other->dev_->compute_stream(), copied);
                dev_->release(copied);
            } else {
                host.resize(bytes);
                p.backend->copy_to_host(*p.part, host.data(), bytes);
                dev_->copy_to_device(slot[t], host.data(), bytes, s);
            }
        }
        dev_->set_current();  // the waits above made the other devices current
        const float* ptrs[kMaxShards] = {};
        int np = 0;
        for (int t = 0; t < n_shards; t++) {
            const float* p = !c.shards[t].part ? nullptr : t == me ? f32(c.shards[t].part) : (const float*)slot[t];
            if (gather) ptrs[t] = p;  // by shard: row0 says where each goes
            else if (p) ptrs[np++] = p;
        }
        if (gather)
            cu::all_gather_rows(ptrs, c.row0.data(), n_shards, n->ne[0], n->n_rows(), f32(n), s);
        else
            cu::all_reduce_sum(ptrs, np, n->n_elements(), f32(n), s);
        c.leave();
        // every shard has made its waits on the event by now (a recorded wait outlives it)
        if (mine.ready) dev_->release(mine.ready);
        mine.ready = nullptr;
    }

#ifdef STOWLM_HAVE_NCCL
    // The CUDA shards (two or more, on distinct devices) exchange their partials through NCCL:
    // each sends its own to every other and receives theirs into its slots (marked moved).
    void nccl_gather(const Collective& c, int me, const std::vector<void*>& slot, std::vector<char>& moved) {
        static const bool enabled = !env_is("STOWLM_NCCL", "0");
        if (!enabled) return;
        std::vector<int> devices, shard_of_rank;
        for (int t = 0; t < (int)c.shards.size(); t++)
            if (auto* b = dynamic_cast<CudaBackend*>(c.shards[t].backend)) {
                for (int d : devices)
                    if (d == b->dev_->index()) return;  // one device twice: peer copies
                devices.push_back(b->dev_->index());
                shard_of_rank.push_back(t);
            }
        if (devices.size() < 2) return;
        int my_rank = -1;
        std::vector<int> peers, recv_from;
        std::vector<void*> recv;
        std::vector<size_t> recv_bytes;
        for (int r = 0; r < (int)devices.size(); r++) {
            const int t = shard_of_rank[r];
            if (t == me) {
                my_rank = r;
                continue;
            }
            peers.push_back(r);
            if (c.shards[t].part)
                recv_from.push_back(r), recv.push_back(slot[t]), recv_bytes.push_back(c.shards[t].part->nbytes()),
                    moved[t] = 1;
        }
        void* comm = cu::nccl_comm(devices, my_rank);
        dev_->set_current();
        const Tensor* own = c.shards[me].part;
        cu::nccl_exchange(comm, own ? own->data : nullptr, own ? own->nbytes() : 0, peers, recv_from, recv, recv_bytes,
                          dev_->compute_stream());
    }
#endif

    int id_;
    std::unique_ptr<cu::CudaDevice> dev_;
    std::map<const void*, bool> pins_;  // host ranges asked to be pinned (by start): whether they are
    std::string name_;
    size_t budget_ = 0;
    // Counted per split (the pipeline runs this device's splits on its own thread; the counters
    // are taken from another once the eval has returned).
    std::atomic<uint64_t> launches_{0}, timed_splits_{0}, graph_launches_{0}, graph_kernels_{0};
    std::atomic<bool> timing_{false};
    // CUDA graphs by Split::uid
    bool graphs_on_ = true;
    bool fusion_on_ = true;  // fused kernels and reused activation rows (STOWLM_CUDA_FUSION=0: off)
    std::mutex graphs_mu_;
    std::unordered_map<uint64_t, Captured> graphs_;
    uint64_t graph_clock_ = 0;
};

}  // namespace

std::unique_ptr<Backend> make_cuda_backend(int id, const DeviceSpec& spec) {
    return std::make_unique<CudaBackend>(id, spec);
}

}  // namespace stowlm
