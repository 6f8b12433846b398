#include <nanobind/stl/string.h>

#include "bind.h"
#ifdef STOWLM_HAVE_CUDA
#include "device.h"
#endif

namespace nb = nanobind;

STOWLM_BIND(cuda) {
    nb::module_ cu = stowlm::bind::submodule(m, "cuda");
    // (devices: list of dicts, reason: why there are none, or "" when there are some)
    cu.def("devices", [] {
        nb::list devs;
        std::string why;
#ifdef STOWLM_HAVE_CUDA
        for (const auto& d : stowlm::cuda::list_devices(&why)) {
            nb::dict e;
            e["index"] = d.index;
            e["name"] = d.name;
            e["compute_capability"] = nb::make_tuple(d.cc_major, d.cc_minor);
            e["total_bytes"] = d.total_bytes;
            e["free_bytes"] = d.free_bytes;
            e["sm_count"] = d.sm_count;
            devs.append(e);
        }
#else
        why = "stowlm was built without CUDA (nvcc was not found at build time)";
#endif
        return nb::make_tuple(devs, why);
    });
}
