// The per-element and per-row ops of a transformer layer on the device, with the same
// semantics as cpu/ops.h. Decoding (get_rows) uses the shared HOST_DEVICE block decoders;
// rope angles, activations and softcap use cpu/attn_math.h, so both sides agree.
#include "cpu/attn_math.h"
#include "cuda_backend.h"
#include "cuda_common.cuh"
#include "quant/float_types.h"
#include "quant/iquants.h"
#include "quant/kquants.h"
#include "quant/legacy.h"
#include "quant/mxfp4.h"
#include "quant/quantize_block.h"

namespace stowlm::cuda {

namespace {

// ---- get_rows: one thread per block of a row ----------------------------------------------

template <typename Block, int N, void (*Decode)(const Block*, float*)>
__global__ void __launch_bounds__(128) get_rows_kernel(const uint8_t* __restrict__ table, size_t row_bytes,
                                                       int64_t n_cols, const int32_t* __restrict__ ids,
                                                       float* __restrict__ out, int64_t ld_out) {
    pdl_begin();
    const int64_t i = blockIdx.y;
    const int64_t nb = n_cols / N;
    const Block* row = (const Block*)(table + (size_t)ids[i] * row_bytes);
    for (int64_t b = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; b < nb; b += (int64_t)gridDim.x * blockDim.x)
        Decode(row + b, out + i * ld_out + b * N);
}

template <typename Block, int N, void (*Decode)(const Block*, float*)>
void launch_get_rows(const void* table, size_t rb, int64_t n_cols, const int32_t* ids, int64_t n_ids, float* out,
                     int64_t ld_out, cudaStream_t s) {
    const int64_t nb = n_cols / N;
    const dim3 grid((unsigned)std::min<int64_t>(ceil_div(nb, 128), 64), (unsigned)n_ids);
    launch_pdl(get_rows_kernel<Block, N, Decode>, grid, 128, 0, s, (const uint8_t*)table, rb, n_cols, ids, out, ld_out);
}

// ---- row reductions: one block of 256 threads per row -------------------------------------

__device__ __forceinline__ float block_sum(float v, float* red) {
    v = warp_sum(v);
    const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
    __syncthreads();  // red may still be read by a previous reduction
    if (lane == 0) red[warp] = v;
    __syncthreads();
    v = lane < (int)(blockDim.x / 32) ? red[lane] : 0.0f;
    return warp_sum(v);
}
__device__ __forceinline__ float block_max(float v, float* red) {
    v = warp_max(v);
    const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    v = lane < (int)(blockDim.x / 32) ? red[lane] : -INFINITY;
    return warp_max(v);
}

__global__ void __launch_bounds__(256) rms_norm_kernel(const float* __restrict__ x, int64_t dim, int64_t ldx,
                                                       const float* __restrict__ w, float eps, float* y, int64_t ldy) {
    pdl_begin();
    __shared__ float red[8];
    const float* xr = x + blockIdx.x * ldx;
    float ss = 0.0f;
    for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) ss += xr[i] * xr[i];
    const float r = 1.0f / sqrtf(block_sum(ss, red) / (float)dim + eps);
    float* yr = y + blockIdx.x * ldy;
    for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) yr[i] = xr[i] * r * (w ? w[i] : 1.0f);
}

// The residual add and the norm after it in one pass: sum = a + b (kept: the residual stream goes
// on; b null: no add, x = a), y = rms_norm(x) * w, and with yq y's block_q8_1 rows for the
// products that read y. Each thread sums, squares and normalizes the same elements as add_kernel
// and rms_norm_kernel, and each warp's 32 consecutive elements are one block quantized as
// quantize_q8_1_kernel does, so the bits are theirs. y may be a's or b's bytes: every read of a
// row is done before block_sum's barrier, every write of y after it.
__global__ void __launch_bounds__(256) add_rms_norm_kernel(const float* a, const float* b, int64_t dim,
                                                           float* sum, const float* __restrict__ w, float eps,
                                                           float* y, block_q8_1* yq) {
    pdl_begin();
    __shared__ float red[8];
    const int64_t row = (int64_t)blockIdx.x * dim;
    const float* x = b ? sum : a;
    float ss = 0.0f;
    for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) {
        float v = a[row + i];
        if (b) sum[row + i] = v = v + b[row + i];
        ss += v * v;
    }
    const float r = 1.0f / sqrtf(block_sum(ss, red) / (float)dim + eps);
    // dim is a multiple of 32 with yq: a warp's lanes are all in range or all out
    for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) {
        const float v = x[row + i] * r * (w ? w[i] : 1.0f);
        y[row + i] = v;
        if (yq) warp_quantize_q8_1(v, yq + (row + i) / 32);
    }
}

