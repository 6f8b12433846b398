// Run-time CPU feature detection (CPUID + the OS-enabled state in XCR0) and the choice of
// kernel path. One build runs on any x86-64: matmul picks the best path the CPU and OS
// allow, or a lower one forced with STOWLM_ISA=scalar|avx2|avx512|amx or set_isa().
#pragma once
#include <string>
#include <vector>

namespace stowlm::cpu {

enum class Isa { Scalar = 0, AVX2 = 1, AVX512_VNNI = 2, AMX = 3 };

struct CpuFeatures {
    // Instruction-set bits from CPUID, each already ANDed with the OS state it needs
    // (YMM for AVX2/FMA/F16C, opmask+ZMM for AVX-512, TILECFG+TILEDATA and the Linux
    // permission for AMX), so a true bit means "usable now".
    bool avx2 = false, fma = false, f16c = false;
    bool avx512f = false, avx512bw = false, avx512vl = false, avx512dq = false, avx512vnni = false;
    bool avx512vbmi = false;  // vpermb, vpermi2b, vpmultishiftqb: the i-quants' table lookups
    bool amx_tile = false, amx_int8 = false;
    // Raw state, for the report.
    bool os_ymm = false, os_zmm = false, os_amx = false, amx_permitted = false;
};

// Detected once per process (thread-safe); the AMX permission is requested at that time.
const CpuFeatures& cpu_features();

const char* isa_name(Isa isa);
// Parses "scalar", "avx2", "avx512", "amx"; throws InvalidInput otherwise.
Isa isa_from_name(const std::string& name);

bool isa_supported(Isa isa);
Isa best_isa();
// The path matmul uses now: best_isa() unless lowered by STOWLM_ISA or set_isa().
Isa active_isa();
// Throws Unsupported naming the missing feature when this CPU/OS cannot run `isa`.
void set_isa(Isa isa);

// Names of the usable features, for reports ("avx2", "fma", ..., "amx_int8").
std::vector<std::string> feature_names();

}  // namespace stowlm::cpu
