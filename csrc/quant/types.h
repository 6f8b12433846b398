// Tensor element types with GGUF's numeric ids, and the size of each type's block.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

#include "error.h"

namespace stowlm {

enum class QType : uint32_t {
    F32 = 0,
    F16 = 1,
    Q4_0 = 2,
    Q4_1 = 3,
    Q5_0 = 6,
    Q5_1 = 7,
    Q8_0 = 8,
    Q8_1 = 9,
    Q2_K = 10,
    Q3_K = 11,
    Q4_K = 12,
    Q5_K = 13,
    Q6_K = 14,
    Q8_K = 15,
    IQ2_XXS = 16,
    IQ2_XS = 17,
    IQ3_XXS = 18,
    IQ1_S = 19,
    IQ4_NL = 20,
    IQ3_S = 21,
    IQ2_S = 22,
    IQ4_XS = 23,
    I8 = 24,
    I16 = 25,
    I32 = 26,
    I64 = 27,
    F64 = 28,
    IQ1_M = 29,
    BF16 = 30,
    MXFP4 = 39,
};

struct QTypeInfo {
    const char* name;
    int32_t block_elems;  // elements per block (1 for plain types)
    int32_t block_bytes;  // bytes per block
    bool supported;       // decodable by stowlm
};

// Returns nullptr for an id GGUF does not define or stowlm does not know.
const QTypeInfo* qtype_info(uint32_t id);

// Throws InvalidInput naming the id when it is unknown or not supported.
const QTypeInfo& qtype_checked(uint32_t id);

inline const char* qtype_name(QType t) {
    const QTypeInfo* i = qtype_info((uint32_t)t);
    return i ? i->name : "unknown";
}

// Bytes of a row of n elements; throws if n is not a multiple of the block size.
size_t row_bytes(QType t, int64_t n);

}  // namespace stowlm
