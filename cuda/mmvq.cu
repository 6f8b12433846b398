// Matrix-vector products for small batches: one warp per weight row, lanes striding over the
// row's 32-element sub-blocks, up to 8 activation rows per pass. Quantized weights meet
// block_q8_1 activations through the shared HOST_DEVICE sub-block loaders and dp4a dot
// (quant/dot_q8_1.h); float weights meet float activations. The same kernels serve the MoE
// expert product through TokenGroups (one launch, blockIdx.y = expert).
#include "cuda_backend.h"
#include "cpu/attn_math.h"
#include "cuda_common.cuh"

namespace stowlm::cuda {

constexpr int kMmvWarps = 4;   // rows per block
constexpr int kMmvBatch = 8;   // activation rows per pass

// Slots [*begin, *end) of this block's group, and its weight base (nullptr: a slot of an expert
// held elsewhere, whose output row is zero).
__device__ __forceinline__ const uint8_t* group_slots(const uint8_t* w, int64_t n_slots, const TokenGroups& g,
                                                      int64_t* begin, int64_t* end) {
    if (g.slot_ids) {
        *begin = blockIdx.y, *end = blockIdx.y + 1;
        const int32_t e = g.slot_ids[blockIdx.y];
        return e < 0 || e >= g.n_expert ? nullptr : w + (size_t)e * g.group_stride;
    }
    if (g.off == nullptr) {
        *begin = 0, *end = n_slots;
        return w;
    }
    *begin = g.off[blockIdx.y], *end = g.off[blockIdx.y + 1];
    return w + (size_t)blockIdx.y * g.group_stride;
}

__device__ __forceinline__ int64_t act_row(const TokenGroups& g, int64_t slot) {
    if (g.slot_ids) return g.per_slot ? slot : 0;
    return g.act_row ? g.act_row[slot] : slot;
}
__device__ __forceinline__ int64_t out_row(const TokenGroups& g, int64_t slot) {
    return g.out_row && !g.slot_ids ? g.out_row[slot] : slot;
}

// Reduces the per-lane partial sums of n rows and writes them (lane t writes row t). n is uniform
// over the warp: a decode step reduces its one row, not all kMmvBatch.
__device__ __forceinline__ void write_rows(float (&acc)[kMmvBatch], int n, const TokenGroups& g, int64_t c0,
                                           int64_t row, float* y, int64_t ldy) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int t = 0; t < kMmvBatch; t++) {
        if (t >= n) break;
        const float v = warp_sum(acc[t]);
        if (lane == t) y[out_row(g, c0 + t) * ldy + row] = v;
    }
}

// One weight row's products with the activation rows of slots [begin, end), by the warp.
template <QType T>
__device__ __forceinline__ void mmvq_row(const uint8_t* wrow, int nsub, const block_q8_1* __restrict__ xq,
                                         int64_t xq_ld, int64_t begin, int64_t end, const TokenGroups& g,
                                         int64_t row, float* __restrict__ y, int64_t ldy) {
    const int lane = threadIdx.x & 31;
    for (int64_t c0 = begin; c0 < end; c0 += kMmvBatch) {
        const int n = (int)min((int64_t)kMmvBatch, end - c0);
        const block_q8_1* xr[kMmvBatch];
#pragma unroll
        for (int t = 0; t < kMmvBatch; t++) xr[t] = xq + act_row(g, c0 + (t < n ? t : 0)) * xq_ld;
        float acc[kMmvBatch] = {};
        for (int sub = lane; sub < nsub; sub += 32) {
            WSub ws;
            WTraits<T>::load(wrow, sub, ws);
#pragma unroll
            for (int t = 0; t < kMmvBatch; t++)
                if (t < n) acc[t] += dot_wsub_q8_1(ws, xr[t][sub]);
        }
        write_rows(acc, n, g, c0, row, y, ldy);
    }
}

