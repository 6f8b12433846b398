// AMX path for batched products: 16 weight rows at a time are unpacked to int8 (the same
// panel form as the other paths), repacked into the tile's 4-byte-interleaved B layout, and
// multiplied with 16 tokens of int8 activations per TDPBSSD (signed x signed, so no offset
// correction). Each K step (one 32-block, or 16 for the formats with 16-element sub-scales)
// gets its own int32 tile, which the epilogue scales by weight and activation scales into
// 16 float accumulators (one ZMM per token, lanes = weight rows). Two C tiles alternate so
// the next step's tile product overlaps the previous step's epilogue.
// GCC 12 reports its own _mm512_undefined_*() inside AVX-512 intrinsics as maybe-uninitialized.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include "cpu/matmul_impl.h"
#include "cpu/matmul_unpack_simd.h"

namespace stowlm::cpu {

namespace {

constexpr int TN = 16;  // weight rows per tile (B columns)
constexpr int TM = 16;  // tokens per tile (A rows)

struct alignas(64) TileCfg {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
};

// Tiles: 0,1 = C (int32, mt x 16), 2,3 = A (activations, mt x step bytes), 4,5 = B (weights).
void config_tiles(int mt, int step) {
    TileCfg c;
    for (int t : {0, 1}) c.rows[t] = (uint8_t)mt, c.colsb[t] = 64;
    for (int t : {2, 3}) c.rows[t] = (uint8_t)mt, c.colsb[t] = (uint16_t)step;
    for (int t : {4, 5}) c.rows[t] = (uint8_t)(step / 4), c.colsb[t] = 64;
    // GCC does not see ldtilecfg read the struct and drops its stores without this barrier.
    __asm__ volatile("" : : "r"(&c) : "memory");
    _tile_loadconfig(&c);
}

bool has_min(QType t) {
    return t == QType::Q4_1 || t == QType::Q5_1 || t == QType::Q2_K || t == QType::Q4_K || t == QType::Q5_K;
}
int k_step(QType t) {
    return (t == QType::Q2_K || t == QType::Q3_K || t == QType::Q6_K) ? 16 : 32;
}

struct PanelBufs {
    Panel unpack, packed, scales;
};

}  // namespace

size_t amx_scratch_extra(QType t, int64_t cols, int64_t n_tok) {
    // per token and K step: (activation scale, scaled activation sum) floats
    return (size_t)n_tok * (size_t)(cols / 16) * 8 + 64;
}

bool matmul_amx(const MatmulArgs& A, ThreadPool& pool) {
    const DotFamily fam = dot_family(A.type);
    if (fam == DotFamily::Float || A.n_tok < kAmxMinTokens) return false;
    const int step = fam == DotFamily::Q32 ? 32 : k_step(A.type);
    const int64_t nsteps = A.cols / step;
    const bool with_min = has_min(A.type);

    // Activation scale table AT[t][s] = (da, sa): per-step activation scale and the scaled sum
    // of its quantized values (for the min/offset term). Lives after the activations.
    float* at = (float*)(((uintptr_t)A.act + A.act_stride * A.n_tok + 63) & ~(uintptr_t)63);
    pool.parallel_for(A.n_tok, [&](int64_t t0, int64_t t1, int) {
        for (int64_t t = t0; t < t1; t++) {
            const uint8_t* ap = (const uint8_t*)A.act + t * A.act_stride;
            float* o = at + t * nsteps * 2;
            for (int64_t s = 0; s < nsteps; s++) {
                if (fam == DotFamily::Q32) {
                    const block_q8_a* b = (const block_q8_a*)ap + s;
                    o[2 * s] = b->d, o[2 * s + 1] = b->s;
                } else {
                    const int per = QK_K / step;
                    const block_q8_K* b = (const block_q8_K*)ap + s / per;
                    const int j = (int)(s % per) * (step / 16);
                    int sum = b->bsums[j];
                    if (step == 32) sum += b->bsums[j + 1];
                    o[2 * s] = b->d, o[2 * s + 1] = b->d * (float)sum;
                }
            }
        }
    });

    const RowLayout L = row_layout(fam, A.cols);
    const int64_t n_panels = (A.rows + TN - 1) / TN;
    pool.parallel_for_dynamic(n_panels, 1, [&](int64_t p0, int64_t p1, int) {
        static thread_local PanelBufs bufs;
        uint8_t* un = (uint8_t*)bufs.unpack.get(L.bytes * TN);
        uint8_t* bp = (uint8_t*)bufs.packed.get((size_t)A.cols * TN);
        float* S = (float*)bufs.scales.get((size_t)nsteps * TN * 4 * 2 + 64 * 4);
        float* M = S + nsteps * TN;
        alignas(64) int32_t cbuf[2][TM * TN];
        for (int64_t p = p0; p < p1; p++) {
            const int64_t r0 = p * TN;
            const int nr = (int)std::min<int64_t>(TN, A.rows - r0);
            // unpack the panel's rows; missing rows of the last panel are zero weights
            for (int n = 0; n < TN; n++) {
                uint8_t* dst = un + n * L.bytes;
                if (n < nr) {
                    const uint8_t* src = A.w + (r0 + n) * A.w_stride;
                    if (!unpack_row_simd(A.type, src, A.cols, dst, L)) unpack_row(A.type, fam, src, A.cols, dst, L);
                } else {
                    memset(dst, 0, L.bytes);
                }
            }
            // B layout: row k4 holds, for each weight row n, its 4 bytes k = 4*k4 .. 4*k4+3
            for (int64_t k4 = 0; k4 < A.cols / 4; k4++)
                for (int n = 0; n < TN; n++)
                    memcpy(bp + k4 * 64 + n * 4, un + n * L.bytes + L.q_off + k4 * 4, 4);
            // per-step weight scales S[s][n] and min coefficients M[s][n]
            for (int n = 0; n < TN; n++) {
                const uint8_t* row = un + n * L.bytes;
                const float* d = (const float*)(row + L.d_off);
                const float* m = (const float*)(row + L.m_off);
                if (fam == DotFamily::Q32) {
                    for (int64_t s = 0; s < nsteps; s++) S[s * TN + n] = d[s], M[s * TN + n] = m[s];
                } else {
                    const int16_t* sc = (const int16_t*)(row + L.sc_off);
                    const int16_t* mn = (const int16_t*)(row + L.mn_off);
                    const int per = QK_K / step, w16 = step / 16;
                    for (int64_t s = 0; s < nsteps; s++) {
                        const int64_t sb = s / per, j = sb * 16 + (s % per) * w16;
                        S[s * TN + n] = d[sb] * (float)sc[j];
                        M[s * TN + n] = -m[sb] * (float)mn[j];
                    }
                }
            }
            for (int64_t t0 = 0; t0 < A.n_tok; t0 += TM) {
                const int mt = (int)std::min<int64_t>(TM, A.n_tok - t0);
                config_tiles(mt, step);
                __m512 acc[TM];
                for (int m = 0; m < TM; m++) acc[m] = _mm512_setzero_ps();
                const uint8_t* abase = (const uint8_t*)A.act + t0 * A.act_stride;
                const float* atb = at + t0 * nsteps * 2;
                auto a_ptr = [&](int64_t s) {
                    if (fam == DotFamily::Q32) return abase + s * sizeof(block_q8_a) + offsetof(block_q8_a, qs);
                    const int per = QK_K / step;
                    return abase + (s / per) * sizeof(block_q8_K) + offsetof(block_q8_K, qs) + (s % per) * step;
                };
                auto epilogue = [&](const int32_t* c, int64_t s) {
                    const __m512 sv = _mm512_loadu_ps(S + s * TN);
                    const __m512 mv = _mm512_loadu_ps(M + s * TN);
#pragma GCC unroll 16
                    for (int m = 0; m < TM; m++) {
                        if (m >= mt) break;
                        const float* a2 = atb + m * nsteps * 2 + 2 * s;
                        const __m512 cf = _mm512_cvtepi32_ps(_mm512_load_si512(c + m * TN));
                        acc[m] = _mm512_fmadd_ps(cf, _mm512_mul_ps(sv, _mm512_set1_ps(a2[0])), acc[m]);
                        if (with_min) acc[m] = _mm512_fmadd_ps(mv, _mm512_set1_ps(a2[1]), acc[m]);
                    }
                };
                int64_t s = 0;
                for (; s + 2 <= nsteps; s += 2) {
                    _tile_zero(0);
                    _tile_zero(1);
                    _tile_loadd(2, a_ptr(s), (long)A.act_stride);
                    _tile_loadd(4, bp + s * step * TN, 64);
                    _tile_dpbssd(0, 2, 4);
                    _tile_loadd(3, a_ptr(s + 1), (long)A.act_stride);
                    _tile_loadd(5, bp + (s + 1) * step * TN, 64);
                    _tile_dpbssd(1, 3, 5);
                    _tile_stored(0, cbuf[0], 64);
                    epilogue(cbuf[0], s);
                    _tile_stored(1, cbuf[1], 64);
                    epilogue(cbuf[1], s + 1);
                }
                if (s < nsteps) {
                    _tile_zero(0);
                    _tile_loadd(2, a_ptr(s), (long)A.act_stride);
                    _tile_loadd(4, bp + s * step * TN, 64);
                    _tile_dpbssd(0, 2, 4);
                    _tile_stored(0, cbuf[0], 64);
                    epilogue(cbuf[0], s);
                }
                const __mmask16 rmask = (__mmask16)((1u << nr) - 1);
                for (int m = 0; m < mt; m++) _mm512_mask_storeu_ps(A.y + (t0 + m) * A.ldy + r0, rmask, acc[m]);
            }
        }
        _tile_release();
    });
    return true;
}

}  // namespace stowlm::cpu
