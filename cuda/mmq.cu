// Tiled quantized matrix-matrix product for larger batches (prefill). A block computes a
// 64-row x 32-token tile of y with int8 tensor cores (mma.sync m16n8k16 s8*s8 -> s32): each
// warp owns 16 weight rows and all 32 tokens (four 16x8 output tiles).
//
// Every weight type is first unpacked into shared memory by the same HOST_DEVICE sub-block
// loader the vector kernel and the CPU tests use (quant/dot_q8_1.h: int8 values plus a scale
// and offset per 16 elements), so one tile kernel serves all types. The tensor-core step is
// 16 deep rather than 32 because the K formats change scale every 16 elements; each 16-deep
// integer result is scaled in float, exactly as wsub_combine() does for one sub-block.
#include "cuda_backend.h"
#include "cuda_common.cuh"

namespace stowlm::cuda {

constexpr int kTileM = 64;       // weight rows per block (4 warps x 16)
constexpr int kTileN = 32;       // tokens per block (4 mma n8 tiles)
constexpr int kTileSubs = 4;     // 32-element sub-blocks per k-stage (128 elements)
constexpr int kRowWords = kTileSubs * 8 + 4;  // +4 words: fragment reads hit 32 distinct banks

struct MmqSmem {
    int32_t a[kTileM][kRowWords];
    int32_t b[kTileN][kRowWords];
    float ad[kTileM][kTileSubs][2];  // weight scale per 16 elements
    float am[kTileM][kTileSubs][2];  // weight offset per 16 elements
    float bd[kTileN][kTileSubs];     // activation scale
    float bs[kTileN][kTileSubs][2];  // activation scaled half sums
};

// D = A(16x16, row) * B(16x8, col) + 0 for int8 inputs; fragments as the PTX ISA lays them out
// for m16n8k16 .s8: a0 rows g, a1 rows g+8, k = 4*tig..4*tig+3; b0 k = 4*tig.., column g;
// d0,d1 row g, columns 2*tig, 2*tig+1; d2,d3 row g+8.
__device__ __forceinline__ void mma_s8_16816(int (&d)[4], int a0, int a1, int b0) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5}, {%6}, {%7, %7, %7, %7};\n"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a0), "r"(a1), "r"(b0), "r"(0));
}

template <QType T>
__device__ __forceinline__ void mmq_load_tile(MmqSmem& sm, const uint8_t* w, size_t row_bytes, int64_t rows,
                                              int64_t row0, int nsub, int k0, const block_q8_1* xq, int64_t xq_ld,
                                              int64_t n_tok, int64_t tok0) {
    const int tid = threadIdx.x;
#pragma unroll 1
    for (int i = 0; i < kTileM * kTileSubs / 128; i++) {
        const int p = tid + 128 * i, r = p / kTileSubs, ks = p % kTileSubs;
        WSub ws;
        if (row0 + r < rows && k0 + ks < nsub) {
            WTraits<T>::load(w + (size_t)(row0 + r) * row_bytes, k0 + ks, ws);
        } else {
#pragma unroll
            for (int k = 0; k < 8; k++) ws.q[k] = 0;
            wsub_set_scales(ws, 0.0f, 0.0f, 0.0f, 0.0f);
        }
#pragma unroll
        for (int k = 0; k < 8; k++) sm.a[r][ks * 8 + k] = ws.q[k];
        sm.ad[r][ks][0] = ws.d[0], sm.ad[r][ks][1] = ws.d[1];
        sm.am[r][ks][0] = ws.m[0], sm.am[r][ks][1] = ws.m[1];
    }
    {
        const int n = tid / kTileSubs, ks = tid % kTileSubs;
        if (tok0 + n < n_tok && k0 + ks < nsub) {
            const block_q8_1& blk = xq[(tok0 + n) * xq_ld + k0 + ks];
            const int4 lo = *(const int4*)&blk.qs[0], hi = *(const int4*)&blk.qs[4];
            int32_t* dst = &sm.b[n][ks * 8];
            dst[0] = lo.x, dst[1] = lo.y, dst[2] = lo.z, dst[3] = lo.w;
            dst[4] = hi.x, dst[5] = hi.y, dst[6] = hi.z, dst[7] = hi.w;
            sm.bd[n][ks] = blk.d;
            sm.bs[n][ks][0] = blk.s0, sm.bs[n][ks][1] = blk.s1;
        } else {
#pragma unroll
            for (int k = 0; k < 8; k++) sm.b[n][ks * 8 + k] = 0;
            sm.bd[n][ks] = 0.0f;
            sm.bs[n][ks][0] = sm.bs[n][ks][1] = 0.0f;
        }
    }
}