__global__ void __launch_bounds__(256) softmax_kernel(const float* __restrict__ x, int64_t dim, int64_t ldx, float sc,
                                                      float* y, int64_t ldy) {
    pdl_begin();
    __shared__ float red[8];
    const float* xr = x + blockIdx.x * ldx;
    float* yr = y + blockIdx.x * ldy;
    float mx = -INFINITY;
    for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) mx = fmaxf(mx, xr[i] * sc);
    mx = block_max(mx, red);
    float sum = 0.0f;
    for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) sum += expf(xr[i] * sc - mx);
    const float inv = 1.0f / block_sum(sum, red);
    for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) yr[i] = expf(xr[i] * sc - mx) * inv;
}

// ---- rope: one thread per rotated pair ------------------------------------------------------

// Entry j of a kernel parameter's pair, by a select (a dynamic index would copy the parameters
// to local memory).
template <typename T>
__device__ __forceinline__ T pick(const T (&a)[2], unsigned j) {
    return j ? a[1] : a[0];
}

// The angles' parameters of a rope, the yarn's corrected dims computed once on the host, as the
// CPU's table does.
RopeAngleParams rope_angle_params(const cpu::RopeParams& p) {
    RopeAngleParams a;
    a.n_rot = p.n_rot, a.freq_base = p.freq_base, a.freq_scale = p.freq_scale;
    a.yarn = rope_is_yarn(p.ext_factor, p.attn_factor), a.ext_factor = p.ext_factor, a.attn_factor = p.attn_factor;
    if (a.yarn) rope_yarn_corr_dims(p.n_rot, p.n_ctx_orig, p.freq_base, p.beta_fast, p.beta_slow, &a.corr_lo, &a.corr_hi);
    return a;
}

// The tensors one launch rotates (blockIdx.y picks one): q and k of a layer share the positions
// and the angles.
struct RopeJobs {
    float* x[2];
    int64_t n_head[2], ld_tok[2];
};

// Rotates pair i of the head at xh (a token at position `pos`).
__device__ __forceinline__ void rope_rotate(float* xh, int64_t i, int32_t pos, bool neox, const RopeAngleParams& a) {
    const int64_t half = a.n_rot / 2;
    float angle, mscale;
    rope_pair_angle(pos, (int)i, a, &angle, &mscale);
    // sincosf's huge-argument path needs a local-memory table; reduce to [-pi, pi] in double
    // (exact enough for any position) and use the fast intrinsic, accurate there to ~1e-6.
    const double theta = (double)angle;
    const float r = (float)(theta - rint(theta * 0.15915494309189535) * 6.283185307179586);
    float sn, cs;
    __sincosf(r, &sn, &cs);
    sn *= mscale, cs *= mscale;
    const int64_t i0 = neox ? i : 2 * i, i1 = neox ? i + half : 2 * i + 1;
    const float x0 = xh[i0], x1 = xh[i1];
    xh[i0] = x0 * cs - x1 * sn;
    xh[i1] = x0 * sn + x1 * cs;
}

__global__ void __launch_bounds__(256) rope_kernel(RopeJobs jobs, int64_t n_tok, int64_t head_dim,
                                                   const int32_t* __restrict__ pos, bool neox, RopeAngleParams a) {
    pdl_begin();
    float* x = pick(jobs.x, blockIdx.y);
    const int64_t n_head = pick(jobs.n_head, blockIdx.y), ld_tok = pick(jobs.ld_tok, blockIdx.y);
    const int64_t half = a.n_rot / 2;
    const int64_t k = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= n_tok * n_head * half) return;
    const int64_t i = k % half, th = k / half, h = th % n_head, t = th / n_head;
    rope_rotate(x + t * ld_tok + h * head_dim, i, pos[t], neox, a);
}

// ---- strided copies: row r of a [ne0, ne1, ne2, ne3] tensor at byte offset i1*nb1 + i2*nb2 + i3*nb3 --

