// Float weights (F32, F16, BF16) times many activation rows: a tiled product in shared memory,
// for batches of kCudaBatchedMinTokens rows and more (a prompt through a MoE router, an F16
// model), where the vector kernel (mmvq.cu's mmv_float_kernel, 8 rows a pass) would read each
// weight row once per 8 rows. A block takes 64 weight rows x 64 activation rows; its 256 threads
// 4 x 4 outputs each, over the columns in tiles of 32 staged as floats. Each output sums its
// columns in order, one tile after the other, so its value depends on its own row and token only.
#include "cuda_backend.h"
#include "cuda_common.cuh"

namespace stowlm::cuda {

namespace {

constexpr int kMfRows = 64, kMfToks = 64, kMfK = 32;
static_assert(kMfRows == kMfToks, "one loop stages both tiles");

template <QType T>
__global__ void __launch_bounds__(256) mmf_kernel(const uint8_t* __restrict__ w, size_t row_bytes, int64_t rows,
                                                  int64_t cols, const float* __restrict__ x, int64_t ldx,
                                                  int64_t n_tok, float* __restrict__ y, int64_t ldy) {
    pdl_begin();
    __shared__ float ws[kMfK][kMfRows + 1], xs[kMfK][kMfToks + 1];  // [column][row]: a warp's stores hit 32 banks
    const int64_t r0 = (int64_t)blockIdx.x * kMfRows, t0 = (int64_t)blockIdx.y * kMfToks;
    const int tr = threadIdx.x / 16, tt = threadIdx.x % 16;  // rows tr*4.., tokens tt*4..
    float acc[4][4] = {};
    for (int64_t k0 = 0; k0 < cols; k0 += kMfK) {
        __syncthreads();  // the last tile has been read
        // thread i stages column i % 32 of rows i / 32, + 8, + 16, ...: a warp reads 32 consecutive
        // columns (coalesced); kMfToks == kMfRows, so the same walk stages the activations
        const int k = threadIdx.x % kMfK;
        const int64_t gk = k0 + k;
        const bool in = gk < cols;
#pragma unroll
        for (int r = threadIdx.x / kMfK; r < kMfRows; r += 256 / kMfK) {
            const int64_t gr = r0 + r, gt = t0 + r;
            ws[k][r] = in && gr < rows ? load_float<T>(w + (size_t)gr * row_bytes, gk) : 0.0f;
            xs[k][r] = in && gt < n_tok ? x[gt * ldx + gk] : 0.0f;
        }
        __syncthreads();
#pragma unroll 8
        for (int k = 0; k < kMfK; k++) {
            float a[4], b[4];
#pragma unroll
            for (int i = 0; i < 4; i++) a[i] = ws[k][tr * 4 + i], b[i] = xs[k][tt * 4 + i];
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < 4; j++) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
        }
    }
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int64_t r = r0 + tr * 4 + i, t = t0 + tt * 4 + j;
            if (r < rows && t < n_tok) y[t * ldy + r] = acc[i][j];
        }
}

}  // namespace

void launch_mmf(QType t, const uint8_t* w, size_t row_bytes, int64_t rows, int64_t cols, const float* x, int64_t ldx,
                int64_t n_tok, float* y, int64_t ldy, cudaStream_t s) {
    if (rows == 0 || n_tok == 0) return;
    if (ceil_div(n_tok, kMfToks) > 65535) throw InvalidInput("mmf: more than 65535 * 64 activation rows in one launch");
    const dim3 grid(ceil_div(rows, kMfRows), ceil_div(n_tok, kMfToks));
    auto go = [&](auto kernel) { launch_pdl(kernel, grid, 256, 0, s, w, row_bytes, rows, cols, x, ldx, n_tok, y, ldy); };
    switch (t) {
        case QType::F32: go(mmf_kernel<QType::F32>); break;
        case QType::F16: go(mmf_kernel<QType::F16>); break;
        case QType::BF16: go(mmf_kernel<QType::BF16>); break;
        default: throw InvalidInput(std::string("mmf: weight type ") + qtype_name(t) + " is not F32/F16/BF16");
    }
    check_launch("mmf_kernel");
}

}  // namespace stowlm::cuda
