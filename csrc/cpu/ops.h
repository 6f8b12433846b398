// The CPU ops a transformer layer needs besides matmul. All tensors are row-major float32
// unless said otherwise; `ld*` are row strides in elements. Every op runs on the given pool.
#pragma once
#include <cstddef>
#include <cstdint>

#include "cpu/threadpool.h"
#include "quant/types.h"

namespace stowlm::cpu {

// out[i, :] = dequantize(row ids[i] of table); table has n_rows rows of n_cols elements of `type`.
// Throws InvalidInput naming the id when an id is outside [0, n_rows).
void get_rows(const void* table, QType type, int64_t n_rows, int64_t n_cols, const int32_t* ids,
              int64_t n_ids, float* out, int64_t ld_out, ThreadPool& pool);

// y[r, :] = x[r, :] / sqrt(mean(x[r, :]^2) + eps) * weight (weight may be null). y may equal x.
void rms_norm(const float* x, int64_t n_rows, int64_t dim, int64_t ldx, const float* weight, float eps,
              float* y, int64_t ldy, ThreadPool& pool);

struct RopeParams {
    int32_t n_rot = 0;        // rotated dimensions at the start of each head (<= head_dim, even)
    float freq_base = 10000;  // theta_i = pos * freq_scale * base^(-2i/n_rot)
    float freq_scale = 1;
    bool neox = false;        // NeoX pairs (i, i + n_rot/2); otherwise adjacent pairs (2i, 2i+1)
    // YaRN (attn_math.h rope_yarn); ext_factor 0 and attn_factor 1: plain RoPE.
    float ext_factor = 0, attn_factor = 1, beta_fast = 32, beta_slow = 1;
    int32_t n_ctx_orig = 0;
};

// In place on x laid out [n_tok][n_head][head_dim]; token t starts at x + t * ld_tok.
void rope(float* x, int64_t n_tok, int64_t n_head, int64_t head_dim, int64_t ld_tok, const int32_t* pos,
          const RopeParams& p, ThreadPool& pool);

struct AttnParams {
    float scale = 1;      // applied to q.k
    float softcap = 0;    // 0: off; else scores = softcap * tanh(scores / softcap)
    int32_t window = 0;   // 0: full; else key visible only when q_pos - kv_pos < window
    bool causal = true;   // key visible only when kv_pos <= q_pos
    // Optional per query head: a logit every query also attends to, with no value (gpt-oss).
    const float* sinks = nullptr;
    // Optional: sequence of each query and of each cell; a query sees only its sequence's cells.
    const int32_t* q_seq = nullptr;
    const int32_t* kv_seq = nullptr;
    // > 0: the cells are cut into splits of this many, merged in order, whatever the batch, so a
    // query's result does not depend on the others (a context serving several sequences).
    int32_t split_cells = 0;
    // > 0: sequence s holds only cells [s * seq_cells, (s + 1) * seq_cells) (KVCache regions), so
    // the kernels skip the KV blocks of other sequences without looking at them; with seq_end,
    // cells [s * seq_cells, seq_end[s]) (a sequence holding the regions after its own).
    int32_t seq_cells = 0;
    const int32_t* seq_end = nullptr;
    // The path of a prompt-sized call however few the queries (matmul's `batched`).
    bool batched = false;
};

// Where the keys and values of the visible cells are: cells of kv_type (F16 or Q8_0), cell j
// of K at k + j * k_cell_bytes, KV head h at + h * row_bytes(kv_type, hd_k); V the same with
// its own stride and hd_v (V may be a view into K, as with multi-head latent attention).
struct KvView {
    const void* k = nullptr;
    const void* v = nullptr;
    QType type = QType::F16;
    int64_t n_kv = 0, n_head_kv = 1;
    size_t k_cell_bytes = 0, v_cell_bytes = 0;
    int64_t hd_k = 0, hd_v = 0;
};

// Flash attention in one pass (online softmax over KV blocks), GQA by n_head / n_head_kv.
// q: [n_tok][n_head][hd_k] f32, token t at q + t * ld_q.
// kv_pos[j]: position held by cell j, or -1 for an empty cell (never visible).
// out: [n_tok][n_head][hd_v] f32, token t at out + t * ld_out; must not overlap q.
// A query that sees no cell (and no sink) gets zeros. scratch: flash_attn_scratch_bytes(...,
// pool.size()) bytes, or null to allocate per call.
size_t flash_attn_scratch_bytes(int64_t n_tok, int64_t n_head, int64_t hd_k, int64_t hd_v, int n_threads,
                                int64_t n_kv = 0, int32_t split_cells = 0, bool batched = false);

// The fixed split of a single sequence's attention in a cache of n_ctx cells: a multiple of 256
// cells, at most 32 splits of the whole cache (enough blocks for a GPU, a bounded partial state
// for the CPU). With it a query's result does not depend on how many tokens its call has (a
// speculative draft's verification pass gives each token the numbers of a one-token step) nor on
// the device, only on the cache's size.
int32_t single_sequence_split_cells(int64_t n_ctx);
void flash_attn(const float* q, int64_t n_tok, int64_t n_head, int64_t ld_q, const KvView& kv, const int32_t* q_pos,
                const int32_t* kv_pos, const AttnParams& p, float* out, int64_t ld_out, void* scratch,
                ThreadPool& pool);

// Writes n_tok rows of [n_head_kv][head_dim] f32 into KV cells dst_cells[i] of kv_type.
void store_kv(const float* x, int64_t n_tok, int64_t ld_x, int64_t n_head_kv, int64_t head_dim, QType kv_type,
              void* cache, size_t kv_cell_bytes, const int32_t* dst_cells, ThreadPool& pool,
              int64_t n_cells = -1);  // n_cells >= 0: dst_cells are checked against it

// A strided F32 tensor [ne0, ne1, ne2, ne3] (nb in bytes; rows of ne0 contiguous) into a
// contiguous one.
void cont(const float* x, const int64_t ne[4], const size_t nb[4], float* out, ThreadPool& pool);
// out rows = [row of a, row of b] for every (i1, i2, i3); a and b strided as cont() reads them.
void concat(const float* a, const int64_t a_ne[4], const size_t a_nb[4], const float* b, int64_t b_ne0,
            const size_t b_nb[4], float* out, ThreadPool& pool);

// gpt-oss's clamped SwiGLU (attn_math.h swiglu_oai) over n contiguous elements.
void swiglu_oai(const float* gate, const float* up, int64_t n, float alpha, float limit, float* out, ThreadPool& pool);

// Gated FFN activations: out = act(gate) * up, elementwise over n rows of dim.
void swiglu(const float* gate, int64_t ld_gate, const float* up, int64_t ld_up, int64_t n, int64_t dim,
            float* out, int64_t ld_out, ThreadPool& pool);
// GELU with the tanh approximation, as gemma uses.
void geglu(const float* gate, int64_t ld_gate, const float* up, int64_t ld_up, int64_t n, int64_t dim,
           float* out, int64_t ld_out, ThreadPool& pool);

// Elementwise helpers over n rows of dim; b may be a single broadcast row (ld_b == 0).
void add(const float* a, int64_t ld_a, const float* b, int64_t ld_b, int64_t n, int64_t dim, float* out,
         int64_t ld_out, ThreadPool& pool);
void mul(const float* a, int64_t ld_a, const float* b, int64_t ld_b, int64_t n, int64_t dim, float* out,
         int64_t ld_out, ThreadPool& pool);
void scale(float* x, int64_t n, int64_t dim, int64_t ldx, float s, ThreadPool& pool);
// x = cap * tanh(x / cap)
void softcap(float* x, int64_t n, int64_t dim, int64_t ldx, float cap, ThreadPool& pool);

}  // namespace stowlm::cpu
