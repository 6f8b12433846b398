// The references round after every multiply and add; forbid FMA contraction here whatever
// ISA flags this file gets in the future, or trunc(x*id + 8.5) could differ in the last bit.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include "quant/quantize.h"

#include <cstring>
#include <string>

#include "quant/quantize_block.h"

namespace stowlm {

namespace {

// Quantizes nb blocks of N floats, staging each block in an aligned local because dst may
// sit at any byte offset.
template <class Block, void (*Quant)(const float*, Block*), int N>
void encode_blocks(const float* src, void* dst, int64_t nb) {
    uint8_t* p = (uint8_t*)dst;
    Block tmp;
    for (int64_t i = 0; i < nb; i++) {
        Quant(src + i * N, &tmp);
        memcpy(p + i * sizeof(Block), &tmp, sizeof(Block));
    }
}

}  // namespace

bool can_quantize(QType t) {
    switch (t) {
        case QType::F32: case QType::F16: case QType::BF16: case QType::Q8_0: case QType::Q4_0:
        case QType::Q4_1: case QType::Q5_0: case QType::Q5_1: case QType::Q8_K: case QType::Q3_K:
            return true;
        default:
            return false;
    }
}

size_t quantize_row(QType t, const float* src, void* dst, int64_t n) {
    const size_t bytes = row_bytes(t, n);  // validates the type and the block multiple
    uint8_t* out = (uint8_t*)dst;
    switch (t) {
        case QType::F32: memcpy(dst, src, bytes); return bytes;
        case QType::F16:
        case QType::BF16:
            for (int64_t i = 0; i < n; i++) {
                const uint16_t h = t == QType::F16 ? f32_to_fp16(src[i]) : f32_to_bf16(src[i]);
                memcpy(out + 2 * i, &h, 2);
            }
            return bytes;
        case QType::Q8_0: encode_blocks<block_q8_0, quantize_block_q8_0, QK>(src, dst, n / QK); return bytes;
        case QType::Q4_0: encode_blocks<block_q4_0, quantize_block_q4_0, QK>(src, dst, n / QK); return bytes;
        case QType::Q4_1: encode_blocks<block_q4_1, quantize_block_q4_1, QK>(src, dst, n / QK); return bytes;
        case QType::Q5_0: encode_blocks<block_q5_0, quantize_block_q5_0, QK>(src, dst, n / QK); return bytes;
        case QType::Q5_1: encode_blocks<block_q5_1, quantize_block_q5_1, QK>(src, dst, n / QK); return bytes;
        case QType::Q8_K: encode_blocks<block_q8_K, quantize_block_q8_K, QK_K>(src, dst, n / QK_K); return bytes;
        case QType::Q3_K: encode_blocks<block_q3_K, quantize_block_q3_K, QK_K>(src, dst, n / QK_K); return bytes;
        default: break;
    }
    throw InvalidInput(std::string("quantize: producing tensor type ") + qtype_name(t) +
                       " is not implemented (supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q8_K, Q3_K)");
}

}  // namespace stowlm
