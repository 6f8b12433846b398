// Mixture-of-experts on the device: the router's top-k (the HOST_DEVICE moe_router.h, one
// thread per token; also split into the graph's TOP_K and MOE_WEIGHTS ops, moe_select.h, with
// router biases, sigmoid gates, expert groups and a softmax over the picked), the experts'
// biases (ADD_ID), a counting sort of the (token, expert) slots by expert, and the expert
// products as ONE grouped launch of the vector kernels (mmvq.cu) with blockIdx.y = expert, each
// expert's block walking only the slots routed to it.
#include "cuda_backend.h"
#include "cuda_common.cuh"
#include "moe_router.h"
#include "moe_select.h"

namespace stowlm::cuda {

namespace {

__global__ void __launch_bounds__(128) router_kernel(const float* __restrict__ logits, int64_t n_tok, int n_expert,
                                                     RouterParams p, int32_t* ids, float* w) {
    pdl_begin();
    const int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= n_tok) return;
    router_topk(logits + t * n_expert, n_expert, p, ids + t * p.k, w + t * p.k);
}

static_assert(kGateSoftmax == (int)cpu::Gating::Softmax && kGateSigmoid == (int)cpu::Gating::Sigmoid &&
                  kGateSoftmaxSelected == (int)cpu::Gating::SoftmaxSelected,
              "moe_select.h's gating values differ from cpu::Gating");

// The plain selection (raw logits): one thread per row.
__global__ void __launch_bounds__(128) top_k_kernel(const float* __restrict__ x, int64_t n_rows, int64_t ldx,
                                                    ExpertSelect p, int32_t* ids) {
    pdl_begin();
    const int64_t r = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= n_rows) return;
    router_top_ids(x + r * ldx, p.n, p.k, ids + r * p.k);
}

// The router's plain top-k and the weights of the picked (the MOE_WEIGHTS op after it) in one
// thread per row: the two kernels' HOST_DEVICE calls in the same order, so their bits.
__global__ void __launch_bounds__(128) top_k_weights_kernel(const float* __restrict__ x, int64_t n_rows, int64_t ldx,
                                                            ExpertSelect p, int32_t* ids,
                                                            const float* __restrict__ logits, int n_expert,
                                                            int gating, bool normalize, float scale, float* w) {
    pdl_begin();
    const int64_t r = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= n_rows) return;
    router_top_ids(x + r * ldx, p.n, p.k, ids + r * p.k);
    moe_gate_weights_any(logits + r * n_expert, n_expert, ids + r * p.k, p.k, gating, normalize, scale, w + r * p.k);
}

// Whether candidate (oi, ov) ranks above (bi, bv) in router_argmax's order: any number above NaN,
// the larger first, the lower id on ties; id -1 is no candidate.
__device__ __forceinline__ bool ranks_above(int oi, float ov, int bi, float bv) {
    if (oi < 0) return false;
    if (bi < 0) return true;
    const bool on = ov == ov, bn = bv == bv;
    if (on != bn) return on;
    if (on && ov != bv) return ov > bv;
    return oi < bi;
}

