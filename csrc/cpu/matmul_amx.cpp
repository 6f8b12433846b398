// AMX path for batched products. Per K step (one 32-element block, or 16 for the formats with
// 16-element sub-scales) one TDPBSSD multiplies 16 weight rows (A tile: unpacked signed int8
// weights, row-major) by 16 tokens (B tile: signed int8 activations in the tile's 4-byte
// interleaved layout), signed x signed so no offset correction. Block scales differ per step,
// so each step's int32 tile is scaled into 16 float accumulators (one ZMM per weight row,
// lanes = tokens): acc[m] += cvt(C[m]) * da(tokens) * S[m] (+ M[m] * sa(tokens) for formats
// with a min). Two C tiles alternate so one step's tile product overlaps the other's
// epilogue. Weights and activations are repacked so every tile load is contiguous.
// GCC 12 reports its own _mm512_undefined_*() inside AVX-512 intrinsics as (maybe-)uninitialized.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>

#include "cpu/matmul_impl.h"
#include "cpu/matmul_unpack_simd.h"

namespace stowlm::cpu {

namespace {

constexpr int TR = 16;  // weight rows per tile (A rows, C rows)
constexpr int TT = 16;  // tokens per tile (B columns, C lanes)

struct alignas(64) TileCfg {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
};

// Tiles: 0-3 = C (16 x 16 int32), 4,5 = A (16 rows x step bytes), 6,7 = B (step/4 x 64 bytes).
void config_tiles(int step) {
    TileCfg c;
    for (int t : {0, 1, 2, 3}) c.rows[t] = TR, c.colsb[t] = 64;
    for (int t : {4, 5}) c.rows[t] = TR, c.colsb[t] = (uint16_t)step;
    for (int t : {6, 7}) c.rows[t] = (uint8_t)(step / 4), c.colsb[t] = 64;
    // GCC does not see ldtilecfg read the struct and drops its stores without this barrier.
    __asm__ volatile("" : : "r"(&c) : "memory");
    _tile_loadconfig(&c);
}

struct Layout {
    int step;
    int64_t nsteps, ntiles;
    uint8_t* bpack;  // [tile][step][step/4][16 tokens][4]
    float* da;       // [tile][step][16 tokens]
    float* sa;       // same shape
};

Layout layout(const MatmulArgs& A) {
    Layout l;
    l.step = batched_step(A.type);
    l.nsteps = A.cols / l.step;
    l.ntiles = ((A.n_tok + 2 * TT - 1) / (2 * TT)) * 2;  // an even number: tiles go in pairs
    uintptr_t p = ((uintptr_t)A.act + A.act_stride * A.n_tok + 63) & ~(uintptr_t)63;
    l.bpack = (uint8_t*)p;
    l.da = (float*)(p + (size_t)l.ntiles * TT * A.cols);
    l.sa = l.da + l.ntiles * l.nsteps * TT;
    return l;
}

struct Bufs {
    Panel unpack, wpack, scales, acc;
};

// acc[m] += cvt(C[m]) * da * S[m] (+ sa * M[m]): one step's int32 tile into 16 float rows
// of accumulators (kept in L1: four tiles' worth do not fit in registers).
template <bool MIN>
__attribute__((always_inline)) inline void epilogue(float* acc, const int32_t* c, const float* da, const float* sa,
                                                    const float* sv, const float* mv) {
    const __m512 dav = _mm512_load_ps(da);
    __m512 sav = _mm512_setzero_ps();
    if (MIN) sav = _mm512_load_ps(sa);
#pragma GCC unroll 16
    for (int m = 0; m < TR; m++) {
        const __m512 cf = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c + m * TT)), dav);
        __m512 r = _mm512_fmadd_ps(cf, _mm512_set1_ps(sv[m]), _mm512_load_ps(acc + m * TT));
        if (MIN) r = _mm512_fmadd_ps(sav, _mm512_set1_ps(mv[m]), r);
        _mm512_store_ps(acc + m * TT, r);
    }
}

