// AVX-512 VNNI path for batched products (prompt processing). Panels of 16 weight rows are
// unpacked once per call into unsigned bytes interleaved by dword, so that ZMM lane r holds 4
// consecutive weights of row r: one vpdpbusd with a broadcast dword of a token's activations
// advances all 16 rows of that token by 4 elements, and a step's scales (weight per row in the
// lanes, activation broadcast) cost one convert, one multiply and one FMA per 16 rows x token
// instead of per row. The unsigned bytes are q + 128 and each step's integer sum starts at
// -128 * sum(activations), so the offset leaves exactly. Steps are 32 elements (16 for the
// formats with 16-element sub-scales); a row's sum over steps runs in the same order for every
// token, whatever tile it falls in.
// GCC 12 reports its own _mm512_undefined_*() inside AVX-512 intrinsics as (maybe-)uninitialized.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>

#include "cpu/matmul_gemm.h"

namespace stowlm::cpu {

namespace {

constexpr int PR = 16;  // weight rows per panel: the 16 lanes of a ZMM
constexpr int NT = 8;   // tokens per register tile

// In place: r[i] lane j -> r[j] lane i.
inline void transpose16x16_epi32(__m512i* r) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    // r[4g + c] holds, per 128-bit lane L, column 4L + c of rows 4g..4g+3
    for (int c = 0; c < 4; c++) {
        const __m512i a = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x88), b = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xdd);
        const __m512i e = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x88), f = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xdd);
        t[c] = _mm512_shuffle_i32x4(a, e, 0x88);       // lane 0 of every group: column c
        t[8 + c] = _mm512_shuffle_i32x4(a, e, 0xdd);   // lane 2: column 8 + c
        t[4 + c] = _mm512_shuffle_i32x4(b, f, 0x88);   // lane 1: column 4 + c
        t[12 + c] = _mm512_shuffle_i32x4(b, f, 0xdd);  // lane 3: column 12 + c
    }
    for (int i = 0; i < 16; i++) r[i] = t[i];
}

void pack_panel(const MatmulArgs& A, const GemmLayout& lo, int64_t r0, PanelBufs& bufs, uint8_t*& wp, float*& D,
                float*& M) {
    const DotFamily fam = dot_family(A.type);
    const RowLayout L = row_layout(fam, A.cols);
    const int step = lo.step;
    const int64_t nsteps = lo.nsteps;
    uint8_t* un = (uint8_t*)bufs.unpack.get(L.bytes * PR);
    wp = (uint8_t*)bufs.wp.get((size_t)A.cols * PR);
    D = (float*)bufs.dm.get((size_t)nsteps * PR * 2 * sizeof(float));
    M = D + nsteps * PR;
    unpack_panel_rows(A, L, r0, PR, un);
    // [row][dword] -> [dword][row], 16 x 16 dwords at a time, as unsigned q + 128
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    int64_t k0 = 0;
    for (; k0 + 16 <= A.cols / 4; k0 += 16) {
        __m512i r[PR];
        for (int n = 0; n < PR; n++) r[n] = _mm512_xor_si512(_mm512_loadu_si512(un + n * L.bytes + L.q_off + 4 * k0), flip);
        transpose16x16_epi32(r);
        for (int k = 0; k < 16; k++) _mm512_store_si512(wp + (k0 + k) * 64, r[k]);
    }
    for (; k0 < A.cols / 4; k0++)  // 8 dwords left when cols is an odd number of 32-blocks
        for (int n = 0; n < PR; n++) {
            uint32_t v;
            memcpy(&v, un + n * L.bytes + L.q_off + 4 * k0, 4);
            ((uint32_t*)wp)[k0 * PR + n] = v ^ 0x80808080u;
        }
    for (int n = 0; n < PR; n++) step_scales(fam, un + n * L.bytes, L, nsteps, step, D + n, M + n, PR);
}

// acc + w (unsigned bytes) x the dword at p broadcast (signed bytes). GCC does not fold the
// broadcast into vpdpbusd's memory operand; folded, a product is one fused-domain uop, not two.
inline __m512i dpbusd_bcast(__m512i acc, __m512i w, const int32_t* p) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*p));
    return acc;
}

