// AVX2 path for batched products (prompt processing) on CPUs without AVX-512: the VNNI GEMM's
// scheme on 8-row panels (YMM lane = row, 4 consecutive weights per lane), with vpmaddubsw in
// place of vpdpbusd. maddubs multiplies unsigned by signed bytes and saturates its pair sums
// at int16, so the weights go in as q + off with a per-format offset that leaves them in
// [0, 63]: two products of at most 63 x 127 per pair, and two pairs added, stay below 32767.
// Formats that need up to [0, 127] (IQ2 grids up to 43, IQ3_XXS up to 62) widen each maddubs
// result on its own ("wide": one more madd per 8 elements). The formats whose quants span a
// full byte (Q8_0, IQ4_NL, IQ4_XS, Q8_K) keep the row kernels.
#include <immintrin.h>

#include "cpu/matmul_gemm.h"

namespace stowlm::cpu {

namespace {

constexpr int PR = 8;  // weight rows per panel: the 8 int32 lanes of a YMM
constexpr int NT = 4;  // tokens per register tile (16 YMM registers)

// The offset that makes a format's unpacked quants non-negative, q + off in [0, 63], or in
// [0, 127] where `wide`; off = -1 where no offset fits a byte below 128.
struct UnsignedForm {
    int off;
    bool wide;
};
UnsignedForm unsigned_form(QType t) {
    switch (t) {
        case QType::Q4_1: case QType::Q5_1: case QType::Q2_K: case QType::Q4_K: case QType::Q5_K: return {0, false};
        case QType::Q3_K: return {4, false};
        case QType::Q4_0: return {8, false};
        case QType::IQ1_S: case QType::IQ1_M: return {9, false};  // 8 * grid +- 1
        case QType::MXFP4: return {12, false};
        case QType::IQ3_S: return {15, false};
        case QType::Q5_0: return {16, false};
        case QType::Q6_K: return {32, false};
        case QType::IQ2_XXS: case QType::IQ2_XS: case QType::IQ2_S: return {43, true};
        case QType::IQ3_XXS: return {62, true};
        default: return {-1, false};
    }
}

// In place: r[i] lane j -> r[j] lane i (8 x 8 int32).
inline void transpose8x8_epi32(__m256i* r) {
    __m256i t[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
    }
    __m256i u[8];
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);      // column 0 (and 4) of rows i..i+3
        u[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);  // column 1 (and 5)
        u[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
        u[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int c = 0; c < 4; c++) {
        r[c] = _mm256_permute2x128_si256(u[c], u[4 + c], 0x20);
        r[4 + c] = _mm256_permute2x128_si256(u[c], u[4 + c], 0x31);
    }
}

// 8 rows from r0 into [dword][row] bytes q + off (wp), and their per-step scales D, M.
void pack_panel(const MatmulArgs& A, const GemmLayout& lo, int64_t r0, int off, PanelBufs& bufs, uint8_t*& wp,
                float*& D, float*& M) {
    const DotFamily fam = dot_family(A.type);
    const RowLayout L = row_layout(fam, A.cols);
    uint8_t* un = (uint8_t*)bufs.unpack.get(L.bytes * PR);
    wp = (uint8_t*)bufs.wp.get((size_t)A.cols * PR);
    D = (float*)bufs.dm.get((size_t)lo.nsteps * PR * 2 * sizeof(float));
    M = D + lo.nsteps * PR;
    unpack_panel_rows(A, L, r0, PR, un);
    const __m256i offv = _mm256_set1_epi8((char)off);
    for (int64_t k0 = 0; k0 < A.cols / 4; k0 += 8) {  // cols is a multiple of 32
        __m256i r[PR];
        for (int n = 0; n < PR; n++)
            r[n] = _mm256_add_epi8(_mm256_loadu_si256((const __m256i*)(un + n * L.bytes + L.q_off + 4 * k0)), offv);
        transpose8x8_epi32(r);
        for (int k = 0; k < 8; k++) _mm256_store_si256((__m256i*)(wp + (k0 + k) * 32), r[k]);
    }
    for (int n = 0; n < PR; n++) step_scales(fam, un + n * L.bytes, L, lo.nsteps, lo.step, D + n, M + n, PR);
}

// Two dwords of products (8 elements) of 8 rows with one token: maddubs pairs, added in int16
// (at most 4 x 63 x 127) and widened once, or (WIDE: weights up to 127) widened apart.
template <bool WIDE>
inline __m256i dot8(__m256i w0, __m256i w1, const int32_t* q) {
    const __m256i p0 = _mm256_maddubs_epi16(w0, _mm256_set1_epi32(q[0]));
    const __m256i p1 = _mm256_maddubs_epi16(w1, _mm256_set1_epi32(q[1]));
    const __m256i ones = _mm256_set1_epi16(1);
    if constexpr (WIDE) return _mm256_add_epi32(_mm256_madd_epi16(p0, ones), _mm256_madd_epi16(p1, ones));
    return _mm256_madd_epi16(_mm256_add_epi16(p0, p1), ones);
}

// y[t][r0 + lane] for NTOK tokens from t0 (the first nr lanes stored); 32 elements per
// iteration: one step, or two 16-element steps sharing the activation scale.
template <int STEP, bool MIN, bool WIDE, int NTOK>
void gemm_tile(const uint8_t* wp, const float* D, const float* M, int64_t nsteps, const GemmLayout& lo, int64_t cols,
               int64_t t0, float* y, int64_t ldy, int nr) {
    constexpr int SP = 32 / STEP;
    __m256 acc[NTOK];
    for (int j = 0; j < NTOK; j++) acc[j] = _mm256_setzero_ps();
    const int8_t* qa = lo.qa + t0 * cols;
    const TokStep* ts = lo.ts + t0 * nsteps;
    for (int64_t s = 0; s < nsteps; s += SP) {
        __m256i w[8];
        for (int k = 0; k < 8; k++) w[k] = _mm256_load_si256((const __m256i*)(wp + (s * STEP / 4 + k) * 32));
#pragma GCC unroll 4
        for (int j = 0; j < NTOK; j++) {
            const TokStep* t = ts + j * nsteps + s;
            const int32_t* q = (const int32_t*)(qa + j * cols + s * STEP);
            if constexpr (SP == 1) {
                __m256i i = _mm256_add_epi32(_mm256_add_epi32(dot8<WIDE>(w[0], w[1], q), dot8<WIDE>(w[2], w[3], q + 2)),
                                             _mm256_add_epi32(dot8<WIDE>(w[4], w[5], q + 4), dot8<WIDE>(w[6], w[7], q + 6)));
                i = _mm256_add_epi32(i, _mm256_set1_epi32(t[0].c));
                const __m256 f = _mm256_mul_ps(_mm256_cvtepi32_ps(i), _mm256_set1_ps(t[0].d));
                acc[j] = _mm256_fmadd_ps(f, _mm256_load_ps(D + s * PR), acc[j]);
            } else {
                const __m256i i0 = _mm256_add_epi32(_mm256_add_epi32(dot8<WIDE>(w[0], w[1], q), dot8<WIDE>(w[2], w[3], q + 2)),
                                                    _mm256_set1_epi32(t[0].c));
                const __m256i i1 = _mm256_add_epi32(_mm256_add_epi32(dot8<WIDE>(w[4], w[5], q + 4), dot8<WIDE>(w[6], w[7], q + 6)),
                                                    _mm256_set1_epi32(t[1].c));
                const __m256 f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i1), _mm256_load_ps(D + (s + 1) * PR),
                                                 _mm256_mul_ps(_mm256_cvtepi32_ps(i0), _mm256_load_ps(D + s * PR)));
                acc[j] = _mm256_fmadd_ps(f, _mm256_set1_ps(t[0].d), acc[j]);
            }
            if constexpr (MIN)
                for (int u = 0; u < SP; u++)
                    acc[j] = _mm256_fmadd_ps(_mm256_load_ps(M + (s + u) * PR), _mm256_set1_ps(t[u].s), acc[j]);
        }
    }
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(nr), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    for (int j = 0; j < NTOK; j++) _mm256_maskstore_ps(y + (t0 + j) * ldy, mask, acc[j]);
}


}  // namespace

bool matmul_gemm_avx2(const MatmulArgs& A, ThreadPool& pool) {
    const UnsignedForm form = unsigned_form(A.type);
    const int off = form.off;
    if (off < 0 || (A.n_tok < kBatchMinTokens && !A.batched)) return false;
    const GemmLayout lo = gemm_layout(A);
    auto run = [&](auto wide) {
        gemm_drive<PR>(A, lo, off, pool, [&](PanelBufs& bufs, int64_t r0) {
            uint8_t* wp;
            float *D, *M;
            pack_panel(A, lo, r0, off, bufs, wp, D, M);
            const int nr = (int)std::min<int64_t>(PR, A.rows - r0);
            with_step_min(A.type, [&](auto step, auto min) {
                over_token_tiles<NT>(A.n_tok, [&](auto n, int64_t t) {
                    gemm_tile<step(), min(), wide(), n()>(wp, D, M, lo.nsteps, lo, A.cols, t, A.y + r0, A.ldy, nr);
                });
            });
        });
    };
    if (form.wide) run(std::true_type{});
    else run(std::false_type{});
    return true;
}

}  // namespace stowlm::cpu
