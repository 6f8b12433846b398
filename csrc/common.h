// Shared basics for the C++ core and the CUDA kernels: the HOST_DEVICE marker and
// exact half/bfloat16 conversions usable on both sides.
#pragma once
#include <cstdint>
#include <cmath>
#include <cstdlib>
#include <cstring>

#if defined(__CUDACC__)
#define HOST_DEVICE __host__ __device__ __forceinline__
#else
#define HOST_DEVICE inline
#endif

namespace stowlm {

// Products of this many tokens or more take each kind of device's batched matmul kernels (the
// CPU's GEMMs, the CUDA tiled kernel); below it a token's product is the same in any batch.
constexpr int64_t kCpuBatchedMinTokens = 24;
constexpr int64_t kCudaBatchedMinTokens = 9;
// Weights repacked into 16-row groups (cpu/repack.h) keep the row kernels up to this many tokens
// (the GEMM must first unpack them into its panels: slower there, ahead past it), so a model
// with repacked weights has a third kernel class from here (Model::batch_bounds).
constexpr int64_t kCpuR16RowsMax = 256;
// Micro-batches from this many tokens copy host-resident experts to the GPU for their products
// (ContextParams::moe_offload_min). Measured (big_moe_compare's sweep, an H100 beside 16 Xeon
// cores, Qwen3-30B-A3B's shape, 2026-11-28): the GPU's prompt speed over the CPU's 0.80x at 64
// tokens, 1.26x at 128, 2.2x at 512.
constexpr int64_t kMoeOffloadMin = 128;
// Beside a GPU, a stack of experts repacks (cpu/repack.h) only where one of its 16-row groups
// fits this many bytes: the GPU puts a staged copy back in GGUF's layout in place, a group at a
// time in a block's shared memory (sm_86/89 give a block at most 99 KiB).
constexpr size_t kStagedRows16GroupMax = (size_t)96 << 10;

HOST_DEVICE float bits_to_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}
HOST_DEVICE uint32_t f32_to_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

// IEEE half -> float, exact for every input (subnormals, inf, NaN payload kept).
HOST_DEVICE float fp16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t mant = h & 0x3ffu;
    if (exp == 0x1f) return bits_to_f32(sign | 0x7f800000u | (mant << 13));
    if (exp == 0) {
        if (mant == 0) return bits_to_f32(sign);
        // subnormal: value = mant * 2^-24, exactly representable in f32
        float v = (float)mant * 5.9604644775390625e-08f;
        return sign ? -v : v;
    }
    return bits_to_f32(sign | ((exp + 112u) << 23) | (mant << 13));
}

// float -> IEEE half, round to nearest even (what numpy's astype(float16) does).
HOST_DEVICE uint16_t f32_to_fp16(float f) {
    uint32_t x = f32_to_bits(f);
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    x &= 0x7fffffffu;
    if (x >= 0x7f800000u) return (uint16_t)(sign | 0x7c00u | (x > 0x7f800000u ? 0x200u : 0u));
    if (x >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);  // rounds past 65504 -> inf
    if (x < 0x38800000u) {                                     // result is subnormal or zero
        if (x < 0x33000000u) return sign;                      // below half of the smallest subnormal
        const uint32_t e = x >> 23;
        const uint32_t m = (x & 0x7fffffu) | 0x800000u;
        const uint32_t shift = 126u - e;                       // 14..24
        uint32_t r = m >> shift;
        const uint32_t rem = m & ((1u << shift) - 1u);
        const uint32_t half = 1u << (shift - 1u);
        if (rem > half || (rem == half && (r & 1u))) r++;
        return (uint16_t)(sign | r);
    }
    uint32_t r = x - 0x38000000u;  // rebias exponent 127 -> 15
    const uint32_t rem = r & 0x1fffu;
    r >>= 13;
    if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) r++;
    return (uint16_t)(sign | r);
}

HOST_DEVICE float bf16_to_f32(uint16_t h) { return bits_to_f32((uint32_t)h << 16); }

// float -> bfloat16, round to nearest even; NaN stays quiet NaN.
HOST_DEVICE uint16_t f32_to_bf16(float f) {
    uint32_t x = f32_to_bits(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 64u);
    return (uint16_t)((x + (0x7fffu + ((x >> 16) & 1u))) >> 16);
}

// Whether environment variable `name` is set to `value` (the STOWLM_* switches; read once by
// their callers, not per launch or per token).
inline bool env_is(const char* name, const char* value) {
    const char* e = std::getenv(name);
    return e && std::strcmp(e, value) == 0;
}

// The number environment variable `name` holds: `fallback` where it is unset, NaN where it is not
// a number (which the caller's range check then refuses, instead of a typo passing unnoticed).
inline double env_number(const char* name, double fallback) {
    const char* e = std::getenv(name);
    if (!e || !*e) return fallback;
    char* end = nullptr;
    const double v = std::strtod(e, &end);
    return *end == 0 ? v : std::nan("");
}

}  // namespace stowlm