// y[t][r0 + lane] for NTOK tokens from t0 (lanes in rmask stored). 32 elements per iteration:
// one step, or two 16-element steps that share the activation scale (Q6_K and friends: the
// per-16 weight scales are applied before that one multiply).
template <int STEP, bool MIN, int NTOK>
void gemm_tile(const uint8_t* wp, const float* D, const float* M, int64_t nsteps, const GemmLayout& lo, int64_t cols,
               int64_t t0, float* y, int64_t ldy, __mmask16 rmask) {
    constexpr int SP = 32 / STEP;  // steps per iteration
    __m512 acc[NTOK];
    for (int j = 0; j < NTOK; j++) acc[j] = _mm512_setzero_ps();
    const int8_t* qa = lo.qa + t0 * cols;
    const TokStep* ts = lo.ts + t0 * nsteps;
    for (int64_t s = 0; s < nsteps; s += SP) {
        __m512i w[8];
#pragma GCC unroll 8
        for (int k = 0; k < 8; k++) w[k] = _mm512_load_si512(wp + (s * STEP / 4 + k) * 64);
        __m512 dv[SP], mv[SP];
        for (int u = 0; u < SP; u++) {
            dv[u] = _mm512_load_ps(D + (s + u) * PR);
            mv[u] = MIN ? _mm512_load_ps(M + (s + u) * PR) : _mm512_setzero_ps();
        }
        // unrolled so the accumulators stay in registers
#pragma GCC unroll 8
        for (int j = 0; j < NTOK; j++) {
            const TokStep* t = ts + j * nsteps + s;
            const int32_t* q = (const int32_t*)(qa + j * cols + s * STEP);
            // two chains of products (even/odd dwords, or one per 16-element step)
            __m512i i0 = _mm512_set1_epi32(t[0].c), i1 = SP == 2 ? _mm512_set1_epi32(t[1].c) : _mm512_setzero_si512();
#pragma GCC unroll 8
            for (int k = 0; k < 4; k++) {
                if constexpr (SP == 1) {
                    i0 = dpbusd_bcast(i0, w[2 * k], q + 2 * k);
                    i1 = dpbusd_bcast(i1, w[2 * k + 1], q + 2 * k + 1);
                } else {
                    i0 = dpbusd_bcast(i0, w[k], q + k);
                    i1 = dpbusd_bcast(i1, w[4 + k], q + 4 + k);
                }
            }
            if constexpr (SP == 1) {
                const __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(i0, i1)), _mm512_set1_ps(t[0].d));
                acc[j] = _mm512_fmadd_ps(f, dv[0], acc[j]);
            } else {
                const __m512 f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i1), dv[1], _mm512_mul_ps(_mm512_cvtepi32_ps(i0), dv[0]));
                acc[j] = _mm512_fmadd_ps(f, _mm512_set1_ps(t[0].d), acc[j]);
            }
            if constexpr (MIN)
                for (int u = 0; u < SP; u++) acc[j] = _mm512_fmadd_ps(mv[u], _mm512_set1_ps(t[u].s), acc[j]);
        }
    }
    for (int j = 0; j < NTOK; j++) _mm512_mask_storeu_ps(y + (t0 + j) * ldy, rmask, acc[j]);
}

}  // namespace

size_t gemm_scratch_extra(QType t, int64_t cols, int64_t n_tok) {
    const int64_t nsteps = cols / batched_step(t);
    return (size_t)n_tok * cols + (size_t)n_tok * nsteps * sizeof(TokStep) + 192;
}

bool matmul_gemm_vnni(const MatmulArgs& A, ThreadPool& pool) {
    if (dot_family(A.type) == DotFamily::Float || (A.n_tok < kBatchMinTokens && !A.batched)) return false;
    const GemmLayout lo = gemm_layout(A);
    gemm_drive<PR>(A, lo, 128, pool, [&](PanelBufs& bufs, int64_t r0) {
        uint8_t* wp;
        float *D, *M;
        pack_panel(A, lo, r0, bufs, wp, D, M);
        const int nr = (int)std::min<int64_t>(PR, A.rows - r0);
        const __mmask16 rmask = (__mmask16)((1u << nr) - 1);
        with_step_min(A.type, [&](auto step, auto min) {
            over_token_tiles<NT>(A.n_tok, [&](auto n, int64_t t) {
                gemm_tile<step(), min(), n()>(wp, D, M, lo.nsteps, lo, A.cols, t, A.y + r0, A.ldy, rmask);
            });
        });
    });
    return true;
}

}  // namespace stowlm::cpu