// top_k_weights_kernel's picks and weights with a warp per row (rows of at most
// kWarpTopKMaxN experts, k <= 32): each pick is the warp's best of its lanes' bests in
// router_argmax's order (so the same ids); softmax terms computed by the lanes, each as
// moe_gate_weights computes it, and summed in its order by lane 0 (so the same bits).
constexpr int kWarpTopKMaxN = 1024, kWarpTopKMaxK = 32;
__global__ void __launch_bounds__(32) top_k_weights_warp_kernel(const float* __restrict__ x, int64_t ldx, ExpertSelect p,
                                                                int32_t* ids, const float* __restrict__ logits,
                                                                int n_expert, int gating, bool normalize, float scale,
                                                                float* w) {
    pdl_begin();
    extern __shared__ double terms[];  // [n_expert]
    __shared__ int picked[kWarpTopKMaxK];
    const int64_t r = blockIdx.x;
    const int lane = threadIdx.x;
    const float* xr = x + r * ldx;
    uint32_t taken = 0;  // bit i: element lane + 32 i is picked
    for (int j = 0; j < p.k; j++) {
        int bi = -1;
        float bv = 0.0f;
        for (int i = 0, e = lane; e < p.n; i++, e += 32) {
            if (taken >> i & 1) continue;
            const float v = xr[e];
            if (bi < 0 || v > bv || (bv != bv && v == v)) bi = e, bv = v;
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            if (ranks_above(oi, ov, bi, bv)) bi = oi, bv = ov;
        }
        if (bi % 32 == lane) taken |= 1u << (bi / 32);
        if (lane == 0) picked[j] = bi;
    }
    __syncwarp();
    for (int j = lane; j < p.k; j += 32) ids[r * p.k + j] = picked[j];
    const float* lr = logits + r * n_expert;
    float* wr = w + r * p.k;
    if (gating != kGateSoftmax) {  // k terms only (a sigmoid each, or a softmax over the picked)
        if (lane == 0) moe_gate_weights_any(lr, n_expert, picked, p.k, gating, normalize, scale, wr);
        return;
    }
    float mx = -INFINITY;
    for (int e = lane; e < n_expert; e += 32) mx = e == lane ? lr[e] : fmaxf(mx, lr[e]);
    if (lane >= n_expert) mx = NAN;  // no element: fmaxf ignores it
    mx = warp_max(mx);
    for (int e = lane; e < n_expert; e += 32) terms[e] = moe_softmax_term(lr[e], mx);
    __syncwarp();
    if (lane != 0) return;
    double denom = 0.0;
    for (int e = 0; e < n_expert; e++) denom += terms[e];
    for (int j = 0; j < p.k; j++) wr[j] = (float)(terms[picked[j]] / denom);
    moe_gate_finish(wr, p.k, normalize, scale);
}

// Gated / biased / grouped selection: one warp per row; the lanes write the scores to shared
// memory, lane 0 picks.
__global__ void __launch_bounds__(32) top_k_scored_kernel(const float* __restrict__ x, int64_t ldx, ExpertSelect p,
                                                          int32_t* ids) {
    pdl_begin();
    extern __shared__ float score[];
    const int64_t r = blockIdx.x;
    const float* xr = x + r * ldx;
    for (int e = threadIdx.x; e < p.n; e += 32) score[e] = expert_score(xr, p, e);
    __syncwarp();
    if (threadIdx.x == 0) expert_select_scored(score, p, ids + r * p.k);
}

__global__ void __launch_bounds__(128) moe_weights_kernel(const float* __restrict__ logits, int64_t n_tok, int n_expert,
                                                          const int32_t* __restrict__ ids, int k, int gating,
                                                          bool normalize, float scale, float* w) {
    pdl_begin();
    const int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= n_tok) return;
    moe_gate_weights_any(logits + t * n_expert, n_expert, ids + t * k, k, gating, normalize, scale, w + t * k);
}

// Slot i (blockIdx.y steps) of x [n_slots][d] gets its expert's bias row.
__global__ void __launch_bounds__(256) add_id_kernel(float* x, const float* __restrict__ bias, int64_t n_expert,
                                                     const int32_t* __restrict__ ids, int64_t n_slots, int64_t d) {
    pdl_begin();
    for (int64_t r = blockIdx.y; r < n_slots; r += gridDim.y) {
        const int32_t e = ids[r];
        if (e < 0 || e >= n_expert) continue;
        for (int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; c < d; c += (int64_t)gridDim.x * blockDim.x)
            x[r * d + c] += bias[e * d + c];
    }
}

__global__ void __launch_bounds__(256) moe_count_kernel(const int32_t* __restrict__ ids, int64_t n_slots, int n_expert,
                                                        int32_t* counts) {
    pdl_begin();
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n_slots) return;
    const int32_t e = ids[i];
    if (e >= 0 && e < n_expert) atomicAdd(&counts[e], 1);
}

