// Each binding file registers its part of the stowlm._core module with STOWLM_BIND, so a
// new family of bindings is a new file, not an edit to a shared one.
#pragma once
#include <nanobind/nanobind.h>

namespace stowlm::bind {

using BindFn = void (*)(nanobind::module_&);
int register_binding(const char* name, BindFn fn);

}  // namespace stowlm::bind

#define STOWLM_BIND(name)                                                                   \
    static void stowlm_bind_##name(nanobind::module_& m);                                  \
    static const int stowlm_bind_reg_##name =                                               \
        ::stowlm::bind::register_binding(#name, &stowlm_bind_##name);                      \
    static void stowlm_bind_##name(nanobind::module_& m)
