// Internal: row loops of the gated activations (ops.cpp's swiglu / geglu), per instruction
// set, with a vector exp (vec_exp.h) instead of one libm call per element.
//   swiglu: out[i] = silu(g[i]) * u[i] = g u / (1 + e^-g)
//   geglu:  out[i] = gelu_tanh(g[i]) * u[i] = g u / (1 + e^(-2 k0 g (1 + k1 g^2)))
// (0.5 (1 + tanh(y)) = 1 / (1 + e^-2y): the tanh form of GELU as one exp.)
#pragma once
#include <cstdint>

namespace stowlm::cpu {

using GatedRowFn = void (*)(const float* g, const float* u, float* out, int64_t n);

struct ActKernels {
    GatedRowFn swiglu, geglu;
};

#if defined(STOWLM_X86)
const ActKernels& act_kernels_avx2();
const ActKernels& act_kernels_avx512();
#endif

}  // namespace stowlm::cpu
