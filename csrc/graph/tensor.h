// Tensors and graph nodes. A tensor is a shape (up to 4 dims, ne[0] fastest), a type, byte
// strides, and where its bytes live (data pointer, the buffer that owns them, the device).
// A tensor produced by an op is also the node of that op (as in ggml): op + params + inputs.
// Tensors never own memory: buffers do (backend/backend.h), and a view points into another
// tensor's bytes.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

#include "quant/types.h"

namespace stowlm {

struct BackendBuffer;
struct Collective;

enum class Op : uint8_t {
    NONE,        // leaf: weight, KV cache, graph input
    VIEW,        // reshape/row range of src[0]; computes nothing
    GET_ROWS,    // src0 table [cols, rows] any type, src1 ids I32 [n] -> F32 [cols, n]
    MUL_MAT,     // src0 weight [cols, rows], src1 F32 [cols, n] -> F32 [rows, n]
    ADD,         // src0 [d, n] + src1 [d, n] or [d, 1] (broadcast row)
    MUL,         // src0 [d, n] * src1 [d, n] or [d, 1]
    SCALE,       // src0 * f[0]
    SOFTCAP,     // f[0] * tanh(src0 / f[0])
    RMS_NORM,    // rows of src0 over ne[0], times src1 (optional weight [d]); f[0] = eps
    ROPE,        // src0 [head_dim, n_head, n], src1 positions I32 [n]; i[0] n_rot, i[1] neox, i[2] YaRN's
                 // original context; f[0] base, f[1] scale, f[2] YaRN ext_factor, f[3] attn_factor,
                 // f[4] beta_fast, f[5] beta_slow (backend/node_params.h)
    STORE_KV,    // src0 F32 [head_dim, n_head_kv, n] into cache src1 at cells src2 (I32 [n]); output is an ordering token
    FLASH_ATTN,  // src0 q [head_dim_k, n_head, n], src1 k cache view, src2 v cache view (rows of
                 // head_dim_v per KV head, any row stride), src3 q_pos, src4 kv_pos, src5/src6 the STORE_KV
                 // tokens it must follow, src7 optional sinks F32 [n_head], src8/src9 optional
                 // sequence ids of the queries I32 [n] and of the cells I32 [n_kv] (a query sees only
                 // its own sequence's cells); f[0] scale, f[1] softcap, i[0] window, i[1] cells per
                 // KV split (0: as the kernel likes) -> [head_dim_v * n_head, n]
    SWIGLU,      // silu(src0) * src1
    GEGLU,       // gelu_tanh(src0) * src1
    COPY,        // src0 lives on another device; out is its copy on this node's device
    CONT,        // src0 any F32 view (rows contiguous, any strides) -> the same shape, contiguous
    CONCAT,      // src0 [a, rows...], src1 [b, rows...] (F32, any row strides) -> [a + b, rows...]
    SWIGLU_OAI,  // gpt-oss: g = min(src0, f[1]), u = clamp(src1, -f[1], f[1]): g * sigmoid(f[0] g) * (u + 1)
    // Mixture of experts:
    TOP_K,       // src0 F32 [n, rows] -> I32 [k, rows]: indices of the k largest selection scores, best
                 // first; i[0] = k. Score = gating(src0) (i[1] cpu::Gating; Softmax/SoftmaxSelected
                 // select on the raw value) + src1 (optional bias [n]); with i[2] > 1 groups only the
                 // i[3] groups of the highest top-2 sums compete (DeepSeek-V3)
    MOE_WEIGHTS, // src0 router logits [n_expert, n], src1 ids I32 [k, n] -> F32 [k, n];
                 // i[0] gating (cpu::Gating), i[1] normalize, f[0] scale
    ADD_ID,      // src0 F32 [d, k, n] + column ids[j, t] of src1 [d, n_expert] (src2 ids I32 [k, n])
    MUL_MAT_ID,  // src0 experts [cols, rows, n_expert], src1 F32 [cols, 1 or k, n], src2 ids I32 [k, n]
                 // -> F32 [rows, k, n]
    MOE_SUM,     // src0 F32 [d, k, n], src1 weights [k, n] -> F32 [d, n]
    LOCAL_IDS,   // src0 ids I32 [k, n] -> I32 [k, n]: id - i[0] where in [i[0], i[0] + i[1]), else -1 (the
                 // experts one tensor-parallel shard holds)
    // Tensor parallelism:
    ALL_REDUCE,  // one node per shard (its device pinned), src0 this shard's partial F32 [d, n] or
                 // null: every shard gets the sum of all partials in shard order (collective, graph.h)
    ALL_GATHER,  // one node per shard (its device pinned), src0 this shard's rows F32 [d_s, n] or null:
                 // every shard gets [sum of d_s, n], the shards' rows in shard order (collective, graph.h)
};

const char* op_name(Op op);

enum class TensorRole : uint8_t {
    COMPUTE,  // output of a node; placed by the memory planner in a device's compute buffer
    WEIGHT,   // model weight (mmap'd or uploaded), fixed device
    KV,       // KV cache storage, fixed device
    INPUT,    // graph input (token ids, positions, KV cells), host memory
};

constexpr int kMaxSrc = 11;
constexpr int kHostDevice = -1;

struct Tensor {
    std::string name;
    QType type = QType::F32;
    int64_t ne[4] = {1, 1, 1, 1};
    size_t nb[4] = {0, 0, 0, 0};
    TensorRole role = TensorRole::COMPUTE;