struct Strides {
    int64_t ne1, ne2;
    size_t nb1, nb2, nb3;
};
__device__ __forceinline__ const float* strided_row(const float* base, const Strides& s, int64_t r) {
    const int64_t i1 = r % s.ne1, i2 = r / s.ne1 % s.ne2, i3 = r / (s.ne1 * s.ne2);
    return (const float*)((const char*)base + i1 * s.nb1 + i2 * s.nb2 + i3 * s.nb3);
}

// Rows in blockIdx.y steps (any count), elements in blockIdx.x * blockDim.x steps.
__global__ void __launch_bounds__(256) cont_kernel(const float* x, Strides sx, int64_t rows, int64_t ne0, float* out) {
    pdl_begin();
    for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
        const float* xr = strided_row(x, sx, r);
        for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < ne0; i += (int64_t)gridDim.x * blockDim.x)
            out[r * ne0 + i] = xr[i];
    }
}

__global__ void __launch_bounds__(256) concat_kernel(const float* a, Strides sa, int64_t a0, const float* b, Strides sb,
                                                     int64_t b0, int64_t rows, float* out) {
    pdl_begin();
    const int64_t w = a0 + b0;
    for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
        const float* ar = strided_row(a, sa, r);
        const float* br = strided_row(b, sb, r);
        for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < w; i += (int64_t)gridDim.x * blockDim.x)
            out[r * w + i] = i < a0 ? ar[i] : br[i - a0];
    }
}

__global__ void __launch_bounds__(256) swiglu_oai_kernel(const float* g, const float* u, int64_t n, float alpha,
                                                         float limit, float* out) {
    pdl_begin();
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        out[i] = stowlm::swiglu_oai(g[i], u[i], alpha, limit);
}

dim3 strided_grid(int64_t rows, int64_t width) {
    return dim3((unsigned)std::min<int64_t>(ceil_div(width, 256), 64), (unsigned)std::min<int64_t>(rows, 65535));
}

// ---- elementwise over n rows of dim ----------------------------------------------------------

enum class Ew { Add, Mul, SwiGLU, GeGLU };

template <Ew Op>
__global__ void __launch_bounds__(256) binary_kernel(const float* a, int64_t ld_a, const float* b, int64_t ld_b,
                                                     int64_t dim, float* out, int64_t ld_out) {
    pdl_begin();
    const int64_t r = blockIdx.y;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < dim; i += (int64_t)gridDim.x * blockDim.x) {
        const float x = a[r * ld_a + i], z = b[r * ld_b + i];
        float v;
        if constexpr (Op == Ew::Add) v = x + z;
        else if constexpr (Op == Ew::Mul) v = x * z;
        else if constexpr (Op == Ew::SwiGLU) v = silu(x) * z;
        else v = gelu_tanh(x) * z;
        out[r * ld_out + i] = v;
    }
}

template <bool Cap>
__global__ void __launch_bounds__(256) unary_kernel(float* x, int64_t dim, int64_t ldx, float c) {
    pdl_begin();
    const int64_t r = blockIdx.y;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < dim; i += (int64_t)gridDim.x * blockDim.x) {
        float& v = x[r * ldx + i];
        v = Cap ? apply_softcap(v, c) : v * c;
    }
}

__global__ void __launch_bounds__(256) f32_to_f16_kernel(const float* x, uint16_t* y, int64_t n) {
    pdl_begin();
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        y[i] = f32_to_fp16(x[i]);
}
__global__ void __launch_bounds__(256) f16_to_f32_kernel(const uint16_t* x, float* y, int64_t n) {
    pdl_begin();
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        y[i] = fp16_to_f32(x[i]);
}