// Exclusive prefix sum of the counts (n_expert is small: one thread does it).
__global__ void moe_scan_kernel(const int32_t* counts, int n_expert, int32_t* off, int32_t* cursor) {
    pdl_begin();
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    int32_t acc = 0;
    for (int e = 0; e < n_expert; e++) {
        off[e] = acc;
        cursor[e] = acc;
        acc += counts[e];
    }
    off[n_expert] = acc;
}

// Slots whose id is outside [0, n_expert) (tensor parallelism: -1, the expert is on another
// shard) get a zero output row, as the CPU's mul_mat_id gives them: a warp writes each of its
// unrouted slots' rows together (no work when every slot is routed).
__global__ void __launch_bounds__(256) moe_scatter_kernel(const int32_t* __restrict__ ids, int64_t n_slots, int k,
                                                          int n_expert, bool per_slot_input, int32_t* cursor,
                                                          int32_t* act_row, int32_t* out_row, float* y, int64_t ldy,
                                                          int64_t rows) {
    pdl_begin();
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const int32_t e = i < n_slots ? ids[i] : 0;
    const bool routed = i < n_slots && e >= 0 && e < n_expert;
    unsigned unrouted = __ballot_sync(0xffffffffu, i < n_slots && !routed);
    const int lane = threadIdx.x & 31;
    while (unrouted) {
        const int l = __ffs(unrouted) - 1;
        unrouted &= unrouted - 1;
        float* row = y + (i - lane + l) * ldy;
        for (int64_t r = lane; r < rows; r += 32) row[r] = 0.0f;
    }
    if (!routed) return;
    const int32_t pos = atomicAdd(&cursor[e], 1);
    act_row[pos] = (int32_t)(per_slot_input ? i : i / k);
    out_row[pos] = (int32_t)i;
}

__global__ void __launch_bounds__(256) moe_combine_kernel(const float* __restrict__ y, int64_t ldy,
                                                          const float* __restrict__ w, int k, int64_t dim,
                                                          float* out, int64_t ld_out) {
    pdl_begin();
    const int64_t t = blockIdx.y;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < dim; i += (int64_t)gridDim.x * blockDim.x) {
        float s = 0.0f;
        for (int j = 0; j < k; j++) s += w[t * k + j] * y[(t * k + j) * ldy + i];
        out[t * ld_out + i] = s;
    }
}

size_t align256(size_t n) { return (n + 255) & ~(size_t)255; }

struct MoeScratch {
    int32_t *counts, *off, *cursor, *act_row, *out_row;
    void* xq;
};

MoeScratch moe_layout(void* base, int n_expert, int64_t n_slots) {
    uint8_t* p = (uint8_t*)base;
    MoeScratch s;
    s.counts = (int32_t*)p;
    s.off = s.counts + n_expert;
    s.cursor = s.off + n_expert + 1;
    s.act_row = s.cursor + n_expert;
    s.out_row = s.act_row + n_slots;
    s.xq = p + align256(sizeof(int32_t) * (size_t)(3 * n_expert + 1 + 2 * n_slots));
    return s;
}

}  // namespace

void router_topk(const float* logits, int64_t n_tok, int n_expert, const RouterParams& p, int32_t* ids,
                 float* weights, Stream s) {
    if (n_expert <= 0 || n_expert > 256) throw InvalidInput("router_topk: n_expert " + std::to_string(n_expert) + " outside 1..256");
    if (p.k <= 0 || p.k > n_expert) throw InvalidInput("router_topk: k=" + std::to_string(p.k) + " outside 1..n_expert");
    if (n_tok <= 0) return;
    launch_pdl(router_kernel, ceil_div(n_tok, 128), 128, 0, (cudaStream_t)s, logits, n_tok, n_expert, p, ids, weights);
    check_launch("router_kernel");
}

