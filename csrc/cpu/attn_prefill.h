// Internal: the many-query-token path of flash_attn (ops_attn.cpp) with AVX-512 over F16 KV.
// A work unit is (a tile of query tokens, one KV head): the tile's tokens times the query heads
// sharing that KV head make up to kRows query rows, and each block of kBlock KV cells is
// converted to float once (K transposed to [dim][cell]) and used by all of them as two small
// GEMMs (scores = Q K^T, out += P V) with the online softmax in between, vectorised. Cells are
// masked with vector compares of their positions; blocks no row sees are skipped.
#pragma once
#include <cstddef>
#include <cstdint>

namespace stowlm::cpu {

struct PrefillArgs {
    const float* q;
    int64_t ld_q, n_rep, hd_k, hd_v;
    const unsigned char* k;  // KV head 0 of cell 0; head g at + g * rb_k, cell j at + j * k_cell_bytes
    const unsigned char* v;  // the same with rb_v, v_cell_bytes
    size_t k_cell_bytes, v_cell_bytes, rb_k, rb_v;
    int64_t n_kv;
    const int32_t* q_pos;
    const int32_t* kv_pos;
    float scale, softcap;
    int32_t window;
    bool causal;
    const float* sinks;  // per query head, or null
    const int32_t* q_seq;   // sequence per query token, or null (one sequence)
    const int32_t* kv_seq;  // sequence per cell
    int64_t seq_cells = 0;  // > 0: sequence s holds only cells [s * seq_cells, (s + 1) * seq_cells)
    const int32_t* seq_end = nullptr;  // or up to seq_end[s] where given (AttnParams::seq_end)
    float* out;
    int64_t ld_out;
};

constexpr int64_t kPrefillRows = 64;   // query rows (tokens x heads of a KV head) per unit
constexpr int64_t kPrefillBlock = 64;  // KV cells per block
// The same size at which matmul goes to AMX, so a batch runs all-old or all-new kernels
// (smaller batches keep the exact numbers of the token-at-a-time paths).
constexpr int64_t kPrefillMinTokens = 24;

// Usable for this head size (the kernels work in whole 16-float vectors, up to 16 of them).
inline bool prefill_head_dim_ok(int64_t hd) { return hd % 16 == 0 && hd <= 256; }

// Per-thread workspace of one unit: scaled queries, K^T, V, P (floats), softmax state, the
// per-token cell masks, a sink for padding rows.
inline size_t prefill_ws_bytes(int64_t hd_k, int64_t hd_v) {
    const int64_t hd = hd_k > hd_v ? hd_k : hd_v;
    const size_t floats = (size_t)kPrefillRows * hd * 2 + (size_t)kPrefillBlock * kPrefillRows + 2 * kPrefillRows +
                          (size_t)kPrefillBlock * hd + 4 * hd;
    return floats * sizeof(float) + kPrefillRows * sizeof(uint64_t) + 6 * 64;
}

#if defined(STOWLM_X86)
// Tokens [t0, t1) (t1 - t0 <= kPrefillRows / n_rep) for KV head g; ws: prefill_ws_bytes(hd_k, hd_v), 64-aligned.
void flash_prefill_unit_avx512(const PrefillArgs& a, int64_t t0, int64_t t1, int64_t g, void* ws);
#endif

}  // namespace stowlm::cpu
