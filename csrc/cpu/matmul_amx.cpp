// GCC 12 reports its own _mm512_undefined_*() inside AVX-512 intrinsics as maybe-uninitialized.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include "cpu/matmul_impl.h"

namespace stowlm::cpu {

bool matmul_amx(const MatmulArgs& a, ThreadPool& pool) { return false; }

}  // namespace stowlm::cpu