void top_k(const float* x, int64_t n_rows, int64_t n, int64_t ldx, const cpu::TopKParams& p, int32_t* ids, Stream s) {
    if (n <= 0 || n > (1 << 20)) throw InvalidInput("cuda top_k: row length " + std::to_string(n) + " outside 1..2^20");
    if (p.k < 1 || p.k > n) throw InvalidInput("cuda top_k: k=" + std::to_string(p.k) + " outside 1..n");
    if (ldx < n) throw InvalidInput("cuda top_k: ldx < n");
    const bool grouped = p.n_groups > 1;
    if (grouped && (n % p.n_groups || p.n_group_used < 1 || p.n_group_used > p.n_groups ||
                    p.k > n / p.n_groups * p.n_group_used))
        throw InvalidInput("cuda top_k: the groups must divide the experts and the kept groups hold at least k");
    if (grouped && p.n_groups > kMaxExpertGroups)
        throw InvalidInput("cuda top_k: " + std::to_string(p.n_groups) + " expert groups, the kernel takes at most " +
                           std::to_string(kMaxExpertGroups));
    if (n_rows <= 0) return;
    const ExpertSelect e = expert_select_of(n, p);
    if (expert_select_plain(e)) {
        launch_pdl(top_k_kernel, ceil_div(n_rows, 128), 128, 0, (cudaStream_t)s, x, n_rows, ldx, e, ids);
        check_launch("top_k_kernel");
        return;
    }
    if (n > kTopKMaxScored)
        throw InvalidInput("cuda top_k: " + std::to_string(n) + " experts with gated, biased or grouped scores, the "
                           "kernel takes at most " + std::to_string(kTopKMaxScored));
    if (n_rows > 0x7fffffff) throw InvalidInput("cuda top_k: too many rows");
    launch_pdl(top_k_scored_kernel, (unsigned)n_rows, 32, (size_t)n * sizeof(float), (cudaStream_t)s, x, ldx, e, ids);
    check_launch("top_k_scored_kernel");
}

void top_k_weights(const float* x, int64_t n_rows, int64_t n, int64_t ldx, const cpu::TopKParams& p, int32_t* ids,
                   const float* logits, cpu::Gating gating, bool normalize, float scale, float* w, Stream s) {
    if (n <= 0 || n > (1 << 20)) throw InvalidInput("cuda top_k_weights: row length " + std::to_string(n) + " outside 1..2^20");
    if (p.k < 1 || p.k > n) throw InvalidInput("cuda top_k_weights: k=" + std::to_string(p.k) + " outside 1..n");
    if (ldx < n) throw InvalidInput("cuda top_k_weights: ldx < n");
    if (!top_k_is_plain(n, p)) throw InvalidInput("cuda top_k_weights: only the plain selection (top_k otherwise)");
    if (n_rows <= 0) return;
    const ExpertSelect e = expert_select_of(n, p);
    if (n <= kWarpTopKMaxN && p.k <= kWarpTopKMaxK && n_rows <= 0x7fffffff) {
        launch_pdl(top_k_weights_warp_kernel, (unsigned)n_rows, 32, (size_t)n * sizeof(double), (cudaStream_t)s, x, ldx,
                   e, ids, logits, (int)n, (int)gating, normalize, scale, w);
        check_launch("top_k_weights_warp_kernel");
        return;
    }
    launch_pdl(top_k_weights_kernel, ceil_div(n_rows, 128), 128, 0, (cudaStream_t)s, x, n_rows, ldx, e, ids, logits,
               (int)n, (int)gating, normalize, scale, w);
    check_launch("top_k_weights_kernel");
}

