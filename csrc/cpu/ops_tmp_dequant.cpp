// TEMPORARY minimal scalar decoders for get_rows (see ops_tmp_dequant.h).
#include "cpu/ops_tmp_dequant.h"

#include <cstring>
#include <string>

#include "common.h"
#include "quant/blocks.h"

namespace stowlm {

namespace {
void q4_k_scale_min(int j, const uint8_t* q, uint8_t* d, uint8_t* m) {
    if (j < 4) {
        *d = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *d = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}
}  // namespace

void dequantize_row(QType type, const void* src, float* y, int64_t n) {
    switch (type) {
        case QType::F32: memcpy(y, src, (size_t)n * 4); return;
        case QType::F16: {
            const uint16_t* s = (const uint16_t*)src;
            for (int64_t i = 0; i < n; i++) y[i] = fp16_to_f32(s[i]);
            return;
        }
        case QType::BF16: {
            const uint16_t* s = (const uint16_t*)src;
            for (int64_t i = 0; i < n; i++) y[i] = bf16_to_f32(s[i]);
            return;
        }
        case QType::Q8_0: {
            const block_q8_0* b = (const block_q8_0*)src;
            for (int64_t i = 0; i < n / QK; i++, y += QK) {
                const float d = fp16_to_f32(b[i].d);
                for (int j = 0; j < QK; j++) y[j] = d * b[i].qs[j];
            }
            return;
        }
        case QType::Q4_0: {
            const block_q4_0* b = (const block_q4_0*)src;
            for (int64_t i = 0; i < n / QK; i++, y += QK) {
                const float d = fp16_to_f32(b[i].d);
                for (int j = 0; j < QK / 2; j++) {
                    y[j] = d * ((b[i].qs[j] & 0xF) - 8);
                    y[j + QK / 2] = d * ((b[i].qs[j] >> 4) - 8);
                }
            }
            return;
        }
        case QType::Q4_1: {
            const block_q4_1* b = (const block_q4_1*)src;
            for (int64_t i = 0; i < n / QK; i++, y += QK) {
                const float d = fp16_to_f32(b[i].d), m = fp16_to_f32(b[i].m);
                for (int j = 0; j < QK / 2; j++) {
                    y[j] = d * (b[i].qs[j] & 0xF) + m;
                    y[j + QK / 2] = d * (b[i].qs[j] >> 4) + m;
                }
            }
            return;
        }
        case QType::Q5_0: {
            const block_q5_0* b = (const block_q5_0*)src;
            for (int64_t i = 0; i < n / QK; i++, y += QK) {
                const float d = fp16_to_f32(b[i].d);
                uint32_t qh;
                memcpy(&qh, b[i].qh, 4);
                for (int j = 0; j < QK / 2; j++) {
                    const int h0 = ((qh >> j) << 4) & 0x10, h1 = (qh >> (j + 12)) & 0x10;
                    y[j] = d * (((b[i].qs[j] & 0xF) | h0) - 16);
                    y[j + QK / 2] = d * (((b[i].qs[j] >> 4) | h1) - 16);
                }
            }
            return;
        }
        case QType::Q4_K: {
            const block_q4_K* b = (const block_q4_K*)src;
            for (int64_t i = 0; i < n / QK_K; i++) {
                const float d = fp16_to_f32(b[i].d), dmin = fp16_to_f32(b[i].dmin);
                const uint8_t* q = b[i].qs;
                for (int c = 0; c < 4; c++, q += 32) {
                    uint8_t s0, m0, s1, m1;
                    q4_k_scale_min(2 * c, b[i].scales, &s0, &m0);
                    q4_k_scale_min(2 * c + 1, b[i].scales, &s1, &m1);
                    for (int l = 0; l < 32; l++) *y++ = d * s0 * (q[l] & 0xF) - dmin * m0;
                    for (int l = 0; l < 32; l++) *y++ = d * s1 * (q[l] >> 4) - dmin * m1;
                }
            }
            return;
        }
        case QType::Q6_K: {
            const block_q6_K* b = (const block_q6_K*)src;
            for (int64_t i = 0; i < n / QK_K; i++) {
                const float d = fp16_to_f32(b[i].d);
                const uint8_t* ql = b[i].ql;
                const uint8_t* qh = b[i].qh;
                const int8_t* sc = b[i].scales;
                for (int h = 0; h < 2; h++, y += 128, ql += 64, qh += 32, sc += 8) {
                    for (int l = 0; l < 32; l++) {
                        const int is = l / 16;
                        const int q1 = ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
                        const int q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
                        const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                        const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                        y[l] = d * sc[is] * q1;
                        y[l + 32] = d * sc[is + 2] * q2;
                        y[l + 64] = d * sc[is + 4] * q3;
                        y[l + 96] = d * sc[is + 6] * q4;
                    }
                }
            }
            return;
        }
        default:
            throw Unsupported(std::string("get_rows: no decoder yet for type ") + qtype_name(type));
    }
}

}  // namespace stowlm
