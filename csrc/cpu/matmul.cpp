// matmul: argument checks, activation quantization, dispatch to the active ISA path, and the
// scalar reference path (plain loops over the shared block arithmetic of quant/dot.h).
#include "cpu/matmul.h"

#include <algorithm>
#include <string>

#include "cpu/cpu_features.h"
#include "cpu/matmul_impl.h"
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
        case QType::IQ4_XS: return true;
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

size_t matmul_scratch_bytes(QType wtype, int64_t cols, int64_t n_tok) {
    check_type_cols(wtype, cols);
    n_tok = n_tok > 0 ? n_tok : 0;
    size_t bytes = act_row_bytes(wtype, cols) * (size_t)n_tok + 64;
#ifdef STOWLM_X86
    if (dot_family(wtype) != DotFamily::Float && n_tok >= kAmxMinTokens) bytes += amx_scratch_extra(wtype, cols, n_tok);
#endif
    return bytes;
}

void quantize_act_scalar(DotFamily fam, const float* x, void* dst, int64_t n) {
    if (fam == DotFamily::Q32) quantize_row_q8_a(x, (block_q8_a*)dst, n);
    else quantize_row_q8_K32(x, (block_q8_K32*)dst, n);
}

void matmul_rows_scalar(const MatmulArgs& a, int64_t r0, int64_t r1) { rows_generic<ScalarKern>(a, r0, r1); }

void matmul(const WeightRef& w, const float* x, int64_t n_tok, int64_t ldx, float* y, int64_t ldy, void* scratch,
            ThreadPool& pool) {
    check_type_cols(w.type, w.cols);
    if (w.rows < 0 || n_tok < 0) throw InvalidInput("matmul: negative rows or n_tok");
    if (ldx < w.cols || ldy < w.rows)
        throw InvalidInput("matmul: ldx must be >= cols and ldy >= rows");
    if (w.rows == 0 || n_tok == 0) return;
    if (!w.data || !x || !y) throw InvalidInput("matmul: null weight, activation or output pointer");
    const DotFamily fam = dot_family(w.type);
    if (fam != DotFamily::Float && !scratch) throw InvalidInput("matmul: scratch is null");

    MatmulArgs A;
    A.type = w.type;
    A.w = (const uint8_t*)w.data;
    A.w_stride = row_bytes(w.type, w.cols);
    A.rows = w.rows, A.cols = w.cols;
    A.x = x, A.ldx = ldx;
    A.act_stride = act_row_bytes(w.type, w.cols);
    // 64-byte aligned activations for the SIMD loads
    A.act = (const void*)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
    A.n_tok = n_tok, A.y = y, A.ldy = ldy;

    const Isa isa = active_isa();
    // Activations are quantized once per call, split over tokens (or over blocks for one token).
    if (fam != DotFamily::Float) {
        uint8_t* act = (uint8_t*)A.act;
        const int64_t nblk = fam == DotFamily::Q32 ? w.cols / QK : w.cols / QK_K;
        const int64_t belems = fam == DotFamily::Q32 ? QK : QK_K;
        auto quantize = [&](int64_t b, int64_t e, int) {
            // contiguous runs of blocks within one token
            while (b < e) {
                const int64_t t = b / nblk, j = b % nblk;
                const int64_t n = std::min(e - b, nblk - j);
                const float* xs = x + t * ldx + j * belems;
                uint8_t* dst = act + t * A.act_stride;
                void* blk = dst + j * (fam == DotFamily::Q32 ? sizeof(block_q8_a) : sizeof(block_q8_K32));
#ifdef STOWLM_X86
                if (isa != Isa::Scalar) quantize_act_avx2(fam, xs, blk, n * belems);
                else
#endif
                    quantize_act_scalar(fam, xs, blk, n * belems);
                b += n;
            }
        };
        // A few tokens quantize in about a microsecond: less than waking the workers costs.
        if (n_tok * w.cols <= kInlineQuantElems) quantize(0, n_tok * nblk, 0);
        else pool.parallel_for(n_tok * nblk, quantize);
    }

#ifdef STOWLM_X86
    if (isa == Isa::AMX && matmul_amx(A, pool)) return;
#endif
    void (*rows_fn)(const MatmulArgs&, int64_t, int64_t) = matmul_rows_scalar;
#ifdef STOWLM_X86
    if (isa == Isa::AVX2) rows_fn = matmul_rows_avx2;
    else if (isa == Isa::AVX512_VNNI || isa == Isa::AMX) rows_fn = matmul_rows_avx512;
#endif
    // Chunks of rows: small enough to balance threads, large enough to stream weights.
    const int64_t nth = pool.size();
    int64_t chunk = (w.rows + nth * 8 - 1) / (nth * 8);
    chunk = std::max<int64_t>(4, (chunk + 3) & ~(int64_t)3);
    pool.parallel_for_dynamic(w.rows, chunk, [&](int64_t r0, int64_t r1, int) { rows_fn(A, r0, r1); });
}

}  // namespace stowlm::cpu
