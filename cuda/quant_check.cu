// Compiles the HOST_DEVICE block decoders under nvcc so that a decoder nvcc rejects fails the
// build. The kernel decodes one block per thread into floats.
#include "common.h"
#include "quant/blocks.h"

namespace stowlm::cuda {

__global__ void fp16_roundtrip_kernel(const uint16_t* in, float* out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = fp16_to_f32(f32_to_fp16(fp16_to_f32(in[i])));
}

}  // namespace stowlm::cuda
