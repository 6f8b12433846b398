// The graph of one micro-batch shape: nodes in execution order, built by ggml-like builder
// functions that map one-to-one onto the CPU kernels of cpu/ops.h and cpu/matmul.h. A graph
// holds pointers to tensors it does not own (weights, KV cache) and owns all others.
#pragma once
#include <atomic>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "graph/tensor.h"

namespace stowlm {

// One device's run of consecutive nodes, with the copies it needs first.
struct Split {
    // Unique in the process, never reused: what a backend keys work it keeps per split on (a
    // CUDA graph of its kernels), where an address could be a freed split's.
    static uint64_t next_uid() {
        static std::atomic<uint64_t> n{0};
        return ++n;
    }
    uint64_t uid = next_uid();
    int device = 0;
    std::vector<Tensor*> nodes;  // COPY nodes first, then the computing nodes
    // Filled by the scheduler: the COPY nodes of other splits whose source this split computes
    // (pushed as it ends), and the splits it waits for: those, and its device's previous split.
    std::vector<Tensor*> pushes;
    std::vector<int> deps;
};

class Backend;

// The shards of one all-reduce: each shard's device thread calls meet() from its ALL_REDUCE
// node, sums the partials in shard order (so every shard gets the same bits), then leave():
// nobody proceeds (and may overwrite its partial) until every shard has read them all, or, where
// leave_waits is false, its partial stays unwritten until it meets the others again. Reused by
// every run of the graph; abort() wakes every waiter with an error (another device failed).
struct Collective {
    std::vector<Tensor*> parts;  // per shard, null where a shard adds nothing
    std::vector<Tensor*> outs;   // per shard
    std::vector<int64_t> row0;   // ALL_GATHER: shard s's rows are [row0[s], row0[s + 1]) of each column
    // What each shard publishes before meet() (its own entry only; the others read it after):
    // where its partial is. The partial the ALL_REDUCE node reads (its src[0]: parts[s], or the
    // scheduler's copy of it onto the shard's device) is in the memory of `backend`, which
    // reads it out for a device that cannot (copy_to_host). `ready`: backend-specific (a CUDA
    // event after which the partial is complete on its device), null when it is complete once
    // its shard has met (host memory). Valid until that shard's leave().
    struct Published {
        Backend* backend = nullptr;
        const Tensor* part = nullptr;
        void* ready = nullptr;
    };
    std::vector<Published> shards;
    // False where every shard is in host memory: a shard then goes on without waiting for the
    // others to have read its part, which the planner keeps unwritten until that shard's next
    // collective (last_uses), where no shard arrives before it has read them all.
    bool leave_waits = true;
    void meet() { wait_all(); }
    void leave() {
        if (leave_waits) wait_all();
    }
    void abort();
    void reset();  // before a run: forget an abort

private:
    void wait_all();
    std::mutex mu_;
    std::condition_variable cv_;
    std::atomic<int> arrived_{0};
    std::atomic<uint64_t> generation_{0};
    std::atomic<bool> aborted_{false};
};

class Graph {
public:
    Graph() = default;
    Graph(const Graph&) = delete;
    Graph& operator=(const Graph&) = delete;

    // A new graph-owned tensor (contiguous).
    Tensor* new_tensor(const std::string& name, QType type, int64_t ne0, int64_t ne1 = 1, int64_t ne2 = 1,
                       int64_t ne3 = 1, TensorRole role = TensorRole::COMPUTE);
    Tensor* new_input(const std::string& name, QType type, int64_t n);

    // Node order = creation order of op tensors (a builder emits them topologically).
    const std::vector<Tensor*>& nodes() const { return nodes_; }
    const std::vector<Tensor*>& inputs() const { return inputs_; }
    Tensor* output = nullptr;

    // Filled by the scheduler: the execution order is the concatenation of the splits.
    std::vector<Split> splits;
    int output_split = -1;  // the split that computes `output`
    std::vector<Tensor*> exec_order() const;
    std::unordered_map<const Tensor*, int> split_of() const;  // the split index of every node

