// Compiles every HOST_DEVICE block decoder and block quantizer under nvcc, so a decoder nvcc
// rejects (or one that spills / uses local memory, per the -Xptxas warnings) fails the build.
// Each kernel handles one block per thread.
#include "common.h"
#include "quant/blocks.h"
#include "quant/float_types.h"
#include "quant/iquants.h"
#include "quant/kquants.h"
#include "quant/legacy.h"
#include "quant/mxfp4.h"
#include "quant/quantize_block.h"

namespace stowlm::cuda {

__global__ void fp16_roundtrip_kernel(const uint16_t* in, float* out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = fp16_to_f32(f32_to_fp16(fp16_to_f32(in[i])));
}

// One decode kernel per block type: block i of `blocks` -> out[i*N .. i*N+N).
#define STOWLM_DECODE_KERNEL(name, Block, N)                                            \
    __global__ void dequantize_##name##_kernel(const Block* blocks, float* out, int nb) { \
        const int i = blockIdx.x * blockDim.x + threadIdx.x;                             \
        if (i < nb) dequantize_block_##name(blocks + i, out + (size_t)i * (N));          \
    }

STOWLM_DECODE_KERNEL(f32, float, 1)
STOWLM_DECODE_KERNEL(f16, uint16_t, 1)
STOWLM_DECODE_KERNEL(bf16, uint16_t, 1)
STOWLM_DECODE_KERNEL(q4_0, block_q4_0, QK)
STOWLM_DECODE_KERNEL(q4_1, block_q4_1, QK)
STOWLM_DECODE_KERNEL(q5_0, block_q5_0, QK)
STOWLM_DECODE_KERNEL(q5_1, block_q5_1, QK)
STOWLM_DECODE_KERNEL(q8_0, block_q8_0, QK)
STOWLM_DECODE_KERNEL(iq4_nl, block_iq4_nl, QK)
STOWLM_DECODE_KERNEL(q2_K, block_q2_K, QK_K)
STOWLM_DECODE_KERNEL(q3_K, block_q3_K, QK_K)
STOWLM_DECODE_KERNEL(q4_K, block_q4_K, QK_K)
STOWLM_DECODE_KERNEL(q5_K, block_q5_K, QK_K)
STOWLM_DECODE_KERNEL(q6_K, block_q6_K, QK_K)
STOWLM_DECODE_KERNEL(q8_K, block_q8_K, QK_K)
STOWLM_DECODE_KERNEL(iq4_xs, block_iq4_xs, QK_K)
STOWLM_DECODE_KERNEL(mxfp4, block_mxfp4, QK)
STOWLM_DECODE_KERNEL(iq2_xxs, block_iq2_xxs, QK_K)
STOWLM_DECODE_KERNEL(iq2_xs, block_iq2_xs, QK_K)
STOWLM_DECODE_KERNEL(iq2_s, block_iq2_s, QK_K)
STOWLM_DECODE_KERNEL(iq3_xxs, block_iq3_xxs, QK_K)
STOWLM_DECODE_KERNEL(iq3_s, block_iq3_s, QK_K)
STOWLM_DECODE_KERNEL(iq1_s, block_iq1_s, QK_K)
STOWLM_DECODE_KERNEL(iq1_m, block_iq1_m, QK_K)
#undef STOWLM_DECODE_KERNEL

// One encode kernel per quantizable block type: in[i*N ..) -> block i.
#define STOWLM_ENCODE_KERNEL(name, Block, N)                                             \
    __global__ void quantize_##name##_kernel(const float* in, Block* blocks, int nb) {    \
        const int i = blockIdx.x * blockDim.x + threadIdx.x;                              \
        if (i < nb) quantize_block_##name(in + (size_t)i * (N), blocks + i);              \
    }

STOWLM_ENCODE_KERNEL(q8_0, block_q8_0, QK)
STOWLM_ENCODE_KERNEL(q4_0, block_q4_0, QK)
STOWLM_ENCODE_KERNEL(q4_1, block_q4_1, QK)
STOWLM_ENCODE_KERNEL(q5_0, block_q5_0, QK)
STOWLM_ENCODE_KERNEL(q5_1, block_q5_1, QK)
STOWLM_ENCODE_KERNEL(q8_K, block_q8_K, QK_K)
#undef STOWLM_ENCODE_KERNEL

}  // namespace stowlm::cuda
