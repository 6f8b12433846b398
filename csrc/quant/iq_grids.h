// The codebooks of the grid i-quants (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S) and
// the byte-wise helpers that apply their signs and deltas, for host and device.
//
// The data (quant/iq_grids.inc) is included twice: as host arrays, and under nvcc as __device__
// arrays, since device code cannot read a host array (and the 33 KB do not belong in registers
// or immediates the way the 16 IQ4 levels do). The accessors pick the copy of the side they run on.
// Without relocatable device code each CUDA module holds its own copy of the device arrays.
#pragma once
#include <cstdint>

#include "common.h"

namespace stowlm {

namespace iq_tables {
#define STOWLM_IQ_TABLE(type, name, n) inline constexpr type k##name[n] = {
#define STOWLM_IQ_TABLE_END() };
#include "quant/iq_grids.inc"
#undef STOWLM_IQ_TABLE
#undef STOWLM_IQ_TABLE_END
#if defined(__CUDACC__)
#define STOWLM_IQ_TABLE(type, name, n) static const __device__ type d##name[n] = {
#define STOWLM_IQ_TABLE_END() };
#include "quant/iq_grids.inc"
#undef STOWLM_IQ_TABLE
#undef STOWLM_IQ_TABLE_END
#endif
}  // namespace iq_tables

#if defined(__CUDA_ARCH__)
#define STOWLM_IQ_GRID(name) iq_tables::d##name
#else
#define STOWLM_IQ_GRID(name) iq_tables::k##name
#endif

// Grid entries: 8 (uint64_t) or 4 (uint32_t) int8 values, element 0 in the low byte. The IQ2
// grids hold 8, 25, 43; the IQ3 grids positive odd/even levels; IQ1S8 is IQ1's {-1, 0, 1} grid
// times 8, so that adding the sub-block's delta (+-1/8 of a step) stays in integers.
HOST_DEVICE uint64_t iq2xxs_grid(int i) { return STOWLM_IQ_GRID(IQ2XXS)[i]; }
HOST_DEVICE uint64_t iq2xs_grid(int i) { return STOWLM_IQ_GRID(IQ2XS)[i]; }
HOST_DEVICE uint64_t iq2s_grid(int i) { return STOWLM_IQ_GRID(IQ2S)[i]; }
HOST_DEVICE uint32_t iq3xxs_grid(int i) { return STOWLM_IQ_GRID(IQ3XXS)[i]; }
HOST_DEVICE uint32_t iq3s_grid(int i) { return STOWLM_IQ_GRID(IQ3S)[i]; }
HOST_DEVICE uint64_t iq1s_grid8(int i) { return STOWLM_IQ_GRID(IQ1S8)[i]; }

// The 8 signs of an IQ2_XXS/IQ2_XS/IQ3_XXS group from its 7 stored bits: the eighth makes the
// count of negative values even (GGUF's ksigns_iq2xs table, computed instead of looked up; the
// parity of the 7 bits from a 16-bit lookup word, no popcount instruction needed).
HOST_DEVICE constexpr uint32_t iq_signs8(uint32_t s7) { return s7 | (((0x6996u >> ((s7 ^ (s7 >> 4)) & 15u)) & 1u) << 7); }

// Bits 0..3 of b moved to bit 0 of bytes 0..3.
HOST_DEVICE uint32_t spread_bits4(uint32_t b) {
    return (b & 1u) | ((b & 2u) << 7) | ((b & 4u) << 14) | ((b & 8u) << 21);
}

// Four grid values (bytes, all >= 1) with byte i negated where bit i of s is set: per byte
// ~v + 1, which never carries into the next byte since v != 0.
HOST_DEVICE uint32_t iq_signed4(uint32_t v, uint32_t s) {
    const uint32_t one = spread_bits4(s);
    return (v ^ (one * 0xFFu)) + one;
}

// Byte-wise a + b modulo 256 (no carry between bytes).
HOST_DEVICE uint32_t add_bytes4(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
    return __vadd4(a, b);
#else
    return ((a & 0x7F7F7F7Fu) + (b & 0x7F7F7F7Fu)) ^ ((a ^ b) & 0x80808080u);
#endif
}

namespace detail {
// iq_signed4 relies on grid values being nonzero.
template <class T, int N>
constexpr bool grid_bytes_nonzero(const T (&g)[N]) {
    for (int i = 0; i < N; i++)
        for (int k = 0; k < (int)sizeof(T); k++)
            if (((g[i] >> (8 * k)) & 0xFF) == 0) return false;
    return true;
}
static_assert(grid_bytes_nonzero(iq_tables::kIQ2XXS) && grid_bytes_nonzero(iq_tables::kIQ2XS) &&
                  grid_bytes_nonzero(iq_tables::kIQ2S) && grid_bytes_nonzero(iq_tables::kIQ3XXS) &&
                  grid_bytes_nonzero(iq_tables::kIQ3S),
              "signed grids hold no zero values");
}  // namespace detail

}  // namespace stowlm