// Panels of 2 x 16 weight rows against pairs of 16-token tiles: per step two A tiles (weights)
// and two B tiles (activations) feed four C tiles, so each tile load serves two products.
template <bool MIN>
void run_panels(const MatmulArgs& A, const Layout& lo, int64_t p0, int64_t p1) {
    static thread_local Bufs bufs;
    constexpr int PR = 2 * TR;  // weight rows per panel
    const DotFamily fam = dot_family(A.type);
    const RowLayout L = row_layout(fam, A.cols);
    const int step = lo.step;
    const int64_t nsteps = lo.nsteps;
    uint8_t* un = (uint8_t*)bufs.unpack.get(L.bytes * PR);
    int8_t* wp = (int8_t*)bufs.wpack.get((size_t)A.cols * PR);
    float* S = (float*)bufs.scales.get((size_t)nsteps * PR * 8 + 256);
    float* M = S + nsteps * PR;
    alignas(64) int32_t cbuf[4][TR * TT];
    // accumulators of the whole panel x all tokens: [tile pair][4][TR * TT], so K can be
    // blocked (the activations of one K block for all tokens stay in L2 across tile pairs)
    float* acc_all = (float*)bufs.acc.get((size_t)(lo.ntiles / 2) * 4 * TR * TT * 4);
    const int64_t kc = std::max<int64_t>(1, 1024 / step);  // steps per K block
    config_tiles(step);
    for (int64_t p = p0; p < p1; p++) {
        const int64_t r0 = p * PR;
        const int nr = (int)std::min<int64_t>(PR, A.rows - r0);
        unpack_panel_rows(A, L, r0, PR, un);
        // weights per step contiguous: wp[s][row][step bytes]; scales S[s][row], M[s][row]
        for (int n = 0; n < PR; n++) {
            const uint8_t* row = un + n * L.bytes;
            const int8_t* q = (const int8_t*)(row + L.q_off);
            if (step == 32) {
                for (int64_t s = 0; s < nsteps; s++)
                    _mm256_store_si256((__m256i*)(wp + (s * PR + n) * 32), _mm256_loadu_si256((const __m256i*)(q + s * 32)));
            } else {
                for (int64_t s = 0; s < nsteps; s++)
                    _mm_store_si128((__m128i*)(wp + (s * PR + n) * 16), _mm_loadu_si128((const __m128i*)(q + s * 16)));
            }
            step_scales(fam, row, L, nsteps, step, S + n, M + n, PR);
        }
        memset(acc_all, 0, (size_t)(lo.ntiles / 2) * 4 * TR * TT * 4);
        for (int64_t k0 = 0; k0 < nsteps; k0 += kc) {
          const int64_t k1 = std::min(nsteps, k0 + kc);
          for (int64_t tt = 0; tt < lo.ntiles; tt += 2) {
            const uint8_t* bp0 = lo.bpack + tt * TT * A.cols;
            const uint8_t* bp1 = bp0 + TT * A.cols;  // the layout has an even number of tiles
            const float* da0 = lo.da + tt * nsteps * TT;
            const float* da1 = da0 + nsteps * TT;
            const float* sa0 = lo.sa + tt * nsteps * TT;
            const float* sa1 = sa0 + nsteps * TT;
            float (*acc)[TR * TT] = (float (*)[TR * TT])(acc_all + (tt / 2) * 4 * TR * TT);
            // C tile c = 2 * row half + token tile. Each step's products are stored one step
            // later, right before their tile is reused, and their float epilogue follows the
            // next step's products: the tile unit runs in order, so a store placed right behind
            // its own product would wait out that product's latency, and the epilogue's loads
            // wait for the store.
            auto epi = [&](int c, int64_t s) __attribute__((always_inline)) {
                const int h = c >> 1, k = c & 1;
                const float* da = (k ? da1 : da0) + s * TT;
                const float* sa = (k ? sa1 : sa0) + s * TT;
                epilogue<MIN>(acc[c], cbuf[c], da, sa, S + s * PR + h * TR, M + s * PR + h * TR);
            };
            for (int64_t s = k0; s < k1; s++) {
                const int8_t* w0 = wp + s * PR * step;
                _tile_loadd(4, w0, step);
                _tile_loadd(5, w0 + TR * step, step);
                _tile_loadd(6, bp0 + s * step * TT, 64);
                _tile_loadd(7, bp1 + s * step * TT, 64);
                const bool prev = s > k0;
                if (prev) _tile_stored(0, cbuf[0], 64);
                _tile_zero(0);
                _tile_dpbssd(0, 4, 6);
                if (prev) _tile_stored(1, cbuf[1], 64);
                _tile_zero(1);
                _tile_dpbssd(1, 4, 7);
                if (prev) _tile_stored(2, cbuf[2], 64);
                _tile_zero(2);
                _tile_dpbssd(2, 5, 6);
                if (prev) _tile_stored(3, cbuf[3], 64);
                _tile_zero(3);
                _tile_dpbssd(3, 5, 7);
                if (prev)
                    for (int c = 0; c < 4; c++) epi(c, s - 1);
            }
            _tile_stored(0, cbuf[0], 64);
            _tile_stored(1, cbuf[1], 64);
            _tile_stored(2, cbuf[2], 64);
            _tile_stored(3, cbuf[3], 64);
            for (int c = 0; c < 4; c++) epi(c, k1 - 1);
          }
        }
        for (int64_t tt = 0; tt < lo.ntiles; tt += 2) {
            float (*acc)[TR * TT] = (float (*)[TR * TT])(acc_all + (tt / 2) * 4 * TR * TT);
            // acc[2 * row half + token tile][row][token] -> y[token][row]
            for (int h = 0; h < 2; h++)
                for (int k = 0; k < 2; k++) {
                    const int64_t t0 = (tt + k) * TT;
                    const int mt = (int)std::min<int64_t>(TT, A.n_tok - t0);
                    const int rn = std::min(TR, nr - h * TR);
                    if (mt <= 0 || rn <= 0) continue;
                    // transpose in L1 so each token's rows go out as one contiguous store
                    alignas(64) float tr[TT][TR];
                    for (int m = 0; m < TR; m++)
                        for (int t = 0; t < TT; t++) tr[t][m] = acc[2 * h + k][m * TT + t];
                    const __mmask16 rmask = (__mmask16)((1u << rn) - 1);
                    for (int t = 0; t < mt; t++)
                        _mm512_mask_storeu_ps(A.y + (t0 + t) * A.ldy + r0 + h * TR, rmask, _mm512_load_ps(tr[t]));
                }
        }
    }
    _tile_release();
}

}  // namespace

