// Each binding file registers its part of the stowlm._core module with STOWLM_BIND, so a
// new family of bindings is a new file, not an edit to a shared one.
#pragma once
#include <nanobind/nanobind.h>

namespace stowlm::bind {

using BindFn = void (*)(nanobind::module_&);
int register_binding(const char* name, BindFn fn);

// The submodule `name` of m (stowlm._core.ops, ...), created by whichever file asks first.
inline nanobind::module_ submodule(nanobind::module_& m, const char* name) {
    if (nanobind::hasattr(m, name)) return nanobind::borrow<nanobind::module_>(m.attr(name));
    return m.def_submodule(name);
}

}  // namespace stowlm::bind

#define STOWLM_BIND(name)                                                                   \
    static void stowlm_bind_##name(nanobind::module_& m);                                  \
    static const int stowlm_bind_reg_##name =                                               \
        ::stowlm::bind::register_binding(#name, &stowlm_bind_##name);                      \
    static void stowlm_bind_##name(nanobind::module_& m)
