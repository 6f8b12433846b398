// mul_mat_id: the expert products of a mixture-of-experts layer on matmul's kernels.
// The (token, slot) pairs are sorted by expert (counting sort, stable in token order), their
// activations quantized straight into that order, each expert's group multiplied as one
// matmul (same row drivers, same AMX path), and the results scattered back to (token, slot).
#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "cpu/cpu_features.h"
#include "cpu/matmul.h"
#include "cpu/matmul_impl.h"
#include "cpu/repack.h"
#include "error.h"

namespace stowlm::cpu {

namespace {

size_t up64(size_t n) { return (n + 63) & ~(size_t)63; }

// Elements below which quantizing or scattering runs on the calling thread alone.
constexpr int64_t kInlineWork = 1 << 15;

// Scratch layout (every region 64-byte aligned): expert offsets, sorted (token, slot) entries,
// activations in sorted order, outputs in sorted order, each token's quantized row (k > 1), and
// a staging area where one expert's activations are copied for the AMX path (which keeps its
// own data right after them).
struct Layout {
    size_t offsets, entries, act, asum, out, once, stage, total;
    size_t act_row;  // bytes per sorted activation row
    size_t nib = 0, nib_row = 0;
    bool float_w;
};

Layout layout(QType t, int64_t rows, int64_t cols, int64_t n_expert, int64_t k, int64_t n_tok) {
    Layout L{};
    const int64_t n = n_tok * k;
    L.float_w = dot_family(t) == DotFamily::Float;
    L.act_row = L.float_w ? (size_t)cols * sizeof(float) : matmul_act_row_bytes(t, cols);
    size_t off = 0;
    L.offsets = off, off += up64((size_t)(n_expert + 1) * sizeof(int64_t));
    L.entries = off, off += up64((size_t)n * sizeof(int32_t));
    L.act = off, off += up64(L.act_row * (size_t)n);
    // the 32-element formats' activation block sums, for repacked experts (reserved either way)
    L.asum = off, off += dot_family(t) == DotFamily::Q32 ? act_sum_bytes(cols, n) : 0;
    L.out = off, off += up64((size_t)n * (size_t)rows * sizeof(float));
    // With one activation row per token and k > 1, each row is quantized once, here, then copied.
    L.once = off, off += k > 1 && !L.float_w ? up64(L.act_row * (size_t)n_tok) : 0;
    // the row kernels' regrouped activations (Q4_0/Q4_1), for every sorted row
    L.nib_row = nib_act_row_bytes(t, cols);
    L.nib = off, off += up64(L.nib_row * (size_t)n);
    L.stage = off;
#ifdef STOWLM_X86
    // One expert's group: n_tok entries when a token's picks are distinct (a router's are), up to
    // n_tok * k when a caller repeats an expert; sized for the latter.
    if (!L.float_w && n >= kBatchMinTokens) off += up64(L.act_row * (size_t)n) + batched_scratch_extra(t, cols, n);
#endif
    L.total = off + 64;  // alignment of the base
    return L;
}

}  // namespace

size_t mul_mat_id_scratch_bytes(QType wtype, int64_t rows, int64_t cols, int64_t n_expert, int64_t k,
                                int64_t n_tok) {
    matmul_check_type_cols(wtype, cols);
    return layout(wtype, std::max<int64_t>(rows, 0), cols, std::max<int64_t>(n_expert, 1), std::max<int64_t>(k, 0),
                  std::max<int64_t>(n_tok, 0))
        .total;
}

void mul_mat_id(const WeightRef& w, int64_t n_expert, const int32_t* ids, int64_t k, const float* x, int64_t x_rows,
                int64_t ldx, int64_t n_tok, float* y, int64_t ldy, void* scratch, ThreadPool& pool) {
    matmul_check_type_cols(w.type, w.cols);
    if (w.rows < 0 || n_tok < 0 || k < 0 || n_expert <= 0)
        throw InvalidInput("mul_mat_id: negative rows, n_tok or k, or no experts");
    if (x_rows != 1 && x_rows != k)
        throw InvalidInput("mul_mat_id: x_rows=" + std::to_string(x_rows) + " must be 1 or k=" + std::to_string(k));
    if (ldx < w.cols || ldy < w.rows) throw InvalidInput("mul_mat_id: ldx must be >= cols and ldy >= rows");
    if (w.rows == 0 || n_tok == 0 || k == 0) return;
    if (!w.data || !x || !y || !ids || !scratch) throw InvalidInput("mul_mat_id: null pointer argument");
    const int64_t n = n_tok * k;
    for (int64_t i = 0; i < n; i++)
        if (ids[i] < -1 || ids[i] >= n_expert)
            throw InvalidInput("mul_mat_id: expert id " + std::to_string(ids[i]) + " (token " + std::to_string(i / k) +
                               ", slot " + std::to_string(i % k) + ") is outside [-1, " + std::to_string(n_expert) +
                               ")");

    const Layout L = layout(w.type, w.rows, w.cols, n_expert, k, n_tok);
    uint8_t* base = (uint8_t*)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
    int64_t* offs = (int64_t*)(base + L.offsets);
    int32_t* entries = (int32_t*)(base + L.entries);
    uint8_t* act = base + L.act;
    float* ys = (float*)(base + L.out);

    // Counting sort of the (token, slot) pairs by expert.
    // Id -1: the slot's expert is not here (tensor parallelism's other shards): no product,
    // a zero row.
    std::fill(offs, offs + n_expert + 1, 0);
    for (int64_t i = 0; i < n; i++)
        if (ids[i] >= 0) offs[ids[i] + 1]++;
    for (int64_t e = 0; e < n_expert; e++) offs[e + 1] += offs[e];
    const int64_t n_valid = offs[n_expert];
    {
        std::vector<int64_t> fill(offs, offs + n_expert);
        for (int64_t i = 0; i < n; i++)
            if (ids[i] >= 0) entries[fill[ids[i]]++] = (int32_t)i;
    }

    const Isa isa = active_isa();
    const DotFamily fam = dot_family(w.type);
    // Activations in sorted order: quantized rows, or the float rows themselves for float weights.
    // Small jobs (a generated token's k rows) run on the caller: waking the pool costs more.
    auto for_rows = [&](int64_t count, int64_t work, auto&& fn) {
        if (work < kInlineWork) fn(0, count, 0);
        else pool.parallel_for(count, fn);
    };
    auto quantize = [&](const float* xr, uint8_t* dst) { quantize_act(isa, fam, xr, dst, w.cols); };
    const bool once = k > 1 && x_rows == 1 && !L.float_w;
    uint8_t* qx = base + L.once;
    if (once)
        for_rows(n_tok, n_tok * w.cols, [&](int64_t t0, int64_t t1, int) {
            for (int64_t t = t0; t < t1; t++) quantize(x + t * ldx, qx + (size_t)t * L.act_row);
        });
    for_rows(n_valid, n_valid * w.cols, [&](int64_t p0, int64_t p1, int) {
        for (int64_t p = p0; p < p1; p++) {
            const int64_t i = entries[p], t = i / k, j = i % k;
            uint8_t* dst = act + (size_t)p * L.act_row;
            if (once) {
                memcpy(dst, qx + (size_t)t * L.act_row, L.act_row);
                continue;
            }
            const float* xr = x + (t * x_rows + (x_rows == 1 ? 0 : j)) * ldx;
            if (L.float_w) memcpy(dst, xr, (size_t)w.cols * sizeof(float));
            else quantize(xr, dst);
        }
    });

    // repacked experts: their offsets' block sums, once for every sorted row
    int32_t* asum = w.rows16 && fam == DotFamily::Q32 ? (int32_t*)(base + L.asum) : nullptr;
    if (asum) {
        MatmulArgs S;
        S.type = w.type, S.cols = w.cols, S.n_tok = n_valid;
        S.act = act, S.act_stride = L.act_row, S.asum = asum;
        prepare_r16(S, pool);
    }
    const bool nib = L.nib_row && matmul_rows_read_nib(isa) && !w.rows16;
    const size_t wrow = row_bytes(w.type, w.cols);
    const size_t expert_bytes = wrow * (size_t)w.rows;
    auto args_for = [&](int64_t e) {
        MatmulArgs A;
        A.type = w.type;
        A.w = (const uint8_t*)w.data + (size_t)e * expert_bytes;
        A.w_stride = wrow;
        A.rows = w.rows, A.cols = w.cols;
        A.x = (const float*)(act + (size_t)offs[e] * L.act_row);
        A.ldx = w.cols;
        A.act = act + (size_t)offs[e] * L.act_row;
        A.act_stride = L.act_row;
        A.n_tok = offs[e + 1] - offs[e];
        A.y = ys + offs[e] * w.rows;
        A.ldy = w.rows;
        A.rows16 = w.rows16;
        A.asum = asum ? asum + offs[e] * (w.cols / QK) : nullptr;
        return A;
    };

    // Large groups go through AMX one expert at a time (all threads on its rows); the rest are
    // cut into row chunks of every picked expert and shared out dynamically.
    std::vector<int64_t> small;
    for (int64_t e = 0; e < n_expert; e++) {
        const int64_t cnt = offs[e + 1] - offs[e];
        if (!cnt) continue;
#ifdef STOWLM_X86
        MatmulArgs A = args_for(e);
        if (!L.float_w && cnt >= kBatchMinTokens && !r16_rows(A, isa)) {
            // The batched kernels keep per-call data right after the activations: give them a
            // private copy.
            uint8_t* stage = base + L.stage;
            memcpy(stage, A.act, (size_t)cnt * L.act_row);
            A.act = stage;
            if (matmul_batched(A, isa, pool)) continue;
        }
#endif
        small.push_back(e);
    }
    if (!small.empty()) {
        const RowsFn rows_fn = w.rows16 ? matmul_r16_rows : matmul_rows_for(isa);
        const int64_t nth = pool.size(), align = w.rows16 ? kRepackRows : 4;  // repacked: whole groups
        int64_t chunk = (w.rows * (int64_t)small.size() + nth * 8 - 1) / (nth * 8);
        chunk = std::min<int64_t>(w.rows, std::max<int64_t>(align, (chunk + align - 1) / align * align));
        const int64_t per_expert = (w.rows + chunk - 1) / chunk;
        std::vector<MatmulArgs> args;
        for (int64_t e : small) {
            args.push_back(args_for(e));
            if (nib) {  // the row kernels' regrouped activations, for these rows only
                MatmulArgs& A = args.back();
                A.act_nib = base + L.nib + (size_t)offs[e] * L.nib_row, A.nib_stride = L.nib_row;
                build_nib_acts(A, (void*)A.act_nib, A.nib_stride);
            }
        }
        pool.parallel_for_dynamic((int64_t)small.size() * per_expert, 1, [&](int64_t b, int64_t end, int) {
            for (int64_t item = b; item < end; item++) {
                const MatmulArgs& A = args[item / per_expert];
                const int64_t r0 = (item % per_expert) * chunk;
                rows_fn(A, r0, std::min(w.rows, r0 + chunk));
            }
        });
    }

    // Back to (token, slot) order.
    if (n_valid < n)
        for (int64_t i = 0; i < n; i++)
            if (ids[i] < 0) std::fill(y + i * ldy, y + i * ldy + w.rows, 0.0f);
    for_rows(n_valid, n_valid * w.rows, [&](int64_t p0, int64_t p1, int) {
        for (int64_t p = p0; p < p1; p++)
            memcpy(y + (int64_t)entries[p] * ldy, ys + p * w.rows, (size_t)w.rows * sizeof(float));
    });
}

}  // namespace stowlm::cpu
