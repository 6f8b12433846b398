// Block layouts exactly as GGUF stores them. Halves are kept as raw uint16_t bits.
#pragma once
#include <cstdint>

namespace stowlm {

constexpr int QK = 32;    // elements per block of the 32-element formats
constexpr int QK_K = 256; // elements per super-block of the K formats
constexpr int K_SCALE_SIZE = 12;

struct block_q4_0 { uint16_t d; uint8_t qs[QK / 2]; };
struct block_q4_1 { uint16_t d; uint16_t m; uint8_t qs[QK / 2]; };
struct block_q5_0 { uint16_t d; uint8_t qh[4]; uint8_t qs[QK / 2]; };
struct block_q5_1 { uint16_t d; uint16_t m; uint8_t qh[4]; uint8_t qs[QK / 2]; };
struct block_q8_0 { uint16_t d; int8_t qs[QK]; };
struct block_iq4_nl { uint16_t d; uint8_t qs[QK / 2]; };

struct block_q2_K { uint8_t scales[QK_K / 16]; uint8_t qs[QK_K / 4]; uint16_t d; uint16_t dmin; };
struct block_q3_K { uint8_t hmask[QK_K / 8]; uint8_t qs[QK_K / 4]; uint8_t scales[12]; uint16_t d; };
struct block_q4_K { uint16_t d; uint16_t dmin; uint8_t scales[K_SCALE_SIZE]; uint8_t qs[QK_K / 2]; };
struct block_q5_K { uint16_t d; uint16_t dmin; uint8_t scales[K_SCALE_SIZE]; uint8_t qh[QK_K / 8]; uint8_t qs[QK_K / 2]; };
struct block_q6_K { uint8_t ql[QK_K / 2]; uint8_t qh[QK_K / 4]; int8_t scales[QK_K / 16]; uint16_t d; };
struct block_q8_K { float d; int8_t qs[QK_K]; int16_t bsums[QK_K / 16]; };
struct block_iq4_xs { uint16_t d; uint16_t scales_h; uint8_t scales_l[QK_K / 64]; uint8_t qs[QK_K / 2]; };

// MXFP4: an E8M0 exponent and 32 E2M1 codes (nibbles, low half first).
struct block_mxfp4 { uint8_t e; uint8_t qs[QK / 2]; };

// The grid (codebook) i-quants: eight 32-element sub-blocks indexing 8- or 4-value grid entries.
struct block_iq2_xxs { uint16_t d; uint16_t qs[QK_K / 8]; };
struct block_iq2_xs { uint16_t d; uint16_t qs[QK_K / 8]; uint8_t scales[QK_K / 32]; };
struct block_iq2_s { uint16_t d; uint8_t qs[QK_K / 4]; uint8_t qh[QK_K / 32]; uint8_t scales[QK_K / 32]; };
struct block_iq3_xxs { uint16_t d; uint8_t qs[3 * QK_K / 8]; };
struct block_iq3_s { uint16_t d; uint8_t qs[QK_K / 4]; uint8_t qh[QK_K / 32]; uint8_t signs[QK_K / 8]; uint8_t scales[QK_K / 64]; };
struct block_iq1_s { uint16_t d; uint8_t qs[QK_K / 8]; uint16_t qh[QK_K / 32]; };
// IQ1_M keeps its fp16 scale in the top nibbles of the four 16-bit words of `scales`.
struct block_iq1_m { uint8_t qs[QK_K / 8]; uint8_t qh[QK_K / 16]; uint8_t scales[QK_K / 32]; };

static_assert(sizeof(block_q4_0) == 18, "q4_0 layout");
static_assert(sizeof(block_q4_1) == 20, "q4_1 layout");
static_assert(sizeof(block_q5_0) == 22, "q5_0 layout");
static_assert(sizeof(block_q5_1) == 24, "q5_1 layout");
static_assert(sizeof(block_q8_0) == 34, "q8_0 layout");
static_assert(sizeof(block_iq4_nl) == 18, "iq4_nl layout");
static_assert(sizeof(block_q2_K) == 84, "q2_K layout");
static_assert(sizeof(block_q3_K) == 110, "q3_K layout");
static_assert(sizeof(block_q4_K) == 144, "q4_K layout");
static_assert(sizeof(block_q5_K) == 176, "q5_K layout");
static_assert(sizeof(block_q6_K) == 210, "q6_K layout");
static_assert(sizeof(block_q8_K) == 292, "q8_K layout");
static_assert(sizeof(block_iq4_xs) == 136, "iq4_xs layout");
static_assert(sizeof(block_mxfp4) == 17, "mxfp4 layout");
static_assert(sizeof(block_iq2_xxs) == 66, "iq2_xxs layout");
static_assert(sizeof(block_iq2_xs) == 74, "iq2_xs layout");
static_assert(sizeof(block_iq2_s) == 82, "iq2_s layout");
static_assert(sizeof(block_iq3_xxs) == 98, "iq3_xxs layout");
static_assert(sizeof(block_iq3_s) == 110, "iq3_s layout");
static_assert(sizeof(block_iq1_s) == 50, "iq1_s layout");
static_assert(sizeof(block_iq1_m) == 56, "iq1_m layout");

}  // namespace stowlm
