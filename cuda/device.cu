#include <cuda_runtime.h>

#include "device.h"

namespace stowlm::cuda {

std::vector<DeviceInfo> list_devices(std::string* why_none) {
    std::vector<DeviceInfo> out;
    int n = 0;
    cudaError_t err = cudaGetDeviceCount(&n);
    if (err != cudaSuccess || n == 0) {
        if (why_none) {
            *why_none = err != cudaSuccess ? std::string(cudaGetErrorName(err)) + ": " + cudaGetErrorString(err)
                                           : std::string("the CUDA runtime reports 0 devices");
        }
        cudaGetLastError();  // clear the sticky error so later queries start clean
        return out;
    }
    for (int i = 0; i < n; i++) {
        cudaDeviceProp p;
        if (cudaGetDeviceProperties(&p, i) != cudaSuccess) continue;
        DeviceInfo d;
        d.index = i;
        d.name = p.name;
        d.cc_major = p.major;
        d.cc_minor = p.minor;
        d.total_bytes = p.totalGlobalMem;
        d.sm_count = p.multiProcessorCount;
        d.shared_mem_per_block_optin = p.sharedMemPerBlockOptin;
        size_t free_b = 0, total_b = 0;
        if (cudaSetDevice(i) == cudaSuccess && cudaMemGetInfo(&free_b, &total_b) == cudaSuccess) d.free_bytes = free_b;
        out.push_back(d);
    }
    return out;
}

}  // namespace stowlm::cuda