template <QType T>
__global__ void __launch_bounds__(kMmvWarps * 32, 1) mmvq_kernel(const uint8_t* __restrict__ w, size_t row_bytes,
                                                              int64_t rows, int nsub,
                                                              const block_q8_1* __restrict__ xq, int64_t xq_ld,
                                                              int64_t n_slots, TokenGroups g, float* __restrict__ y,
                                                              int64_t ldy) {
    pdl_begin();
    const int64_t row = (int64_t)blockIdx.x * kMmvWarps + threadIdx.x / 32;
    if (row >= rows) return;
    int64_t begin, end;
    const uint8_t* wbase = group_slots(w, n_slots, g, &begin, &end);
    if (!wbase) {  // by slot: an expert held elsewhere
        if ((threadIdx.x & 31) == 0) y[out_row(g, begin) * ldy + row] = 0.0f;
        return;
    }
    mmvq_row<T>(wbase + (size_t)row * row_bytes, nsub, xq, xq_ld, begin, end, g, row, y, ldy);
}

// Up to kMmvMulti products of the same activation rows (a layer's q, k and v) in one launch: the
// blocks of weight 0's rows, then weight 1's, ...; each row as mmvq_kernel computes it (the same
// bits). Entries picked by selects: a dynamic index would copy the parameters to local memory.
template <QType T>
__global__ void __launch_bounds__(kMmvWarps * 32, 1) mmvq_multi_kernel(MmvqMulti m, size_t row_bytes, int nsub,
                                                                    const block_q8_1* __restrict__ xq, int64_t xq_ld,
                                                                    int64_t n_tok) {
    pdl_begin();
    const unsigned b = blockIdx.x;
    const int i = b < m.block_end[0] ? 0 : b < m.block_end[1] ? 1 : 2;
    const unsigned b0 = i == 0 ? 0u : i == 1 ? m.block_end[0] : m.block_end[1];
    const int64_t row = (int64_t)(b - b0) * kMmvWarps + threadIdx.x / 32;
    if (row >= (i == 0 ? m.rows[0] : i == 1 ? m.rows[1] : m.rows[2])) return;
    const uint8_t* w = i == 0 ? m.w[0] : i == 1 ? m.w[1] : m.w[2];
    float* y = i == 0 ? m.y[0] : i == 1 ? m.y[1] : m.y[2];
    const int64_t ldy = i == 0 ? m.ldy[0] : i == 1 ? m.ldy[1] : m.ldy[2];
    mmvq_row<T>(w + (size_t)row * row_bytes, nsub, xq, xq_ld, 0, n_tok, TokenGroups{}, row, y, ldy);
}

// The gate and up products of the same activations and the GLU that joins them, one warp per row
// of both: each dot product is mmvq_kernel's (same lanes, order and reduction) and the GLU is the
// swiglu/geglu kernel's expression, so g, u and act get the bits of the three kernels it replaces.
// Plain (grp empty): n_tok activation rows. By slot (grp.slot_ids: one token's experts, block y
// is slot y): the weights of expert slot_ids[y], zero rows for an expert held elsewhere.
template <QType T, bool Gelu>
__global__ void __launch_bounds__(kMmvWarps * 32, 1) mmvq_glu_kernel(const uint8_t* __restrict__ wg,
                                                                  const uint8_t* __restrict__ wu, size_t row_bytes,
                                                                  int64_t rows, int nsub,
                                                                  const block_q8_1* __restrict__ xq, int64_t xq_ld,
                                                                  int64_t n_tok, TokenGroups grp,
                                                                  float* __restrict__ g, float* __restrict__ u,
                                                                  float* __restrict__ act, int64_t ldy) {
    pdl_begin();
    const int64_t row = (int64_t)blockIdx.x * kMmvWarps + threadIdx.x / 32;
    if (row >= rows) return;
    const int lane = threadIdx.x & 31;
    int64_t begin = 0, end = n_tok;
    size_t base = 0;
    if (grp.slot_ids) {
        begin = blockIdx.y, end = begin + 1;
        const int32_t e = grp.slot_ids[blockIdx.y];
        if (e < 0 || e >= grp.n_expert) {  // as the expert product's zero rows, and silu(0) * 0
            if (lane == 0) g[begin * ldy + row] = 0.0f, u[begin * ldy + row] = 0.0f, act[begin * ldy + row] = 0.0f;
            return;
        }
        base = (size_t)e * grp.group_stride;
    }
    const uint8_t* grow = wg + base + (size_t)row * row_bytes;
    const uint8_t* urow = wu + base + (size_t)row * row_bytes;
    for (int64_t c0 = begin; c0 < end; c0 += kMmvBatch) {
        const int n = (int)min((int64_t)kMmvBatch, end - c0);
        const block_q8_1* xr[kMmvBatch];
#pragma unroll
        for (int t = 0; t < kMmvBatch; t++) xr[t] = xq + act_row(grp, c0 + (t < n ? t : 0)) * xq_ld;
        float ag[kMmvBatch] = {}, au[kMmvBatch] = {};
        for (int sub = lane; sub < nsub; sub += 32) {
            WSub ws;
            WTraits<T>::load(grow, sub, ws);
#pragma unroll
            for (int t = 0; t < kMmvBatch; t++)
                if (t < n) ag[t] += dot_wsub_q8_1(ws, xr[t][sub]);
            WTraits<T>::load(urow, sub, ws);
#pragma unroll
            for (int t = 0; t < kMmvBatch; t++)
                if (t < n) au[t] += dot_wsub_q8_1(ws, xr[t][sub]);
        }
#pragma unroll
        for (int t = 0; t < kMmvBatch; t++) {
            if (t >= n) break;  // uniform over the warp
            const float vg = warp_sum(ag[t]), vu = warp_sum(au[t]);
            if (lane == t) {
                const int64_t at = out_row(grp, c0 + t) * ldy + row;
                g[at] = vg, u[at] = vu;
                act[at] = Gelu ? gelu_tanh(vg) * vu : silu(vg) * vu;
            }
        }
    }
}

