// IQ2_XXS rows with AVX-512 VBMI (Ice Lake, Sapphire Rapids, Zen 4/5): the grid and sign tables
// looked up in registers for a whole 256-block at once instead of one scalar load and insert per
// 8 weights, which bounded the fused kernel (matmul_fused_iq.h) at ~7 GB/s on two Zen 4 cores.
// A grid entry is 8 weights of three levels (8, 25, 43), so it is kept as a 16-bit code of 2-bit
// level indices: vpermi2w looks the 32 codes of a block up in 4 x 64 entries, vpmultishiftqb
// puts each weight's 2 bits at the bottom of its byte and vpermb turns them into levels. The
// 7-bit sign fields become ksigns bytes (vpermi2b over 128 entries), i.e. a 64-bit mask per 64
// weights that negates the activations. Integer sums per block as the fused kernel
// (sum_s (2 sc_s + 1) dot_s), then one FMA by d / 8 * d_act per block into 16 float lanes.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>

#include <cstring>

#include "cpu/matmul_impl.h"
#include "quant/blocks.h"
#include "quant/dot.h"
#include "quant/iq_grids.h"
#include "quant/iquants.h"

namespace stowlm::cpu {

namespace {

struct Iq2xxsTables {
    uint16_t code[256];  // grid entry g: bits 2p, 2p + 1 = level index of its weight p
    uint8_t signs[128];  // ksigns: the field f and its parity as bit 7 (an even count of minus signs)
    uint8_t levels[64];  // entry i: the level of index i & 3
    Iq2xxsTables() {
        for (int g = 0; g < 256; g++) {
            const uint64_t e = iq_tables::kIQ2XXS[g];
            uint16_t c = 0;
            for (int p = 0; p < 8; p++) {
                const int v = (int)((e >> (8 * p)) & 0xff);
                c |= (uint16_t)((v == 8 ? 0 : v == 25 ? 1 : 2) << (2 * p));
            }
            code[g] = c;
        }
        for (int f = 0; f < 128; f++) signs[f] = (uint8_t)(f | ((__builtin_popcount(f) & 1) << 7));
        for (int i = 0; i < 64; i++) levels[i] = (uint8_t)((i & 3) == 0 ? 8 : (i & 3) == 1 ? 25 : 43);
    }
};
const Iq2xxsTables& tables() {
    static const Iq2xxsTables t;
    return t;
}
bool levels_match_grid() {
    for (int g = 0; g < 256; g++)
        for (int p = 0; p < 8; p++) {
            const int v = (int)((iq_tables::kIQ2XXS[g] >> (8 * p)) & 0xff);
            if (v != 8 && v != 25 && v != 43) return false;
        }
    return true;
}

// A 64-byte vector of bytes f(i).
template <class F>
inline __m512i bytes64(F f) {
    alignas(64) uint8_t b[64];
    for (int i = 0; i < 64; i++) b[i] = (uint8_t)f(i);
    return _mm512_load_si512(b);
}

// The constants of the decode (built on first use).
struct Consts {
    __m512i code[8], sgn0, sgn1, lev;
    __m512i gidx;        // word k = byte 8 (k / 4) + k % 4 of qs: block k's grid index (k = 4 ib + l)
    __m512i qidx[4];     // chunk c: word 4m = code 8c + m (qword m: the code of group m)
    __m512i shift2;      // multishift: byte p of a qword from bit 2p
    __m512i shift7;      // multishift: bytes 0-3 of a qword from bits 0, 7, 14, 21
    __m512i rep[4];      // chunk c: byte 8g + j = sign byte g (sub-block 2c + g / 4, field g % 4)
    __m512i bit;         // byte 8g + j = 1 << j
    __m512i sidx[4];     // chunk c: lanes 0-7 dword 2 (2c), lanes 8-15 dword 2 (2c + 1)
    Consts() {
        const Iq2xxsTables& t = tables();
        for (int m = 0; m < 8; m++) code[m] = _mm512_loadu_si512(t.code + 32 * m);
        sgn0 = _mm512_loadu_si512(t.signs), sgn1 = _mm512_loadu_si512(t.signs + 64);
        lev = _mm512_loadu_si512(t.levels);
        gidx = bytes64([](int i) { const int k = i / 2; return i % 2 ? 0 : 8 * (k / 4) + k % 4; });
        for (int c = 0; c < 4; c++) {
            qidx[c] = bytes64([c](int i) { const int w = i / 2; return i % 2 ? 0 : (w % 4 == 0 ? 8 * c + w / 4 : 0); });
            rep[c] = bytes64([c](int i) { const int g = i / 8; return 8 * (2 * c + g / 4) + g % 4; });
            sidx[c] = _mm512_setr_epi32(4 * c, 4 * c, 4 * c, 4 * c, 4 * c, 4 * c, 4 * c, 4 * c, 4 * c + 2, 4 * c + 2, 4 * c + 2,
                                        4 * c + 2, 4 * c + 2, 4 * c + 2, 4 * c + 2, 4 * c + 2);
        }
        shift2 = bytes64([](int i) { return 2 * (i % 8); });
        shift7 = bytes64([](int i) { return i % 8 < 4 ? 7 * (i % 8) : 0; });
        bit = bytes64([](int i) { return 1 << (i % 8); });
    }
};

// One block of a row: its 256 weights as 4 x 64 level bytes, 4 sign masks and the sub-blocks'
// odd scales 2 sc + 1 as int32 lanes (lanes 0-7 and 8-15 of chunk c: sub-blocks 2c, 2c + 1).
struct Decoded {
    __m512i mag[4], scale[4];
    __mmask64 neg[4];
};
inline void decode(const block_iq2_xxs& x, const Consts& K, Decoded& D) {
    const __m512i q = _mm512_loadu_si512(x.qs);
    const __m512i gi = _mm512_maskz_permutexvar_epi8(0x5555555555555555ULL, K.gidx, q);
    const __m512i r0 = _mm512_permutex2var_epi16(K.code[0], gi, K.code[1]);
    const __m512i r1 = _mm512_permutex2var_epi16(K.code[2], gi, K.code[3]);
    const __m512i r2 = _mm512_permutex2var_epi16(K.code[4], gi, K.code[5]);
    const __m512i r3 = _mm512_permutex2var_epi16(K.code[6], gi, K.code[7]);
    const __mmask32 b6 = _mm512_test_epi16_mask(gi, _mm512_set1_epi16(64)), b7 = _mm512_test_epi16_mask(gi, _mm512_set1_epi16(128));
    const __m512i codes = _mm512_mask_mov_epi16(_mm512_mask_mov_epi16(r0, b6, r1), b7, _mm512_mask_mov_epi16(r2, b6, r3));
    const __m512i aux = _mm512_srli_epi64(q, 32);  // qword ib: the signs and scale of sub-block ib
    const __m512i sb = _mm512_permutex2var_epi8(K.sgn0, _mm512_multishift_epi64_epi8(K.shift7, aux), K.sgn1);
    const __m512i sc = _mm512_add_epi64(_mm512_slli_epi64(_mm512_srli_epi64(aux, 28), 1), _mm512_set1_epi64(1));
    for (int c = 0; c < 4; c++) {
        const __m512i cq = _mm512_maskz_permutexvar_epi16(0x11111111u, K.qidx[c], codes);
        D.mag[c] = _mm512_permutexvar_epi8(_mm512_multishift_epi64_epi8(K.shift2, cq), K.lev);
        D.neg[c] = _mm512_test_epi8_mask(_mm512_permutexvar_epi8(K.rep[c], sb), K.bit);
        D.scale[c] = _mm512_permutexvar_epi32(K.sidx[c], sc);
    }
}

// Rows [r0, r1) x tokens [t0, t0 + TT) (one call for the rows: the constants stay in registers).
template <int TT>
void iq2xxs_rows(const MatmulArgs& A, const Consts& K, int64_t r0, int64_t r1, int64_t t0) {
    const int64_t nsb = A.cols / QK_K;
    const block_q8_K32* a[TT];
    for (int j = 0; j < TT; j++) a[j] = (const block_q8_K32*)((const uint8_t*)A.act + (t0 + j) * A.act_stride);
    const __m512i zero = _mm512_setzero_si512();
    for (int64_t r = r0; r < r1; r++) {
        const block_iq2_xxs* w = (const block_iq2_xxs*)(A.w + r * A.w_stride);
        __m512 acc[TT];
        for (int j = 0; j < TT; j++) acc[j] = _mm512_setzero_ps();
        for (int64_t b = 0; b < nsb; b++) {
            Decoded D;
            decode(w[b], K, D);
            const float dw = _cvtsh_ss(w[b].d) * 0.125f;  // iq_scale
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
    if (A.type != QType::IQ2_XXS) return false;
    static const bool ok = levels_match_grid();
    if (!ok) return false;
    static const Consts K;
    over_token_tiles<4>(A.n_tok, [&](auto n, int64_t t) { iq2xxs_rows<n()>(A, K, r0, r1, t); });
    return true;
}

}  // namespace stowlm::cpu