// Row t of [n_head_kv * head_dim] floats into cell cells[t] (cells < 0 skipped): halves, or
// Q8_0 blocks made by the shared quantize_block_q8_0 (one thread per block, bit-identical to
// the CPU cache). Heads are contiguous in a cell, so block b of the row is block b of the cell.
// The caches one launch writes (blockIdx.z picks one): a layer's K and V go to the same cells.
// width: floats a row (F16) or Q8_0 blocks a row.
struct StoreJobs {
    const float* x[2];
    int64_t ld_x[2], width[2];
    uint8_t* cache[2];
    size_t cell_bytes[2];
};
// Job j's row t into its cell: the elements (F16) or blocks (Q8_0) first, first + step, ...
template <bool Q8>
__device__ __forceinline__ void store_row(const StoreJobs& jobs, unsigned j, int64_t t, const int32_t* __restrict__ cells,
                                          int64_t first, int64_t step) {
    const int32_t c = cells[t];
    if (c < 0) return;
    const int64_t width = pick(jobs.width, j);
    const float* x = pick(jobs.x, j) + t * pick(jobs.ld_x, j);
    uint8_t* cell = pick(jobs.cache, j) + (size_t)c * pick(jobs.cell_bytes, j);
    for (int64_t i = first; i < width; i += step) {
        if (Q8) quantize_block_q8_0(x + i * QK, (block_q8_0*)cell + i);
        else ((uint16_t*)cell)[i] = f32_to_fp16(x[i]);
    }
}
__global__ void __launch_bounds__(256) store_kv_f16_kernel(StoreJobs jobs, const int32_t* __restrict__ cells) {
    pdl_begin();
    store_row<false>(jobs, blockIdx.z, blockIdx.y, cells, (int64_t)blockIdx.x * blockDim.x + threadIdx.x,
                     (int64_t)gridDim.x * blockDim.x);
}
__global__ void __launch_bounds__(128) store_kv_q8_0_kernel(StoreJobs jobs, const int32_t* __restrict__ cells) {
    pdl_begin();
    store_row<true>(jobs, blockIdx.z, blockIdx.y, cells, (int64_t)blockIdx.x * blockDim.x + threadIdx.x,
                    (int64_t)gridDim.x * blockDim.x);
}

// rope_pair and then store_kv_pair of the rotated k and of v, one launch: block (t, 0) rotates
// token t's q, (t, 1) its k and then stores it, (t, 2) stores its v; the same arithmetic as the
// two kernels, so the same bits.
template <bool Q8>
__global__ void __launch_bounds__(256) rope_store_kernel(float* __restrict__ q, int64_t n_head_q, int64_t ld_q,
                                                         int64_t n_head_k, StoreJobs kv, int64_t head_dim,
                                                         const int32_t* __restrict__ pos, bool neox, RopeAngleParams a,
                                                         const int32_t* __restrict__ cells) {
    pdl_begin();
    const int64_t t = blockIdx.x, half = a.n_rot / 2;
    const unsigned job = blockIdx.y;
    if (job < 2) {
        float* x = job == 0 ? q + t * ld_q : (float*)kv.x[0] + t * kv.ld_x[0];
        const int64_t n = (job == 0 ? n_head_q : n_head_k) * half;
        for (int64_t k = threadIdx.x; k < n; k += blockDim.x) rope_rotate(x + (k / half) * head_dim, k % half, pos[t], neox, a);
        if (job == 0) return;
        __syncthreads();  // the whole rotated row before it is stored
    }
    store_row<Q8>(kv, job - 1, t, cells, threadIdx.x, blockDim.x);
}

dim3 rows_grid(int64_t n, int64_t dim) { return dim3((unsigned)std::min<int64_t>(ceil_div(dim, 256), 64), (unsigned)n); }

void check_rows(const char* op, int64_t n, int64_t dim) {
    if (n < 0 || dim < 0) throw InvalidInput(std::string(op) + ": negative size");
    if (n > 65535) throw InvalidInput(std::string(op) + ": " + std::to_string(n) + " rows exceed the 65535 per launch");
}

template <Ew Op>
void binary(const char* name, const float* a, int64_t ld_a, const float* b, int64_t ld_b, int64_t n, int64_t dim,
            float* out, int64_t ld_out, Stream s) {
    check_rows(name, n, dim);
    if (n == 0 || dim == 0) return;
    launch_pdl(binary_kernel<Op>, rows_grid(n, dim), 256, 0, (cudaStream_t)s, a, ld_a, b, ld_b, dim, out, ld_out);
    check_launch(name);
}

}  // namespace

