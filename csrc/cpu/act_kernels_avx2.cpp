// AVX2 gated activations (act_kernels.h, written once in act_kernels_simd.h).
#include "cpu/act_kernels_simd.h"

namespace stowlm::cpu {

const ActKernels& act_kernels_avx2() { return gated_kernels<F32x8>(); }

}  // namespace stowlm::cpu
