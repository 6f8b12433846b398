// Flash attention on the CPU: one pass over the KV cells in blocks with an online softmax,
// never holding an n_tok x n_kv score matrix. Work units are (query-token tile, KV head, KV
// split): the query heads sharing a KV head and the tokens of a tile reuse each KV block
// while it is in cache. When there are too few units for the pool (decoding), the KV range
// is split across threads and the partial softmax states are merged afterwards.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "cpu/attn_math.h"
#include "cpu/attn_prefill.h"
#include "cpu/ops.h"
#include "cpu/ops_kernels.h"
#include "error.h"
#include "quant/blocks.h"

namespace stowlm::cpu {

namespace {

constexpr int64_t kKvBlock = 128;      // KV cells per block
constexpr int64_t kTokTile = 4;        // query tokens per work unit
constexpr int64_t kMinSplitCells = 256;  // a KV split is never smaller than this

int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
size_t align64(size_t n) { return (n + 63) & ~(size_t)63; }

// Free splits (no AttnParams::split_cells): a call of fewer tokens than a prompt tile cuts the
// cells in one split per thread, a prompt-sized call runs each query over them in one pass.
// Either way a query's result does not depend on how many others its call has, only on its
// class (prefix reuse evaluates a prompt's tail apart from the chunk a fresh pass would take).
int64_t max_splits(int64_t n_tok, int n_threads, bool batched = false) {
    return n_threads > 1 && !batched && n_tok < kPrefillMinTokens ? n_threads : 1;
}

// The many-token path (attn_prefill.h) applies to these calls where the CPU has AVX-512.
bool prefill_shape(int64_t n_tok, int64_t hd_k, int64_t hd_v, bool batched = false) {
    return (n_tok >= kPrefillMinTokens || batched) && prefill_head_dim_ok(hd_k) && prefill_head_dim_ok(hd_v);
}

// scores [n_rep][kKvBlock], visible-cell list, (m, l) per (token, head) of a unit, block maxima;
// or the prefill path's workspace where that may run.
size_t per_thread_bytes(int64_t n_tok, int64_t n_head, int64_t hd_k, int64_t hd_v, bool batched) {
    const size_t b = align64(n_head * kKvBlock * sizeof(float)) + align64(kKvBlock * sizeof(int32_t)) +
                     align64(2 * kTokTile * n_head * sizeof(float)) + align64(n_head * sizeof(float));
    return prefill_shape(n_tok, hd_k, hd_v, batched) ? std::max(b, align64(prefill_ws_bytes(hd_k, hd_v))) : b;
}

size_t partial_bytes(int64_t n_tok, int64_t n_head, int64_t hd_v, int64_t n_split) {
    return n_split > 1 ? align64((size_t)(n_tok * n_head * n_split * (hd_v + 2)) * sizeof(float)) : 0;
}

}  // namespace

int32_t single_sequence_split_cells(int64_t n_ctx) {
    const int64_t per = cdiv(std::max<int64_t>(n_ctx, 1), 32);
    return (int32_t)std::max<int64_t>(kMinSplitCells, cdiv(per, kMinSplitCells) * kMinSplitCells);
}

// Fixed splits (AttnParams::split_cells) apply to the calls of fewer tokens than a prompt
// tile; a larger batch runs each query over the cells in one pass, also batch-independent.
int64_t fixed_splits(int64_t n_tok, int64_t n_kv, int32_t split_cells, bool batched) {
    return n_tok < kPrefillMinTokens && !batched ? std::max<int64_t>(1, cdiv(n_kv, split_cells)) : 1;
}

size_t flash_attn_scratch_bytes(int64_t n_tok, int64_t n_head, int64_t hd_k, int64_t hd_v, int n_threads,
                                int64_t n_kv, int32_t split_cells, bool batched) {
    if (n_threads < 1) n_threads = 1;
    // The plan made for the largest call also serves the smaller ones of the same graph: with
    // fixed splits those are the ones with partial states (fewer than a prompt tile of tokens).
    const size_t partial =
        split_cells > 0
            ? partial_bytes(std::min<int64_t>(n_tok, kPrefillMinTokens - 1), n_head, hd_v,
                            fixed_splits(std::min<int64_t>(n_tok, kPrefillMinTokens - 1), n_kv, split_cells, false))
            : partial_bytes(std::min<int64_t>(n_tok, kPrefillMinTokens - 1), n_head, hd_v,
                            max_splits(std::min<int64_t>(n_tok, kPrefillMinTokens - 1), n_threads));
    return partial + (size_t)n_threads * per_thread_bytes(n_tok, n_head, hd_k, hd_v, batched) + 64;
}

void flash_attn(const float* q, int64_t n_tok, int64_t n_head, int64_t ld_q, const KvView& kv, const int32_t* q_pos,
                const int32_t* kv_pos, const AttnParams& p, float* out, int64_t ld_out, void* scratch,
                ThreadPool& pool) {
    const QType kv_type = kv.type;
    const int64_t n_kv = kv.n_kv, n_head_kv = kv.n_head_kv, hd_k = kv.hd_k, hd_v = kv.hd_v;
    if (kv_type != QType::F16 && kv_type != QType::Q8_0)
        throw InvalidInput(std::string("flash_attn: kv_type ") + qtype_name(kv_type) + " is not F16 or Q8_0");
    if (n_tok < 0 || n_kv < 0 || hd_k <= 0 || hd_v <= 0 || n_head <= 0 || n_head_kv <= 0)
        throw InvalidInput("flash_attn: n_tok, n_kv must be >= 0 and n_head, n_head_kv, head dims > 0");
    if (n_head % n_head_kv != 0)
        throw InvalidInput("flash_attn: n_head " + std::to_string(n_head) + " is not a multiple of n_head_kv " +
                           std::to_string(n_head_kv));
    // throw for a Q8_0 head dim not a multiple of 32
    const size_t rb_k = row_bytes(kv_type, hd_k), rb_v = row_bytes(kv_type, hd_v);
    if (kv.k_cell_bytes < (size_t)n_head_kv * rb_k || kv.v_cell_bytes < (size_t)n_head_kv * rb_v)
        throw InvalidInput("flash_attn: a KV cell stride is smaller than n_head_kv * row bytes");
    if (ld_q < n_head * hd_k || ld_out < n_head * hd_v)
        throw InvalidInput("flash_attn: ld_q / ld_out smaller than n_head * head_dim");
    if (p.window < 0) throw InvalidInput("flash_attn: window must be >= 0");
    if (n_tok == 0) return;

    const int nth = pool.size();
    const int64_t n_rep = n_head / n_head_kv;
    const int64_t n_tiles = cdiv(n_tok, kTokTile);
    // Below this many q.k multiply-adds waking the workers costs more than it saves.
    const bool small = n_tok * n_head * n_kv * hd_k < (1 << 16);
    int64_t n_split = 1;
    if (p.split_cells > 0)
        n_split = fixed_splits(n_tok, n_kv, p.split_cells, p.batched);
    else
        n_split = std::max<int64_t>(1, std::min<int64_t>(max_splits(n_tok, nth, p.batched), n_kv / kMinSplitCells));
    // (one split is all the cells, fixed splits or not: a prompt-sized call of a sequence whose
    // region starts past split_cells must still see its cells)
    const int64_t split_len = p.split_cells > 0 && n_split > 1 ? (int64_t)p.split_cells
                                                                : cdiv(std::max<int64_t>(n_kv, 1), n_split);

    std::vector<unsigned char> own;
    if (!scratch) {
        own.resize(flash_attn_scratch_bytes(n_tok, n_head, hd_k, hd_v, nth, n_kv, p.split_cells, p.batched));
        scratch = own.data();
    }
    unsigned char* base = (unsigned char*)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
    float* partial = (float*)base;
    unsigned char* thread_base = base + partial_bytes(n_tok, n_head, hd_v, n_split);
    const size_t ptb = per_thread_bytes(n_tok, n_head, hd_k, hd_v, p.batched);

#ifdef STOWLM_X86
    if (kv_type == QType::F16 && prefill_shape(n_tok, hd_k, hd_v, p.batched) && n_rep <= kPrefillRows &&
        ops_isa() == OpsIsa::Avx512) {
        PrefillArgs a;
        a.q = q, a.ld_q = ld_q, a.n_rep = n_rep, a.hd_k = hd_k, a.hd_v = hd_v;
        a.k = (const unsigned char*)kv.k, a.v = (const unsigned char*)kv.v;
        a.k_cell_bytes = kv.k_cell_bytes, a.v_cell_bytes = kv.v_cell_bytes, a.rb_k = rb_k, a.rb_v = rb_v;
        a.n_kv = n_kv, a.q_pos = q_pos, a.kv_pos = kv_pos;
        a.scale = p.scale, a.softcap = p.softcap, a.window = p.window, a.causal = p.causal, a.sinks = p.sinks;
        a.q_seq = p.q_seq, a.kv_seq = p.kv_seq, a.seq_cells = p.q_seq ? p.seq_cells : 0, a.seq_end = p.seq_end;
        a.out = out, a.ld_out = ld_out;
        const int64_t tq = kPrefillRows / n_rep, n_ptiles = cdiv(n_tok, tq);
        // the last tiles first: under a causal mask they see the most cells
        pool.parallel_for_dynamic(n_ptiles * n_head_kv, 1, [&](int64_t b, int64_t e, int ith) {
            for (int64_t u = b; u < e; u++) {
                const int64_t tile = n_ptiles - 1 - u / n_head_kv, g = u % n_head_kv;
                flash_prefill_unit_avx512(a, tile * tq, std::min(n_tok, (tile + 1) * tq), g,
                                          base + (size_t)ith * ptb);
            }
        });
        return;
    }
#endif
    // With sequence regions a token sees cells [lo, hi) of its own region, up to the region's
    // last cell in use: the empty cells after it are invisible, so no unit scans them (a slot's
    // region is mostly empty while its request is short).
    std::vector<int64_t> reg(p.q_seq ? 2 * n_tok : 0);
    for (int64_t t = 0; t < (p.q_seq ? n_tok : 0); t++) {
        if (t > 0 && p.q_seq[t] == p.q_seq[t - 1]) {
            reg[2 * t] = reg[2 * t - 2], reg[2 * t + 1] = reg[2 * t - 1];
            continue;
        }
        attn_seq_region(p.q_seq[t], p.seq_cells, n_kv, &reg[2 * t], &reg[2 * t + 1], p.seq_end);
        while (reg[2 * t + 1] > reg[2 * t] && kv_pos[reg[2 * t + 1] - 1] < 0) reg[2 * t + 1]--;
    }
    // whether split s holds any of token t's cells (always, without splits or regions): the
    // CUDA kernel's rule for the splits it neither computes nor folds
    auto in_split = [&](int64_t t, int64_t s) {
        int64_t jb, je;
        return n_split == 1 || !p.q_seq || attn_split_cells(s, split_len, n_kv, reg[2 * t], reg[2 * t + 1], &jb, &je);
    };
    const OpsKernels& kr = ops_kernels();
    const bool f16 = kv_type == QType::F16;
    const float scale = p.scale, cap = p.softcap;
    const int32_t window = p.window;
    const bool causal = p.causal;
    const int64_t slot = hd_v + 2;  // partial state: acc[hd_v], m, l
    // distance between the accumulators of consecutive heads (output rows or partial slots)
    const int64_t acc_ld = n_split == 1 ? hd_v : n_split * slot;

    auto unit = [&](int64_t u, int ith) {
        const int64_t s = u % n_split;
        const int64_t g = (u / n_split) % n_head_kv;
        const int64_t tile = u / (n_split * n_head_kv);
        const int64_t t0 = tile * kTokTile, t1 = std::min(n_tok, t0 + kTokTile);
        const int64_t j_begin = s * split_len, j_end = std::min(n_kv, j_begin + split_len);

        unsigned char* tb = thread_base + (size_t)ith * ptb;
        float* sc = (float*)tb;
        tb += align64(n_head * kKvBlock * sizeof(float));
        int32_t* vis = (int32_t*)tb;
        tb += align64(kKvBlock * sizeof(int32_t));
        float* ml = (float*)tb;
        tb += align64(2 * kTokTile * n_head * sizeof(float));
        float* mx = (float*)tb;

        auto acc_of = [&](int64_t t, int64_t h) -> float* {
            return n_split == 1 ? out + t * ld_out + h * hd_v : partial + ((t * n_head + h) * n_split + s) * slot;
        };
        // each token's cells are [lo, hi): other blocks are skipped unseen, and a split none of
        // them reaches leaves no state (the merge skips it: an empty state merges as a no-op)
        int64_t lo[kTokTile], hi[kTokTile];
        bool any = false;
        for (int64_t t = t0; t < t1; t++) {
            lo[t - t0] = p.q_seq ? reg[2 * t] : 0;
            hi[t - t0] = p.q_seq ? reg[2 * t + 1] : n_kv;
            any |= in_split(t, s);
        }
        if (!any) return;
        for (int64_t t = t0; t < t1; t++)
            for (int64_t r = 0; r < n_rep; r++) {
                if (!in_split(t, s)) continue;
                std::fill(acc_of(t, g * n_rep + r), acc_of(t, g * n_rep + r) + hd_v, 0.0f);
                const int64_t i = ((t - t0) * n_rep + r) * 2;
                ml[i] = -INFINITY;
                ml[i + 1] = 0.0f;
            }

        const unsigned char* kbase = (const unsigned char*)kv.k + g * rb_k;
        const unsigned char* vbase = (const unsigned char*)kv.v + g * rb_v;
        for (int64_t jb = j_begin; jb < j_end; jb += kKvBlock) {
            const int64_t je = std::min(j_end, jb + kKvBlock);
            for (int64_t t = t0; t < t1; t++) {
                if (jb >= hi[t - t0] || je <= lo[t - t0]) continue;
                const int32_t qp = q_pos[t];
                int nv = 0;
                for (int64_t j = std::max(jb, lo[t - t0]), j_to = std::min(je, hi[t - t0]); j < j_to; j++) {
                    const int32_t kp = kv_pos[j];
                    const bool ok = kp >= 0 && (!causal || kp <= qp) &&
                                    (window == 0 || (int64_t)qp - (int64_t)kp < (int64_t)window) &&
                                    (!p.q_seq || p.kv_seq[j] == p.q_seq[t]);
                    if (ok) vis[nv++] = (int32_t)(j - jb);
                }
                if (nv == 0) continue;
                const unsigned char* kb = kbase + (size_t)jb * kv.k_cell_bytes;
                const unsigned char* vb = vbase + (size_t)jb * kv.v_cell_bytes;
                const float* qg = q + t * ld_q + g * n_rep * hd_k;
                float* acc0 = acc_of(t, g * n_rep);
                auto scores_mh = f16 ? kr.scores_f16_mh : kr.scores_q8_0_mh;
                auto accum_mh = f16 ? kr.accum_f16_mh : kr.accum_q8_0_mh;
                if (scores_mh) {
                    scores_mh(qg, hd_k, (int)n_rep, kb, kv.k_cell_bytes, vis, nv, hd_k, scale, sc, kKvBlock, mx);
                } else {
                    for (int64_t r = 0; r < n_rep; r++)
                        mx[r] = f16 ? kr.scores_f16(qg + r * hd_k, kb, kv.k_cell_bytes, vis, nv, hd_k, scale,
                                                    sc + r * kKvBlock)
                                    : kr.scores_q8_0(qg + r * hd_k, kb, kv.k_cell_bytes, vis, nv, hd_k, scale,
                                                     sc + r * kKvBlock);
                }
                for (int64_t r = 0; r < n_rep; r++) {
                    float* sr = sc + r * kKvBlock;
                    if (cap != 0.0f) {  // tanh is monotonic: the max maps to the max
                        for (int i = 0; i < nv; i++) sr[i] = apply_softcap(sr[i], cap);
                        mx[r] = apply_softcap(mx[r], cap);
                    }
                    float* st = ml + ((t - t0) * n_rep + r) * 2;
                    const float f = online_softmax_rescale(st[0], st[1], mx[r]);
                    if (f != 1.0f) kr.scale(acc0 + r * acc_ld, f, hd_v);
                    st[1] += kr.exp_sum(sr, nv, st[0]);  // sr now holds the weights
                }
                if (accum_mh) {
                    accum_mh(acc0, acc_ld, (int)n_rep, sc, kKvBlock, vb, kv.v_cell_bytes, vis, nv, hd_v);
                } else {
                    for (int64_t r = 0; r < n_rep; r++) {
                        if (f16) kr.accum_f16(acc0 + r * acc_ld, sc + r * kKvBlock, vb, kv.v_cell_bytes, vis, nv, hd_v);
                        else kr.accum_q8_0(acc0 + r * acc_ld, sc + r * kKvBlock, vb, kv.v_cell_bytes, vis, nv, hd_v);
                    }
                }
            }
        }
        for (int64_t t = t0; t < t1; t++)
            for (int64_t r = 0; r < n_rep; r++) {
                if (!in_split(t, s)) continue;
                float* st = ml + ((t - t0) * n_rep + r) * 2;
                float* acc = acc_of(t, g * n_rep + r);
                if (n_split == 1) {
                    if (p.sinks) kr.scale(acc, attn_sink(st[0], st[1], p.sinks[g * n_rep + r]), hd_v);
                    // A query with no visible key (and no sink) gets zeros rather than NaN.
                    kr.scale(acc, st[1] > 0 ? 1.0f / st[1] : 0.0f, hd_v);
                } else {
                    acc[hd_v] = st[0];
                    acc[hd_v + 1] = st[1];
                }
            }
    };

    const int64_t n_units = n_tiles * n_head_kv * n_split;
    if (nth == 1 || n_units == 1 || small) {
        for (int64_t u = 0; u < n_units; u++) unit(u, 0);
    } else {
        // Units taken one at a time as threads come free: a split's cells vary (the last split
        // is partial; a sliding window or a short region leaves work in a few neighbours), and a
        // fixed share would leave one thread with the full ones.
        pool.parallel_for_dynamic(n_units, 1, [&](int64_t b, int64_t e, int ith) {
            for (int64_t u = b; u < e; u++) unit(u, ith);
        });
    }

    if (n_split > 1) {
        auto merge = [&](int64_t b, int64_t e) {
            for (int64_t th = b; th < e; th++) {
                const int64_t t = th / n_head, h = th % n_head;
                float* o = out + t * ld_out + h * hd_v;
                const float* ps = partial + (t * n_head + h) * n_split * slot;
                float m = -INFINITY, l = 0.0f;
                std::fill(o, o + hd_v, 0.0f);
                for (int64_t s = 0; s < n_split; s++) {
                    if (!in_split(t, s)) continue;  // no state: merging it would change nothing
                    const float* a = ps + s * slot;
                    float fa, fb;
                    online_softmax_merge(m, l, a[hd_v], a[hd_v + 1], &fa, &fb);
                    for (int64_t d = 0; d < hd_v; d++) o[d] = o[d] * fa + a[d] * fb;
                }
                if (p.sinks) kr.scale(o, attn_sink(m, l, p.sinks[h]), hd_v);
                kr.scale(o, l > 0 ? 1.0f / l : 0.0f, hd_v);
            }
        };
        merge(0, n_tok * n_head);  // tiny: n_tok * n_head * n_split * hd_v flops
    }
}

}  // namespace stowlm::cpu
