// The one grammar of device lists, shared by the Python layer (stowlm/devices.py, through the
// bindings) and stowlm-bench: "cpu", "cpu:1", "cpu:0[threads=1,mem=512MiB]", "cuda:1[mem=8GiB]",
// "cpu:0[threads=2,speed=1.6]", and a device of MPI rank R as "cpu:0@R" (or "cpu:0[rank=R]").
// Errors are InvalidInput naming the text and the part that is wrong.
#pragma once
#include <cstddef>
#include <string>
#include <vector>

#include "backend/backend.h"

namespace stowlm {

// "512MiB", "2GiB", "1.5G", "3MB", "1000000" -> bytes (K/M/G/T and KiB.. are binary, KB.. decimal).
size_t parse_bytes(const std::string& text);
// One device; says nothing of whether it exists here (a CUDA device, another rank).
DeviceSpec parse_device_spec(const std::string& text);
// A comma-separated list (commas inside [...] belong to a device's options): no device twice,
// at least one.
std::vector<DeviceSpec> parse_device_list(const std::string& text);
// "512MiB" where n is a whole number of a unit, else the byte count (how specs print sizes).
std::string format_bytes(size_t n);

}  // namespace stowlm