void moe_weights(const float* logits, int64_t n_tok, int64_t n_expert, const int32_t* ids, int64_t k,
                 cpu::Gating gating, bool normalize, float scale, float* w, Stream s) {
    if (n_expert <= 0 || n_expert > (1 << 20))
        throw InvalidInput("cuda moe_weights: n_expert " + std::to_string(n_expert) + " outside 1..2^20");
    if (k < 1 || k > n_expert) throw InvalidInput("cuda moe_weights: k=" + std::to_string(k) + " outside 1..n_expert");
    if (n_tok <= 0) return;
    launch_pdl(moe_weights_kernel, ceil_div(n_tok, 128), 128, 0, (cudaStream_t)s, logits, n_tok, (int)n_expert, ids,
               (int)k, (int)gating, normalize, scale, w);
    check_launch("moe_weights_kernel");
}

void add_id(float* x, const float* bias, int64_t n_expert, const int32_t* ids, int64_t n_tok, int64_t k, int64_t d,
            Stream s) {
    if (n_tok < 0 || k < 0 || d < 0) throw InvalidInput("cuda add_id: negative size");
    const int64_t n_slots = n_tok * k;
    if (n_slots == 0 || d == 0) return;
    const dim3 grid((unsigned)std::min<int64_t>(ceil_div(d, 256), 64), (unsigned)std::min<int64_t>(n_slots, 65535));
    launch_pdl(add_id_kernel, grid, 256, 0, (cudaStream_t)s, x, bias, n_expert, ids, n_slots, d);
    check_launch("add_id_kernel");
}

size_t moe_scratch_bytes(const DeviceWeight& w, int n_expert, int64_t n_act_rows, int64_t n_slots) {
    size_t b = align256(sizeof(int32_t) * (size_t)(3 * n_expert + 1 + 2 * n_slots));
    if (!is_float_type(w.type)) b += q8_1_bytes(n_act_rows, w.cols);
    return b;
}

void moe_matmul(const DeviceWeight& w, int n_expert, const float* x, int64_t ldx, bool per_slot_input,
                const int32_t* ids, int64_t n_tok, int k, float* y, int64_t ldy, void* scratch, Stream s) {
    if (n_expert <= 0 || n_expert > 65535) throw InvalidInput("moe_matmul: n_expert " + std::to_string(n_expert) + " outside 1..65535");
    // (k may exceed n_expert: with tensor parallelism a shard holds some of the experts, and the
    // slots routed elsewhere carry id -1)
    if (k <= 0) throw InvalidInput("moe_matmul: k=" + std::to_string(k) + " must be positive");
    const QTypeInfo& info = qtype_checked((uint32_t)w.type);
    if (w.cols <= 0 || w.cols % 32 || w.cols % info.block_elems)
        throw InvalidInput("moe_matmul: cols=" + std::to_string(w.cols) + " is not a positive multiple of 32 and of the " +
                           info.name + " block size");
    if (n_tok <= 0 || w.rows == 0) return;
    const int64_t n_slots = n_tok * k;
    const cudaStream_t st = (cudaStream_t)s;
    MoeScratch sc = moe_layout(scratch, n_expert, n_slots);
    const size_t rb = row_bytes(w.type, w.cols);
    const bool is_float = is_float_type(w.type);
    if (n_tok == 1 && n_slots <= 65535) {
        // One token (decoding): a block per slot reads its expert's id itself, no sorting (the
        // same dot products, so the bits of the grouped launch).
        TokenGroups g;
        g.slot_ids = ids, g.n_expert = n_expert, g.per_slot = per_slot_input;
        g.group_stride = rb * (size_t)w.rows, g.n_groups = (int)n_slots;
        if (is_float) {
            launch_mmv_float(w.type, (const uint8_t*)w.data, rb, w.rows, w.cols, x, ldx, 0, g, y, ldy, st);
        } else {
            quantize_q8_1(x, per_slot_input ? n_slots : 1, w.cols, ldx, sc.xq, s);
            launch_mmvq(w.type, (const uint8_t*)w.data, rb, w.rows, w.cols, (const block_q8_1*)sc.xq, w.cols / 32, 0, g,
                        y, ldy, st);
        }
        return;
    }
    check_cuda(cudaMemsetAsync(sc.counts, 0, sizeof(int32_t) * (size_t)n_expert, st), "moe_matmul memset");
    launch_pdl(moe_count_kernel, ceil_div(n_slots, 256), 256, 0, st, ids, n_slots, n_expert, sc.counts);
    check_launch("moe_count_kernel");
    launch_pdl(moe_scan_kernel, 1, 32, 0, st, sc.counts, n_expert, sc.off, sc.cursor);
    check_launch("moe_scan_kernel");
    launch_pdl(moe_scatter_kernel, ceil_div(n_slots, 256), 256, 0, st, ids, n_slots, k, n_expert, per_slot_input,
               sc.cursor, sc.act_row, sc.out_row, y, ldy, w.rows);
    check_launch("moe_scatter_kernel");
    TokenGroups g;
    g.off = sc.off, g.act_row = sc.act_row, g.out_row = sc.out_row;
    g.group_stride = rb * (size_t)w.rows;
    g.n_groups = n_expert;
    if (is_float) {
        launch_mmv_float(w.type, (const uint8_t*)w.data, rb, w.rows, w.cols, x, ldx, 0, g, y, ldy, st);
    } else {
        const int64_t n_act = per_slot_input ? n_slots : n_tok;
        quantize_q8_1(x, n_act, w.cols, ldx, sc.xq, s);
        launch_mmvq(w.type, (const uint8_t*)w.data, rb, w.rows, w.cols, (const block_q8_1*)sc.xq, w.cols / 32, 0, g,
                    y, ldy, st);
    }
}

