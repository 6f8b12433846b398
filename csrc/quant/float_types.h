// Plain float element types (F32, F16, BF16) as one-element "blocks", and the rounding-exact
// float helpers every decoder uses so host and device produce the same bits as gguf-py.
#pragma once
#include <cstdint>

#include "common.h"

namespace stowlm {

// a*b rounded once, never fused into a following add. nvcc contracts a*b+c into an FMA by
// default, which changes the last bit against gguf's numpy (multiply, round, add, round);
// __fmul_rn is never contracted. Host TUs that need the same guarantee build without FMA
// contraction (see dequant.cpp).
HOST_DEVICE float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
    return __fmul_rn(a, b);
#else
    return a * b;
#endif
}

HOST_DEVICE void dequantize_block_f32(const float* b, float* out) { out[0] = b[0]; }
HOST_DEVICE void dequantize_block_f16(const uint16_t* b, float* out) { out[0] = fp16_to_f32(b[0]); }
HOST_DEVICE void dequantize_block_bf16(const uint16_t* b, float* out) { out[0] = bf16_to_f32(b[0]); }

}  // namespace stowlm
