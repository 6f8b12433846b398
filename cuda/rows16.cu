// Staged experts that the CPU keeps repacked into 16-row groups (cpu/repack.h) back in GGUF's
// layout, in place in the staging slot, for the GPU's kernels: one block of threads a group,
// read whole into shared memory, then each thread writes rows' blocks with the byte moves the
// CPU repacked them with (quant/rows16.h).
#include "cuda_backend.h"
#include "cuda_common.cuh"
#include "quant/rows16.h"

namespace stowlm::cuda {

namespace {

// Group blockIdx.x of the n_mat matrices (mat_bytes apart, `groups` whole groups each, rb bytes a
// row of nb blocks); WORDS: every group starts 4-byte aligned, so it is read in words.
template <bool WORDS>
__global__ void __launch_bounds__(256) unrepack_rows16_kernel(uint8_t* __restrict__ data, QType t, int64_t groups,
                                                              size_t mat_bytes, size_t rb, int64_t nb) {
    extern __shared__ __align__(16) uint8_t grp[];
    const int64_t m = blockIdx.x / groups, g = blockIdx.x % groups;
    uint8_t* rows = data + m * mat_bytes + g * kRepackRows * rb;
    const size_t bytes = kRepackRows * rb;
    if (WORDS)
        for (size_t i = threadIdx.x; i < bytes / 4; i += blockDim.x) ((uint32_t*)grp)[i] = ((const uint32_t*)rows)[i];
    else
        for (size_t i = threadIdx.x; i < bytes; i += blockDim.x) grp[i] = rows[i];
    __syncthreads();
    const int pb = rows16_block_bytes(t);
    // consecutive threads take consecutive blocks of a row, so their writes are neighbours
    for (int64_t j = threadIdx.x; j < kRepackRows * nb; j += blockDim.x) {
        const int r = (int)(j / nb);
        const int64_t b = j % nb;
        rows16_move_block<true>(t, rows + r * rb + b * pb, grp + b * kRepackRows * pb, r);
    }
}

}  // namespace

void unrepack_rows16(void* data, QType type, int64_t n_mat, int64_t rows, int64_t cols, Stream s) {
    const size_t smem = rows16_group_bytes(type, cols), rb = smem / kRepackRows;
    if (smem == 0 || n_mat <= 0 || rows <= 0)
        throw InvalidInput(std::string("cuda unrepack_rows16: ") + qtype_name(type) + " " + std::to_string(rows) + " x " +
                           std::to_string(cols) + " has no 16-row layout");
    const int64_t nb = (int64_t)rb / rows16_block_bytes(type), groups = rows / kRepackRows;
    if (smem > kStagedRows16GroupMax)
        throw InvalidInput("cuda unrepack_rows16: a group of " + std::to_string(smem) + " bytes is over " +
                           std::to_string(kStagedRows16GroupMax));
    if (groups == 0) return;  // fewer than 16 rows: all in GGUF's layout already
    const size_t mat_bytes = (size_t)rows * rb;
    const bool words = (uintptr_t)data % 4 == 0 && mat_bytes % 4 == 0;  // (a group's bytes are a multiple of 16)
    auto kernel = words ? unrepack_rows16_kernel<true> : unrepack_rows16_kernel<false>;
    if (smem > 48 * 1024)
        check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem),
                   "unrepack_rows16 (shared memory)");
    kernel<<<(unsigned)(n_mat * groups), 256, smem, (cudaStream_t)s>>>((uint8_t*)data, type, groups, mat_bytes, rb, nb);
    check_launch("unrepack_rows16_kernel");
}

}  // namespace stowlm::cuda
