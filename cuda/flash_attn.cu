// Flash attention over F16 or Q8_0 KV cells, same semantics as cpu::flash_attn: cells visible by
// their positions (attn_visibility.h) and, with several sequences, by their sequence; optional
// softcap, sinks, GQA; K and V of their own widths and cell strides (V may be a view into K, as
// multi-head latent attention stores it); online softmax (attn_math.h).
//
// One block of W warps (4; 16 with STOWLM_CUDA_FA_WARPS=16) per (query token, head). The cells
// are cut into splits; within a split each warp walks every W-th cell (counted from the split's
// first cell), several in flight at once, with its own (m, l, acc), lanes holding the head's
// elements lane, lane + 32, ...; the warps' states are merged in shared memory into the split's
// (m, l, acc). A block either folds every split in order itself or, when there are too few blocks
// to fill the device (decoding), runs one split and writes its state, and a second kernel folds
// the states in the same order with the same arithmetic (explicit fused multiply-adds): so with
// fixed split boundaries (several sequences) a query's result is the same bits whatever the batch
// and whichever way the launcher chose. A query of a sequence that owns a region of cells skips the
// cells outside it without reading them, and the splits outside it altogether (they would fold
// as no-ops).
#include <algorithm>
#include <string>

#include "attn_visibility.h"
#include "cpu/attn_math.h"
#include "cuda_backend.h"
#include "cuda_common.cuh"

