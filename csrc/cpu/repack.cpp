// Repacking into 16-row groups and back, and the scalar reference product (repack.h).
#include "cpu/repack.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <string>

#include "error.h"
#include "quant/blocks.h"
#include "quant/float_types.h"
#include "quant/dot.h"
#include "quant/iquants.h"
#include "quant/legacy.h"
#include "quant/mxfp4.h"

namespace stowlm::cpu {

int repack_offset(QType t) {
    switch (t) {
        case QType::Q8_0: return 128;
        case QType::Q4_0: return 8;
        case QType::Q5_0: return 16;
        case QType::IQ4_NL: case QType::MXFP4: return 128;  // their levels + 128 (a byte), as Q8_0's
        default: return 0;  // Q4_1, Q5_1: unsigned values, a min term instead
    }
}

bool repack_supported(QType t, int64_t rows, int64_t cols) {
    return rows16_group_bytes(t, cols) > 0 && rows > 0;
}

namespace {

size_t group_block_bytes(QType t) { return kRepackRows * (size_t)rows16_block_bytes(t); }

// The 6-bit scale and min of sub-block s of a Q4_K/Q5_K super-block (12 packed bytes).
void scale_min_k4(const uint8_t* q, int s, int& sc, int& m) {
    if (s < 4) sc = q[s] & 63, m = q[s + 4] & 63;
    else sc = (q[s + 4] & 0xF) | ((q[s - 4] >> 6) << 4), m = (q[s + 4] >> 4) | ((q[s] >> 6) << 4);
}

// Row r's value of element e (unsigned: Q2_K 0..3, Q3_K 0..7 = q + 4, Q4_K/Q5_K 0..31, Q6_K 0..63
// = q + 32) in a group block.
int kformat_u(QType t, const uint8_t* gb, int r, int e) {
    if (t == QType::Q2_K || t == QType::Q3_K) {
        const int n = e / 128, j = (e % 128) / 32, l = e % 32;
        const uint8_t(*qs)[8][64] = t == QType::Q2_K ? ((const block_q2_Kx16*)gb)->qs : ((const block_q3_Kx16*)gb)->qs;
        int u = (qs[n][l / 4][4 * r + l % 4] >> (2 * j)) & 3;
        if (t == QType::Q3_K) u |= ((((const block_q3_Kx16*)gb)->hmask[l / 4][4 * r + l % 4] >> (4 * n + j)) & 1) << 2;
        return u;
    }
    if (t == QType::Q6_K) {
        const block_q6_Kx16* y = (const block_q6_Kx16*)gb;
        const int n = e / 128, m = e % 128;
        const int lo = m < 64 ? y->ql[n][m / 4][4 * r + m % 4] & 0xF : y->ql[n][(m - 64) / 4][4 * r + m % 4] >> 4;
        const int l = m % 32;
        return lo | (((y->qh[n][l / 4][4 * r + l % 4] >> (2 * (m / 32))) & 3) << 4);
    }
    const int j = e / 64, h = (e % 64) / 32, l = e % 32;
    const uint8_t* qs = t == QType::Q5_K ? ((const block_q5_Kx16*)gb)->qs[j][l / 4] : ((const block_q4_Kx16*)gb)->qs[j][l / 4];
    int u = (qs[4 * r + l % 4] >> (4 * h)) & 0xF;
    if (t == QType::Q5_K) u |= (int)((((const block_q5_Kx16*)gb)->qh[e / 4] >> (4 * r + e % 4)) & 1) << 4;
    return u;
}

}  // namespace

void repack_rows16(QType t, int64_t rows, int64_t cols, const void* src, void* dst, int64_t r0, int64_t r1) {
    if (!repack_supported(t, rows, cols))
        throw InvalidInput("repack_rows16: " + std::string(qtype_checked((uint32_t)t).name) + " " +
                           std::to_string(rows) + " x " + std::to_string(cols) + " cannot be repacked");
    if (r1 < 0) r1 = rows;
    {
        // rows after the last whole group keep the GGUF layout (matmul_r16_tail)
        const int64_t tail0 = rows / kRepackRows * kRepackRows, rb = (int64_t)row_bytes(t, cols);
        const int64_t a = std::max(r0, tail0);
        if (r1 > a) memcpy((uint8_t*)dst + a * rb, (const uint8_t*)src + a * rb, (size_t)((r1 - a) * rb));
        r1 = std::min(r1, tail0);
    }
    const size_t rb = row_bytes(t, cols), pb = (size_t)rows16_block_bytes(t), gb = group_block_bytes(t);
    for (int64_t g = r0 / kRepackRows; g < r1 / kRepackRows; g++) {
        const uint8_t* rowp = (const uint8_t*)src + g * kRepackRows * rb;
        uint8_t* out = (uint8_t*)dst + g * kRepackRows * rb;
        memset(out, 0, kRepackRows * rb);  // (the fifth bits are OR'ed in)
        for (int64_t b = 0; b < (int64_t)(rb / pb); b++)
            for (int r = 0; r < kRepackRows; r++) rows16_move_block<false>(t, (uint8_t*)rowp + r * rb + b * pb, out + b * gb, r);
    }
}

void unrepack_row16(QType t, int64_t rows, int64_t cols, const void* packed, int64_t r, void* dst) {
    const size_t rb = row_bytes(t, cols), pb = (size_t)rows16_block_bytes(t);
    if (r >= rows / kRepackRows * kRepackRows) {  // a tail row, as it was
        memcpy(dst, (const uint8_t*)packed + r * rb, rb);
        return;
    }
    const uint8_t* in = (const uint8_t*)packed + (r / kRepackRows) * kRepackRows * rb;
    for (int64_t b = 0; b < (int64_t)(rb / pb); b++)
        rows16_move_block<true>(t, (uint8_t*)dst + b * pb, (uint8_t*)in + b * kRepackRows * pb, (int)(r % kRepackRows));
}

void act_block_sums(const MatmulArgs& A, int32_t* sums) {
    const int64_t nb = A.cols / QK;
    for (int64_t t = 0; t < A.n_tok; t++) {
        const block_q8_a* a = (const block_q8_a*)((const uint8_t*)A.act + t * A.act_stride);
        for (int64_t b = 0; b < nb; b++) {
            int s = 0;
            for (int e = 0; e < QK; e++) s += a[b].qs[e];
            sums[t * nb + b] = s;
        }
    }
}

namespace {

// The K formats' reference: the integer sums of repack.h's formula, then its one or two FMAs.
void matmul_r16_scalar_k(const MatmulArgs& A, int64_t g0, int64_t g1) {
    const int64_t nsb = A.cols / QK_K;
    const size_t gb = group_block_bytes(A.type);
    for (int64_t g = g0; g < g1; g++) {
        const uint8_t* grp = A.w + g * kRepackRows * A.w_stride;
        for (int64_t t = 0; t < A.n_tok; t++) {
            const block_q8_K32* a = (const block_q8_K32*)((const uint8_t*)A.act + t * A.act_stride);
            for (int r = 0; r < kRepackRows; r++) {
                float acc = 0;
                for (int64_t b = 0; b < nsb; b++) {
                    const uint8_t* x = grp + b * gb;
                    const float da = a[b].d[0];
                    if (A.type == QType::IQ4_XS) {
                        const block_iq4_xsx16* y = (const block_iq4_xsx16*)x;
                        block_iq4_xs row{};  // row r's scale fields, for iq4xs_scale
                        row.scales_h = y->scales_h[r];
                        for (int k = 0; k < 4; k++) row.scales_l[k] = y->scales_l[k][r];
                        int32_t isum = 0;
                        for (int ib = 0; ib < 8; ib++) {
                            int32_t dot = 0;
                            for (int e = 0; e < 32; e++) {
                                const int lo = e % 16;
                                const int n = (y->qs[ib][lo / 4][4 * r + lo % 4] >> (e < 16 ? 0 : 4)) & 15;
                                dot += iq4nl_value(n) * a[b].qs[32 * ib + e];
                            }
                            isum += iq4xs_scale(&row, ib) * dot;
                        }
                        acc = std::fma((float)isum, fp16_to_f32(y->d[r]) * da, acc);
                        continue;
                    }
                    if (A.type == QType::Q2_K) {
                        const block_q2_Kx16* y = (const block_q2_Kx16*)x;
                        int32_t isum = 0, imin = 0;
                        for (int s = 0; s < 16; s++) {
                            int32_t dot = 0;
                            for (int e = 16 * s; e < 16 * s + 16; e++) dot += kformat_u(A.type, x, r, e) * a[b].qs[e];
                            isum += (y->scales[s][r] & 0xF) * dot;
                            imin += (y->scales[s][r] >> 4) * a[b].bsums[s];
                        }
                        acc = std::fma((float)isum, fp16_to_f32(y->d[r]) * da, acc);
                        acc = std::fma(-(float)imin, fp16_to_f32(y->dmin[r]) * da, acc);
                        continue;
                    }
                    if (A.type == QType::Q3_K) {
                        const block_q3_Kx16* y = (const block_q3_Kx16*)x;
                        uint8_t sc12[12];
                        for (int k = 0; k < 12; k++) sc12[k] = y->scales[k][r];
                        int32_t isum = 0, corr = 0;
                        for (int s = 0; s < 16; s++) {
                            int32_t dot = 0;
                            for (int e = 16 * s; e < 16 * s + 16; e++) dot += kformat_u(A.type, x, r, e) * a[b].qs[e];
                            isum += q3k_scale(sc12, s) * dot;
                            corr += q3k_scale(sc12, s) * a[b].bsums[s];
                        }
                        acc = std::fma((float)(isum - 4 * corr), fp16_to_f32(y->d[r]) * da, acc);
                        continue;
                    }
                    if (A.type == QType::Q6_K) {
                        const block_q6_Kx16* y = (const block_q6_Kx16*)x;
                        int32_t isum = 0, corr = 0;
                        for (int s = 0; s < 16; s++) {
                            int32_t dot = 0;
                            for (int e = 16 * s; e < 16 * s + 16; e++) dot += kformat_u(A.type, x, r, e) * a[b].qs[e];
                            isum += y->scales[s][r] * dot;
                            corr += y->scales[s][r] * a[b].bsums[s];
                        }
                        acc = std::fma((float)(isum - 32 * corr), fp16_to_f32(y->d[r]) * da, acc);
                        continue;
                    }
                    const bool q5 = A.type == QType::Q5_K;
                    const uint16_t* d = q5 ? ((const block_q5_Kx16*)x)->d : ((const block_q4_Kx16*)x)->d;
                    const uint16_t* dmin = q5 ? ((const block_q5_Kx16*)x)->dmin : ((const block_q4_Kx16*)x)->dmin;
                    uint8_t sc12[12];
                    for (int k = 0; k < 12; k++)
                        sc12[k] = q5 ? ((const block_q5_Kx16*)x)->scales[k][r] : ((const block_q4_Kx16*)x)->scales[k][r];
                    int32_t isum = 0, imin = 0;
                    for (int s = 0; s < 8; s++) {
                        int sc, m;
                        scale_min_k4(sc12, s, sc, m);
                        int32_t dot = 0;
                        for (int e = 32 * s; e < 32 * s + 32; e++) dot += kformat_u(A.type, x, r, e) * a[b].qs[e];
                        isum += sc * dot;
                        imin += m * (a[b].bsums[2 * s] + a[b].bsums[2 * s + 1]);
                    }
                    acc = std::fma((float)isum, fp16_to_f32(d[r]) * da, acc);
                    acc = std::fma(-(float)imin, fp16_to_f32(dmin[r]) * da, acc);
                }
                A.y[t * A.ldy + g * kRepackRows + r] = acc;
            }
        }
    }
}

}  // namespace

void matmul_r16_tail(const MatmulArgs& A) {
    const bool k = rows16_kformat(A.type);
    const int64_t nb = k ? A.cols / QK_K : A.cols / QK;
    const size_t pb = qtype_checked((uint32_t)A.type).block_bytes;
    int8_t q[QK_K];
    int16_t sc[16], mn[16];
    for (int64_t r = A.rows / kRepackRows * kRepackRows; r < A.rows; r++) {
        const uint8_t* row = A.w + r * A.w_stride;
        for (int64_t t = 0; t < A.n_tok; t++) {
            const uint8_t* act = (const uint8_t*)A.act + t * A.act_stride;
            float acc = 0;
            for (int64_t b = 0; b < nb; b++) {
                float d = 0, m = 0;
                if (!k) {
                    const block_q8_a& a = ((const block_q8_a*)act)[b];
                    unpack_q32(A.type, row + b * pb, q, &d, &m);
                    int32_t dot = 0;
                    for (int e = 0; e < QK; e++) dot += q[e] * a.qs[e];
                    acc = std::fma((float)dot, d * a.d, acc);
                    if (A.type == QType::Q4_1 || A.type == QType::Q5_1) acc = std::fma(m, a.s, acc);
                    continue;
                }
                const block_q8_K32& a = ((const block_q8_K32*)act)[b];
                unpack_qk(A.type, row + b * pb, q, sc, mn, &d, &m);
                int32_t isum = 0, imin = 0;
                for (int j = 0; j < 16; j++) {
                    int32_t dot = 0;
                    for (int e = 16 * j; e < 16 * j + 16; e++) dot += q[e] * a.qs[e];
                    isum += sc[j] * dot;
                    imin += mn[j] * a.bsums[j];
                }
                // the same integers as the groups' formula (Q3_K's q are u - 4 here, Q6_K's u - 32)
                acc = std::fma((float)isum, d * a.d[0], acc);
                if (has_min_term(A.type)) acc = std::fma(-(float)imin, m * a.d[0], acc);
            }
            A.y[t * A.ldy + r] = acc;
        }
    }
}

void matmul_r16_scalar(const MatmulArgs& A, int64_t g0, int64_t g1) {
    if (rows16_kformat(A.type)) return matmul_r16_scalar_k(A, g0, g1);
    const int64_t nb = A.cols / QK;
    const size_t gb = group_block_bytes(A.type);
    const Rows16Q32 f = rows16_q32(A.type);
    for (int64_t g = g0; g < g1; g++) {
        const uint8_t* grp = A.w + g * kRepackRows * A.w_stride;
        for (int64_t t = 0; t < A.n_tok; t++) {
            const block_q8_a* a = (const block_q8_a*)((const uint8_t*)A.act + t * A.act_stride);
            const int32_t* sum = A.asum + t * nb;
            for (int r = 0; r < kRepackRows; r++) {
                float acc = 0;
                for (int64_t b = 0; b < nb; b++) {
                    const uint8_t* ib = grp + b * gb;
                    uint16_t dh = 0, mh = 0;
                    memcpy(&dh, ib + f.sb * r, f.sb);
                    if (f.min) memcpy(&mh, ib + f.gm + 2 * r, 2);
                    const uint8_t* qs = ib + f.gqs;
                    uint64_t qh[8] = {};
                    if (f.fifth) memcpy(qh, ib + f.gqh, 64);
                    int32_t dot = -repack_offset(A.type) * sum[b];
                    for (int e = 0; e < QK; e++) {
                        int u;
                        if (f.q8) u = qs[(e / 4) * 64 + 4 * r + e % 4];
                        else {
                            const int lo = e % 16;
                            u = (qs[(lo / 4) * 64 + 4 * r + lo % 4] >> (e < 16 ? 0 : 4)) & 0xF;
                            if (f.fifth) u |= (int)((qh[e / 4] >> (4 * r + e % 4)) & 1) << 4;
                            if (A.type == QType::IQ4_NL) u = iq4nl_value(u) + 128;
                            if (A.type == QType::MXFP4) u = mxfp4_value(u) + 128;
                        }
                        dot += u * a[b].qs[e];
                    }
                    const float dw = A.type == QType::MXFP4 ? e8m0_to_f32_half((uint8_t)dh) : fp16_to_f32(dh);
                    const float s = dw * a[b].d;  // rounded to float before the FMA, as the SIMD path
                    acc = std::fma((float)dot, s, acc);
                    if (f.min) acc = std::fma(fp16_to_f32(mh), a[b].s, acc);  // the min term, block by block
                }
                A.y[t * A.ldy + g * kRepackRows + r] = acc;
            }
        }
    }
}

}  // namespace stowlm::cpu
