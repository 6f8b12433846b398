// The grid i-quants' rows with AVX-512 VBMI (Ice Lake, Sapphire Rapids, Zen 4/5): IQ2_XXS,
// IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S. Their grid and sign tables are looked up in registers for a
// whole 256-block at once, not with one scalar load and insert per 4 or 8 weights, which bounded
// the fused kernels (matmul_fused_iq.h) at 4-7 GB/s on two Zen 4 cores. A grid entry's weights
// take 3 (IQ2) or 8 (IQ3) levels, so each entry is kept as a 16-bit code of 2- or 3-bit level
// indices: vpermi2w looks 32 codes up in 64 entries at a time (256-1024 entries: 4-16 of them and
// blends by the index's high bits), vpmultishiftqb puts each weight's bits at the bottom of its
// byte and vpermb turns them into levels. The 7-bit sign fields become ksigns bytes (vpermi2b
// over 128 entries), explicit sign bits are used as they are: a 64-bit mask per 64 weights
// negates the activations. Integer sums per block as the fused kernels (sum_s (2 sc_s + 1)
// dot_s), then one FMA by the block's scale (iq_scale) times d_act into 16 float lanes.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>

#include <cstring>
#include <type_traits>

#include "cpu/matmul_impl.h"
#include "quant/blocks.h"
#include "quant/dot.h"
#include "quant/iq_grids.h"
#include "quant/iquants.h"

