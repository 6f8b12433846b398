// The 16-row group layout of repacked weights (cpu/repack.h) as byte moves between one row's
// block and its place in a group's block: the CPU repacks and unrepacks with them, and the GPU
// puts staged experts the CPU keeps repacked back in GGUF's layout with them (cuda/rows16.cu).
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "common.h"
#include "quant/blocks.h"
#include "quant/types.h"

namespace stowlm {

constexpr int kRepackRows = 16;

// Block b of a group of 16 rows. qs: vector k holds, for row r, bytes 4r..4r+3 = elements
// 4k..4k+3 of that row's block b as unsigned values (Q8_0: q + 128; Q4_0/Q5_0: each byte has
// element 4k+i in its low nibble and 16+4k+i in its high one, k < 4). d: the rows' fp16 scales.
// Q5_0's fifth bits: qh[k] bit 4r+i belongs to element 4k+i of row r (k < 8). IQ4_NL keeps Q4_0's
// bytes (block_q4_0x16), its nibbles indexing the IQ4 levels (+ 128 in the products); MXFP4 the
// same with the doubled E2M1 levels, its rows' E8M0 exponents (a byte each) in place of d.
struct block_q8_0x16 { uint16_t d[16]; uint8_t qs[8][64]; };
struct block_q4_0x16 { uint16_t d[16]; uint8_t qs[4][64]; };
struct block_mxfp4x16 { uint8_t e[16]; uint8_t qs[4][64]; };
struct block_q5_0x16 { uint16_t d[16]; uint8_t qs[4][64]; uint64_t qh[8]; };
// Q4_1/Q5_1: the same with the rows' fp16 mins after d (w = d u + m; no offset).
struct block_q4_1x16 { uint16_t d[16]; uint16_t m[16]; uint8_t qs[4][64]; };
struct block_q5_1x16 { uint16_t d[16]; uint16_t m[16]; uint8_t qs[4][64]; uint64_t qh[8]; };
// The K formats keep each row's bytes, moved: Q4_K/Q5_K qs[j][c] holds for row r bytes
// 32j + 4c .. +3 of its qs (low nibbles elements 64j + 4c + i, high ones 32 further), scales[k][r]
// byte k of its 12 packed 6-bit scales and mins; Q5_K's fifth bits as qh[G] bit 4r + i for
// element 4G + i. Q6_K: ql[n][c] bytes 64n + 4c .. +3 of row r's ql (low nibbles elements
// 128n + 4c + i, high ones 64 further), qh[n][c] bytes 32n + 4c .. +3 of its qh (bits 2k, 2k+1:
// element 128n + 4c + i + 32k), scales[s][r] its 16-element scale s.
// Q2_K: qs[n][c] bytes 32n + 4c .. +3 of row r's qs (bits 2j, 2j+1: element 128n + 32j + 4c + i),
// scales[s][r] its byte s (scale and min of sub-block s). Q3_K: qs as Q2_K's, hmask[c] bytes
// 4c .. +3 of its hmask (bit 4n + j: the high bit of element 128n + 32j + 4c + i), scales[k][r]
// byte k of its 12 packed 6-bit scales; its values u = q + 4 (0..7).
struct block_q2_Kx16 { uint16_t d[16]; uint16_t dmin[16]; uint8_t scales[16][16]; uint8_t qs[2][8][64]; };
struct block_q3_Kx16 { uint16_t d[16]; uint8_t scales[12][16]; uint8_t hmask[8][64]; uint8_t qs[2][8][64]; };
struct block_q4_Kx16 { uint16_t d[16]; uint16_t dmin[16]; uint8_t scales[12][16]; uint8_t qs[4][8][64]; };
struct block_q5_Kx16 { uint16_t d[16]; uint16_t dmin[16]; uint8_t scales[12][16]; uint64_t qh[64]; uint8_t qs[4][8][64]; };
struct block_q6_Kx16 { uint8_t ql[2][16][64]; uint8_t qh[2][8][64]; int8_t scales[16][16]; uint16_t d[16]; };
// IQ4_XS: the rows' d and scales_h, scales_l[k][r] byte k of row r's scales_l, and per 32-element
// sub-block ib Q4_0's layout: qs[ib][c][4r + i] = byte 16 ib + 4c + i of row r's qs (elements
// 32 ib + 4c + i low, + 16 high), the nibbles indexing the IQ4 levels.
struct block_iq4_xsx16 { uint16_t d[16]; uint16_t scales_h[16]; uint8_t scales_l[4][16]; uint8_t qs[8][4][64]; };
static_assert(sizeof(block_q8_0x16) == 16 * 34, "16 rows of Q8_0 blocks");
static_assert(sizeof(block_q4_1x16) == 16 * 20, "16 rows of Q4_1 blocks");
static_assert(sizeof(block_q5_1x16) == 16 * 24, "16 rows of Q5_1 blocks");
static_assert(sizeof(block_q2_Kx16) == 16 * 84, "16 rows of Q2_K blocks");
static_assert(sizeof(block_q3_Kx16) == 16 * 110, "16 rows of Q3_K blocks");
static_assert(sizeof(block_q4_Kx16) == 16 * 144, "16 rows of Q4_K blocks");
static_assert(sizeof(block_q5_Kx16) == 16 * 176, "16 rows of Q5_K blocks");
static_assert(sizeof(block_q6_Kx16) == 16 * 210, "16 rows of Q6_K blocks");
static_assert(sizeof(block_iq4_xsx16) == 16 * 136, "16 rows of IQ4_XS blocks");
static_assert(sizeof(block_q4_0x16) == 16 * 18, "16 rows of Q4_0 blocks");
static_assert(sizeof(block_q5_0x16) == 16 * 22, "16 rows of Q5_0 blocks");
static_assert(sizeof(block_mxfp4x16) == 16 * 17, "16 rows of MXFP4 blocks");

// Bytes of one row's block of t where t has a 16-row layout (repack_supported's types), else 0.
HOST_DEVICE int rows16_block_bytes(QType t) {
    switch (t) {
        case QType::Q4_0: case QType::IQ4_NL: return 18;
        case QType::Q4_1: return 20;
        case QType::Q5_0: return 22;
        case QType::Q5_1: return 24;
        case QType::Q8_0: return 34;
        case QType::MXFP4: return 17;
        case QType::Q2_K: return 84;
        case QType::Q3_K: return 110;
        case QType::Q4_K: return 144;
        case QType::Q5_K: return 176;
        case QType::Q6_K: return 210;
        case QType::IQ4_XS: return 136;
        default: return 0;
    }
}
// The 256-element formats of the layout.
HOST_DEVICE bool rows16_kformat(QType t) {
    return t == QType::Q2_K || t == QType::Q3_K || t == QType::Q4_K || t == QType::Q5_K || t == QType::Q6_K ||
           t == QType::IQ4_XS;
}
// Bytes of one 16-row group of a t matrix `cols` wide (16 rows' bytes), or 0 where t has no 16-row
// layout or `cols` is not whole blocks of it.
HOST_DEVICE size_t rows16_group_bytes(QType t, int64_t cols) {
    const int64_t block = rows16_kformat(t) ? QK_K : QK;
    if (rows16_block_bytes(t) == 0 || cols <= 0 || cols % block) return 0;
    return (size_t)kRepackRows * (size_t)(cols / block) * (size_t)rows16_block_bytes(t);
}

// Where a 32-element format keeps its fields (byte offsets; the scale at 0 in both): in a row's
// block and in a group's (d[16] or MXFP4's e[16], m[16] where the format has a min, qs, Q5's qh).
struct Rows16Q32 {
    bool q8, min, fifth;
    int sb;            // a scale's bytes: fp16 d, MXFP4's E8M0 exponent 1
    int m, qh, qs;     // in the row's block
    int gm, gqs, gqh;  // in the group's block
};
HOST_DEVICE Rows16Q32 rows16_q32(QType t) {
    Rows16Q32 f;
    f.q8 = t == QType::Q8_0, f.min = t == QType::Q4_1 || t == QType::Q5_1, f.fifth = t == QType::Q5_0 || t == QType::Q5_1;
    f.sb = t == QType::MXFP4 ? 1 : 2;
    f.m = 2, f.qh = f.min ? 4 : 2, f.qs = f.sb + (f.min ? 2 : 0) + (f.fifth ? 4 : 0);
    f.gm = 32, f.gqs = f.min ? 64 : 16 * f.sb, f.gqh = f.gqs + 256;
    return f;
}

namespace detail {
template <bool IN>  // IN: group -> row; else row -> group
HOST_DEVICE void rows16_mv(uint8_t* row, uint8_t* grp, size_t n) {
    if constexpr (IN) memcpy(row, grp, n);
    else memcpy(grp, row, n);
}
HOST_DEVICE uint64_t rows16_u64(const uint8_t* p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}
HOST_DEVICE void rows16_or_u64(uint8_t* p, uint64_t bits) { const uint64_t v = rows16_u64(p) | bits; memcpy(p, &v, 8); }

// The K formats (the layouts above).
template <bool IN>
HOST_DEVICE void rows16_move_kblock(QType t, uint8_t* row, uint8_t* grp, int r) {
    if (t == QType::IQ4_XS) {
        block_iq4_xs* x = (block_iq4_xs*)row;
        block_iq4_xsx16* y = (block_iq4_xsx16*)grp;
        rows16_mv<IN>((uint8_t*)&x->d, (uint8_t*)&y->d[r], 2);
        rows16_mv<IN>((uint8_t*)&x->scales_h, (uint8_t*)&y->scales_h[r], 2);
        for (int k = 0; k < 4; k++) rows16_mv<IN>(&x->scales_l[k], &y->scales_l[k][r], 1);
        for (int ib = 0; ib < 8; ib++)
            for (int c = 0; c < 4; c++) rows16_mv<IN>(x->qs + 16 * ib + 4 * c, y->qs[ib][c] + 4 * r, 4);
        return;
    }
    if (t == QType::Q2_K || t == QType::Q3_K) {  // their qs share one layout
        uint8_t *qs, (*gqs)[8][64];
        if (t == QType::Q2_K) {
            block_q2_K* x = (block_q2_K*)row;
            block_q2_Kx16* y = (block_q2_Kx16*)grp;
            rows16_mv<IN>((uint8_t*)&x->d, (uint8_t*)&y->d[r], 2);
            rows16_mv<IN>((uint8_t*)&x->dmin, (uint8_t*)&y->dmin[r], 2);
            for (int k = 0; k < 16; k++) rows16_mv<IN>(&x->scales[k], &y->scales[k][r], 1);
            qs = x->qs, gqs = y->qs;
        } else {
            block_q3_K* x = (block_q3_K*)row;
            block_q3_Kx16* y = (block_q3_Kx16*)grp;
            rows16_mv<IN>((uint8_t*)&x->d, (uint8_t*)&y->d[r], 2);
            for (int k = 0; k < 12; k++) rows16_mv<IN>(&x->scales[k], &y->scales[k][r], 1);
            for (int c = 0; c < 8; c++) rows16_mv<IN>(x->hmask + 4 * c, y->hmask[c] + 4 * r, 4);
            qs = x->qs, gqs = y->qs;
        }
        for (int n = 0; n < 2; n++)
            for (int c = 0; c < 8; c++) rows16_mv<IN>(qs + 32 * n + 4 * c, gqs[n][c] + 4 * r, 4);
        return;
    }
    if (t == QType::Q6_K) {
        block_q6_K* x = (block_q6_K*)row;
        block_q6_Kx16* y = (block_q6_Kx16*)grp;
        rows16_mv<IN>((uint8_t*)&x->d, (uint8_t*)&y->d[r], 2);
        for (int s = 0; s < 16; s++) rows16_mv<IN>((uint8_t*)&x->scales[s], (uint8_t*)&y->scales[s][r], 1);
        for (int n = 0; n < 2; n++) {
            for (int c = 0; c < 16; c++) rows16_mv<IN>(x->ql + 64 * n + 4 * c, y->ql[n][c] + 4 * r, 4);
            for (int c = 0; c < 8; c++) rows16_mv<IN>(x->qh + 32 * n + 4 * c, y->qh[n][c] + 4 * r, 4);
        }
        return;
    }
    // Q4_K and Q5_K share d, dmin, scales and qs (Q5_K's qh apart)
    const bool q5 = t == QType::Q5_K;
    uint8_t* xqs = row + (q5 ? offsetof(block_q5_K, qs) : offsetof(block_q4_K, qs));
    block_q4_Kx16* y4 = (block_q4_Kx16*)grp;
    block_q5_Kx16* y5 = (block_q5_Kx16*)grp;
    rows16_mv<IN>(row, (uint8_t*)(q5 ? &y5->d[r] : &y4->d[r]), 2);  // d, dmin, scales[12] lead both row blocks
    rows16_mv<IN>(row + 2, (uint8_t*)(q5 ? &y5->dmin[r] : &y4->dmin[r]), 2);
    for (int k = 0; k < 12; k++) rows16_mv<IN>(row + 4 + k, q5 ? &y5->scales[k][r] : &y4->scales[k][r], 1);
    for (int j = 0; j < 4; j++)
        for (int c = 0; c < 8; c++) rows16_mv<IN>(xqs + 32 * j + 4 * c, (q5 ? y5->qs[j][c] : y4->qs[j][c]) + 4 * r, 4);
    if (!q5) return;
    uint8_t* xqh = row + offsetof(block_q5_K, qh);  // qh[m] bit k: element 32k + m
    const uint8_t* gqh = (const uint8_t*)y5->qh;     // element 4G + i: bit 4r + i of the group's qh[G]
    if constexpr (IN) {
        for (int m = 0; m < 32; m++) {  // every byte written whole
            int v = 0;
            for (int k = 0; k < 8; k++) v |= (int)((rows16_u64(gqh + 8 * (8 * k + m / 4)) >> (4 * r + m % 4)) & 1) << k;
            xqh[m] = (uint8_t)v;
        }
    } else {
        for (int G = 0; G < QK_K / 4; G++) {
            const int k = G / 8, m0 = 4 * (G % 8);
            uint64_t v = 0;
            for (int i = 0; i < 4; i++) v |= (uint64_t)((xqh[m0 + i] >> k) & 1) << i;
            rows16_or_u64((uint8_t*)y5->qh + 8 * G, v << (4 * r));
        }
    }
}

template <bool IN>
HOST_DEVICE void rows16_move_q32block(QType t, uint8_t* row, uint8_t* grp, int r) {
    const Rows16Q32 f = rows16_q32(t);
    rows16_mv<IN>(row, grp + f.sb * r, f.sb);
    if (f.min) rows16_mv<IN>(row + f.m, grp + f.gm + 2 * r, 2);
    uint8_t *qs = row + f.qs, *gqs = grp + f.gqs;
    if (f.q8) {  // 4 signed bytes at a time as q + 128
        for (int k = 0; k < 8; k++) {
            uint32_t v;
            memcpy(&v, IN ? gqs + k * 64 + 4 * r : qs + 4 * k, 4);
            v ^= 0x80808080u;
            memcpy(IN ? qs + 4 * k : gqs + k * 64 + 4 * r, &v, 4);
        }
        return;
    }
    // the 4/5-bit formats' bytes keep their nibble pairs (elements 4k + i and 16 + 4k + i)
    for (int k = 0; k < 4; k++) rows16_mv<IN>(qs + 4 * k, gqs + k * 64 + 4 * r, 4);
    if (!f.fifth) return;
    uint32_t h = 0;
    if constexpr (IN) {
        for (int k = 0; k < 8; k++) h |= (uint32_t)((rows16_u64(grp + f.gqh + 8 * k) >> (4 * r)) & 0xF) << (4 * k);
        memcpy(row + f.qh, &h, 4);
    } else {
        memcpy(&h, row + f.qh, 4);
        for (int k = 0; k < 8; k++) rows16_or_u64(grp + f.gqh + 8 * k, (uint64_t)((h >> (4 * k)) & 0xF) << (4 * r));
    }
}
}  // namespace detail

// Row r's block between its GGUF bytes `row` and its place in the group's block `grp`: into the
// group (IN false: the group's block zeroed first, since the fifth bits are OR'ed in) or back to
// the row (IN true: every byte of the row's block written).
template <bool IN>
HOST_DEVICE void rows16_move_block(QType t, uint8_t* row, uint8_t* grp, int r) {
    if (rows16_kformat(t)) detail::rows16_move_kblock<IN>(t, row, grp, r);
    else detail::rows16_move_q32block<IN>(t, row, grp, r);
}

// One whole 16-row group of a t matrix `cols` wide (GGUF's bytes at `rows`) from its repacked
// bytes `grp` (the group's blocks one after another).
HOST_DEVICE void rows16_unpack_group(QType t, int64_t cols, const uint8_t* grp, uint8_t* rows) {
    const int pb = rows16_block_bytes(t);
    const size_t rb = rows16_group_bytes(t, cols) / kRepackRows;
    const int64_t nb = (int64_t)(rb / pb);
    for (int r = 0; r < kRepackRows; r++)
        for (int64_t b = 0; b < nb; b++)
            rows16_move_block<true>(t, rows + r * rb + b * pb, (uint8_t*)grp + b * kRepackRows * pb, r);
}

}  // namespace stowlm
