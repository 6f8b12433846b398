#include <algorithm>
#include <cstring>
#include <vector>

#include "bind.h"
#include "error.h"

namespace nb = nanobind;

namespace stowlm::bind {

namespace {
struct Entry {
    const char* name;
    BindFn fn;
};
std::vector<Entry>& registry() {
    static std::vector<Entry> r;
    return r;
}
}  // namespace

int register_binding(const char* name, BindFn fn) {
    registry().push_back({name, fn});
    return 0;
}

}  // namespace stowlm::bind

NB_MODULE(_core, m) {
    m.doc() = "stowlm native core";
    nb::register_exception_translator([](const std::exception_ptr& p, void*) {
        try {
            std::rethrow_exception(p);
        } catch (const stowlm::InvalidInput& e) {
            PyErr_SetString(PyExc_ValueError, e.what());
        } catch (const stowlm::OutOfDeviceMemory& e) {
            PyErr_SetString(PyExc_MemoryError, e.what());
        } catch (const stowlm::Unsupported& e) {
            PyErr_SetString(PyExc_RuntimeError, e.what());
        }
    });
#ifdef STOWLM_HAVE_CUDA
    m.attr("built_with_cuda") = true;
#else
    m.attr("built_with_cuda") = false;
#endif
    // Registration order across files is unspecified; sort by name so submodules are stable.
    auto entries = stowlm::bind::registry();
    std::sort(entries.begin(), entries.end(),
              [](const auto& a, const auto& b) { return std::strcmp(a.name, b.name) < 0; });
    for (const auto& e : entries) e.fn(m);
}
