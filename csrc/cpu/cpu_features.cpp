#include "cpu/cpu_features.h"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <mutex>

#include "error.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#define STOWLM_HAVE_CPUID 1
#endif
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace stowlm::cpu {

namespace {

#ifdef STOWLM_HAVE_CPUID
void cpuid(unsigned leaf, unsigned sub, unsigned r[4]) {
    __cpuid_count(leaf, sub, r[0], r[1], r[2], r[3]);
}
uint64_t xgetbv0() {
    uint32_t lo, hi;
    // xgetbv with ecx=0 (XCR0); only executed after CPUID reported OSXSAVE.
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((uint64_t)hi << 32) | lo;
}
#endif

// Linux keeps AMX tile data disabled per process until asked (arch_prctl); without this
// the first tile instruction faults. The permission covers every thread of the process.
bool request_amx_permission() {
#if defined(__linux__) && defined(STOWLM_HAVE_CPUID)
    constexpr long ARCH_GET_XCOMP_PERM = 0x1022, ARCH_REQ_XCOMP_PERM = 0x1023;
    constexpr int XFEATURE_XTILEDATA = 18;
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) return false;
    unsigned long bits = 0;
    if (syscall(SYS_arch_prctl, ARCH_GET_XCOMP_PERM, &bits) != 0) return false;
    return (bits >> XFEATURE_XTILEDATA) & 1;
#else
    return false;
#endif
}

CpuFeatures detect() {
    CpuFeatures f;
#ifdef STOWLM_HAVE_CPUID
    unsigned r[4];
    cpuid(0, 0, r);
    const unsigned max_leaf = r[0];
    cpuid(1, 0, r);
    const bool osxsave = (r[2] >> 27) & 1;
    const bool fma = (r[2] >> 12) & 1, f16c = (r[2] >> 29) & 1, avx = (r[2] >> 28) & 1;
    uint64_t xcr0 = osxsave ? xgetbv0() : 0;
    f.os_ymm = avx && (xcr0 & 0x6) == 0x6;                // SSE + AVX state
    f.os_zmm = f.os_ymm && (xcr0 & 0xe0) == 0xe0;         // opmask, ZMM_Hi256, Hi16_ZMM
    f.os_amx = (xcr0 & (3ull << 17)) == (3ull << 17);     // TILECFG (17), TILEDATA (18)
    if (max_leaf >= 7) {
        cpuid(7, 0, r);
        const unsigned b = r[1], c = r[2], d = r[3];
        f.avx2 = f.os_ymm && ((b >> 5) & 1);
        f.fma = f.os_ymm && fma;
        f.f16c = f.os_ymm && f16c;
        f.avx512f = f.os_zmm && ((b >> 16) & 1);
        f.avx512dq = f.os_zmm && ((b >> 17) & 1);
        f.avx512bw = f.os_zmm && ((b >> 30) & 1);
        f.avx512vl = f.os_zmm && ((b >> 31) & 1);
        f.avx512vnni = f.os_zmm && ((c >> 11) & 1);
        f.avx512vbmi = f.os_zmm && ((c >> 1) & 1);
        const bool amx_tile = (d >> 24) & 1, amx_int8 = (d >> 25) & 1;
        if (amx_tile && amx_int8 && f.os_amx) f.amx_permitted = request_amx_permission();
        f.amx_tile = amx_tile && f.os_amx && f.amx_permitted;
        f.amx_int8 = amx_int8 && f.amx_tile;
    }
#endif
    return f;
}

std::atomic<int> g_active{-1};
std::once_flag g_init;

void init_active() {
    std::call_once(g_init, [] {
        Isa isa = best_isa();
        if (const char* s = std::getenv("STOWLM_ISA")) {
            if (*s) {
                try {
                    Isa want = isa_from_name(s);
                    if (isa_supported(want)) {
                        isa = want;
                    } else {
                        std::fprintf(stderr, "stowlm: STOWLM_ISA=%s is not supported by this CPU/OS; using %s\n",
                                     s, isa_name(isa));
                    }
                } catch (const InvalidInput&) {
                    std::fprintf(stderr, "stowlm: ignoring unknown STOWLM_ISA=%s (scalar|avx2|avx512|amx)\n", s);
                }
            }
        }
        g_active.store((int)isa);
    });
}

}  // namespace