template <QType T>
__global__ void __launch_bounds__(kMmvWarps * 32, 1) mmv_float_kernel(const uint8_t* __restrict__ w, size_t row_bytes,
                                                                   int64_t rows, int64_t cols,
                                                                   const float* __restrict__ x, int64_t ldx,
                                                                   int64_t n_slots, TokenGroups g,
                                                                   float* __restrict__ y, int64_t ldy) {
    pdl_begin();
    const int64_t row = (int64_t)blockIdx.x * kMmvWarps + threadIdx.x / 32;
    if (row >= rows) return;
    int64_t begin, end;
    const uint8_t* wbase = group_slots(w, n_slots, g, &begin, &end);
    const int lane = threadIdx.x & 31;
    if (!wbase) {  // by slot: an expert held elsewhere
        if (lane == 0) y[out_row(g, begin) * ldy + row] = 0.0f;
        return;
    }
    const uint8_t* wrow = wbase + (size_t)row * row_bytes;
    for (int64_t c0 = begin; c0 < end; c0 += kMmvBatch) {
        const int n = (int)min((int64_t)kMmvBatch, end - c0);
        const float* xr[kMmvBatch];
#pragma unroll
        for (int t = 0; t < kMmvBatch; t++) xr[t] = x + act_row(g, c0 + (t < n ? t : 0)) * ldx;
        float acc[kMmvBatch] = {};
        for (int64_t i = lane; i < cols; i += 32) {
            const float wv = load_float<T>(wrow, i);
#pragma unroll
            for (int t = 0; t < kMmvBatch; t++)
                if (t < n) acc[t] += wv * xr[t][i];
        }
        write_rows(acc, n, g, c0, row, y, ldy);
    }
}

void launch_mmvq(QType t, const uint8_t* w, size_t row_bytes, int64_t rows, int64_t cols, const block_q8_1* xq,
                 int64_t xq_ld, int64_t n_slots, const TokenGroups& g, float* y, int64_t ldy, cudaStream_t s) {
    if (rows == 0 || (g.off == nullptr && g.slot_ids == nullptr && n_slots == 0)) return;
    const dim3 grid(ceil_div(rows, kMmvWarps), (unsigned)g.n_groups);
    const int nsub = (int)(cols / 32);
    switch (t) {
#define STOWLM_CASE(T)                                                                                              \
    case QType::T:                                                                                                  \
        launch_pdl(mmvq_kernel<QType::T>, grid, kMmvWarps * 32, 0, s, w, row_bytes, rows, nsub, xq, xq_ld, n_slots, \
                   g, y, ldy);                                                                                      \
        break;
        STOWLM_Q8_1_WEIGHT_TYPES(STOWLM_CASE)
#undef STOWLM_CASE
        default: throw InvalidInput(std::string("mmvq: weight type ") + qtype_name(t) + " is not a quantized type");
    }
    check_launch("mmvq_kernel");
}