    Op op = Op::NONE;
    Tensor* src[kMaxSrc] = {};
    int32_t iparams[5] = {};
    float fparams[8] = {};

    // Where the bytes are. For a VIEW, view_src/view_offset describe them; data is resolved
    // from the source once that is placed.
    void* data = nullptr;
    BackendBuffer* buffer = nullptr;  // owner of the bytes (the view source's buffer for a view)
    int device = kHostDevice;
    Tensor* view_src = nullptr;
    size_t view_offset = 0;
    Collective* collective = nullptr;  // ALL_REDUCE/ALL_GATHER: the shards it meets (graph-owned)
    // A MUL_MAT_ID the scheduler gave to a device that stages its host-resident weights itself
    // (Backend::can_stage): its weights stay where they are, no COPY node brings them.
    bool staged = false;
    // A layer's experts split between the host and a GPU that stages the rest (models/blocks.cpp,
    // ContextParams::moe_cpu_share): the host's products are never staged, and the sum that joins
    // the two shares starts a split of its own, so that the GPU's share need not wait for the host's.
    enum class Share : uint8_t { NONE, HOST, JOIN } share = Share::NONE;
    // A CPU weight repacked at load into groups of 16 interleaved rows (cpu/repack.h).
    bool rows16 = false;

    int64_t n_elements() const { return ne[0] * ne[1] * ne[2] * ne[3]; }
    int64_t n_rows() const { return ne[1] * ne[2] * ne[3]; }
    size_t row_size() const;
    // Bytes of a contiguous tensor of this shape (what a compute buffer reserves for it).
    size_t nbytes() const { return row_size() * (size_t)n_rows(); }
    bool is_contiguous() const;
    // The tensor whose storage this one uses (itself unless it is a view).
    Tensor* storage_root() {
        Tensor* t = this;
        while (t->view_src) t = t->view_src;
        return t;
    }
    const Tensor* storage_root() const {
        const Tensor* t = this;
        while (t->view_src) t = t->view_src;
        return t;
    }
    int n_src() const {
        int n = 0;
        for (int i = 0; i < kMaxSrc; i++)
            if (src[i]) n = i + 1;
        return n;
    }
};

// Bytes of a row of n elements of type t (index types included, which quant/types.h leaves out).
size_t tensor_row_bytes(QType t, int64_t n);
// Sets contiguous strides for t's type and shape.
void set_contiguous_strides(Tensor& t);

}  // namespace stowlm