const CpuFeatures& cpu_features() {
    static const CpuFeatures f = detect();
    return f;
}

const char* isa_name(Isa isa) {
    switch (isa) {
        case Isa::Scalar: return "scalar";
        case Isa::AVX2: return "avx2";
        case Isa::AVX512_VNNI: return "avx512";
        case Isa::AMX: return "amx";
    }
    return "unknown";
}

Isa isa_from_name(const std::string& name) {
    if (name == "scalar") return Isa::Scalar;
    if (name == "avx2") return Isa::AVX2;
    if (name == "avx512" || name == "avx512_vnni") return Isa::AVX512_VNNI;
    if (name == "amx") return Isa::AMX;
    throw InvalidInput("unknown ISA name '" + name + "' (expected scalar, avx2, avx512 or amx)");
}

bool isa_supported(Isa isa) {
    const CpuFeatures& f = cpu_features();
#ifndef STOWLM_X86
    return isa == Isa::Scalar;
#endif
    const bool avx2 = f.avx2 && f.fma && f.f16c;
    const bool avx512 = avx2 && f.avx512f && f.avx512bw && f.avx512vl && f.avx512dq && f.avx512vnni;
    switch (isa) {
        case Isa::Scalar: return true;
        case Isa::AVX2: return avx2;
        case Isa::AVX512_VNNI: return avx512;
        case Isa::AMX: return avx512 && f.amx_tile && f.amx_int8;
    }
    return false;
}

Isa best_isa() {
    for (Isa i : {Isa::AMX, Isa::AVX512_VNNI, Isa::AVX2})
        if (isa_supported(i)) return i;
    return Isa::Scalar;
}

Isa active_isa() {
    init_active();
    return (Isa)g_active.load(std::memory_order_relaxed);
}

void set_isa(Isa isa) {
    init_active();
    if (!isa_supported(isa)) {
        const CpuFeatures& f = cpu_features();
        std::string why;
        if (isa == Isa::AMX)
            why = !f.os_amx ? "the OS has not enabled AMX tile state (XCR0 bits 17/18)"
                  : !f.amx_permitted ? "the kernel refused the AMX tile-data permission (arch_prctl)"
                                     : "the CPU lacks AMX-TILE/AMX-INT8 or AVX-512 VNNI";
        else if (isa == Isa::AVX512_VNNI)
            why = !f.os_zmm ? "the OS has not enabled ZMM/opmask state" : "the CPU lacks AVX-512 F/BW/VL/DQ/VNNI";
        else
            why = !f.os_ymm ? "the OS has not enabled YMM state" : "the CPU lacks AVX2/FMA/F16C";
        throw Unsupported(std::string("set_isa(") + isa_name(isa) + "): " + why);
    }
    g_active.store((int)isa);
}

std::vector<std::string> feature_names() {
    const CpuFeatures& f = cpu_features();
    std::vector<std::string> v;
    auto add = [&](bool b, const char* n) { if (b) v.push_back(n); };
    add(f.avx2, "avx2"); add(f.fma, "fma"); add(f.f16c, "f16c");
    add(f.avx512f, "avx512f"); add(f.avx512bw, "avx512bw"); add(f.avx512vl, "avx512vl");
    add(f.avx512dq, "avx512dq"); add(f.avx512vnni, "avx512vnni"); add(f.avx512vbmi, "avx512vbmi");
    add(f.amx_tile, "amx_tile"); add(f.amx_int8, "amx_int8");
    return v;
}

}  // namespace stowlm::cpu
