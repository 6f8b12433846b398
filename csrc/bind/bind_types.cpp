#include <nanobind/stl/string.h>

#include "bind.h"
#include "quant/types.h"

namespace nb = nanobind;

STOWLM_BIND(types) {
    // {name: (id, block_elems, block_bytes)} for the types stowlm decodes.
    m.def("qtypes", [] {
        nb::dict d;
        for (uint32_t id = 0; id < 64; id++) {
            const stowlm::QTypeInfo* i = stowlm::qtype_info(id);
            if (i && i->supported) d[i->name] = nb::make_tuple(id, i->block_elems, i->block_bytes);
        }
        return d;
    });
}