void get_rows(const void* table, QType type, int64_t n_rows, int64_t n_cols, const int32_t* ids,
              const int32_t* ids_host, int64_t n_ids, float* out, int64_t ld_out, Stream s) {
    check_rows("get_rows", n_ids, n_cols);
    const size_t rb = row_bytes(type, n_cols);
    if (ids_host)
        for (int64_t i = 0; i < n_ids; i++)
            if (ids_host[i] < 0 || ids_host[i] >= n_rows)
                throw InvalidInput("get_rows: id " + std::to_string(ids_host[i]) + " (at index " + std::to_string(i) +
                                   ") is outside [0, " + std::to_string(n_rows) + ")");
    if (n_ids == 0 || n_cols == 0) return;
    const cudaStream_t st = (cudaStream_t)s;
    switch (type) {
#define STOWLM_CASE(T, Block, N, fn) \
    case QType::T: launch_get_rows<Block, N, fn>(table, rb, n_cols, ids, n_ids, out, ld_out, st); break;
        STOWLM_CASE(F32, float, 1, dequantize_block_f32)
        STOWLM_CASE(F16, uint16_t, 1, dequantize_block_f16)
        STOWLM_CASE(BF16, uint16_t, 1, dequantize_block_bf16)
        STOWLM_CASE(Q4_0, block_q4_0, QK, dequantize_block_q4_0)
        STOWLM_CASE(Q4_1, block_q4_1, QK, dequantize_block_q4_1)
        STOWLM_CASE(Q5_0, block_q5_0, QK, dequantize_block_q5_0)
        STOWLM_CASE(Q5_1, block_q5_1, QK, dequantize_block_q5_1)
        STOWLM_CASE(Q8_0, block_q8_0, QK, dequantize_block_q8_0)
        STOWLM_CASE(IQ4_NL, block_iq4_nl, QK, dequantize_block_iq4_nl)
        STOWLM_CASE(Q2_K, block_q2_K, QK_K, dequantize_block_q2_K)
        STOWLM_CASE(Q3_K, block_q3_K, QK_K, dequantize_block_q3_K)
        STOWLM_CASE(Q4_K, block_q4_K, QK_K, dequantize_block_q4_K)
        STOWLM_CASE(Q5_K, block_q5_K, QK_K, dequantize_block_q5_K)
        STOWLM_CASE(Q6_K, block_q6_K, QK_K, dequantize_block_q6_K)
        STOWLM_CASE(Q8_K, block_q8_K, QK_K, dequantize_block_q8_K)
        STOWLM_CASE(IQ4_XS, block_iq4_xs, QK_K, dequantize_block_iq4_xs)
        STOWLM_CASE(MXFP4, block_mxfp4, QK, dequantize_block_mxfp4)
        STOWLM_CASE(IQ2_XXS, block_iq2_xxs, QK_K, dequantize_block_iq2_xxs)
        STOWLM_CASE(IQ2_XS, block_iq2_xs, QK_K, dequantize_block_iq2_xs)
        STOWLM_CASE(IQ2_S, block_iq2_s, QK_K, dequantize_block_iq2_s)
        STOWLM_CASE(IQ3_XXS, block_iq3_xxs, QK_K, dequantize_block_iq3_xxs)
        STOWLM_CASE(IQ3_S, block_iq3_s, QK_K, dequantize_block_iq3_s)
        STOWLM_CASE(IQ1_S, block_iq1_s, QK_K, dequantize_block_iq1_s)
        STOWLM_CASE(IQ1_M, block_iq1_m, QK_K, dequantize_block_iq1_m)
#undef STOWLM_CASE
        default: throw InvalidInput(std::string("get_rows: type ") + qtype_name(type) + " cannot be decoded");
    }
    check_launch("get_rows_kernel");
}

void rms_norm(const float* x, int64_t n_rows, int64_t dim, int64_t ldx, const float* weight, float eps, float* y,
              int64_t ldy, Stream s) {
    if (n_rows < 0 || dim < 0) throw InvalidInput("rms_norm: negative size");
    if (n_rows == 0 || dim == 0) return;
    launch_pdl(rms_norm_kernel, (unsigned)n_rows, 256, 0, (cudaStream_t)s, x, dim, ldx, weight, eps, y, ldy);
    check_launch("rms_norm_kernel");
}

void add_rms_norm(const float* a, const float* b, int64_t n_rows, int64_t dim, float* sum, const float* weight,
                  float eps, float* y, void* yq, Stream s) {
    if (n_rows < 0 || dim < 0) throw InvalidInput("add_rms_norm: negative size");
    if (yq && dim % 32) throw InvalidInput("add_rms_norm: quantized rows need a multiple of 32 elements");
    if (b && !sum) throw InvalidInput("add_rms_norm: an add needs its sum's bytes");
    if (n_rows == 0 || dim == 0) return;
    launch_pdl(add_rms_norm_kernel, (unsigned)n_rows, 256, 0, (cudaStream_t)s, a, b, dim, sum, weight, eps, y,
               (block_q8_1*)yq);
    check_launch("add_rms_norm_kernel");
}

