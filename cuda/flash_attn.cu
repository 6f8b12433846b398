// Flash attention over F16 or Q8_0 KV cells, same semantics as cpu::flash_attn: cells visible by
// their positions (attn_visibility.h), optional softcap, GQA, online softmax (attn_math.h).
// One block of 4 warps per (query token, head) and KV split; each warp walks every 4th cell
// of the split with its own (m, l, acc), lanes holding head_dim/32 elements each; the warps'
// states are merged in shared memory. With n_split > 1 (decoding long contexts) each split
// writes its unnormalized (m, l, acc) and a second kernel merges the splits in order.
#include "attn_visibility.h"
#include "cpu/attn_math.h"
#include "cuda_backend.h"
#include "cuda_common.cuh"

namespace stowlm::cuda {

constexpr int kFaWarps = 4;
constexpr int kFaMaxDim = kFlashAttnMaxHeadDim;
constexpr int kFaPerLane = kFaMaxDim / 32;

struct FaArgs {
    const float* q;
    int64_t n_tok, n_head, ld_q;
    const uint8_t* k;
    const uint8_t* v;
    int64_t n_kv, n_head_kv;
    size_t cell_bytes;
    size_t head_bytes;  // row_bytes(kv_type, head_dim)
    int head_dim;
    const int32_t* q_pos;
    const int32_t* kv_pos;
    float scale, softcap;
    int32_t window;
    bool causal;
    float* out;
    int64_t ld_out;
    int n_split;
    float* partial;  // [n_tok * n_head][n_split][head_dim + 2]: m, l, acc
};

// Element d of a K or V head row. Q8_0: element lane + 32*i is value `lane` of block i.
template <QType KV>
__device__ __forceinline__ float kv_value(const uint8_t* row, int d) {
    if constexpr (KV == QType::F16) {
        return fp16_to_f32(((const uint16_t*)row)[d]);
    } else {
        const block_q8_0* b = (const block_q8_0*)row + (d >> 5);
        return fp16_to_f32(b->d) * (float)b->qs[d & 31];
    }
}

template <QType KV>
__global__ void __launch_bounds__(kFaWarps * 32, 1) flash_attn_kernel(FaArgs a) {
    __shared__ float sm_m[kFaWarps], sm_l[kFaWarps];
    __shared__ float sm_acc[kFaWarps][kFaMaxDim];
    const int64_t qi = blockIdx.x;  // t * n_head + h
    const int64_t t = qi / a.n_head, h = qi % a.n_head;
    const int64_t kvh = h / (a.n_head / a.n_head_kv);
    const int warp = threadIdx.x / 32, lane = threadIdx.x & 31, D = a.head_dim;
    const int64_t chunk = (a.n_kv + a.n_split - 1) / a.n_split;
    const int64_t j0 = (int64_t)blockIdx.y * chunk, j1 = min(a.n_kv, j0 + chunk);
    const int32_t qp = a.q_pos[t];

    float qv[kFaPerLane], acc[kFaPerLane];
    const float* qrow = a.q + t * a.ld_q + h * D;
#pragma unroll
    for (int i = 0; i < kFaPerLane; i++) {
        const int d = lane + 32 * i;
        qv[i] = d < D ? qrow[d] : 0.0f;
        acc[i] = 0.0f;
    }
    float m = -INFINITY, l = 0.0f;
    const size_t head_off = (size_t)kvh * a.head_bytes;
    for (int64_t j = j0 + warp; j < j1; j += kFaWarps) {
        if (!kv_visible(qp, a.kv_pos[j], a.causal, a.window)) continue;  // uniform over the warp
        const uint8_t* kr = a.k + (size_t)j * a.cell_bytes + head_off;
        float s = 0.0f;
#pragma unroll
        for (int i = 0; i < kFaPerLane; i++) {
            const int d = lane + 32 * i;
            if (d < D) s += qv[i] * kv_value<KV>(kr, d);
        }
        // lane 0's sum for everyone, so every lane updates (m, l) identically
        s = __shfl_sync(0xffffffffu, warp_sum(s), 0) * a.scale;
        if (a.softcap > 0.0f) s = apply_softcap(s, a.softcap);
        float f;
        const float p = online_softmax_update(m, l, s, &f);
        const uint8_t* vr = a.v + (size_t)j * a.cell_bytes + head_off;
#pragma unroll
        for (int i = 0; i < kFaPerLane; i++) {
            const int d = lane + 32 * i;
            if (d < D) acc[i] = acc[i] * f + p * kv_value<KV>(vr, d);
        }
    }
    if (lane == 0) sm_m[warp] = m, sm_l[warp] = l;
#pragma unroll
    for (int i = 0; i < kFaPerLane; i++)
        if (lane + 32 * i < D) sm_acc[warp][lane + 32 * i] = acc[i];
    __syncthreads();

    float M = -INFINITY, L = 0.0f, fs[kFaWarps];
#pragma unroll
    for (int w = 0; w < kFaWarps; w++) {
        float fa, fb;
        online_softmax_merge(M, L, sm_m[w], sm_l[w], &fa, &fb);
        for (int u = 0; u < w; u++) fs[u] *= fa;
        fs[w] = fb;
    }
    if (a.n_split == 1) {
        float* o = a.out + t * a.ld_out + h * D;
        const float inv = L > 0.0f ? 1.0f / L : 0.0f;
        for (int d = threadIdx.x; d < D; d += blockDim.x) {
            float r = 0.0f;
#pragma unroll
            for (int w = 0; w < kFaWarps; w++) r += fs[w] * sm_acc[w][d];
            o[d] = r * inv;
        }
    } else {
        float* part = a.partial + ((size_t)qi * a.n_split + blockIdx.y) * (size_t)(D + 2);
        if (threadIdx.x == 0) part[0] = M, part[1] = L;
        for (int d = threadIdx.x; d < D; d += blockDim.x) {
            float r = 0.0f;
#pragma unroll
            for (int w = 0; w < kFaWarps; w++) r += fs[w] * sm_acc[w][d];
            part[2 + d] = r;
        }
    }
}

// Merges the n_split partials of one (token, head) in split order.
__global__ void __launch_bounds__(128) flash_attn_combine_kernel(const float* __restrict__ partial, int n_split,
                                                                 int64_t n_head, int head_dim, float* __restrict__ out,
                                                                 int64_t ld_out) {
    const int64_t qi = blockIdx.x, t = qi / n_head, h = qi % n_head;
    const float* base = partial + (size_t)qi * n_split * (size_t)(head_dim + 2);
    float* o = out + t * ld_out + h * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float M = -INFINITY, L = 0.0f, A = 0.0f;
        for (int s = 0; s < n_split; s++) {
            const float* p = base + (size_t)s * (head_dim + 2);
            float fa, fb;
            online_softmax_merge(M, L, p[0], p[1], &fa, &fb);
            A = A * fa + p[2 + d] * fb;
        }
        o[d] = L > 0.0f ? A / L : 0.0f;
    }
}

