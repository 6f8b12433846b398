// Activation quantization on the device: float rows -> block_q8_1 rows, one warp per block of
// 32 (one lane per element). Each lane rounds with the same HOST_DEVICE function the host
// quantizer uses (quant/dot_q8_1.h) and the max and the sums are exact, so the device blocks
// are bit-identical to quantize_block_q8_1 on the CPU.
#include "cuda_backend.h"
#include "cuda_common.cuh"

namespace stowlm::cuda {

__global__ void __launch_bounds__(256) quantize_q8_1_kernel(const float* __restrict__ x, int64_t n_blocks,
                                                            int64_t blocks_per_row, int64_t ldx,
                                                            block_q8_1* __restrict__ y) {
    pdl_begin();
    const int64_t b = (int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (b >= n_blocks) return;  // whole warps leave together
    const int lane = threadIdx.x & 31;
    const int64_t r = b / blocks_per_row, c = b % blocks_per_row;
    warp_quantize_q8_1(x[r * ldx + c * 32 + lane], y + b);
}

size_t q8_1_bytes(int64_t n_rows, int64_t cols) { return (size_t)n_rows * (size_t)(cols / 32) * sizeof(block_q8_1); }

void quantize_q8_1(const float* x, int64_t n_rows, int64_t cols, int64_t ldx, void* xq, Stream s) {
    if (cols <= 0 || cols % 32) throw InvalidInput("quantize_q8_1: cols=" + std::to_string(cols) + " is not a positive multiple of 32");
    if (ldx < cols) throw InvalidInput("quantize_q8_1: ldx < cols");
    const int64_t n_blocks = n_rows * (cols / 32);
    if (n_blocks == 0) return;
    launch_pdl(quantize_q8_1_kernel, ceil_div(n_blocks, 8), 256, 0, (cudaStream_t)s, x, n_blocks, cols / 32, ldx,
               (block_q8_1*)xq);
    check_launch("quantize_q8_1_kernel");
}

}  // namespace stowlm::cuda