    void add_node(Tensor* t) { nodes_.push_back(t); }
    Collective* new_collective() {
        collectives_.push_back(std::make_unique<Collective>());
        return collectives_.back().get();
    }
    const std::vector<std::unique_ptr<Collective>>& collectives() const { return collectives_; }

private:
    std::vector<std::unique_ptr<Collective>> collectives_;
    std::deque<Tensor> owned_;  // deque: pointers stay valid as it grows
    std::vector<Tensor*> nodes_;
    std::vector<Tensor*> inputs_;
};

// ---- builders (each returns the new node) ---------------------------------------------
Tensor* get_rows(Graph& g, Tensor* table, Tensor* ids);
Tensor* mul_mat(Graph& g, Tensor* w, Tensor* x);
Tensor* add(Graph& g, Tensor* a, Tensor* b);
Tensor* mul(Graph& g, Tensor* a, Tensor* b);
Tensor* scale(Graph& g, Tensor* a, float s);
Tensor* softcap(Graph& g, Tensor* a, float cap);
Tensor* rms_norm(Graph& g, Tensor* x, Tensor* weight, float eps);
Tensor* reshape(Graph& g, Tensor* x, int64_t ne0, int64_t ne1, int64_t ne2 = 1);
// The first n rows (along ne[1]) of a contiguous 2-d tensor, as a view.
Tensor* view_rows(Graph& g, Tensor* x, int64_t n);
// How a RoPE node rotates (llama.cpp's ggml_rope_ext arguments); ext_factor 0: no YaRN.
struct RopeSpec {
    int32_t n_rot = 0;
    float freq_base = 10000, freq_scale = 1;
    bool neox = false;
    float ext_factor = 0, attn_factor = 1, beta_fast = 32, beta_slow = 1;
    int32_t n_ctx_orig = 0;
};
Tensor* rope(Graph& g, Tensor* x, Tensor* pos, const RopeSpec& r);
// Columns [first, first + n) of every row of x, as a view (row strides kept).
Tensor* view_cols(Graph& g, Tensor* x, int64_t n, int64_t first);
Tensor* cont(Graph& g, Tensor* x);
Tensor* concat(Graph& g, Tensor* a, Tensor* b);
// Tensor parallelism: ids of the experts [first, first + n) renumbered from 0, others -1.
Tensor* local_ids(Graph& g, Tensor* ids, int64_t first, int64_t n);
// The sum of parts[s] (null: nothing from shard s) in shard order, on each of devices[s]: one
// ALL_REDUCE node per shard, shape [ne0, ne1].
std::vector<Tensor*> all_reduce(Graph& g, const std::vector<Tensor*>& parts, const std::vector<int>& devices,
                                int64_t ne0, int64_t ne1);
// The rows of parts[s] ([d_s, ...] alike but for d_s; null: none) stacked in shard order, on each
// of devices[s]: one ALL_GATHER node per shard, shape [sum of d_s, ...]. Nothing is summed: every
// shard gets exactly the bits each part had.
std::vector<Tensor*> all_gather(Graph& g, const std::vector<Tensor*>& parts, const std::vector<int>& devices);
inline bool is_collective(Op op) { return op == Op::ALL_REDUCE || op == Op::ALL_GATHER; }
Tensor* swiglu_oai(Graph& g, Tensor* gate, Tensor* up, float alpha, float limit);
// x [d, k, n] + the bias column of each slot's expert: bias [d, n_expert], ids [k, n].
Tensor* add_id(Graph& g, Tensor* x, Tensor* bias, Tensor* ids);
Tensor* store_kv(Graph& g, Tensor* x, Tensor* cache, Tensor* cells);
// Which cells a query sees: positions (causal, window) and, with several sequences, the sequence
// of each query and cell; split_cells > 0 cuts the cells into fixed splits so a query's result
// does not depend on the other queries of the batch (contexts with several sequences).
struct AttnMask {
    Tensor* q_pos = nullptr;
    Tensor* kv_pos = nullptr;
    Tensor* q_seq = nullptr;
    Tensor* kv_seq = nullptr;
    int32_t split_cells = 0;
    int32_t seq_cells = 0;  // > 0: sequence s holds only cells [s * seq_cells, (s + 1) * seq_cells)
    Tensor* seq_end = nullptr;  // I32 [n_seq] with seq_cells: where each sequence's cells end (a
                                // sequence may hold the regions after its own, KVCache::set_span)
    int32_t ctx_cells = 0;  // the cache's cells: a backend may size call-independent splits by it
};
Tensor* flash_attn(Graph& g, Tensor* q, Tensor* k, Tensor* v, const AttnMask& mask, Tensor* k_stored,
                   Tensor* v_stored, float scale, float softcap, int32_t window, Tensor* sinks = nullptr);
Tensor* swiglu(Graph& g, Tensor* gate, Tensor* up);
Tensor* geglu(Graph& g, Tensor* gate, Tensor* up);
Tensor* copy_to_device(Graph& g, Tensor* src, int device);
// Mixture of experts (see Op in graph/tensor.h).
// gating: cpu::Gating applied before a selection bias is added (see Op::TOP_K).
Tensor* top_k(Graph& g, Tensor* x, int64_t k, int32_t gating = 0, Tensor* bias = nullptr, int32_t n_groups = 0,
              int32_t n_group_used = 0);
Tensor* moe_weights(Graph& g, Tensor* logits, Tensor* ids, int32_t gating, bool normalize, float scale);
Tensor* mul_mat_id(Graph& g, Tensor* experts, Tensor* x, Tensor* ids);
// The host-resident weight a staged node (Tensor::staged) has its device copy in: a MUL_MAT_ID's
// experts, an ADD_ID's per-expert biases (gpt-oss); null for other ops.
inline const Tensor* staged_weight(const Tensor& n) {
    return n.op == Op::MUL_MAT_ID ? n.src[0] : n.op == Op::ADD_ID ? n.src[1] : nullptr;
}
Tensor* moe_sum(Graph& g, Tensor* e, Tensor* weights);

}  // namespace stowlm
