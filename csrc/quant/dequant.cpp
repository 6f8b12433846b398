// Bit-exactness needs every decode step rounded separately (multiply, round, add, round), as
// numpy does; forbid FMA contraction here whatever ISA flags this file gets in the future.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include "quant/dequant.h"

#include <cstring>

#include "quant/blocks.h"
#include "quant/float_types.h"
#include "quant/iquants.h"
#include "quant/kquants.h"
#include "quant/legacy.h"
#include "quant/mxfp4.h"

namespace stowlm {

namespace {

// Decodes nb blocks. Blocks are copied to an aligned local first: GGUF data (and Python
// buffers) may sit at any byte offset, and the block structs hold uint16_t/float fields.
template <class Block, void (*Decode)(const Block*, float*), int N>
void decode_blocks(const void* src, float* dst, int64_t nb) {
    const uint8_t* p = (const uint8_t*)src;
    if (((uintptr_t)p % alignof(Block)) == 0) {
        const Block* b = (const Block*)p;
        for (int64_t i = 0; i < nb; i++) Decode(b + i, dst + i * N);
        return;
    }
    Block tmp;
    for (int64_t i = 0; i < nb; i++) {
        memcpy(&tmp, p + i * sizeof(Block), sizeof(Block));
        Decode(&tmp, dst + i * N);
    }
}

}  // namespace

void dequantize_row(QType t, const void* src, float* dst, int64_t n) {
    row_bytes(t, n);  // validates the type and that n is a whole number of blocks
    const int64_t nb32 = n / QK, nb256 = n / QK_K;
    switch (t) {
        case QType::F32: memcpy(dst, src, (size_t)n * sizeof(float)); return;
        case QType::F16: return decode_blocks<uint16_t, dequantize_block_f16, 1>(src, dst, n);
        case QType::BF16: return decode_blocks<uint16_t, dequantize_block_bf16, 1>(src, dst, n);
        case QType::Q4_0: return decode_blocks<block_q4_0, dequantize_block_q4_0, QK>(src, dst, nb32);
        case QType::Q4_1: return decode_blocks<block_q4_1, dequantize_block_q4_1, QK>(src, dst, nb32);
        case QType::Q5_0: return decode_blocks<block_q5_0, dequantize_block_q5_0, QK>(src, dst, nb32);
        case QType::Q5_1: return decode_blocks<block_q5_1, dequantize_block_q5_1, QK>(src, dst, nb32);
        case QType::Q8_0: return decode_blocks<block_q8_0, dequantize_block_q8_0, QK>(src, dst, nb32);
        case QType::IQ4_NL: return decode_blocks<block_iq4_nl, dequantize_block_iq4_nl, QK>(src, dst, nb32);
        case QType::Q2_K: return decode_blocks<block_q2_K, dequantize_block_q2_K, QK_K>(src, dst, nb256);
        case QType::Q3_K: return decode_blocks<block_q3_K, dequantize_block_q3_K, QK_K>(src, dst, nb256);
        case QType::Q4_K: return decode_blocks<block_q4_K, dequantize_block_q4_K, QK_K>(src, dst, nb256);
        case QType::Q5_K: return decode_blocks<block_q5_K, dequantize_block_q5_K, QK_K>(src, dst, nb256);
        case QType::Q6_K: return decode_blocks<block_q6_K, dequantize_block_q6_K, QK_K>(src, dst, nb256);
        case QType::Q8_K: return decode_blocks<block_q8_K, dequantize_block_q8_K, QK_K>(src, dst, nb256);
        case QType::IQ4_XS: return decode_blocks<block_iq4_xs, dequantize_block_iq4_xs, QK_K>(src, dst, nb256);
        case QType::MXFP4: return decode_blocks<block_mxfp4, dequantize_block_mxfp4, QK>(src, dst, nb32);
        case QType::IQ2_XXS: return decode_blocks<block_iq2_xxs, dequantize_block_iq2_xxs, QK_K>(src, dst, nb256);
        case QType::IQ2_XS: return decode_blocks<block_iq2_xs, dequantize_block_iq2_xs, QK_K>(src, dst, nb256);
        case QType::IQ2_S: return decode_blocks<block_iq2_s, dequantize_block_iq2_s, QK_K>(src, dst, nb256);
        case QType::IQ3_XXS: return decode_blocks<block_iq3_xxs, dequantize_block_iq3_xxs, QK_K>(src, dst, nb256);
        case QType::IQ3_S: return decode_blocks<block_iq3_s, dequantize_block_iq3_s, QK_K>(src, dst, nb256);
        case QType::IQ1_S: return decode_blocks<block_iq1_s, dequantize_block_iq1_s, QK_K>(src, dst, nb256);
        case QType::IQ1_M: return decode_blocks<block_iq1_m, dequantize_block_iq1_m, QK_K>(src, dst, nb256);
        default: break;
    }
    throw InvalidInput(std::string("dequantize: tensor type ") + qtype_name(t) + " has no decoder");
}

}  // namespace stowlm
