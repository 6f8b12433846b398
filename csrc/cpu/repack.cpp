// Repacking into 16-row groups and back, and the scalar reference product (repack.h).
#include "cpu/repack.h"

#include <cmath>
#include <cstring>
#include <string>

#include "error.h"
#include "quant/blocks.h"
#include "quant/float_types.h"
#include "quant/legacy.h"

namespace stowlm::cpu {

int repack_offset(QType t) {
    switch (t) {
        case QType::Q8_0: return 128;
        case QType::Q4_0: return 8;
        case QType::Q5_0: return 16;
        default: return 0;
    }
}

bool repack_supported(QType t, int64_t rows, int64_t cols) {
    return repack_offset(t) && rows > 0 && rows % kRepackRows == 0 && cols > 0 && cols % QK == 0;
}

namespace {

size_t group_block_bytes(QType t) {
    switch (t) {
        case QType::Q8_0: return sizeof(block_q8_0x16);
        case QType::Q4_0: return sizeof(block_q4_0x16);
        default: return sizeof(block_q5_0x16);
    }
}

// Element e (0..31) of a plain block as the unsigned value the repacked layout keeps.
int plain_u(QType t, const uint8_t* blk, int e) {
    if (t == QType::Q8_0) return (int)((const block_q8_0*)blk)->qs[e] + 128;
    if (t == QType::Q4_0) return nibble_at(((const block_q4_0*)blk)->qs, e);
    const block_q5_0* b = (const block_q5_0*)blk;
    uint32_t qh;
    memcpy(&qh, b->qh, 4);
    return nibble_at(b->qs, e) | (int)(((qh >> e) & 1) << 4);
}

}  // namespace

void repack_rows16(QType t, int64_t rows, int64_t cols, const void* src, void* dst, int64_t r0, int64_t r1) {
    if (!repack_supported(t, rows, cols))
        throw InvalidInput("repack_rows16: " + std::string(qtype_checked((uint32_t)t).name) + " " +
                           std::to_string(rows) + " x " + std::to_string(cols) + " cannot be repacked");
    if (r1 < 0) r1 = rows;
    const int64_t nb = cols / QK;
    const size_t rb = row_bytes(t, cols), pb = qtype_checked((uint32_t)t).block_bytes, gb = group_block_bytes(t);
    for (int64_t g = r0 / kRepackRows; g < r1 / kRepackRows; g++) {
        const uint8_t* rowp = (const uint8_t*)src + g * kRepackRows * rb;
        uint8_t* out = (uint8_t*)dst + g * kRepackRows * rb;
        for (int64_t b = 0; b < nb; b++) {
            uint8_t* ob = out + b * gb;
            memset(ob, 0, gb);
            uint16_t* d = (uint16_t*)ob;
            uint8_t* qs = ob + 32;
            for (int r = 0; r < kRepackRows; r++) {
                const uint8_t* blk = rowp + r * rb + b * pb;
                memcpy(&d[r], blk, 2);  // every one of the three formats starts with its fp16 d
                for (int e = 0; e < QK; e++) {
                    const int u = plain_u(t, blk, e);
                    if (t == QType::Q8_0) {
                        qs[(e / 4) * 64 + 4 * r + e % 4] = (uint8_t)u;
                        continue;
                    }
                    const int lo = e % 16, k = lo / 4, i = lo % 4;
                    qs[k * 64 + 4 * r + i] |= (uint8_t)((u & 0xF) << (e < 16 ? 0 : 4));
                    if (t == QType::Q5_0 && (u & 0x10)) {
                        uint64_t* qh = (uint64_t*)(ob + 32 + 256);
                        qh[e / 4] |= (uint64_t)1 << (4 * r + e % 4);
                    }
                }
            }
        }
    }
}

void unrepack_row16(QType t, int64_t cols, const void* packed, int64_t r, void* dst) {
    const int64_t nb = cols / QK, g = r / kRepackRows, rr = r % kRepackRows;
    const size_t rb = row_bytes(t, cols), pb = qtype_checked((uint32_t)t).block_bytes, gb = group_block_bytes(t);
    const uint8_t* in = (const uint8_t*)packed + g * kRepackRows * rb;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t* ib = in + b * gb;
        uint8_t* blk = (uint8_t*)dst + b * pb;
        memset(blk, 0, pb);
        memcpy(blk, ib + 2 * rr, 2);
        const uint8_t* qs = ib + 32;
        for (int e = 0; e < QK; e++) {
            int u;
            if (t == QType::Q8_0) {
                u = qs[(e / 4) * 64 + 4 * rr + e % 4];
                ((block_q8_0*)blk)->qs[e] = (int8_t)(u - 128);
                continue;
            }
            const int lo = e % 16, k = lo / 4, i = lo % 4;
            u = (qs[k * 64 + 4 * rr + i] >> (e < 16 ? 0 : 4)) & 0xF;
            uint8_t* bq = t == QType::Q4_0 ? ((block_q4_0*)blk)->qs : ((block_q5_0*)blk)->qs;
            bq[lo] |= (uint8_t)(u << (e < 16 ? 0 : 4));
            if (t == QType::Q5_0) {
                uint64_t qh;
                memcpy(&qh, ib + 32 + 256 + 8 * (e / 4), 8);
                if ((qh >> (4 * rr + e % 4)) & 1) ((block_q5_0*)blk)->qh[e / 8] |= (uint8_t)(1u << (e % 8));
            }
        }
    }
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

void matmul_r16_scalar(const MatmulArgs& A, int64_t g0, int64_t g1) {
    const int64_t nb = A.cols / QK;
    const size_t gb = group_block_bytes(A.type);
    for (int64_t g = g0; g < g1; g++) {
        const uint8_t* grp = A.w + g * kRepackRows * A.w_stride;
        for (int64_t t = 0; t < A.n_tok; t++) {
            const block_q8_a* a = (const block_q8_a*)((const uint8_t*)A.act + t * A.act_stride);
            const int32_t* sum = A.asum + t * nb;
            for (int r = 0; r < kRepackRows; r++) {
                float acc = 0;
                for (int64_t b = 0; b < nb; b++) {
                    const uint8_t* ib = grp + b * gb;
                    uint16_t dh;
                    memcpy(&dh, ib + 2 * r, 2);
                    const uint8_t* qs = ib + 32;
                    uint64_t qh[8] = {};
                    if (A.type == QType::Q5_0) memcpy(qh, ib + 32 + 256, 64);
                    int32_t dot = -repack_offset(A.type) * sum[b];
                    for (int e = 0; e < QK; e++) {
                        int u;
                        if (A.type == QType::Q8_0) u = qs[(e / 4) * 64 + 4 * r + e % 4];
                        else {
                            const int lo = e % 16;
                            u = (qs[(lo / 4) * 64 + 4 * r + lo % 4] >> (e < 16 ? 0 : 4)) & 0xF;
                            if (A.type == QType::Q5_0) u |= (int)((qh[e / 4] >> (4 * r + e % 4)) & 1) << 4;
                        }
                        dot += u * a[b].qs[e];
                    }
                    const float s = fp16_to_f32(dh) * a[b].d;  // rounded to float before the FMA, as the SIMD path
                    acc = std::fma((float)dot, s, acc);
                }
                A.y[t * A.ldy + g * kRepackRows + r] = acc;
            }
        }
    }
}

}  // namespace stowlm::cpu