namespace stowlm::cpu {

namespace {

// A grid's entries as 16-bit codes of level indices (BITS bits a weight, PER weights an entry)
// and its levels (lev[i]: the level of index i mod 2^BITS). ok: the grid has at most 2^BITS
// distinct bytes, as the GGUF grids do.
template <class T, int N, int PER, int BITS>
struct GridCodes {
    uint16_t code[N];
    uint8_t lev[64] = {};
    bool ok = true;
    explicit GridCodes(const T* grid) {
        int n = 0, levels[1 << BITS] = {};
        for (int g = 0; g < N; g++) {
            uint16_t c = 0;
            for (int p = 0; p < PER; p++) {
                const int v = (int)((grid[g] >> (8 * p)) & 0xff);
                int k = 0;
                while (k < n && levels[k] != v) k++;
                if (k == n) {
                    if (n == (1 << BITS)) { ok = false; return; }
                    levels[n++] = v;
                }
                c |= (uint16_t)(k << (BITS * p));
            }
            code[g] = c;
        }
        for (int i = 0; i < 64; i++) lev[i] = (uint8_t)levels[i % (1 << BITS)];
    }
};
// The codes of one GGUF grid (an array of 4- or 8-byte entries), built on first use.
template <const auto& Grid, int BITS>
const auto& grid_codes() {
    using T = std::remove_cv_t<std::remove_reference_t<decltype(Grid[0])>>;
    static const GridCodes<T, (int)(sizeof(Grid) / sizeof(T)), (int)sizeof(T), BITS> t(Grid);
    return t;
}
const auto& iq2xxs_codes() { return grid_codes<iq_tables::kIQ2XXS, 2>(); }
const auto& iq2xs_codes() { return grid_codes<iq_tables::kIQ2XS, 2>(); }
const auto& iq2s_codes() { return grid_codes<iq_tables::kIQ2S, 2>(); }
const auto& iq3xxs_codes() { return grid_codes<iq_tables::kIQ3XXS, 3>(); }
const auto& iq3s_codes() { return grid_codes<iq_tables::kIQ3S, 3>(); }

// A 64-byte vector of bytes f(i).
template <class F>
inline __m512i bytes64(F f) {
    alignas(64) uint8_t b[64];
    for (int i = 0; i < 64; i++) b[i] = (uint8_t)f(i);
    return _mm512_load_si512(b);
}

// The constants of the decode (built on first use).
struct Consts {
    __m512i code2[8], code3[8], code2x[16], code3s[16], code2s[32], lev2, lev2x, lev2s, lev3, lev3s, sgn0, sgn1;
    __m512i gidx;        // IQ2_XXS: word k = byte 8 (k / 4) + k % 4 of qs (grid index k = 4 ib + l)
    __m512i qidx2[4];    // IQ2_XXS chunk c: word 4m = code 8c + m (qword m: group m's code)
    __m512i qidx3[2];    // IQ3_XXS: words 4m, 4m + 2 = codes 16h + 2m, + 1 (h: the chunk's half of the codes)
    __m512i shift2;      // multishift: byte p of a qword from bit 2p
    __m512i shift3;      // multishift: bytes 0-3 from bits 0, 3, 6, 9, bytes 4-7 from 32, 35, 38, 41
    __m512i shift7;      // multishift: bytes 0-3 of a qword from bits 0, 7, 14, 21
    __m512i rep[4];      // chunk c: byte 8g + j = sign byte g (sub-block 2c + g / 4, field g % 4)
    __m512i bit;         // byte 8g + j = 1 << j
    __m512i sidx[4];     // chunk c: lanes 0-7 dword 2 (2c), lanes 8-15 dword 2 (2c + 1)
    __m512i rep16[4];    // IQ2_XS chunk c: byte 8g + j = byte 2 (8c + g) (the low byte of group word 8c + g)
    __m512i sidx16[4];   // IQ2_XS chunk c: lane L = the scale of 16 weights: sub-block 2c + L / 8, its half L % 8 / 4
    __m512i sidx32[4];   // IQ3_S chunk c: lanes 0-7 the low scale of byte c, lanes 8-15 its high one
    Consts() {
        const auto& t2x = iq2xs_codes();
        const auto& t3s = iq3s_codes();
        for (int m = 0; m < 16; m++) code2x[m] = _mm512_loadu_si512(t2x.code + 32 * m), code3s[m] = _mm512_loadu_si512(t3s.code + 32 * m);
        lev2x = _mm512_loadu_si512(t2x.lev), lev3s = _mm512_loadu_si512(t3s.lev);
        const auto& t2s = iq2s_codes();
        for (int m = 0; m < 32; m++) code2s[m] = _mm512_loadu_si512(t2s.code + 32 * m);
        lev2s = _mm512_loadu_si512(t2s.lev);
        for (int c = 0; c < 4; c++) {
            rep16[c] = bytes64([c](int i) { return 2 * (8 * c + i / 8); });
            alignas(64) int32_t l16[16], l32[16];
            for (int L = 0; L < 16; L++) l16[L] = (2 * c + L / 8) + (L % 8 / 4 ? 16 : 0), l32[L] = c + (L / 8 ? 16 : 0);
            sidx16[c] = _mm512_load_si512(l16), sidx32[c] = _mm512_load_si512(l32);
        }
        const auto& t2 = iq2xxs_codes();
        const auto& t3 = iq3xxs_codes();
        for (int m = 0; m < 8; m++) code2[m] = _mm512_loadu_si512(t2.code + 32 * m), code3[m] = _mm512_loadu_si512(t3.code + 32 * m);
        lev2 = _mm512_loadu_si512(t2.lev), lev3 = _mm512_loadu_si512(t3.lev);
        sgn0 = bytes64([](int i) { return iq_signs8((uint32_t)i); });
        sgn1 = bytes64([](int i) { return iq_signs8((uint32_t)(64 + i)); });
        gidx = bytes64([](int i) { const int k = i / 2; return i % 2 ? 0 : 8 * (k / 4) + k % 4; });
        for (int c = 0; c < 4; c++) {
            qidx2[c] = bytes64([c](int i) { const int w = i / 2; return i % 2 ? 0 : (w % 4 == 0 ? 8 * c + w / 4 : 0); });
            rep[c] = bytes64([c](int i) { const int g = i / 8; return 8 * (2 * c + g / 4) + g % 4; });
            sidx[c] = _mm512_setr_epi32(4 * c, 4 * c, 4 * c, 4 * c, 4 * c, 4 * c, 4 * c, 4 * c, 4 * c + 2, 4 * c + 2, 4 * c + 2,
                                        4 * c + 2, 4 * c + 2, 4 * c + 2, 4 * c + 2, 4 * c + 2);
        }
        for (int h = 0; h < 2; h++)
            qidx3[h] = bytes64([h](int i) { const int w = i / 2; return i % 2 || w % 2 ? 0 : 16 * h + 2 * (w / 4) + (w % 4) / 2; });
        shift2 = bytes64([](int i) { return 2 * (i % 8); });
        shift3 = bytes64([](int i) { return i % 8 < 4 ? 3 * (i % 8) : 32 + 3 * (i % 8 - 4); });
        shift7 = bytes64([](int i) { return i % 8 < 4 ? 7 * (i % 8) : 0; });
        bit = bytes64([](int i) { return 1 << (i % 8); });
    }
};

// 32 words of 256-entry codes (tab: 8 vectors of 32) at the 32 word indices gi (bits 0-7).
inline __m512i lookup256(const __m512i* tab, __m512i gi) {
    const __m512i r0 = _mm512_permutex2var_epi16(tab[0], gi, tab[1]);
    const __m512i r1 = _mm512_permutex2var_epi16(tab[2], gi, tab[3]);
    const __m512i r2 = _mm512_permutex2var_epi16(tab[4], gi, tab[5]);
    const __m512i r3 = _mm512_permutex2var_epi16(tab[6], gi, tab[7]);
    const __mmask32 b6 = _mm512_test_epi16_mask(gi, _mm512_set1_epi16(64)), b7 = _mm512_test_epi16_mask(gi, _mm512_set1_epi16(128));
    return _mm512_mask_mov_epi16(_mm512_mask_mov_epi16(r0, b6, r1), b7, _mm512_mask_mov_epi16(r2, b6, r3));
}

// Chunk c's 64 weight levels from codes of 8 weights (2 bits each: the IQ2 grids), 32 per vector.
inline __m512i levels8(const Consts& K, __m512i codes, int c, __m512i lev) {
    const __m512i cq = _mm512_maskz_permutexvar_epi16(0x11111111u, K.qidx2[c], codes);
    return _mm512_permutexvar_epi8(_mm512_multishift_epi64_epi8(K.shift2, cq), lev);
}
// Chunk c's 64 weight levels from codes of 4 weights (3 bits each: the IQ3 grids), 64 in two vectors.
inline __m512i levels4(const Consts& K, const __m512i (&codes)[2], int c, __m512i lev) {
    const __m512i cq = _mm512_maskz_permutexvar_epi16(0x55555555u, K.qidx3[c % 2], codes[c / 2]);
    return _mm512_permutexvar_epi8(_mm512_multishift_epi64_epi8(K.shift3, cq), lev);
}
// Bytes of two 4-bit scales (low nibble first) in dwords as odd scales 2 sc + 1: lo and hi.
inline void odd_scales(__m512i bytes, __m512i& lo, __m512i& hi) {
    const __m512i one = _mm512_set1_epi32(1);
    lo = _mm512_add_epi32(_mm512_slli_epi32(_mm512_and_si512(bytes, _mm512_set1_epi32(15)), 1), one);
    hi = _mm512_add_epi32(_mm512_slli_epi32(_mm512_srli_epi32(bytes, 4), 1), one);
}
// One block of a row: its 256 weights as 4 x 64 level bytes, 4 sign masks and the sub-blocks'
// odd scales 2 sc + 1 as int32 lanes (lanes 0-7 and 8-15 of chunk c: sub-blocks 2c, 2c + 1).
struct Decoded {
    __m512i mag[4], scale[4];
    __mmask64 neg[4];
};
// The sign masks and scales of sub-blocks whose qword ib of aux holds their word of 4 x 7 sign
// bits and 4-bit scale (IQ2_XXS, IQ3_XXS).
inline void signs_scales(__m512i aux, const Consts& K, Decoded& D) {
    const __m512i sb = _mm512_permutex2var_epi8(K.sgn0, _mm512_multishift_epi64_epi8(K.shift7, aux), K.sgn1);
    const __m512i sc = _mm512_add_epi64(_mm512_slli_epi64(_mm512_srli_epi64(aux, 28), 1), _mm512_set1_epi64(1));
    for (int c = 0; c < 4; c++) {
        D.neg[c] = _mm512_test_epi8_mask(_mm512_permutexvar_epi8(K.rep[c], sb), K.bit);
        D.scale[c] = _mm512_permutexvar_epi32(K.sidx[c], sc);
    }
}
struct FIQ2_XXS {
    using B = block_iq2_xxs;
    static constexpr float kD = 0.125f;
    static bool ok() { return iq2xxs_codes().ok; }
    static void decode(const B& x, const Consts& K, Decoded& D) {
        const __m512i q = _mm512_loadu_si512(x.qs);
        const __m512i codes = lookup256(K.code2, _mm512_maskz_permutexvar_epi8(0x5555555555555555ULL, K.gidx, q));
        for (int c = 0; c < 4; c++) D.mag[c] = levels8(K, codes, c, K.lev2);
        signs_scales(_mm512_srli_epi64(q, 32), K, D);  // qword ib: the sign and scale word of sub-block ib
    }
};
// 32 words of 512-entry codes at 9-bit indices (bits 0-7 in gi, bit 8 as hi).
inline __m512i lookup512(const __m512i* tab, __m512i gi, __mmask32 hi) {
    return _mm512_mask_mov_epi16(lookup256(tab, gi), hi, lookup256(tab + 8, gi));
}
// IQ2_XS and IQ2_S: the scales of 16 weights (a nibble each of the 8 scale bytes) in chunks' lanes.
inline void half_scales(const uint8_t* scales, const Consts& K, Decoded& D) {
    __m512i lo, hi;
    odd_scales(_mm512_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)scales)), lo, hi);
    for (int c = 0; c < 4; c++) D.scale[c] = _mm512_permutex2var_epi32(lo, K.sidx16[c], hi);
}
// IQ2_XS: a word per group of 8, 9 bits of grid index and 7 sign bits; a 4-bit scale per 16.
struct FIQ2_XS {
    using B = block_iq2_xs;
    static constexpr float kD = 0.125f;
    static bool ok() { return iq2xs_codes().ok; }
    static void decode(const B& x, const Consts& K, Decoded& D) {
        const __m512i q = _mm512_loadu_si512(x.qs);
        const __m512i codes = lookup512(K.code2x, q, _mm512_test_epi16_mask(q, _mm512_set1_epi16(256)));
        const __m512i sb = _mm512_permutex2var_epi8(K.sgn0, _mm512_srli_epi16(q, 9), K.sgn1);  // even bytes
        for (int c = 0; c < 4; c++) {
            D.mag[c] = levels8(K, codes, c, K.lev2x);
            D.neg[c] = _mm512_test_epi8_mask(_mm512_permutexvar_epi8(K.rep16[c], sb), K.bit);
        }
        half_scales(x.scales, K, D);
    }
};
// IQ2_S: 10-bit indices (the low byte in qs, bits 8-9 in qh: 2 bits per group in group order), a
// sign byte per group (weight order), a 4-bit scale per 16.
struct FIQ2_S {
    using B = block_iq2_s;
    static constexpr float kD = 0.125f;
    static bool ok() { return iq2s_codes().ok; }
    static void decode(const B& x, const Consts& K, Decoded& D) {
        uint64_t qh, sg[4];
        memcpy(&qh, x.qh, 8);
        memcpy(sg, x.qs + QK_K / 8, 32);
        const __m512i gi = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)x.qs));
        const __mmask32 b8 = (__mmask32)_pext_u64(qh, 0x5555555555555555ULL), b9 = (__mmask32)_pext_u64(qh, 0xAAAAAAAAAAAAAAAAULL);
        const __m512i codes = _mm512_mask_mov_epi16(lookup512(K.code2s, gi, b8), b9, lookup512(K.code2s + 16, gi, b8));
        for (int c = 0; c < 4; c++) D.mag[c] = levels8(K, codes, c, K.lev2s), D.neg[c] = _cvtu64_mask64(sg[c]);
        half_scales(x.scales, K, D);
    }
};
// IQ3_S: 9-bit indices (the low byte in qs, bit 8 in qh: 64 bits in entry order), explicit sign
// bits in weight order, a 4-bit scale per 32.
struct FIQ3_S {
    using B = block_iq3_s;
    static constexpr float kD = 1.0f;
    static bool ok() { return iq3s_codes().ok; }
    static void decode(const B& x, const Consts& K, Decoded& D) {
        const __m512i q = _mm512_loadu_si512(x.qs);
        uint64_t qh, sg[4];
        memcpy(&qh, x.qh, 8);
        memcpy(sg, x.signs, 32);
        const __m512i codes[2] = {lookup512(K.code3s, _mm512_cvtepu8_epi16(_mm512_castsi512_si256(q)), (__mmask32)qh),
                                  lookup512(K.code3s, _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(q, 1)), (__mmask32)(qh >> 32))};
        __m512i lo, hi;  // byte j: the scales of sub-blocks 2j (low nibble) and 2j + 1
        odd_scales(_mm512_cvtepu8_epi32(_mm_cvtsi32_si128((int)u32_from_bytes(x.scales))), lo, hi);
        for (int c = 0; c < 4; c++) {
            D.mag[c] = levels4(K, codes, c, K.lev3s);
            D.neg[c] = _cvtu64_mask64(sg[c]);
            D.scale[c] = _mm512_permutex2var_epi32(lo, K.sidx32[c], hi);
        }
    }
};
struct FIQ3_XXS {
    using B = block_iq3_xxs;
    static constexpr float kD = 0.25f;
    static bool ok() { return iq3xxs_codes().ok; }
    static void decode(const B& x, const Consts& K, Decoded& D) {
        const __m512i q = _mm512_loadu_si512(x.qs);  // the 64 grid indices
        const __m512i codes[2] = {lookup256(K.code3, _mm512_cvtepu8_epi16(_mm512_castsi512_si256(q))),
                                  lookup256(K.code3, _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(q, 1)))};
        for (int c = 0; c < 4; c++) D.mag[c] = levels4(K, codes, c, K.lev3);
        signs_scales(_mm512_cvtepu32_epi64(_mm256_loadu_si256((const __m256i*)(x.qs + QK_K / 4))), K, D);
    }
};