void softmax(const float* x, int64_t n, int64_t dim, int64_t ldx, float sc, float* y, int64_t ldy, Stream s) {
    if (n < 0 || dim < 0) throw InvalidInput("softmax: negative size");
    if (n == 0 || dim == 0) return;
    launch_pdl(softmax_kernel, (unsigned)n, 256, 0, (cudaStream_t)s, x, dim, ldx, sc, y, ldy);
    check_launch("softmax_kernel");
}

// rope() over one or two tensors of the same tokens, head width and positions, one launch.
// The pairs a launch rotates at most (threads), after the arguments' checks.
static int64_t rope_pairs(const RopeJobs& jobs, int n_jobs, int64_t n_tok, int64_t head_dim, const cpu::RopeParams& p) {
    int64_t n = 0;
    for (int j = 0; j < n_jobs; j++) {
        if (n_tok < 0 || jobs.n_head[j] < 0) throw InvalidInput("rope: negative size");
        n = std::max(n, n_tok * jobs.n_head[j] * (p.n_rot / 2));
    }
    if (p.n_rot <= 0 || p.n_rot % 2 != 0 || p.n_rot > head_dim)
        throw InvalidInput("rope: n_rot " + std::to_string(p.n_rot) + " must be even, > 0 and <= head_dim " +
                           std::to_string(head_dim));
    return n;
}
static void rope_jobs(const RopeJobs& jobs, int n_jobs, int64_t n_tok, int64_t head_dim, const int32_t* pos,
                      const cpu::RopeParams& p, Stream s) {
    const int64_t n = rope_pairs(jobs, n_jobs, n_tok, head_dim, p);
    if (n == 0) return;
    const RopeAngleParams a = rope_angle_params(p);
    launch_pdl(rope_kernel, dim3(ceil_div(n, 256), (unsigned)n_jobs), 256, 0, (cudaStream_t)s, jobs, n_tok, head_dim,
               pos, p.neox, a);
    check_launch("rope_kernel");
}

void rope(float* x, int64_t n_tok, int64_t n_head, int64_t head_dim, int64_t ld_tok, const int32_t* pos,
          const cpu::RopeParams& p, Stream s) {
    rope_jobs(RopeJobs{{x, nullptr}, {n_head, 0}, {ld_tok, 0}}, 1, n_tok, head_dim, pos, p, s);
}

void rope_pair(float* q, int64_t n_head_q, int64_t ld_q, float* k, int64_t n_head_k, int64_t ld_k, int64_t n_tok,
               int64_t head_dim, const int32_t* pos, const cpu::RopeParams& p, Stream s) {
    rope_jobs(RopeJobs{{q, k}, {n_head_q, n_head_k}, {ld_q, ld_k}}, 2, n_tok, head_dim, pos, p, s);
}

void cont(const float* x, const int64_t ne[4], const size_t nb[4], float* out, Stream s) {
    const int64_t rows = ne[1] * ne[2] * ne[3];
    if (ne[0] < 0 || rows < 0) throw InvalidInput("cont: negative size");
    if (nb[0] != sizeof(float)) throw InvalidInput("cont: rows must be contiguous (nb[0] = 4)");
    if (rows == 0 || ne[0] == 0) return;
    launch_pdl(cont_kernel, strided_grid(rows, ne[0]), 256, 0, (cudaStream_t)s, x,
               Strides{ne[1], ne[2], nb[1], nb[2], nb[3]}, rows, ne[0], out);
    check_launch("cont_kernel");
}

void concat(const float* a, const int64_t a_ne[4], const size_t a_nb[4], const float* b, int64_t b_ne0,
            const size_t b_nb[4], float* out, Stream s) {
    const int64_t rows = a_ne[1] * a_ne[2] * a_ne[3];
    if (a_ne[0] < 0 || b_ne0 < 0 || rows < 0) throw InvalidInput("concat: negative size");
    if (a_nb[0] != sizeof(float) || b_nb[0] != sizeof(float)) throw InvalidInput("concat: rows must be contiguous");
    if (rows == 0 || a_ne[0] + b_ne0 == 0) return;
    launch_pdl(concat_kernel, strided_grid(rows, a_ne[0] + b_ne0), 256, 0, (cudaStream_t)s, a,
               Strides{a_ne[1], a_ne[2], a_nb[1], a_nb[2], a_nb[3]}, a_ne[0], b,
               Strides{a_ne[1], a_ne[2], b_nb[1], b_nb[2], b_nb[3]}, b_ne0, rows, out);
    check_launch("concat_kernel");
}

