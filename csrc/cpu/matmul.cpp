// matmul: argument checks, activation quantization, dispatch to the active ISA path, and the
// scalar reference path (plain loops over the shared block arithmetic of quant/dot.h).
#include "cpu/matmul.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "cpu/cpu_features.h"
#include "cpu/matmul_impl.h"
#include "cpu/repack.h"
#include "error.h"

namespace stowlm::cpu {

namespace {

constexpr int64_t kInlineQuantElems = 1 << 14;

struct ScalarKern {
    static float dot_q32(const int8_t* q, const float* d, const float* m, const block_q8_a* a, int64_t nb) {
        float s = 0;
        for (int64_t b = 0; b < nb; b++) s += stowlm::dot_q32(q + b * QK, d[b], m[b], a[b]);
        return s;
    }
    static float dot_qk(const int8_t* q, const int16_t* sc, const int16_t* mn, const float* d, const float* dmin,
                        const block_q8_K32* a, int64_t nsb) {
        float s = 0;
        for (int64_t b = 0; b < nsb; b++)
            s += stowlm::dot_qk(q + b * QK_K, sc + 16 * b, mn + 16 * b, d[b], dmin[b], a[b]);
        return s;
    }
    static float dot_f(const float* w, const float* x, int64_t n) {
        float s = 0;
        for (int64_t i = 0; i < n; i++) s += w[i] * x[i];
        return s;
    }
    static void to_f32(QType t, const void* src, float* dst, int64_t n) {
        const uint16_t* h = (const uint16_t*)src;
        if (t == QType::F16)
            for (int64_t i = 0; i < n; i++) dst[i] = fp16_to_f32(h[i]);
        else
            for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(h[i]);
    }
};

bool type_supported(QType t) {
    switch (t) {
        case QType::F32: case QType::F16: case QType::BF16: case QType::Q4_0: case QType::Q4_1:
        case QType::Q5_0: case QType::Q5_1: case QType::Q8_0: case QType::Q2_K: case QType::Q3_K:
        case QType::Q4_K: case QType::Q5_K: case QType::Q6_K: case QType::Q8_K: case QType::IQ4_NL:
        case QType::IQ4_XS: case QType::MXFP4: case QType::IQ2_XXS: case QType::IQ2_XS: case QType::IQ2_S:
        case QType::IQ3_XXS: case QType::IQ3_S: case QType::IQ1_S: case QType::IQ1_M: return true;
        default: return false;
    }
}

void check_type_cols(QType t, int64_t cols) {
    const QTypeInfo* info = qtype_info((uint32_t)t);
    if (!info || !type_supported(t))
        throw InvalidInput(std::string("matmul: weight type ") + (info ? info->name : "id " + std::to_string((uint32_t)t)) +
                           " is not supported");
    if (cols <= 0 || cols % info->block_elems != 0)
        throw InvalidInput("matmul: cols=" + std::to_string(cols) + " is not a positive multiple of the " +
                           info->name + " block size " + std::to_string(info->block_elems));
}

size_t act_row_bytes(QType t, int64_t cols) {
    switch (dot_family(t)) {
        case DotFamily::Float: return 0;
        case DotFamily::Q32: return (size_t)(cols / QK) * sizeof(block_q8_a);
        default: return (size_t)(cols / QK_K) * sizeof(block_q8_K32);
    }
}

}  // namespace

void matmul_check_type_cols(QType t, int64_t cols) { check_type_cols(t, cols); }
size_t matmul_act_row_bytes(QType t, int64_t cols) { return act_row_bytes(t, cols); }

size_t matmul_scratch_bytes(QType wtype, int64_t cols, int64_t n_tok, bool batched) {
    check_type_cols(wtype, cols);
    n_tok = n_tok > 0 ? n_tok : 0;
    size_t bytes = act_row_bytes(wtype, cols) * (size_t)n_tok + 64;
    if (dot_family(wtype) == DotFamily::Q32) bytes += act_sum_bytes(cols, n_tok);
#ifdef STOWLM_X86
    // after the activations: the batched kernels' data, or the row kernels' regrouped activations
    if (dot_family(wtype) != DotFamily::Float && (n_tok >= kBatchMinTokens || batched))
        bytes += batched_scratch_extra(wtype, cols, n_tok);
    else bytes += nib_act_row_bytes(wtype, cols) * (size_t)n_tok + 64;
#endif
    return bytes;
}

int nib_act_kind(QType t, int64_t cols) {
    const bool pairs = (cols / QK) % 2 == 0;
    switch (t) {
        case QType::Q4_0: case QType::Q4_1: return 1;
        case QType::Q8_0: case QType::IQ4_NL: case QType::MXFP4: return pairs ? 2 : 0;
        case QType::Q5_0: return pairs ? 3 : 0;
        case QType::Q5_1: return pairs ? 4 : 0;
        case QType::Q4_K: case QType::Q5_K: return 5;
        default: return 0;
    }
}

size_t nib_act_row_bytes(QType t, int64_t cols) {
    const int kind = nib_act_kind(t, cols);
    if (kind == 1) return (size_t)((cols / QK + 3) / 4) * sizeof(NibGroup);
    if (kind == 5) return (size_t)(cols / QK_K) * sizeof(K4Group);
    return kind ? (size_t)(cols / QK / 2) * sizeof(PairGroup) : 0;
}

void build_nib_acts(const MatmulArgs& A, void* dst, size_t nib_stride) {
    const int kind = nib_act_kind(A.type, A.cols);
    const int64_t nb = A.cols / QK, ng = (nb + 3) / 4;
    if (kind == 5) {
        if (A.n_tok == 1) return;  // one token reads A.act
        for (int64_t t = 0; t < A.n_tok; t++) {
            const block_q8_K32* a = (const block_q8_K32*)((const uint8_t*)A.act + t * A.act_stride);
            K4Group* g = (K4Group*)((uint8_t*)dst + t * nib_stride);
            for (int64_t b = 0; b < A.cols / QK_K; b++) {
                static const int src[8] = {0, 64, 32, 96, 128, 192, 160, 224};
                for (int c = 0; c < 8; c++) memcpy(g[b].qs + 32 * c, a[b].qs + src[c], 32);
                for (int k = 0; k < 8; k++) {
                    g[b].v[k] = a[b].d[k];
                    g[b].v[8 + k] = (float)(int16_t)(a[b].bsums[2 * k] + a[b].bsums[2 * k + 1]) * a[b].d[k];
                }
            }
        }
        return;
    }
    for (int64_t t = 0; t < A.n_tok; t++) {
        const block_q8_a* a = (const block_q8_a*)((const uint8_t*)A.act + t * A.act_stride);
        if (kind >= 2) {
            const int off = kind == 2 ? 128 : kind == 3 ? 16 : 0;
            PairGroup* g = (PairGroup*)((uint8_t*)dst + t * nib_stride);
            for (int64_t p = 0; p < nb / 2; p++) {
                PairGroup& G = g[p];
                memcpy(G.qs, a[2 * p].qs, 32);
                memcpy(G.qs + 32, a[2 * p + 1].qs, 32);
                for (int l = 0; l < 16; l++) {
                    int sum = 0;
                    for (int k = 0; k < 4; k++) sum += G.qs[4 * l + k];
                    G.neg[l] = -off * sum;
                    G.d[l] = a[2 * p + l / 8].d;
                }
                for (int l = 0; l < 8; l++) G.s[l] = a[2 * p + l / 4].s;
            }
            continue;
        }
        NibGroup* g = (NibGroup*)((uint8_t*)dst + t * nib_stride);
        for (int64_t gi = 0; gi < ng; gi++) {
            NibGroup& G = g[gi];
            memset(&G, 0, sizeof G);
            for (int i = 0; i < 4 && 4 * gi + i < nb; i++) {
                const block_q8_a& b = a[4 * gi + i];
                memcpy(G.lo + 16 * i, b.qs, 16);
                memcpy(G.hi + 16 * i, b.qs + 16, 16);
                for (int k = 0; k < 4; k++) G.d4[4 * i + k] = b.d, G.s4[4 * i + k] = b.s;
            }
            for (int l = 0; l < 16; l++) {
                int sum = 0;
                for (int k = 0; k < 4; k++) sum += G.lo[4 * l + k] + G.hi[4 * l + k];
                G.neg8[l] = -8 * sum;
            }
        }
    }
}

#ifdef STOWLM_X86
size_t batched_scratch_extra(QType t, int64_t cols, int64_t n_tok) {
    return std::max(amx_scratch_extra(t, cols, n_tok), gemm_scratch_extra(t, cols, n_tok));
}

bool matmul_batched(const MatmulArgs& A, Isa isa, ThreadPool& pool) {
    if (A.n_tok < kBatchMinTokens && !A.batched) return false;
    if (isa == Isa::AMX && (A.n_tok >= kAmxMinTokens || A.batched) && matmul_amx(A, pool)) return true;
    if (isa == Isa::AVX2) return matmul_gemm_avx2(A, pool);
    return (isa == Isa::AMX || isa == Isa::AVX512_VNNI) && matmul_gemm_vnni(A, pool);
}
#endif

void quantize_act_scalar(DotFamily fam, const float* x, void* dst, int64_t n) {
    if (fam == DotFamily::Q32) quantize_row_q8_a(x, (block_q8_a*)dst, n);
    else quantize_row_q8_K32(x, (block_q8_K32*)dst, n);
}

void quantize_act(Isa isa, DotFamily fam, const float* x, void* dst, int64_t n) {
#ifdef STOWLM_X86
    if (isa != Isa::Scalar) return quantize_act_avx2(fam, x, dst, n);
#endif
    (void)isa;
    quantize_act_scalar(fam, x, dst, n);
}

void quantize_activations(QType wtype, int64_t cols, const float* x, int64_t n_tok, int64_t ldx, void* dst) {
    check_type_cols(wtype, cols);
    if (n_tok < 0 || ldx < cols) throw InvalidInput("quantize_activations: n_tok < 0 or ldx < cols");
    const DotFamily fam = dot_family(wtype);
    const size_t rb = act_row_bytes(wtype, cols);
    if (fam == DotFamily::Float) return;
    const Isa isa = active_isa();
    for (int64_t t = 0; t < n_tok; t++) quantize_act(isa, fam, x + t * ldx, (uint8_t*)dst + t * rb, cols);
}

void matmul_rows_scalar(const MatmulArgs& a, int64_t r0, int64_t r1) { rows_generic<ScalarKern>(a, r0, r1); }

namespace {

void check_call(const WeightRef& w, const float* x, int64_t n_tok, int64_t ldx, const float* y, int64_t ldy,
                const void* scratch) {
    check_type_cols(w.type, w.cols);
    if (w.rows < 0 || n_tok < 0) throw InvalidInput("matmul: negative rows or n_tok");
    if (ldx < w.cols || ldy < w.rows)
        throw InvalidInput("matmul: ldx must be >= cols and ldy >= rows");
    if (w.rows == 0 || n_tok == 0) return;
    if (!w.data || !x || !y) throw InvalidInput("matmul: null weight, activation or output pointer");
    if (w.rows16 && !repack_supported(w.type, w.rows, w.cols))
        throw InvalidInput("matmul: a " + std::string(qtype_checked((uint32_t)w.type).name) + " matrix of " +
                           std::to_string(w.rows) + " rows cannot be in 16-row groups");
    if (dot_family(w.type) != DotFamily::Float && !scratch) throw InvalidInput("matmul: scratch is null");
}

MatmulArgs make_args(const WeightRef& w, const float* x, int64_t n_tok, int64_t ldx, float* y, int64_t ldy,
                     void* scratch) {
    MatmulArgs A;
    A.type = w.type;
    A.w = (const uint8_t*)w.data;
    A.w_stride = row_bytes(w.type, w.cols);
    A.rows = w.rows, A.cols = w.cols;
    A.x = x, A.ldx = ldx;
    A.act_stride = act_row_bytes(w.type, w.cols);
    A.rows16 = w.rows16;
    // 64-byte aligned: the 32-element formats' block sums (repack.h), then the activations
    uintptr_t p = ((uintptr_t)scratch + 63) & ~(uintptr_t)63;
    if (dot_family(w.type) == DotFamily::Q32) {
        A.asum = (const int32_t*)p;
        p += act_sum_bytes(w.cols, n_tok);
    }
    A.act = (const void*)p;
    A.n_tok = n_tok, A.y = y, A.ldy = ldy;
    return A;
}

// Activations are quantized once per call, split over tokens (or over blocks for one token).
void quantize_acts(const MatmulArgs& A, ThreadPool& pool) {
    const DotFamily fam = dot_family(A.type);
    if (fam == DotFamily::Float) return;
    const Isa isa = active_isa();
    uint8_t* act = (uint8_t*)A.act;
    const int64_t nblk = fam == DotFamily::Q32 ? A.cols / QK : A.cols / QK_K;
    const int64_t belems = fam == DotFamily::Q32 ? QK : QK_K;
    auto quantize = [&](int64_t b, int64_t e, int) {
        // contiguous runs of blocks within one token
        while (b < e) {
            const int64_t t = b / nblk, j = b % nblk;
            const int64_t n = std::min(e - b, nblk - j);
            const float* xs = A.x + t * A.ldx + j * belems;
            uint8_t* dst = act + t * A.act_stride;
            void* blk = dst + j * (fam == DotFamily::Q32 ? sizeof(block_q8_a) : sizeof(block_q8_K32));
            quantize_act(isa, fam, xs, blk, n * belems);
            b += n;
        }
    };
    // A few tokens quantize in about a microsecond: less than waking the workers costs.
    if (A.n_tok * A.cols <= kInlineQuantElems) quantize(0, A.n_tok * nblk, 0);
    else pool.parallel_for(A.n_tok * nblk, quantize);
}

}  // namespace

RowsFn matmul_rows_for(Isa isa) {
#ifdef STOWLM_X86
    if (isa == Isa::AVX2) return matmul_rows_avx2;
    if (isa == Isa::AVX512_VNNI || isa == Isa::AMX) return matmul_rows_avx512;
#endif
    (void)isa;
    return matmul_rows_scalar;
}

bool matmul_rows_read_nib(Isa isa) {
#ifdef STOWLM_X86
    return matmul_rows_for(isa) == matmul_rows_avx512;
#else
    (void)isa;
    return false;
#endif
}

namespace {

#ifdef STOWLM_X86
// The AVX-512 row kernels of the 32-element formats read regrouped activations (NibGroup,
// PairGroup): made once per call, after the quantized ones, and shared by every matrix of the
// call of one kind (same cols, same act); the others read A.act. Q4_0/Q4_1 always get theirs
// (their kernel without them sums differently); the PairGroup kernels give the same results
// either way.
void attach_nib_acts(MatmulArgs* A, int n, Isa isa) {
    if (!matmul_rows_read_nib(isa)) return;
    auto kind_of = [&](int i) { return A[i].rows16 ? 0 : nib_act_kind(A[i].type, A[i].cols); };  // repacked: none
    int first = 0;
    while (first < n && kind_of(first) != 1) first++;
    if (first == n) {
        first = 0;
        while (first < n && !kind_of(first)) first++;
    }
    if (first == n) return;
    const int kind = nib_act_kind(A[first].type, A[first].cols);
    const size_t stride = nib_act_row_bytes(A[first].type, A[first].cols);
    void* dst = (void*)(((uintptr_t)A[0].act + A[0].act_stride * A[0].n_tok + 63) & ~(uintptr_t)63);
    build_nib_acts(A[first], dst, stride);
    for (int i = 0; i < n; i++)
        if (kind_of(i) == kind) A[i].act_nib = dst, A[i].nib_stride = stride;
}
#endif

// One chunk of rows per thread: each streams its rows front to back (the hardware prefetcher
// and the kernels' next-tile prefetch stay on one stream) and the shared counter is touched once
// per thread. Measured on 2 threads: 16 chunks gave smollm2 tg128 281 t/s, 2 chunks 318.
int64_t row_chunk(int64_t rows, int nth) {
    const int64_t chunk = (rows + nth - 1) / nth;
    return std::max<int64_t>(4, (chunk + 3) & ~(int64_t)3);
}

// Repacked weights: groups of 16 rows split as row_chunk splits rows (every ISA's kernels give
// the scalar ones' bits).
RowsFn r16_rows_for(Isa isa) {
#ifdef STOWLM_X86
    if (isa == Isa::AVX512_VNNI || isa == Isa::AMX) return matmul_r16_avx512;
    if (isa == Isa::AVX2) return matmul_r16_avx2;
#endif
    (void)isa;
    return matmul_r16_scalar;
}
// Work units of a repacked matrix: its groups of 16 rows, then its tail rows as one more.
int64_t r16_units(int64_t rows) { return (rows + kRepackRows - 1) / kRepackRows; }
int64_t group_chunk(int64_t rows, int nth) { return std::max<int64_t>(1, (r16_units(rows) + nth - 1) / nth); }
void r16_part(RowsFn fn, const MatmulArgs& A, int64_t u0, int64_t u1) {
    const int64_t groups = A.rows / kRepackRows;
    if (u0 < groups) fn(A, u0, std::min(u1, groups));
    if (u1 > groups) matmul_r16_tail(A);
}

// Tokens [t0, t0 + n) of A alone (the row kernels give a token the same product in any batch).
MatmulArgs token_block(const MatmulArgs& A, int64_t t0, int64_t n) {
    MatmulArgs B = A;
    B.x = A.x ? A.x + t0 * A.ldx : nullptr;
    B.act = (const uint8_t*)A.act + t0 * A.act_stride;
    B.act_nib = A.act_nib ? (const uint8_t*)A.act_nib + t0 * A.nib_stride : nullptr;
    B.asum = A.asum ? A.asum + t0 * (A.cols / QK) : nullptr;
    B.y = A.y + t0 * A.ldy;
    B.n_tok = n;
    return B;
}

// A token block's activations stay in L2 while a thread's row groups stream past them (without
// blocks the repacked kernels lost a fifth at 512 tokens: 4864x896 Q5_0 530 -> 420 GOP/s).
constexpr int64_t kR16TokenBlock = 64;

// A repacked matrix over any number of tokens: token blocks, each over all the row groups.
void r16_run(const MatmulArgs& A, Isa isa, ThreadPool& pool) {
    const RowsFn fn = r16_rows_for(isa);
    const int64_t units = r16_units(A.rows), chunk = group_chunk(A.rows, pool.size());
    const int64_t n_chunks = (units + chunk - 1) / chunk;
    const int64_t n_blocks = (A.n_tok + kR16TokenBlock - 1) / kR16TokenBlock;
    pool.parallel_for_dynamic(n_chunks * n_blocks, 1, [&](int64_t c, int64_t, int) {
        const int64_t t0 = c / n_chunks * kR16TokenBlock, u0 = c % n_chunks * chunk;
        r16_part(fn, token_block(A, t0, std::min(kR16TokenBlock, A.n_tok - t0)), u0, std::min(units, u0 + chunk));
    });
}

}  // namespace

// The VNNI GEMM must first unpack repacked rows into its panels (4864x896 Q4_0/Q5_0/Q8_0 and
// 896x4864 Q3_K-Q6_K at 24-48 tokens: GEMM 160-530 GOP/s, row kernels 380-630; even at 64, ahead
// from 96-128). A pass forced onto the batched kernels takes the GEMM, the largest passes' class.
bool r16_rows(const MatmulArgs& A, Isa isa) {
    return A.rows16 && isa != Isa::AMX && !A.batched && A.n_tok < kCpuR16RowsMax;
}

void prepare_r16(const MatmulArgs& A, ThreadPool& pool) {
    const int64_t nb = A.cols / QK;
    int32_t* sums = const_cast<int32_t*>(A.asum);
    auto run = [&](int64_t t0, int64_t t1, int) { act_block_sums(token_block(A, t0, t1 - t0), sums + t0 * nb); };
    if (A.n_tok * A.cols <= kInlineQuantElems) run(0, A.n_tok, 0);
    else pool.parallel_for(A.n_tok, run);
}
void matmul_r16_rows(const MatmulArgs& A, int64_t r0, int64_t r1) {
    r16_part(r16_rows_for(active_isa()), A, r0 / kRepackRows, r16_units(r1));
}

void matmul(const WeightRef& w, const float* x, int64_t n_tok, int64_t ldx, float* y, int64_t ldy, void* scratch,
            ThreadPool& pool, bool batched) {
    check_call(w, x, n_tok, ldx, y, ldy, scratch);
    if (w.rows == 0 || n_tok == 0) return;
    MatmulArgs A = make_args(w, x, n_tok, ldx, y, ldy, scratch);
    A.batched = batched;
    quantize_acts(A, pool);
    const Isa isa = active_isa();
#ifdef STOWLM_X86
    if (!r16_rows(A, isa) && matmul_batched(A, isa, pool)) return;  // the panels unpack repacked rows
#endif
    if (A.rows16) {
        if (A.asum) prepare_r16(A, pool);  // the 32-element formats' offsets
        r16_run(A, isa, pool);
        return;
    }
#ifdef STOWLM_X86
    attach_nib_acts(&A, 1, isa);
#endif
    const RowsFn rows_fn = matmul_rows_for(isa);
    pool.parallel_for_dynamic(w.rows, row_chunk(w.rows, pool.size()),
                              [&](int64_t r0, int64_t r1, int) { rows_fn(A, r0, r1); });
}

void matmul_multi(const WeightRef* ws, int n_w, const float* x, int64_t n_tok, int64_t ldx, float* const* ys,
                  const int64_t* ldys, void* scratch, ThreadPool& pool, bool batched) {
    if (n_w <= 0) return;
    bool shared = n_w <= kMaxMulti;
    for (int i = 0; i < n_w && shared; i++) {
        check_call(ws[i], x, n_tok, ldx, ys[i], ldys[i], scratch);
        shared = ws[i].cols == ws[0].cols && act_row_bytes(ws[i].type, ws[i].cols) == act_row_bytes(ws[0].type, ws[0].cols) &&
                 dot_family(ws[i].type) == dot_family(ws[0].type) && ws[i].rows > 0;
    }
    if (!shared || n_tok == 0) {
        for (int i = 0; i < n_w; i++) matmul(ws[i], x, n_tok, ldx, ys[i], ldys[i], scratch, pool, batched);
        return;
    }
    // One quantization (the activation format depends on the family only) and one pass of the
    // pool over all the matrices' rows: a single wake-up and barrier instead of one per matrix.
    MatmulArgs A[kMaxMulti];
    int64_t chunk[kMaxMulti], first[kMaxMulti + 1];
    first[0] = 0;
    for (int i = 0; i < n_w; i++) {
        A[i] = make_args(ws[i], x, n_tok, ldx, ys[i], ldys[i], scratch);
        A[i].batched = batched;
        // repacked matrices are cut in groups of 16 rows (units of their chunks)
        const int64_t units = A[i].rows16 ? r16_units(ws[i].rows) : ws[i].rows;
        chunk[i] = A[i].rows16 ? group_chunk(ws[i].rows, pool.size()) : row_chunk(ws[i].rows, pool.size());
        first[i + 1] = first[i] + (units + chunk[i] - 1) / chunk[i];
    }
    quantize_acts(A[0], pool);
    bool any16 = false;
    for (int i = 0; i < n_w; i++) any16 = any16 || A[i].rows16;
    if (any16 && A[0].asum) prepare_r16(A[0], pool);  // the sums are the same for every matrix of the call
    const Isa isa = active_isa();
    const RowsFn rows_fn = matmul_rows_for(isa), r16_fn = r16_rows_for(isa);
    auto part = [&](int i, int64_t u0) {
        if (A[i].rows16) return r16_part(r16_fn, A[i], u0, std::min(r16_units(A[i].rows), u0 + chunk[i]));
        rows_fn(A[i], u0, std::min(A[i].rows, u0 + chunk[i]));
    };
#ifdef STOWLM_X86
    if (n_tok >= kBatchMinTokens || batched) {
        // a batch: the activations quantized once, each matrix through the batched kernel
        for (int i = 0; i < n_w; i++) {
            if (r16_rows(A[i], isa)) r16_run(A[i], isa, pool);
            else if (!matmul_batched(A[i], isa, pool))
                pool.parallel_for_dynamic(first[i + 1] - first[i], 1,
                                          [&](int64_t c, int64_t, int) { part(i, c * chunk[i]); });
        }
        return;
    }
    attach_nib_acts(A, n_w, isa);
#endif
    pool.parallel_for_dynamic(first[n_w], 1, [&](int64_t c, int64_t, int) {
        int i = 0;
        while (c >= first[i + 1]) i++;
        part(i, (c - first[i]) * chunk[i]);
    });
}

}  // namespace stowlm::cpu
