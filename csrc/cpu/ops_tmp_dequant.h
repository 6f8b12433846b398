// TEMPORARY: stands in for csrc/quant/dequant.h (written by the quants work) until it lands
// on main; delete this file and ops_tmp_dequant.cpp then and include "quant/dequant.h".
#pragma once
#include <cstdint>

#include "quant/types.h"

namespace stowlm {
// Decodes n elements (a multiple of the block size) of `type` at src into dst.
void dequantize_row(QType type, const void* src, float* dst, int64_t n);
}  // namespace stowlm
