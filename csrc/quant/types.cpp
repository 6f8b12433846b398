#include "quant/types.h"

namespace stowlm {

namespace {
struct Entry {
    uint32_t id;
    QTypeInfo info;
};
// Block sizes are GGUF's (ggml-common.h layouts); unsupported ids still get a name for messages.
const Entry kTypes[] = {
    {0, {"F32", 1, 4, true}},          {1, {"F16", 1, 2, true}},        {2, {"Q4_0", 32, 18, true}},
    {3, {"Q4_1", 32, 20, true}},       {6, {"Q5_0", 32, 22, true}},     {7, {"Q5_1", 32, 24, true}},
    {8, {"Q8_0", 32, 34, true}},       {9, {"Q8_1", 32, 36, false}},    {10, {"Q2_K", 256, 84, true}},
    {11, {"Q3_K", 256, 110, true}},    {12, {"Q4_K", 256, 144, true}},  {13, {"Q5_K", 256, 176, true}},
    {14, {"Q6_K", 256, 210, true}},    {15, {"Q8_K", 256, 292, true}},  {16, {"IQ2_XXS", 256, 66, true}},
    {17, {"IQ2_XS", 256, 74, true}},   {18, {"IQ3_XXS", 256, 98, true}}, {19, {"IQ1_S", 256, 50, true}},
    {20, {"IQ4_NL", 32, 18, true}},    {21, {"IQ3_S", 256, 110, true}},  {22, {"IQ2_S", 256, 82, true}},
    {23, {"IQ4_XS", 256, 136, true}},  {24, {"I8", 1, 1, false}},       {25, {"I16", 1, 2, false}},
    {26, {"I32", 1, 4, false}},        {27, {"I64", 1, 8, false}},      {28, {"F64", 1, 8, false}},
    {29, {"IQ1_M", 256, 56, true}},    {30, {"BF16", 1, 2, true}},      {34, {"TQ1_0", 256, 54, false}},
    {35, {"TQ2_0", 256, 66, false}},   {39, {"MXFP4", 32, 17, true}},   {40, {"NVFP4", 64, 36, false}},
    {41, {"Q1_0", 128, 18, false}},
};
}  // namespace

const QTypeInfo* qtype_info(uint32_t id) {
    for (const Entry& e : kTypes)
        if (e.id == id) return &e.info;
    return nullptr;
}

const QTypeInfo& qtype_checked(uint32_t id) {
    const QTypeInfo* i = qtype_info(id);
    if (!i) throw InvalidInput("unknown tensor type id " + std::to_string(id));
    if (!i->supported)
        throw InvalidInput(std::string("tensor type ") + i->name + " (id " + std::to_string(id) +
                           ") is not supported by stowlm");
    return *i;
}

size_t row_bytes(QType t, int64_t n) {
    const QTypeInfo& i = qtype_checked((uint32_t)t);
    if (n < 0 || n % i.block_elems != 0)
        throw InvalidInput(std::string("row of ") + std::to_string(n) + " elements is not a multiple of the " +
                           i.name + " block size " + std::to_string(i.block_elems));
    return (size_t)(n / i.block_elems) * (size_t)i.block_bytes;
}

}  // namespace stowlm
