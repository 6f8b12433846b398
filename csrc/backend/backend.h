// One device = one Backend object: a small table of functions (alloc/free buffers, memory
// total/free, supports(op), compute(split), copies to/from host and peer). The CPU backend
// (and its "virtual device" form, with its own thread count and a hard memory budget) lives in
// cpu_backend.cpp; the CUDA backend (cuda/cuda_engine.cpp) implements the same table. Buffers
// know their device.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "graph/graph.h"

namespace stowlm {

class Backend;

// Bytes a backend handed out. Either owned device memory or a window onto host memory the
// backend reads in place (mmap'd weights on a CPU device), which still counts against the
// device's budget. Freed (and uncounted) when destroyed.
struct BackendBuffer {
    Backend* backend = nullptr;
    void* data = nullptr;
    size_t size = 0;
    bool external = false;  // the bytes belong to someone else (the model mapping)
    std::string purpose;    // "weights", "kv", "compute": named in errors and reports
    BackendBuffer() = default;
    BackendBuffer(const BackendBuffer&) = delete;
    BackendBuffer& operator=(const BackendBuffer&) = delete;
    ~BackendBuffer();
};
using BufferPtr = std::unique_ptr<BackendBuffer>;

// What a device that launches kernels (CUDA) did since its counters were last taken, for
// stowlm-bench -v; a CPU device counts nothing (counted false).
struct KernelStats {
    bool counted = false;
    uint64_t launches = 0;      // kernels its splits enqueued, those of replayed graphs included
    uint64_t graph_launches = 0;  // CUDA graphs replayed (each stands for its kernels)
    uint64_t graph_kernels = 0;   // of `launches`, those run by replaying a graph
    uint64_t timed_splits = 0;  // splits run while kernel timing was on
    // Device seconds of the timed splits' work with no host gaps: each timed split's stream is
    // held until all its kernels are enqueued, then timed with an event pair.
    double kernel_s = 0;
    uint64_t late_splits = 0;  // timed splits whose hold ran out first: their time includes host gaps
    // A CPU device's timed ops: (label, calls, seconds); products are labelled by their weights'
    // names without the layer ("attn_q.weight+attn_k.weight+attn_v.weight", "output.weight").
    struct Op {
        std::string label;
        uint64_t calls = 0;
        double seconds = 0;
    };
    std::vector<Op> ops;
};

// The timed ops of a device, summed by label: a group run as one (products of one input, a fused
// kernel) by its nodes joined with '+', a product by its weight's name without the layer
// ("attn_q.weight+attn_k.weight+attn_v.weight"), any other node by its op's name.
class OpTimes {
public:
    void add(Tensor* const* ns, size_t n, double seconds) { add(label(ns, n), seconds); }
    void add(const std::string& label, double seconds) {
        auto [it, fresh] = index_.try_emplace(label, ops_.size());
        if (fresh) ops_.push_back({label, 0, 0.0});
        ops_[it->second].calls++;
        ops_[it->second].seconds += seconds;
    }
    std::vector<KernelStats::Op> take() {
        index_.clear();
        return std::exchange(ops_, {});
    }
    static std::string label(Tensor* const* ns, size_t n) {
        std::string l;
        for (size_t j = 0; j < n; j++) {
            l += j ? "+" : "";
            if (ns[j]->op != Op::MUL_MAT && ns[j]->op != Op::MUL_MAT_ID) {
                l += op_name(ns[j]->op);
                continue;
            }
            const std::string& w = ns[j]->src[0]->name;
            const size_t dot = w.rfind("blk.", 0) == 0 ? w.find('.', 4) : std::string::npos;
            l += dot == std::string::npos ? w : w.substr(dot + 1);
        }
        return l;
    }

private:
    std::vector<KernelStats::Op> ops_;
    std::unordered_map<std::string, size_t> index_;
};

class Backend {
public:
    virtual ~Backend() = default;
    virtual const std::string& name() const = 0;  // "cpu:0"
    virtual int id() const = 0;                   // index in the model's device list
    virtual bool host_accessible() const = 0;     // can its kernels read host memory directly?
    // Products of this many tokens or more may take batched kernels; below it a token's product
    // is the same whatever else is in its batch (what batched decoding and prefix reuse rely on).
    virtual int64_t batched_min_tokens() const = 0;