void swiglu_oai(const float* gate, const float* up, int64_t n, float alpha, float limit, float* out, Stream s) {
    if (n < 0) throw InvalidInput("swiglu_oai: negative size");
    if (n == 0) return;
    launch_pdl(swiglu_oai_kernel, (unsigned)std::min<int64_t>(ceil_div(n, 256), 4096), 256, 0, (cudaStream_t)s, gate,
               up, n, alpha, limit, out);
    check_launch("swiglu_oai_kernel");
}

void swiglu(const float* gate, int64_t ld_gate, const float* up, int64_t ld_up, int64_t n, int64_t dim, float* out,
            int64_t ld_out, Stream s) {
    binary<Ew::SwiGLU>("swiglu", gate, ld_gate, up, ld_up, n, dim, out, ld_out, s);
}
void geglu(const float* gate, int64_t ld_gate, const float* up, int64_t ld_up, int64_t n, int64_t dim, float* out,
           int64_t ld_out, Stream s) {
    binary<Ew::GeGLU>("geglu", gate, ld_gate, up, ld_up, n, dim, out, ld_out, s);
}
void add(const float* a, int64_t ld_a, const float* b, int64_t ld_b, int64_t n, int64_t dim, float* out,
         int64_t ld_out, Stream s) {
    binary<Ew::Add>("add", a, ld_a, b, ld_b, n, dim, out, ld_out, s);
}
void mul(const float* a, int64_t ld_a, const float* b, int64_t ld_b, int64_t n, int64_t dim, float* out,
         int64_t ld_out, Stream s) {
    binary<Ew::Mul>("mul", a, ld_a, b, ld_b, n, dim, out, ld_out, s);
}

void scale(float* x, int64_t n, int64_t dim, int64_t ldx, float sc, Stream s) {
    check_rows("scale", n, dim);
    if (n == 0 || dim == 0) return;
    launch_pdl(unary_kernel<false>, rows_grid(n, dim), 256, 0, (cudaStream_t)s, x, dim, ldx, sc);
    check_launch("scale");
}
void softcap(float* x, int64_t n, int64_t dim, int64_t ldx, float cap, Stream s) {
    check_rows("softcap", n, dim);
    if (!(cap > 0.0f)) throw InvalidInput("softcap: cap must be > 0");
    if (n == 0 || dim == 0) return;
    launch_pdl(unary_kernel<true>, rows_grid(n, dim), 256, 0, (cudaStream_t)s, x, dim, ldx, cap);
    check_launch("softcap");
}

void f32_to_f16(const float* x, uint16_t* y, int64_t n, Stream s) {
    if (n <= 0) return;
    launch_pdl(f32_to_f16_kernel, (unsigned)std::min<int64_t>(ceil_div(n, 256), 4096), 256, 0, (cudaStream_t)s, x, y, n);
    check_launch("f32_to_f16");
}
void f16_to_f32(const uint16_t* x, float* y, int64_t n, Stream s) {
    if (n <= 0) return;
    launch_pdl(f16_to_f32_kernel, (unsigned)std::min<int64_t>(ceil_div(n, 256), 4096), 256, 0, (cudaStream_t)s, x, y, n);
    check_launch("f16_to_f32");
}

void copy_rows(const void* src, size_t ld_src_bytes, void* dst, size_t ld_dst_bytes, int64_t n, size_t bytes,
               Stream s) {
    if (n <= 0 || bytes == 0) return;
    check_cuda(cudaMemcpy2DAsync(dst, ld_dst_bytes, src, ld_src_bytes, bytes, (size_t)n, cudaMemcpyDeviceToDevice,
                                 (cudaStream_t)s),
               "copy_rows");
}

