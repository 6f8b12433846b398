// CPU quantized matrix products: y = W x for every weight type against F32 activations.
// Activations are quantized once per call (Q8_0 or Q8_K blocks, by weight type) into
// `scratch`, then dotted with integer SIMD chosen at run time (cpu_features.h).
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
};

// Bytes of scratch matmul() needs for n_tok activation rows of `cols` against this weight type.
size_t matmul_scratch_bytes(QType wtype, int64_t cols, int64_t n_tok);

// y[t * ldy + r] = sum_c W[r, c] * x[t * ldx + c]  for t < n_tok, r < rows.
// Throws InvalidInput for an unsupported type or a cols value that is not a block multiple.
void matmul(const WeightRef& w, const float* x, int64_t n_tok, int64_t ldx, float* y, int64_t ldy,
            void* scratch, ThreadPool& pool);

}  // namespace stowlm::cpu