    virtual size_t memory_total() const = 0;  // the budget
    virtual size_t memory_used() const = 0;
    size_t memory_free() const { return memory_total() - memory_used(); }

    // Throws OutOfDeviceMemory naming the device, the bytes asked and the bytes available;
    // nothing is allocated then.
    virtual BufferPtr alloc_buffer(size_t bytes, const std::string& purpose) = 0;
    // Makes host bytes usable by the device: zero copy where host_accessible(), an upload
    // otherwise. Counted against the budget either way.
    virtual BufferPtr import_host(const void* data, size_t bytes, const std::string& purpose) = 0;
    virtual void free_buffer(BackendBuffer& b) = 0;

    virtual bool supports(const Tensor& node) const = 0;
    // Can run node (a MUL_MAT_ID) though its weights live in host memory, copying them in as it
    // runs (staging_bytes): a prompt's expert products on a GPU whose experts stay in RAM.
    virtual bool can_stage(const Tensor&) const { return false; }
    // Runs the split's nodes in order; their tensors are placed (data set) already.
    virtual void compute(const Split& split, void* scratch, size_t scratch_bytes) = 0;
    // Scratch bytes node needs while it runs (matmul activation quantization, attention).
    virtual size_t scratch_bytes(const Tensor& node) const = 0;
    // The slot a staged node (can_stage) copies its host-resident weights into (aligned as the
    // backend wants it); the planner reserves two slots of the largest at the end of the device's
    // scratch, so that the next staged node's copy runs while this one's product does.
    virtual size_t staging_bytes(const Tensor&) const { return 0; }
    // Page-locks the host ranges (page-aligned, disjoint) staged nodes copy from, so that their
    // copies run at the bus's speed; returns the bytes of them that are pinned (a refused range is
    // not; its copies go the slow way). The ranges must outlive the backend.
    virtual size_t pin_host(const std::vector<std::pair<const void*, size_t>>&) { return 0; }

    virtual void copy_from_host(Tensor& dst, const void* src, size_t bytes, size_t offset = 0) = 0;
    virtual void copy_to_host(const Tensor& src, void* dst, size_t bytes, size_t offset = 0) = 0;
    // dst lives on this device, src on `from`.
    virtual void copy_from_peer(Tensor& dst, const Tensor& src, Backend& from) = 0;
    virtual void synchronize() = 0;

    // Kernel timing holds each split's work until it is all enqueued, so it changes how the device
    // overlaps with the host: turn it on only for a pass whose speed is not reported.
    virtual void set_kernel_timing(bool) {}
    // The counters since the last call (waits for the device's timed work), then zero.
    virtual KernelStats take_kernel_stats() { return {}; }
};

// "N bytes (X MiB)": how out-of-memory errors of every device state sizes.
std::string describe_bytes(size_t bytes);

// A CPU device: `threads` workers (its own pool) and a budget of `mem_bytes` (0: system RAM).
std::unique_ptr<Backend> make_cpu_backend(int id, const std::string& name, int threads, size_t mem_bytes);

// What a device list entry asks for (the grammar: backend/device_spec.h).
struct DeviceSpec {
    std::string kind = "cpu";
    int index = 0;
    int threads = 0;        // 0: the machine's cores (or STOWLM_THREADS)
    size_t mem_bytes = 0;   // 0: no budget beyond physical RAM
    // The MPI rank whose device it is (dist/remote_device.h), -1 for this process's; a device of
    // another rank is named dev@RANK ("cpu:0@1").
    int rank = -1;
    double speed = 0;  // relative speed for fit's stage balance (Python's); 0: its threads, 1 for CUDA
    std::string name() const { return kind + ":" + std::to_string(index) + (rank >= 0 ? "@" + std::to_string(rank) : ""); }
};

// kind "cpu", or "cuda" (index: the CUDA device; mem_bytes: an optional budget below its
// memory). Unsupported naming the device and the reason when it cannot be opened (no CUDA in
// this build, no such device).
std::unique_ptr<Backend> make_backend(int id, const DeviceSpec& spec);
// Defined by cuda/cuda_engine.cpp, only in builds with CUDA.
std::unique_ptr<Backend> make_cuda_backend(int id, const DeviceSpec& spec);

}  // namespace stowlm