template <QType T>
__global__ void __launch_bounds__(128, 1) mmq_kernel(const uint8_t* __restrict__ w, size_t row_bytes, int64_t rows,
                                                     int nsub, const block_q8_1* __restrict__ xq, int64_t xq_ld,
                                                     int64_t n_tok, float* __restrict__ y, int64_t ldy) {
    static_assert(kTileN * kTileSubs == 128, "one activation block per thread per stage");
    __shared__ MmqSmem sm;
    const int64_t row0 = (int64_t)blockIdx.x * kTileM, tok0 = (int64_t)blockIdx.y * kTileN;
    const int warp = threadIdx.x / 32, lane = threadIdx.x & 31, g = lane >> 2, tig = lane & 3;
    const int ra = warp * 16 + g, rb = ra + 8;  // this lane's two tile rows
    float acc[4][4] = {};
    for (int k0 = 0; k0 < nsub; k0 += kTileSubs) {
        __syncthreads();  // previous stage fully consumed
        mmq_load_tile<T>(sm, w, row_bytes, rows, row0, nsub, k0, xq, xq_ld, n_tok, tok0);
        __syncthreads();
#pragma unroll 1
        for (int ks = 0; ks < kTileSubs; ks++) {
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int col = ks * 8 + h * 4 + tig;
                const int a0 = sm.a[ra][col], a1 = sm.a[rb][col];
                const float da = sm.ad[ra][ks][h], db = sm.ad[rb][ks][h];
                const float ma = sm.am[ra][ks][h], mb = sm.am[rb][ks][h];
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    int c[4];
                    mma_s8_16816(c, a0, a1, sm.b[8 * j + g][col]);
                    const int n0 = 8 * j + 2 * tig, n1 = n0 + 1;
                    const float x0 = sm.bd[n0][ks], x1 = sm.bd[n1][ks];
                    const float s0 = sm.bs[n0][ks][h], s1 = sm.bs[n1][ks][h];
                    acc[j][0] += wsub_half_value(da, ma, x0, s0, c[0]);
                    acc[j][1] += wsub_half_value(da, ma, x1, s1, c[1]);
                    acc[j][2] += wsub_half_value(db, mb, x0, s0, c[2]);
                    acc[j][3] += wsub_half_value(db, mb, x1, s1, c[3]);
                }
            }
        }
    }
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const int64_t n0 = tok0 + 8 * j + 2 * tig, ga = row0 + ra, gb = row0 + rb;
        if (n0 < n_tok && ga < rows) y[n0 * ldy + ga] = acc[j][0];
        if (n0 + 1 < n_tok && ga < rows) y[(n0 + 1) * ldy + ga] = acc[j][1];
        if (n0 < n_tok && gb < rows) y[n0 * ldy + gb] = acc[j][2];
        if (n0 + 1 < n_tok && gb < rows) y[(n0 + 1) * ldy + gb] = acc[j][3];
    }
}

void launch_mmq(QType t, const uint8_t* w, size_t row_bytes, int64_t rows, int64_t cols, const block_q8_1* xq,
                int64_t xq_ld, int64_t n_tok, float* y, int64_t ldy, cudaStream_t s) {
    if (rows == 0 || n_tok == 0) return;
    const dim3 grid(ceil_div(rows, kTileM), ceil_div(n_tok, kTileN));
    const int nsub = (int)(cols / 32);
    switch (t) {
#define STOWLM_CASE(T)                                                                                \
    case QType::T: mmq_kernel<QType::T><<<grid, 128, 0, s>>>(w, row_bytes, rows, nsub, xq, xq_ld, n_tok, y, ldy); break;
        STOWLM_Q8_1_WEIGHT_TYPES(STOWLM_CASE)
#undef STOWLM_CASE
        default: throw InvalidInput(std::string("mmq: weight type ") + qtype_name(t) + " is not a quantized type");
    }
    check_launch("mmq_kernel");
}

}  // namespace stowlm::cuda
