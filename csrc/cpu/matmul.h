// CPU quantized matrix products: y = W x for every weight type against F32 activations.
// Activations are quantized once per call into `scratch` as llama.cpp does for each weight type
// (8-bit blocks of 32 with their sums for the 32-element formats and MXFP4; for the K formats
// and the 256-element i-quants one scale per 256 values, Q8_K's rule, kept with per-16 sums in
// quant/dot.h's block_q8_K32; float weights use the F32 activations as they are), then dotted
// with the kernel path chosen at run time (cpu_features.h): scalar, AVX2 or AVX-512 VNNI rows,
// and for batches of 24+ tokens the GEMM of AVX-512 VNNI or AVX2 (weight panels interleaved per
// call), or AMX tiles.
// Rows or panels are split over the pool's threads. Paths that unpack weights keep a per-thread
// buffer that is allocated on first use and reused (grown only for a larger `cols`), so
// steady-state calls allocate nothing and create no threads.
#pragma once
#include <cstddef>
#include <cstdint>

#include "cpu/threadpool.h"
#include "quant/types.h"

namespace stowlm::cpu {

// A weight matrix as GGUF stores it: `rows` rows of `cols` elements, each row row_bytes(type, cols).
struct WeightRef {
    const void* data = nullptr;
    QType type = QType::F32;
    int64_t rows = 0;
    int64_t cols = 0;
    bool rows16 = false;  // repacked at load into groups of 16 interleaved rows (cpu/repack.h)
};

// Bytes of scratch matmul() needs for n_tok activation rows of `cols` against this weight type
// (on any path: it includes the AMX path's repacked activations when n_tok is large).
// Throws InvalidInput like matmul() for an unsupported type or cols.
size_t matmul_scratch_bytes(QType wtype, int64_t cols, int64_t n_tok, bool batched = false);

// y[t * ldy + r] = sum_c W[r, c] * x[t * ldx + c]  for t < n_tok, r < rows.
// Throws InvalidInput for an unsupported type or a cols value that is not a block multiple.
// batched: the batched kernels (the GEMMs) however few the tokens, which give each token the
// product a larger batch gives it (a prompt's tail evaluated after a reused prefix).
void matmul(const WeightRef& w, const float* x, int64_t n_tok, int64_t ldx, float* y, int64_t ldy,
            void* scratch, ThreadPool& pool, bool batched = false);

// The activations as matmul() quantizes them for weight type `wtype` on the active path: n_tok
// rows of cols floats (ldx apart), row t at dst + t * matmul_act_row_bytes(wtype, cols) bytes
// (block_q8_a or block_q8_K32 of quant/dot.h; 0 bytes for float weights). For tests and tools.
size_t matmul_act_row_bytes(QType wtype, int64_t cols);
void quantize_activations(QType wtype, int64_t cols, const float* x, int64_t n_tok, int64_t ldx, void* dst);

// Several products of the same activations (a layer's q, k, v or gate, up): for weights of one
// activation format the activations are quantized once, and for a few tokens one pass of the
// pool covers every matrix's rows (a batch runs the batched kernel per matrix); otherwise the
// same as matmul() on each in turn. At most kMaxMulti weights share. Results equal matmul()'s.
constexpr int kMaxMulti = 4;
void matmul_multi(const WeightRef* ws, int n_w, const float* x, int64_t n_tok, int64_t ldx, float* const* ys,
                  const int64_t* ldys, void* scratch, ThreadPool& pool, bool batched = false);

// Expert products (ggml's mul_mat_id). `w` describes one expert's matrix (rows x cols); the
// n_expert matrices follow each other, expert e's at byte e * rows * row_bytes(type, cols).
// For token t < n_tok and slot j < k, with e = ids[t * k + j]:
//   y[(t * k + j) * ldy + r] = sum_c W_e[r, c] * x[(t * x_rows + (x_rows == 1 ? 0 : j)) * ldx + c]
// x_rows is 1 (all slots of a token read its one activation row) or k (a row per slot).
// The (token, slot) pairs are grouped by expert and each expert's group is one product through
// matmul's kernels (the batched ones for groups of 24+ tokens), threads spread over experts and rows; an
// expert no token picks is never read. Id -1 marks a slot whose expert lives elsewhere (tensor
// parallelism): its row of y is zero. Throws InvalidInput for an id outside [-1, n_expert).
size_t mul_mat_id_scratch_bytes(QType wtype, int64_t rows, int64_t cols, int64_t n_expert, int64_t k,
                                int64_t n_tok);
void mul_mat_id(const WeightRef& w, int64_t n_expert, const int32_t* ids, int64_t k, const float* x, int64_t x_rows,
                int64_t ldx, int64_t n_tok, float* y, int64_t ldy, void* scratch, ThreadPool& pool);

}  // namespace stowlm::cpu
