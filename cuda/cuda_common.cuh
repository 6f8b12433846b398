// Helpers shared by the .cu files of the CUDA backend: error checks, warp reductions, and the
// internal launchers one kernel family offers another (moe.cu reuses mmvq's grouped kernel).
#pragma once
#include <cuda_runtime.h>

#include <string>

#include "error.h"
#include "quant/dot_q8_1.h"
#include "quant/types.h"

namespace stowlm::cuda {

inline void check_cuda(cudaError_t e, const char* what) {
    if (e != cudaSuccess)
        throw Unsupported(std::string("CUDA error in ") + what + ": " + cudaGetErrorName(e) + ": " + cudaGetErrorString(e));
}
// Kernels launched by this thread (cuda_backend.cu; read through launches_on_this_thread()).
extern thread_local uint64_t t_launches;
// After every launch: a bad configuration shows up here, not at the next synchronize; and the
// launch is counted (the backend reports kernels per token, stowlm-bench -v).
inline void check_launch(const char* kernel) {
    ++t_launches;
    check_cuda(cudaGetLastError(), kernel);
}

inline unsigned ceil_div(int64_t a, int64_t b) { return (unsigned)((a + b - 1) / b); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
__device__ __forceinline__ int warp_sum_int(int v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Rows handled by token groups. Plain product: one group, slot i reads activation row i and
// writes output row i. Grouped (MoE): group g (blockIdx.y) owns slots [off[g], off[g+1]) of
// the sorted lists, act_row[slot] / out_row[slot] give the rows, and its weights start
// g * group_stride bytes further.
struct TokenGroups {
    const int32_t* off = nullptr;
    const int32_t* act_row = nullptr;
    const int32_t* out_row = nullptr;
    size_t group_stride = 0;
    int n_groups = 1;
};

// mmvq.cu: y rows for every slot, weights of a quantized type against block_q8_1 rows (xq_ld
// blocks apart); n_slots is the slot count of the plain product (ignored when grouped).
void launch_mmvq(QType t, const uint8_t* w, size_t row_bytes, int64_t rows, int64_t cols, const block_q8_1* xq,
                 int64_t xq_ld, int64_t n_slots, const TokenGroups& g, float* y, int64_t ldy, cudaStream_t s);
// mmvq.cu: the same for F32/F16/BF16 weights against float activations (ldx floats apart).
void launch_mmv_float(QType t, const uint8_t* w, size_t row_bytes, int64_t rows, int64_t cols, const float* x,
                      int64_t ldx, int64_t n_slots, const TokenGroups& g, float* y, int64_t ldy, cudaStream_t s);
// mmq.cu: tiled product of a quantized weight against n_tok block_q8_1 rows.
void launch_mmq(QType t, const uint8_t* w, size_t row_bytes, int64_t rows, int64_t cols, const block_q8_1* xq,
                int64_t xq_ld, int64_t n_tok, float* y, int64_t ldy, cudaStream_t s);

}  // namespace stowlm::cuda