// Rows [r0, r1) x tokens [t0, t0 + TT) (one call for the rows: the constants stay in registers).
template <class F, int TT>
void iq_rows(const MatmulArgs& A, const Consts& K, int64_t r0, int64_t r1, int64_t t0) {
    using B = typename F::B;
    const int64_t nsb = A.cols / QK_K;
    const block_q8_K32* a[TT];
    for (int j = 0; j < TT; j++) a[j] = (const block_q8_K32*)((const uint8_t*)A.act + (t0 + j) * A.act_stride);
    const __m512i zero = _mm512_setzero_si512();
    for (int64_t r = r0; r < r1; r++) {
        const B* w = (const B*)(A.w + r * A.w_stride);
        __m512 acc[TT];
        for (int j = 0; j < TT; j++) acc[j] = _mm512_setzero_ps();
        for (int64_t b = 0; b < nsb; b++) {
            Decoded D;
            F::decode(w[b], K, D);
            const float dw = _cvtsh_ss(w[b].d) * F::kD;  // iq_scale, with F16C
            for (int j = 0; j < TT; j++) {
                __m512i is = zero;
                for (int c = 0; c < 4; c++) {
                    const __m512i x = _mm512_loadu_si512(a[j][b].qs + 64 * c);
                    const __m512i sx = _mm512_mask_sub_epi8(x, D.neg[c], zero, x);
                    is = _mm512_add_epi32(is, _mm512_mullo_epi32(_mm512_dpbusd_epi32(zero, D.mag[c], sx), D.scale[c]));
                }
                acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is), _mm512_set1_ps(dw * a[j][b].d[0]), acc[j]);
            }
        }
        for (int j = 0; j < TT; j++) A.y[(t0 + j) * A.ldy + r] = _mm512_reduce_add_ps(acc[j]);
    }
}

}  // namespace

bool iq_rows_avx512vbmi(const MatmulArgs& A, int64_t r0, int64_t r1) {
    static const Consts K;
    auto run = [&](auto f) {
        using F = decltype(f);
        if (!F::ok()) return false;
        over_token_tiles<4>(A.n_tok, [&](auto n, int64_t t) { iq_rows<F, n()>(A, K, r0, r1, t); });
        return true;
    };
    switch (A.type) {
        case QType::IQ2_XXS: return run(FIQ2_XXS{});
        case QType::IQ3_XXS: return run(FIQ3_XXS{});
        case QType::IQ2_XS: return run(FIQ2_XS{});
        case QType::IQ3_S: return run(FIQ3_S{});
        case QType::IQ2_S: return run(FIQ2_S{});
        default: return false;
    }
}

}  // namespace stowlm::cpu
