// The graph of one micro-batch shape: nodes in execution order, built by ggml-like builder
// functions that map one-to-one onto the CPU kernels of cpu/ops.h and cpu/matmul.h. A graph
// holds pointers to tensors it does not own (weights, KV cache) and owns all others.
#pragma once
#include <deque>
#include <string>
#include <vector>

#include "graph/tensor.h"

namespace stowlm {

// One device's run of consecutive nodes, with the copies it needs first.
struct Split {
    int device = 0;
    std::vector<Tensor*> nodes;  // COPY nodes first, then the computing nodes
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
    std::vector<Tensor*> exec_order() const;

    void add_node(Tensor* t) { nodes_.push_back(t); }

private:
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
Tensor* rope(Graph& g, Tensor* x, Tensor* pos, int32_t n_rot, float freq_base, float freq_scale, bool neox);
Tensor* store_kv(Graph& g, Tensor* x, Tensor* cache, Tensor* cells);
Tensor* flash_attn(Graph& g, Tensor* q, Tensor* k, Tensor* v, Tensor* q_pos, Tensor* kv_pos, Tensor* k_stored,
                   Tensor* v_stored, float scale, float softcap, int32_t window);
Tensor* swiglu(Graph& g, Tensor* gate, Tensor* up);
Tensor* geglu(Graph& g, Tensor* gate, Tensor* up);
Tensor* copy_to_device(Graph& g, Tensor* src, int device);
// Mixture of experts (see Op in graph/tensor.h).
Tensor* top_k(Graph& g, Tensor* x, int64_t k);
Tensor* moe_weights(Graph& g, Tensor* logits, Tensor* ids, int32_t gating, bool normalize, float scale);
Tensor* mul_mat_id(Graph& g, Tensor* experts, Tensor* x, Tensor* ids);
Tensor* moe_sum(Graph& g, Tensor* e, Tensor* weights);

}  // namespace stowlm
