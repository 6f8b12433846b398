// Errors the core raises. The bindings translate each kind into a Python exception, keeping
// the message, which must name the file, tensor or field at fault.
#pragma once
#include <stdexcept>
#include <string>

namespace stowlm {

// Input the caller gave is wrong (bad shape, unknown type, malformed file): Python ValueError.
struct InvalidInput : std::invalid_argument {
    using std::invalid_argument::invalid_argument;
};
// A device cannot hold what was asked of it: Python MemoryError.
struct OutOfDeviceMemory : std::runtime_error {
    using std::runtime_error::runtime_error;
};
// Something the platform cannot do here (no CUDA device, no AMX): Python RuntimeError.
struct Unsupported : std::runtime_error {
    using std::runtime_error::runtime_error;
};

}  // namespace stowlm