void launch_mmvq_multi(QType t, MmvqMulti m, size_t row_bytes, int64_t cols, const block_q8_1* xq,
                       int64_t xq_ld, int64_t n_tok, cudaStream_t s) {
    int64_t blocks = 0;
    for (int i = 0; i < kMmvMulti; i++) m.block_end[i] = (unsigned)(blocks += ceil_div(m.rows[i], kMmvWarps));
    if (blocks == 0 || n_tok == 0) return;
    const int nsub = (int)(cols / 32);
    switch (t) {
#define STOWLM_CASE(T)                                                                                              \
    case QType::T:                                                                                                  \
        launch_pdl(mmvq_multi_kernel<QType::T>, (unsigned)blocks, kMmvWarps * 32, 0, s, m, row_bytes, nsub, xq,     \
                   xq_ld, n_tok);                                                                                   \
        break;
        STOWLM_Q8_1_WEIGHT_TYPES(STOWLM_CASE)
#undef STOWLM_CASE
        default: throw InvalidInput(std::string("mmvq_multi: weight type ") + qtype_name(t) + " is not a quantized type");
    }
    check_launch("mmvq_multi_kernel");
}

void launch_mmvq_glu(QType t, bool gelu, const uint8_t* wg, const uint8_t* wu, size_t row_bytes, int64_t rows,
                     int64_t cols, const block_q8_1* xq, int64_t xq_ld, int64_t n_tok, const TokenGroups& grp, float* g,
                     float* u, float* act, int64_t ldy, cudaStream_t s) {
    if (rows == 0 || n_tok == 0) return;
    const dim3 grid(ceil_div(rows, kMmvWarps), grp.slot_ids ? (unsigned)grp.n_groups : 1u);
    const int nsub = (int)(cols / 32);
    switch (t) {
#define STOWLM_CASE(T)                                                                                              \
    case QType::T:                                                                                                  \
        if (gelu)                                                                                                   \
            launch_pdl(mmvq_glu_kernel<QType::T, true>, grid, kMmvWarps * 32, 0, s, wg, wu, row_bytes, rows, nsub,  \
                       xq, xq_ld, n_tok, grp, g, u, act, ldy);                                                      \
        else                                                                                                        \
            launch_pdl(mmvq_glu_kernel<QType::T, false>, grid, kMmvWarps * 32, 0, s, wg, wu, row_bytes, rows,       \
                       nsub, xq, xq_ld, n_tok, grp, g, u, act, ldy);                                                \
        break;
        STOWLM_Q8_1_WEIGHT_TYPES(STOWLM_CASE)
#undef STOWLM_CASE
        default: throw InvalidInput(std::string("mmvq_glu: weight type ") + qtype_name(t) + " is not a quantized type");
    }
    check_launch("mmvq_glu_kernel");
}

void launch_mmv_float(QType t, const uint8_t* w, size_t row_bytes, int64_t rows, int64_t cols, const float* x,
                      int64_t ldx, int64_t n_slots, const TokenGroups& g, float* y, int64_t ldy, cudaStream_t s) {
    if (rows == 0 || (g.off == nullptr && g.slot_ids == nullptr && n_slots == 0)) return;
    const dim3 grid(ceil_div(rows, kMmvWarps), (unsigned)g.n_groups);
    switch (t) {
        case QType::F32:
            launch_pdl(mmv_float_kernel<QType::F32>, grid, kMmvWarps * 32, 0, s, w, row_bytes, rows, cols, x, ldx,
                       n_slots, g, y, ldy);
            break;
        case QType::F16:
            launch_pdl(mmv_float_kernel<QType::F16>, grid, kMmvWarps * 32, 0, s, w, row_bytes, rows, cols, x, ldx,
                       n_slots, g, y, ldy);
            break;
        case QType::BF16:
            launch_pdl(mmv_float_kernel<QType::BF16>, grid, kMmvWarps * 32, 0, s, w, row_bytes, rows, cols, x, ldx,
                       n_slots, g, y, ldy);
            break;
        default: throw InvalidInput(std::string("mmv_float: weight type ") + qtype_name(t) + " is not F32/F16/BF16");
    }
    check_launch("mmv_float_kernel");
}

}  // namespace stowlm::cuda