namespace stowlm::cuda {

namespace {

constexpr int kFaWarps = 4;
constexpr int kFaThreads = kFaWarps * 32;

struct FaArgs {
    const float* q;
    int64_t n_tok, n_head, ld_q;
    const uint8_t* k;
    const uint8_t* v;
    int64_t n_kv, n_head_kv;
    size_t k_cell_bytes, v_cell_bytes;
    size_t k_head_bytes, v_head_bytes;  // row_bytes(kv_type, hd_k / hd_v)
    int hd_k, hd_v;
    const int32_t* q_pos;
    const int32_t* kv_pos;
    const float* sinks;     // [n_head] or null
    const int32_t* q_seq;   // [n_tok] or null
    const int32_t* kv_seq;  // [n_kv] (with q_seq)
    int32_t seq_cells;      // > 0: sequence s owns cells [s * seq_cells, (s + 1) * seq_cells)
    const int32_t* seq_end; // [n_seq] or null: ... up to seq_end[s] instead (regions held after its own)
    float scale, softcap;
    int32_t window;
    bool causal;
    float* out;
    int64_t ld_out;
    int64_t split_len;  // cells per split
    int64_t n_splits;   // splits of the n_kv cells
    bool per_block;     // blockIdx.y is the split, its state goes to `partial`; else a block folds all
    float* partial;     // [n_tok * n_head][n_splits][hd_v + 2]: m, l, acc
    block_q8_1* yq;     // or null: out's q8_1 rows too (ld_out == n_head * hd_v, hd_v % 32 == 0)
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

// PK / PV: K / V elements per lane (head widths up to 32 * PK and 32 * PV); W warps a block; G
// cells in flight per warp.
template <QType KV, int PK, int PV, int W, int G>
__global__ void __launch_bounds__(W * 32, 1) flash_attn_kernel(FaArgs a) {
    pdl_begin();
    constexpr int kDV = PV * 32;
    constexpr int kPT = (kDV + (W * 32) - 1) / (W * 32);  // folded outputs per thread
    __shared__ float sm_m[W], sm_l[W];
    __shared__ float sm_acc[W][kDV];
    const int64_t qi = blockIdx.x;  // t * n_head + h
    const int64_t t = qi / a.n_head, h = qi % a.n_head;
    const int64_t kvh = h / (a.n_head / a.n_head_kv);
    const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
    const int32_t qp = a.q_pos[t];
    const int32_t qs = a.q_seq ? a.q_seq[t] : 0;
    int64_t lo, hi;
    attn_seq_region(qs, a.q_seq ? a.seq_cells : 0, a.n_kv, &lo, &hi, a.seq_end);

    float qv[PK];
    const float* qrow = a.q + t * a.ld_q + h * a.hd_k;
#pragma unroll
    for (int i = 0; i < PK; i++) {
        const int d = lane + 32 * i;
        qv[i] = d < a.hd_k ? qrow[d] : 0.0f;
    }
    const uint8_t* kbase = a.k + (size_t)kvh * a.k_head_bytes;
    const uint8_t* vbase = a.v + (size_t)kvh * a.v_head_bytes;

    float M = -INFINITY, L = 0.0f, A[kPT];
#pragma unroll
    for (int i = 0; i < kPT; i++) A[i] = 0.0f;
    const int64_t s_begin = a.per_block ? (int64_t)blockIdx.y : 0;
    const int64_t s_end = a.per_block ? s_begin + 1 : a.n_splits;
    for (int64_t sp = s_begin; sp < s_end; sp++) {
        const int64_t j0 = sp * a.split_len;
        int64_t jb, je;
        // A split holding none of the query's cells would fold as a no-op: no state at all (the
        // combine kernel skips it too). Uniform per block.
        if (!attn_split_cells(sp, a.split_len, a.n_kv, lo, hi, &jb, &je)) continue;

        float m = -INFINITY, l = 0.0f, acc[PV];
#pragma unroll
        for (int i = 0; i < PV; i++) acc[i] = 0.0f;
        int64_t j = j0 + warp;  // this warp's cells: j0 + warp + W i, from the first one >= jb
        if (j < jb) j += (jb - j + W - 1) / W * W;
        // G of the warp's cells at a time: their loads and score sums issued together, then
        // folded one by one in cell order, as a walk of one cell at a time would (the same bits).
        for (; j < je; j += (int64_t)W * G) {
            bool seen[G];  // uniform over the warp
#pragma unroll
            for (int g = 0; g < G; g++) {
                const int64_t jg = j + (int64_t)W * g;
                seen[g] = jg < je && kv_visible(qp, a.kv_pos[jg], a.causal, a.window) &&
                          (!a.q_seq || a.kv_seq[jg] == qs);
            }
            float s[G], vv[G][PV];
#pragma unroll
            for (int g = 0; g < G; g++) {
                s[g] = 0.0f;
                if (!seen[g]) continue;
                const size_t jg = (size_t)(j + (int64_t)W * g);
                const uint8_t* kr = kbase + jg * a.k_cell_bytes;
                const uint8_t* vr = vbase + jg * a.v_cell_bytes;
#pragma unroll
                for (int i = 0; i < PK; i++) {
                    const int d = lane + 32 * i;
                    if (d < a.hd_k) s[g] = fmaf(qv[i], kv_value<KV>(kr, d), s[g]);
                }
#pragma unroll
                for (int i = 0; i < PV; i++) {
                    const int d = lane + 32 * i;
                    vv[g][i] = d < a.hd_v ? kv_value<KV>(vr, d) : 0.0f;
                }
            }
#pragma unroll
            for (int g = 0; g < G; g++)
                if (seen[g]) s[g] = warp_sum(s[g]);
#pragma unroll
            for (int g = 0; g < G; g++) {
                if (!seen[g]) continue;
                // lane 0's sum for everyone, so every lane updates (m, l) identically
                float sc = __shfl_sync(0xffffffffu, s[g], 0) * a.scale;
                if (a.softcap > 0.0f) sc = apply_softcap(sc, a.softcap);
                float f;
                const float p = online_softmax_update(m, l, sc, &f);
#pragma unroll
                for (int i = 0; i < PV; i++)
                    if (lane + 32 * i < a.hd_v) acc[i] = fmaf(p, vv[g][i], acc[i] * f);
            }
        }
        __syncthreads();  // the previous split's shared state has been read
        if (lane == 0) sm_m[warp] = m, sm_l[warp] = l;
#pragma unroll
        for (int i = 0; i < PV; i++)
            if (lane + 32 * i < a.hd_v) sm_acc[warp][lane + 32 * i] = acc[i];
        __syncthreads();

        // the split's state: the warps' merged in order
        float ms = -INFINITY, ls = 0.0f, fs[W];
#pragma unroll
        for (int w = 0; w < W; w++) {
            float fa, fb;
            online_softmax_merge(ms, ls, sm_m[w], sm_l[w], &fa, &fb);
            for (int u = 0; u < w; u++) fs[u] *= fa;
            fs[w] = fb;
        }
        float fa = 0.0f, fb = 0.0f;
        float* part = a.per_block ? a.partial + ((size_t)qi * a.n_splits + sp) * (size_t)(a.hd_v + 2) : nullptr;
        if (a.per_block) {
            if (threadIdx.x == 0) part[0] = ms, part[1] = ls;
        } else {
            online_softmax_merge(M, L, ms, ls, &fa, &fb);
        }
#pragma unroll
        for (int i = 0; i < kPT; i++) {
            const int d = threadIdx.x + (W * 32) * i;
            if (d >= a.hd_v) break;
            float r = 0.0f;
#pragma unroll
            for (int w = 0; w < W; w++) r = fmaf(fs[w], sm_acc[w][d], r);
            if (a.per_block) part[2 + d] = r;
            else A[i] = attn_fold_acc(A[i], fa, r, fb);
        }
    }
    if (a.per_block) return;
    const float sc = attn_out_scale(M, L, a.sinks != nullptr, a.sinks ? a.sinks[h] : 0.0f);
    float* o = a.out + t * a.ld_out + h * a.hd_v;
#pragma unroll
    for (int i = 0; i < kPT; i++) {
        const int d = threadIdx.x + (W * 32) * i;
        if (d >= a.hd_v) break;  // with yq uniform over a warp (hd_v % 32 == 0)
        const float v = A[i] * sc;
        o[d] = v;
        if (a.yq) warp_quantize_q8_1(v, a.yq + (t * a.ld_out + h * a.hd_v + d) / 32);
    }
}

// Folds the states of one (token, head) in split order, as flash_attn_kernel folds them (the
// splits outside the query's region have none).
__global__ void __launch_bounds__(kFaThreads) flash_attn_combine_kernel(const FaArgs a) {
    pdl_begin();
    const int64_t qi = blockIdx.x, t = qi / a.n_head, h = qi % a.n_head;
    int64_t lo, hi, jb, je;
    attn_seq_region(a.q_seq ? a.q_seq[t] : 0, a.q_seq ? a.seq_cells : 0, a.n_kv, &lo, &hi, a.seq_end);
    const float* base = a.partial + (size_t)qi * a.n_splits * (size_t)(a.hd_v + 2);
    float* o = a.out + t * a.ld_out + h * a.hd_v;
    const float* sinks = a.sinks;
    for (int d = threadIdx.x; d < a.hd_v; d += blockDim.x) {
        float M = -INFINITY, L = 0.0f, A = 0.0f;
        for (int64_t s = 0; s < a.n_splits; s++) {
            if (!attn_split_cells(s, a.split_len, a.n_kv, lo, hi, &jb, &je)) continue;
            const float* p = base + (size_t)s * (a.hd_v + 2);
            float fa, fb;
            online_softmax_merge(M, L, p[0], p[1], &fa, &fb);
            A = attn_fold_acc(A, fa, p[2 + d], fb);
        }
        const float v = A * attn_out_scale(M, L, sinks != nullptr, sinks ? sinks[h] : 0.0f);
        o[d] = v;
        if (a.yq) warp_quantize_q8_1(v, a.yq + (t * a.ld_out + h * a.hd_v + d) / 32);  // a warp: 32 of d
    }
}

// ---- prompts: a block for a tile of tokens of one head, K and V tiles shared in shared memory ----
//
// kTileQ tokens of head h share each tile of kTileK cells, read once into shared memory
// (coalesced, as floats; K padded a column so a lane a cell reads without bank conflicts). A warp
// takes kTileQ / 4 of the tokens; for each, a lane scores one cell of the tile, the tile's state
// (max, sum, weighted values; lanes holding the head's elements lane, lane + 32, ...) folds into
// the token's by online_softmax_merge and attn_fold_acc. The tiles start at cell 0 whatever the
// batch, so a token's result is the same bits in any batch that takes this kernel (a single
// class: passes of kCudaBatchedMinTokens tokens and more, as the tiled products).
constexpr int kTileQ = 16, kTileK = 32;

template <int HD>
__global__ void __launch_bounds__(128) flash_attn_tiled_kernel(FaArgs a) {
    pdl_begin();
    constexpr int kPer = HD / 32;                 // elements a lane holds
    constexpr int kQW = kTileQ / 4;               // tokens a warp takes
    __shared__ float ks[kTileK][HD + 1], vs[kTileK][HD], qs[kTileQ][HD];
    const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
    const int64_t h = blockIdx.y, t0 = (int64_t)blockIdx.x * kTileQ;
    const int64_t kvh = h / (a.n_head / a.n_head_kv);
    for (int i = threadIdx.x; i < kTileQ * HD; i += 128) {
        const int64_t t = t0 + i / HD;
        qs[i / HD][i % HD] = t < a.n_tok ? a.q[t * a.ld_q + h * HD + i % HD] : 0.0f;
    }
    int32_t qp[kQW], qsq[kQW];
    int64_t lo[kQW], hi[kQW];
    float m[kQW], l[kQW], acc[kQW][kPer];
#pragma unroll
    for (int u = 0; u < kQW; u++) {
        const int64_t t = t0 + warp * kQW + u;
        const bool real = t < a.n_tok;
        qp[u] = real ? a.q_pos[t] : INT32_MIN;  // a row past the batch sees nothing
        qsq[u] = real && a.q_seq ? a.q_seq[t] : 0;
        attn_seq_region(qsq[u], a.q_seq ? a.seq_cells : 0, a.n_kv, &lo[u], &hi[u], a.seq_end);
        m[u] = -INFINITY, l[u] = 0.0f;
#pragma unroll
        for (int i = 0; i < kPer; i++) acc[u][i] = 0.0f;
    }
    const uint8_t* kbase = a.k + (size_t)kvh * a.k_head_bytes;
    const uint8_t* vbase = a.v + (size_t)kvh * a.v_head_bytes;
    for (int64_t j0 = 0; j0 < a.n_kv; j0 += kTileK) {
        __syncthreads();  // the last tile has been read (and, the first time, qs written)
        for (int i = threadIdx.x; i < kTileK * HD; i += 128) {
            const int64_t j = j0 + i / HD;
            const int d = i % HD;
            const bool in = j < a.n_kv;
            ks[i / HD][d] = in ? fp16_to_f32(((const uint16_t*)(kbase + (size_t)j * a.k_cell_bytes))[d]) : 0.0f;
            vs[i / HD][d] = in ? fp16_to_f32(((const uint16_t*)(vbase + (size_t)j * a.v_cell_bytes))[d]) : 0.0f;
        }
        __syncthreads();
        const int64_t j = j0 + lane;
        const int32_t kp = j < a.n_kv ? a.kv_pos[j] : -1;
        const int32_t ksq = j < a.n_kv && a.q_seq ? a.kv_seq[j] : 0;
#pragma unroll
        for (int u = 0; u < kQW; u++) {
            const bool seen = j >= lo[u] && j < hi[u] && kv_visible(qp[u], kp, a.causal, a.window) &&
                              (!a.q_seq || ksq == qsq[u]);
            if (!__any_sync(0xffffffffu, seen)) continue;  // no cell of the tile for this token
            const int q = warp * kQW + u;
            float s = -INFINITY;
            if (seen) {
                float dot = 0.0f;
#pragma unroll 16
                for (int d = 0; d < HD; d++) dot = fmaf(qs[q][d], ks[lane][d], dot);
                s = dot * a.scale;
                if (a.softcap > 0.0f) s = apply_softcap(s, a.softcap);
            }
            const float mc = warp_max(s);
            const float p = seen ? expf(s - mc) : 0.0f;
            const float lc = warp_sum(p);
            float part[kPer];
#pragma unroll
            for (int i = 0; i < kPer; i++) part[i] = 0.0f;
            for (int c = 0; c < kTileK; c++) {
                const float pc = __shfl_sync(0xffffffffu, p, c);
                if (pc == 0.0f) continue;  // uniform; an unseen cell's V may be any bits (a NaN times 0 is NaN)
#pragma unroll
                for (int i = 0; i < kPer; i++) part[i] = fmaf(pc, vs[c][lane + 32 * i], part[i]);
            }
            float fa, fb;
            online_softmax_merge(m[u], l[u], mc, lc, &fa, &fb);
#pragma unroll
            for (int i = 0; i < kPer; i++) acc[u][i] = attn_fold_acc(acc[u][i], fa, part[i], fb);
        }
    }
#pragma unroll
    for (int u = 0; u < kQW; u++) {
        const int64_t t = t0 + warp * kQW + u;
        if (t >= a.n_tok) break;
        const float sc = attn_out_scale(m[u], l[u], a.sinks != nullptr, a.sinks ? a.sinks[h] : 0.0f);
        float* o = a.out + t * a.ld_out + h * HD;
#pragma unroll
        for (int i = 0; i < kPer; i++) o[lane + 32 * i] = acc[u][i] * sc;
    }
}

// Whether a pass takes the tiled kernel: STOWLM_CUDA_FA_TILED=1 (a measurement for now), a batched
// pass (the tiled products' class), F16 cells, K and V heads of 64 or 128.
// (The switches are read once, as the engine reads STOWLM_CUDA_GRAPHS: not on every launch.)
bool tiled_prompt(const FaArgs& a, QType kv_type) {
    static const bool on = env_is("STOWLM_CUDA_FA_TILED", "1");
    return on && a.n_tok >= kCudaBatchedMinTokens && kv_type == QType::F16 &&
           a.hd_k == a.hd_v && (a.hd_k == 64 || a.hd_k == 128) && a.n_tok <= (int64_t)kTileQ * 0x7fffffff &&
           a.n_head <= 65535;
}

// Per-lane widths by head width (fewer registers for the common heads, more cells in flight);
// an element past the width adds nothing, so each instance gives the widest one's bits.
template <QType KV, int W>
void launch(const FaArgs& a, dim3 grid, cudaStream_t s) {
    const int hd = std::max(a.hd_k, a.hd_v);
    if (hd <= 64) launch_pdl(flash_attn_kernel<KV, 2, 2, W, 8>, grid, W * 32, 0, s, a);
    else if (hd <= 128) launch_pdl(flash_attn_kernel<KV, 4, 4, W, 8>, grid, W * 32, 0, s, a);
    else if (hd <= 256) launch_pdl(flash_attn_kernel<KV, 8, 8, W, 4>, grid, W * 32, 0, s, a);
    else
        launch_pdl(flash_attn_kernel<KV, kFlashAttnMaxHeadDimK / 32, kFlashAttnMaxHeadDimV / 32, W, 2>, grid, W * 32, 0,
                   s, a);
}

// Warps a block (STOWLM_CUDA_FA_WARPS=16, for now a measurement: a (token, head)'s cells walked
// by 16 warps, not 4, a quarter of the latency chain each; other bits than 4's).
int fa_warps() {
    static const int w = env_is("STOWLM_CUDA_FA_WARPS", "16") ? 16 : kFaWarps;
    return w;
}

}  // namespace

void flash_attn(const float* q, int64_t n_tok, int64_t n_head, int64_t ld_q, const cpu::KvView& kv,
                const int32_t* q_pos, const int32_t* kv_pos, const cpu::AttnParams& p, float* out, int64_t ld_out,
                int n_split, void* scratch, Stream s, void* yq) {
    const QType kv_type = kv.type;
    if (kv_type != QType::F16 && kv_type != QType::Q8_0)
        throw InvalidInput(std::string("cuda flash_attn: kv_type ") + qtype_name(kv_type) + " is not F16 or Q8_0");
    if (kv.hd_k <= 0 || kv.hd_k > kFlashAttnMaxHeadDimK || kv.hd_v <= 0 || kv.hd_v > kFlashAttnMaxHeadDimV)
        throw InvalidInput("cuda flash_attn: head widths " + std::to_string(kv.hd_k) + " (K) / " + std::to_string(kv.hd_v) +
                           " (V) outside 1.." + std::to_string(kFlashAttnMaxHeadDimK) + " / 1.." +
                           std::to_string(kFlashAttnMaxHeadDimV));
    if (kv.n_head_kv <= 0 || n_head % kv.n_head_kv)
        throw InvalidInput("cuda flash_attn: n_head " + std::to_string(n_head) + " is not a multiple of n_head_kv " +
                           std::to_string(kv.n_head_kv));
    // throw for a Q8_0 head width not a multiple of 32
    const size_t rb_k = row_bytes(kv_type, kv.hd_k), rb_v = row_bytes(kv_type, kv.hd_v);
    if (kv.k_cell_bytes < (size_t)kv.n_head_kv * rb_k || kv.v_cell_bytes < (size_t)kv.n_head_kv * rb_v)
        throw InvalidInput("cuda flash_attn: a KV cell stride is smaller than n_head_kv * row bytes");
    if (p.window < 0) throw InvalidInput("cuda flash_attn: window must be >= 0");
    if (!p.q_seq != !p.kv_seq) throw InvalidInput("cuda flash_attn: q_seq and kv_seq go together");
    if (p.split_cells < 0 || p.seq_cells < 0) throw InvalidInput("cuda flash_attn: split_cells / seq_cells must be >= 0");
    if (n_split < 1 || n_split > 65535) throw InvalidInput("cuda flash_attn: n_split must be in 1..65535");
    if (ld_q < n_head * kv.hd_k || ld_out < n_head * kv.hd_v)
        throw InvalidInput("cuda flash_attn: ld_q / ld_out smaller than n_head * head width");
    const int64_t n_kv = std::max<int64_t>(kv.n_kv, 0);
    int64_t split_len, n_splits;
    if (p.split_cells > 0) {
        split_len = p.split_cells;
        n_splits = flash_attn_fixed_splits(n_kv, p.split_cells);
        if (n_split > 1 && n_split != n_splits)
            throw InvalidInput("cuda flash_attn: with fixed splits n_split must be 1 or their count " +
                               std::to_string(n_splits));
    } else {
        split_len = (std::max<int64_t>(n_kv, 1) + n_split - 1) / n_split;
        n_splits = std::max<int64_t>(1, (n_kv + split_len - 1) / split_len);
    }
    const bool per_block = n_split > 1;
    if (per_block && scratch == nullptr) throw InvalidInput("cuda flash_attn: n_split > 1 needs scratch");
    if (yq && (ld_out != n_head * kv.hd_v || kv.hd_v % 32))
        throw InvalidInput("cuda flash_attn: q8_1 rows of out need ld_out == n_head * hd_v and hd_v % 32 == 0");
    if (n_tok == 0 || n_head == 0) return;
    FaArgs a{q, n_tok, n_head, ld_q, (const uint8_t*)kv.k, (const uint8_t*)kv.v, n_kv, kv.n_head_kv,
             kv.k_cell_bytes, kv.v_cell_bytes, rb_k, rb_v, (int)kv.hd_k, (int)kv.hd_v, q_pos, kv_pos, p.sinks,
             p.q_seq, p.kv_seq, p.seq_cells, p.q_seq ? p.seq_end : nullptr, p.scale, p.softcap, p.window, p.causal,
             out, ld_out, split_len,
             n_splits, per_block, (float*)scratch, (block_q8_1*)yq};
    const cudaStream_t st = (cudaStream_t)s;
    if (tiled_prompt(a, kv_type)) {
        const dim3 tiles((unsigned)((n_tok + kTileQ - 1) / kTileQ), (unsigned)n_head);
        if (kv.hd_k == 64) launch_pdl(flash_attn_tiled_kernel<64>, tiles, 128, 0, st, a);
        else launch_pdl(flash_attn_tiled_kernel<128>, tiles, 128, 0, st, a);
        check_launch("flash_attn_tiled_kernel");
        if (yq) quantize_q8_1(out, n_tok, n_head * kv.hd_v, ld_out, yq, s);
        return;
    }
    const dim3 grid((unsigned)(n_tok * n_head), per_block ? (unsigned)n_splits : 1u);
    const bool wide = fa_warps() == 16;
    if (kv_type == QType::F16) wide ? launch<QType::F16, 16>(a, grid, st) : launch<QType::F16, kFaWarps>(a, grid, st);
    else wide ? launch<QType::Q8_0, 16>(a, grid, st) : launch<QType::Q8_0, kFaWarps>(a, grid, st);
    check_launch("flash_attn_kernel");
    if (per_block) {
        launch_pdl(flash_attn_combine_kernel, (unsigned)(n_tok * n_head), kFaThreads, 0, st, a);
        check_launch("flash_attn_combine_kernel");
    }
}

}  // namespace stowlm::cuda
