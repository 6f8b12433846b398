// CUDA device discovery. Built only where nvcc is found; the runtime is linked statically,
// so on a machine without a driver or GPU every query answers "no device" instead of failing.
#pragma once
#include <cstddef>
#include <string>
#include <vector>

namespace stowlm::cuda {

struct DeviceInfo {
    int index = 0;
    std::string name;
    int cc_major = 0, cc_minor = 0;
    size_t total_bytes = 0, free_bytes = 0;
    int sm_count = 0;
    size_t shared_mem_per_block_optin = 0;
};

// Devices the CUDA runtime can use here; empty when none. `why_none` says why (no driver, ...).
std::vector<DeviceInfo> list_devices(std::string* why_none = nullptr);

}  // namespace stowlm::cuda
