// Helpers shared by the .cu files of the CUDA backend: error checks, warp reductions, and the
// internal launchers one kernel family offers another (moe.cu reuses mmvq's grouped kernel).
#pragma once
#include <cuda_runtime.h>

#include <string>
#include <utility>

#include "cuda_backend.h"
#include "error.h"
#include "quant/dot_q8_1.h"
#include "quant/float_types.h"
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

// Programmatic dependent launch (sm_90+, STOWLM_CUDA_PDL=1, for now a measurement): a decode
// step's kernels launched by launch_pdl may be scheduled while the kernel before them is still
// running, and wait in pdl_begin until it has finished and its writes are visible, so a launch's
// latency overlaps the kernel before. Every kernel launch_pdl launches starts with pdl_begin.
bool pdl_enabled();  // cuda_backend.cu: the switch, and a device of compute capability 9+
__device__ __forceinline__ void pdl_begin() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");  // the next kernel may be scheduled now
    asm volatile("griddepcontrol.wait;" ::: "memory");               // the kernel before has finished
#endif
}
template <typename... P, typename... A>
inline void launch_pdl(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem, cudaStream_t s, A&&... args) {
    if (!pdl_enabled()) {
        kernel<<<grid, block, smem, s>>>(std::forward<A>(args)...);
        return;
    }
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t c = {};
    c.gridDim = grid, c.blockDim = block, c.dynamicSmemBytes = smem, c.stream = s, c.attrs = attr, c.numAttrs = 1;
    check_cuda(cudaLaunchKernelEx(&c, kernel, std::forward<A>(args)...), "cudaLaunchKernelEx");
}

// Element i of a row of F32, F16 or BF16 weights (the float products, mmvq.cu and mmf.cu).
template <QType T>
__device__ __forceinline__ float load_float(const uint8_t* row, int64_t i) {
    if constexpr (T == QType::F32) return ((const float*)row)[i];
    else if constexpr (T == QType::F16) return fp16_to_f32(((const uint16_t*)row)[i]);
    else return bf16_to_f32(((const uint16_t*)row)[i]);
}

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

// One warp quantizes the 32 values of a block_q8_1, lane i holding value i: the host quantizer's
// rounding (quant/dot_q8_1.h) with an exact max and exact sums, so its blocks are the host's bits.
// Every op that writes block_q8_1 activations (quantize.cu, the fused norm) goes through it.
__device__ __forceinline__ void warp_quantize_q8_1(float v, block_q8_1* out) {
    const int lane = threadIdx.x & 31;
    const float amax = warp_max(abs_f(v));
    const float d = amax / 127.0f, id = q8_1_inverse_scale(amax);
    const int q = q8_1_value(v, id);
    // sum of each 16-lane half: reduce within halves only
    int s = q;
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    ((int8_t*)out->qs)[lane] = (int8_t)q;
    if (lane == 0) out->s0 = d * (float)s;
    if (lane == 16) out->s1 = d * (float)s;
    if (lane == 1) out->d = d;
    if (lane == 2) out->pad = 0.0f;
}

// Rows handled by token groups. Plain product: one group, slot i reads activation row i and
// writes output row i. Grouped (MoE): group g (blockIdx.y) owns slots [off[g], off[g+1]) of
// the sorted lists, act_row[slot] / out_row[slot] give the rows, and its weights start
// g * group_stride bytes further.
// By slot (slot_ids set, one token's experts): block y is slot y, its weights those of expert
// slot_ids[y] (outside [0, n_expert), as -1 for an expert on another shard: a zero row), its
// activation row y (per_slot) or 0, its output row y.
struct TokenGroups {
    const int32_t* off = nullptr;
    const int32_t* act_row = nullptr;
    const int32_t* out_row = nullptr;
    size_t group_stride = 0;
    int n_groups = 1;
    const int32_t* slot_ids = nullptr;
    int n_expert = 0;
    bool per_slot = false;
};

// mmvq.cu: y rows for every slot, weights of a quantized type against block_q8_1 rows (xq_ld
// blocks apart); n_slots is the slot count of the plain product (ignored when grouped).
void launch_mmvq(QType t, const uint8_t* w, size_t row_bytes, int64_t rows, int64_t cols, const block_q8_1* xq,
                 int64_t xq_ld, int64_t n_slots, const TokenGroups& g, float* y, int64_t ldy, cudaStream_t s);
// mmvq.cu: up to kMmvMulti products of the same block_q8_1 rows (weights of one type and width) in
// one launch, each row's bits as launch_mmvq's; entries past the used ones have 0 rows.
struct MmvqMulti {
    const uint8_t* w[kMmvMulti] = {};
    float* y[kMmvMulti] = {};
    int64_t rows[kMmvMulti] = {};
    int64_t ldy[kMmvMulti] = {};
    unsigned block_end[kMmvMulti] = {};  // set by the launcher: blocks of entries 0..i
};
void launch_mmvq_multi(QType t, MmvqMulti m, size_t row_bytes, int64_t cols, const block_q8_1* xq,
                       int64_t xq_ld, int64_t n_tok, cudaStream_t s);
// mmvq.cu: the gate and up products of n_tok (< kCudaBatchedMinTokens) block_q8_1 rows joined by
// the GLU (gelu: gelu_tanh(g) * u, else silu(g) * u), all three written with row stride ldy; or,
// with grp by slot (one token's experts), grp.n_groups slots' products of their experts.
void launch_mmvq_glu(QType t, bool gelu, const uint8_t* wg, const uint8_t* wu, size_t row_bytes, int64_t rows,
                     int64_t cols, const block_q8_1* xq, int64_t xq_ld, int64_t n_tok, const TokenGroups& grp, float* g,
                     float* u, float* act, int64_t ldy, cudaStream_t s);
// mmf.cu: float weights times n_tok (many) activation rows, a tiled product (batches of
// kCudaBatchedMinTokens and more; a row's value does not depend on the batch).
void launch_mmf(QType t, const uint8_t* w, size_t row_bytes, int64_t rows, int64_t cols, const float* x, int64_t ldx,
                int64_t n_tok, float* y, int64_t ldy, cudaStream_t s);
// mmvq.cu: launch_mmvq's product for F32/F16/BF16 weights against float activations (ldx floats apart).
void launch_mmv_float(QType t, const uint8_t* w, size_t row_bytes, int64_t rows, int64_t cols, const float* x,
                      int64_t ldx, int64_t n_slots, const TokenGroups& g, float* y, int64_t ldy, cudaStream_t s);
// mmq.cu: tiled product of a quantized weight against n_tok block_q8_1 rows.
void launch_mmq(QType t, const uint8_t* w, size_t row_bytes, int64_t rows, int64_t cols, const block_q8_1* xq,
                int64_t xq_ld, int64_t n_tok, float* y, int64_t ldy, cudaStream_t s);

}  // namespace stowlm::cuda