void moe_matmul_glu(const DeviceWeight& gate, const DeviceWeight& up, int n_expert, const float* x, const int32_t* ids,
                    int k, float* g, float* u, float* act, int64_t ldy, bool gelu, void* scratch, Stream s) {
    if (is_float_type(gate.type) || gate.type != up.type || gate.rows != up.rows || gate.cols != up.cols)
        throw InvalidInput("moe_matmul_glu: gate and up must be quantized experts of one type and shape");
    if (n_expert <= 0 || n_expert > 65535 || k <= 0 || k > 65535)
        throw InvalidInput("moe_matmul_glu: n_expert and k must be in 1..65535");
    if (gate.cols <= 0 || gate.cols % 32 || gate.cols % qtype_checked((uint32_t)gate.type).block_elems)
        throw InvalidInput("moe_matmul_glu: cols=" + std::to_string(gate.cols) + " is not a multiple of the block");
    if (gate.rows == 0) return;
    const MoeScratch sc = moe_layout(scratch, n_expert, k);
    quantize_q8_1(x, 1, gate.cols, gate.cols, sc.xq, s);
    const size_t rb = row_bytes(gate.type, gate.cols);
    TokenGroups grp;
    grp.slot_ids = ids, grp.n_expert = n_expert, grp.group_stride = rb * (size_t)gate.rows, grp.n_groups = k;
    launch_mmvq_glu(gate.type, gelu, (const uint8_t*)gate.data, (const uint8_t*)up.data, rb, gate.rows, gate.cols,
                    (const block_q8_1*)sc.xq, gate.cols / 32, 1, grp, g, u, act, ldy, (cudaStream_t)s);
}

void moe_combine(const float* y, int64_t ldy, const float* weights, int64_t n_tok, int k, int64_t dim, float* out,
                 int64_t ld_out, Stream s) {
    if (n_tok <= 0 || dim <= 0) return;
    if (n_tok > 65535) throw InvalidInput("moe_combine: more than 65535 tokens per launch");
    const dim3 grid((unsigned)std::min<int64_t>(ceil_div(dim, 256), 64), (unsigned)n_tok);
    launch_pdl(moe_combine_kernel, grid, 256, 0, (cudaStream_t)s, y, ldy, weights, k, dim, out, ld_out);
    check_launch("moe_combine_kernel");
}

}  // namespace stowlm::cuda