void flash_attn(const float* q, int64_t n_tok, int64_t n_head, int64_t ld_q, const void* k, const void* v,
                QType kv_type, int64_t n_kv, int64_t n_head_kv, size_t kv_cell_bytes, int64_t head_dim,
                const int32_t* q_pos, const int32_t* kv_pos, const cpu::AttnParams& p, float* out, int64_t ld_out,
                int n_split, void* scratch, Stream s) {
    if (kv_type != QType::F16 && kv_type != QType::Q8_0)
        throw InvalidInput(std::string("cuda flash_attn: kv_type ") + qtype_name(kv_type) + " is not F16 or Q8_0");
    if (head_dim <= 0 || head_dim > kFaMaxDim)
        throw InvalidInput("cuda flash_attn: head_dim " + std::to_string(head_dim) + " outside 1.." + std::to_string(kFaMaxDim));
    if (n_head_kv <= 0 || n_head % n_head_kv)
        throw InvalidInput("cuda flash_attn: n_head " + std::to_string(n_head) + " is not a multiple of n_head_kv " +
                           std::to_string(n_head_kv));
    const size_t head_bytes = row_bytes(kv_type, head_dim);  // throws for Q8_0 with head_dim % 32
    if (kv_cell_bytes < (size_t)n_head_kv * head_bytes)
        throw InvalidInput("cuda flash_attn: kv_cell_bytes " + std::to_string(kv_cell_bytes) + " < n_head_kv * row bytes " +
                           std::to_string((size_t)n_head_kv * head_bytes));
    if (p.window < 0) throw InvalidInput("cuda flash_attn: window must be >= 0");
    if (n_split < 1 || n_split > 1024) throw InvalidInput("cuda flash_attn: n_split must be in 1..1024");
    if (ld_q < n_head * head_dim || ld_out < n_head * head_dim) throw InvalidInput("cuda flash_attn: ld_q/ld_out < n_head*head_dim");
    if (n_split > 1 && scratch == nullptr) throw InvalidInput("cuda flash_attn: n_split > 1 needs scratch");
    if (n_tok == 0 || n_head == 0) return;
    FaArgs a{q, n_tok, n_head, ld_q, (const uint8_t*)k, (const uint8_t*)v, n_kv, n_head_kv, kv_cell_bytes,
             head_bytes, (int)head_dim, q_pos, kv_pos, p.scale, p.softcap, p.window, p.causal, out, ld_out, n_split,
             (float*)scratch};
    const dim3 grid((unsigned)(n_tok * n_head), (unsigned)n_split);
    if (kv_type == QType::F16)
        flash_attn_kernel<QType::F16><<<grid, kFaWarps * 32, 0, (cudaStream_t)s>>>(a);
    else
        flash_attn_kernel<QType::Q8_0><<<grid, kFaWarps * 32, 0, (cudaStream_t)s>>>(a);
    check_launch("flash_attn_kernel");
    if (n_split > 1) {
        flash_attn_combine_kernel<<<(unsigned)(n_tok * n_head), 128, 0, (cudaStream_t)s>>>(
            (const float*)scratch, n_split, n_head, (int)head_dim, out, ld_out);
        check_launch("flash_attn_combine_kernel");
    }
}

}  // namespace stowlm::cuda