size_t amx_scratch_extra(QType t, int64_t cols, int64_t n_tok) {
    const int64_t ntok16 = (n_tok + 2 * TT - 1) / (2 * TT) * (2 * TT);
    return (size_t)ntok16 * cols + (size_t)ntok16 * (cols / 16) * 8 + 128;
}

bool matmul_amx(const MatmulArgs& A, ThreadPool& pool) {
    const DotFamily fam = dot_family(A.type);
    if (fam == DotFamily::Float || (A.n_tok < kAmxMinTokens && !A.batched)) return false;
    const Layout lo = layout(A);
    const int step = lo.step;
    const int64_t nsteps = lo.nsteps;

    // Activations into B-tile order plus per-step scales da and scaled sums sa (zero for
    // the missing tokens of the last tile).
    // The 4-byte groups of 16 tokens side by side: one gather per B tile row.
    const __m512i tok_off = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                               _mm512_set1_epi32((int)A.act_stride));
    pool.parallel_for(lo.ntiles * nsteps, [&](int64_t i0, int64_t i1, int) {
        for (int64_t i = i0; i < i1; i++) {
            const int64_t tt = i / nsteps, s = i % nsteps;
            uint8_t* bp = lo.bpack + tt * TT * A.cols + s * step * TT;
            float* da = lo.da + (tt * nsteps + s) * TT;
            float* sa = lo.sa + (tt * nsteps + s) * TT;
            const int64_t nt = std::max<int64_t>(0, std::min<int64_t>(TT, A.n_tok - tt * TT));  // 0: padding tile
            const __mmask16 tm = (__mmask16)((1u << nt) - 1);
            const uint8_t* ap = (const uint8_t*)A.act + tt * TT * A.act_stride;
            const int8_t* qs0;  // step s of the tile's first token; the others act_stride apart
            if (fam == DotFamily::Q32) {
                qs0 = ((const block_q8_a*)ap)[s].qs;
            } else {
                const int per = QK_K / step;
                qs0 = ((const block_q8_K32*)ap)[s / per].qs + (s % per) * step;
            }
            for (int k4 = 0; k4 < step / 4; k4++)
                _mm512_store_si512(bp + k4 * 64, _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), tm, tok_off,
                                                                             qs0 + 4 * k4, 1));
            for (int t = 0; t < TT; t++) {
                if (t >= nt) {
                    da[t] = sa[t] = 0;
                    continue;
                }
                const uint8_t* tp = ap + t * A.act_stride;
                if (fam == DotFamily::Q32) {
                    const block_q8_a* b = (const block_q8_a*)tp + s;
                    da[t] = b->d, sa[t] = b->s;
                } else {
                    const int per = QK_K / step;
                    const block_q8_K32* b = (const block_q8_K32*)tp + s / per;
                    const int j = (int)(s % per) * (step / 16);  // first 16-group of the step
                    int sum = b->bsums[j];
                    if (step == 32) sum += b->bsums[j + 1];
                    da[t] = b->d[j / 2], sa[t] = b->d[j / 2] * (float)sum;
                }
            }
        }
    });

    const int64_t n_panels = (A.rows + 2 * TR - 1) / (2 * TR);
    const bool with_min = has_min_term(A.type);
    pool.parallel_for_dynamic(n_panels, 1, [&](int64_t p0, int64_t p1, int) {
        if (with_min) run_panels<true>(A, lo, p0, p1);
        else run_panels<false>(A, lo, p0, p1);
    });
    return true;
}

}  // namespace stowlm::cpu