// The jobs of store_kv() of one or two row sets, after the arguments' checks; widest: the most
// elements (F16) or blocks (Q8_0) of a row.
static StoreJobs store_jobs(const KvRows* rows, int n_jobs, int64_t n_tok, QType kv_type, int64_t& widest) {
    if (kv_type != QType::F16 && kv_type != QType::Q8_0)
        throw InvalidInput(std::string("cuda store_kv: kv_type ") + qtype_name(kv_type) + " is not F16 or Q8_0");
    StoreJobs jobs{};
    widest = 0;
    for (int j = 0; j < n_jobs; j++) {
        const KvRows& r = rows[j];
        check_rows("store_kv", n_tok, r.head_dim);
        const size_t rb = row_bytes(kv_type, r.head_dim);
        if (r.cell_bytes < (size_t)r.n_head_kv * rb)
            throw InvalidInput("cuda store_kv: kv_cell_bytes " + std::to_string(r.cell_bytes) +
                               " < n_head_kv * row bytes " + std::to_string((size_t)r.n_head_kv * rb));
        const int64_t width = r.n_head_kv * r.head_dim;
        jobs.x[j] = r.x, jobs.ld_x[j] = r.ld_x, jobs.cache[j] = (uint8_t*)r.cache, jobs.cell_bytes[j] = r.cell_bytes;
        jobs.width[j] = kv_type == QType::F16 ? width : width / QK;
        widest = std::max(widest, jobs.width[j]);
    }
    return jobs;
}

// store_kv() of one or two row sets into their caches at the same cells, one launch.
static void store_kv_jobs(const KvRows* rows, int n_jobs, int64_t n_tok, QType kv_type, const int32_t* cells,
                          Stream s) {
    int64_t widest;
    const StoreJobs jobs = store_jobs(rows, n_jobs, n_tok, kv_type, widest);
    if (n_tok == 0 || widest == 0) return;
    if (kv_type == QType::F16) {
        const dim3 grid((unsigned)std::min<int64_t>(ceil_div(widest, 256), 64), (unsigned)n_tok, (unsigned)n_jobs);
        launch_pdl(store_kv_f16_kernel, grid, 256, 0, (cudaStream_t)s, jobs, cells);
    } else {
        const dim3 grid((unsigned)std::min<int64_t>(ceil_div(widest, 128), 64), (unsigned)n_tok, (unsigned)n_jobs);
        launch_pdl(store_kv_q8_0_kernel, grid, 128, 0, (cudaStream_t)s, jobs, cells);
    }
    check_launch("store_kv");
}

void store_kv(const float* x, int64_t n_tok, int64_t ld_x, int64_t n_head_kv, int64_t head_dim, QType kv_type,
              void* cache, size_t kv_cell_bytes, const int32_t* dst_cells, Stream s) {
    const KvRows r{x, ld_x, n_head_kv, head_dim, cache, kv_cell_bytes};
    store_kv_jobs(&r, 1, n_tok, kv_type, dst_cells, s);
}

void store_kv_pair(const KvRows& k, const KvRows& v, int64_t n_tok, QType kv_type, const int32_t* dst_cells,
                   Stream s) {
    const KvRows rows[2] = {k, v};
    store_kv_jobs(rows, 2, n_tok, kv_type, dst_cells, s);
}

void rope_store(float* q, int64_t n_head_q, int64_t ld_q, const KvRows& k, const KvRows& v, int64_t n_tok,
                const int32_t* pos, const cpu::RopeParams& p, QType kv_type, const int32_t* dst_cells, Stream s) {
    const int64_t head_dim = k.head_dim;
    const int64_t pairs = rope_pairs(RopeJobs{{q, (float*)k.x}, {n_head_q, k.n_head_kv}, {ld_q, k.ld_x}}, 2, n_tok, head_dim, p);
    const KvRows rows[2] = {k, v};
    int64_t widest;
    const StoreJobs jobs = store_jobs(rows, 2, n_tok, kv_type, widest);
    if (n_tok == 0 || (pairs == 0 && widest == 0)) return;
    const RopeAngleParams a = rope_angle_params(p);
    auto kernel = kv_type == QType::Q8_0 ? rope_store_kernel<true> : rope_store_kernel<false>;
    launch_pdl(kernel, dim3((unsigned)n_tok, 3), 256, 0, (cudaStream_t)s, q, n_head_q, ld_q, k.n_head_kv, jobs,
               head_dim, pos, p.neox, a, dst_cells);
    check_launch("rope_store_kernel");
}

}  // namespace stowlm::cuda
