// Host dequantization of GGUF rows: the one entry point every consumer (get_rows, tests,
// reference paths) uses to turn stored blocks into float32.
#pragma once
#include <cstdint>

#include "quant/types.h"

namespace stowlm {

// Decodes n elements (a whole number of t's blocks, laid out as in GGUF) from src into dst,
// bit-identical to gguf-py's dequantize. src needs no particular alignment.
// Throws InvalidInput for an unknown/unsupported type or n not a multiple of the block size.
void dequantize_row(QType t, const void* src, float* dst, int64_t n);

}  // namespace stowlm
