// stowlm._core.cpu: what the CPU offers and which kernel path is in use.
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "bind.h"
#include "cpu/cpu_features.h"

namespace nb = nanobind;
using namespace stowlm::cpu;

STOWLM_BIND(cpu) {
    nb::module_ c = stowlm::bind::submodule(m, "cpu");
    c.def("features", [] { return feature_names(); }, "Usable CPU features (CPUID and OS state).");
    c.def("best_isa", [] { return std::string(isa_name(best_isa())); });
    c.def("active_isa", [] { return std::string(isa_name(active_isa())); });
    c.def("supported_isas", [] {
        std::vector<std::string> v;
        for (Isa i : {Isa::Scalar, Isa::AVX2, Isa::AVX512_VNNI, Isa::AMX})
            if (isa_supported(i)) v.push_back(isa_name(i));
        return v;
    });
    c.def("set_isa", [](const std::string& name) { set_isa(isa_from_name(name)); }, nb::arg("name"),
          "Force the kernel path (scalar, avx2, avx512, amx); RuntimeError if this CPU/OS lacks it.");
}
