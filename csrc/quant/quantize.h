// Host quantization of float rows into GGUF blocks (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0,
// Q5_1, Q8_K, Q3_K). Bit-identical to gguf-py's quantize where gguf-py implements the type, and to
// ggml's quantize_row_q8_K_ref for Q8_K; Q3_K is stowlm's own. Per-block versions:
// quant/quantize_block.h.
#pragma once
#include <cstddef>
#include <cstdint>

#include "quant/types.h"

namespace stowlm {

// Whether quantize_row can produce type t.
bool can_quantize(QType t);

// Quantizes n floats (a whole number of t's blocks) from src into dst (any alignment) and
// returns the bytes written, row_bytes(t, n). Throws InvalidInput for a type it cannot
// produce or n not a multiple of the block size.
size_t quantize_row(QType t, const float* src, void* dst, int64_t n);

}  // namespace stowlm
