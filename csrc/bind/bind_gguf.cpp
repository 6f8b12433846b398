// stowlm._core.gguf: the GGUF reader for Python. Tensor data comes back as zero-copy uint8
// views whose owner holds the mapping, so a view outlives close() safely.
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cerrno>
#include <cstring>
#include <memory>

#include "bind.h"
#include "gguf/gguf.h"

namespace nb = nanobind;
using stowlm::GGUFFile;
using stowlm::GGUFType;
using stowlm::GGUFValue;

namespace {

struct Handle {
    std::shared_ptr<const GGUFFile> f;
    std::string path;

    const GGUFFile& get() const {
        if (!f) throw stowlm::InvalidInput(path + ": the GGUF file is closed");
        return *f;
    }
};

// GGUF strings are meant to be UTF-8; vocabularies sometimes hold raw bytes, which
// surrogateescape keeps losslessly (s.encode("utf-8", "surrogateescape") gives them back).
nb::object str_of(const std::string& s) {
    PyObject* o = PyUnicode_DecodeUTF8(s.data(), (Py_ssize_t)s.size(), "surrogateescape");
    if (!o) throw nb::python_error();
    return nb::steal(o);
}

nb::dlpack::dtype dtype_of(GGUFType t) {
    switch (t) {
        case GGUFType::UINT8: return nb::dtype<uint8_t>();
        case GGUFType::INT8: return nb::dtype<int8_t>();
        case GGUFType::UINT16: return nb::dtype<uint16_t>();
        case GGUFType::INT16: return nb::dtype<int16_t>();
        case GGUFType::UINT32: return nb::dtype<uint32_t>();
        case GGUFType::INT32: return nb::dtype<int32_t>();
        case GGUFType::UINT64: return nb::dtype<uint64_t>();
        case GGUFType::INT64: return nb::dtype<int64_t>();
        case GGUFType::FLOAT32: return nb::dtype<float>();
        case GGUFType::FLOAT64: return nb::dtype<double>();
        case GGUFType::BOOL: return nb::dtype<bool>();
        default: throw std::logic_error("not a numeric GGUF type");
    }
}

size_t elem_bytes(GGUFType t) { return dtype_of(t).bits / 8; }

nb::object value_of(const GGUFValue& v) {
    switch (v.type) {
        case GGUFType::BOOL: return nb::bool_(v.i != 0);
        case GGUFType::UINT64: return nb::steal(PyLong_FromUnsignedLongLong(v.u));
        case GGUFType::FLOAT32: case GGUFType::FLOAT64: return nb::float_(v.f);
        case GGUFType::STRING: return str_of(v.s);
        case GGUFType::ARRAY: {
            if (v.elem_type == GGUFType::STRING) {
                nb::list out;
                for (const std::string& s : v.strings) out.append(str_of(s));
                return out;
            }
            // Numeric arrays are copied into an aligned numpy array: the mapping may hold them
            // at any byte offset, and a copy of metadata is small next to the weights.
            size_t n = (size_t)v.count, bytes = n * elem_bytes(v.elem_type);
            uint8_t* buf = new uint8_t[bytes ? bytes : 1];
            if (bytes) memcpy(buf, v.data, bytes);
            nb::capsule owner(buf, [](void* p) noexcept { delete[] (uint8_t*)p; });
            size_t shape[1] = {n};
            return nb::cast(nb::ndarray<nb::numpy>(buf, 1, shape, owner, nullptr, dtype_of(v.elem_type)));
        }
        default: return nb::int_(v.i);  // every other integer type fits in int64
    }
}

std::string type_str(const GGUFValue& v) {
    std::string s = stowlm::gguf_type_name(v.type);
    if (v.type == GGUFType::ARRAY) s += std::string("[") + stowlm::gguf_type_name(v.elem_type) + "]";
    return s;
}

}  // namespace

STOWLM_BIND(gguf) {
    nb::module_ g = stowlm::bind::submodule(m, "gguf");
    nb::class_<Handle>(g, "GGUFFile")
        .def_static("open",
                    [](const std::string& path) {
                        try {
                            return Handle{GGUFFile::open_shared(path), path};
                        } catch (const stowlm::GGUFFileNotFound& e) {
                            PyErr_SetObject(PyExc_FileNotFoundError,
                                            nb::make_tuple(ENOENT, e.what()).ptr());
                            throw nb::python_error();
                        }
                    })
        .def_prop_ro("path", [](const Handle& h) { return h.path; })
        .def_prop_ro("closed", [](const Handle& h) { return !h.f; })
        .def_prop_ro("version", [](const Handle& h) { return h.get().version(); })
        .def_prop_ro("n_splits", [](const Handle& h) { return h.get().n_splits(); })
        .def_prop_ro("split_paths",
                     [](const Handle& h) {
                         nb::list out;
                         for (size_t k = 0; k < h.get().n_splits(); k++) out.append(h.get().split_path(k));
                         return out;
                     })
        .def_prop_ro("total_file_bytes", [](const Handle& h) { return h.get().total_file_bytes(); })
        .def("metadata",
             [](const Handle& h) {
                 nb::dict d;
                 for (const auto& [k, v] : h.get().metadata()) d[str_of(k)] = value_of(v);
                 return d;
             })
        .def("metadata_types",
             [](const Handle& h) {
                 nb::dict d;
                 for (const auto& [k, v] : h.get().metadata()) d[str_of(k)] = type_str(v);
                 return d;
             })
        .def("tensors",
             [](const Handle& h) {
                 // (name, type, shape in numpy order, nbytes, offset in its file, split index)
                 nb::list out;
                 for (const stowlm::GGUFTensor& t : h.get().tensors()) {
                     nb::list shape;
                     for (int d = t.n_dims - 1; d >= 0; d--) shape.append(t.ne[d]);
                     out.append(nb::make_tuple(t.name, stowlm::qtype_name(t.type), nb::tuple(shape), t.nbytes,
                                               t.file_offset, t.split));
                 }
                 return out;
             })
        .def("tensor_data",
             [](const Handle& h, const std::string& name) {
                 const stowlm::GGUFTensor& t = h.get().tensor(name);
                 // The capsule holds a reference to the file: the mapping lives while any view does.
                 auto* keep = new std::shared_ptr<const GGUFFile>(h.f);
                 nb::capsule owner(keep, [](void* p) noexcept { delete (std::shared_ptr<const GGUFFile>*)p; });
                 size_t shape[1] = {t.nbytes};
                 return nb::ndarray<nb::numpy, const uint8_t, nb::ndim<1>, nb::ro>(t.data, 1, shape, owner);
             })
        // The typed getters the engine uses, by name, so tests can hold them to the metadata.
        .def("get",
             [](const Handle& h, const std::string& key, const std::string& kind) -> nb::object {
                 const GGUFFile& f = h.get();
                 if (kind == "str") return nb::cast(f.get_str(key));
                 if (kind == "int") return nb::cast(f.get_int(key));
                 if (kind == "float") return nb::cast(f.get_float(key));
                 if (kind == "bool") {
                     if (!f.has(key)) f.get_int(key);  // the missing-key error
                     return nb::cast(f.get_bool(key, false));
                 }
                 if (kind == "int_array") return nb::cast(f.get_int_array(key));
                 if (kind == "float_array") return nb::cast(f.get_float_array(key));
                 if (kind == "str_array") return nb::cast(f.get_str_array(key));
                 throw stowlm::InvalidInput("get: unknown kind '" + kind + "'");
             })
        .def("close", [](Handle& h) { h.f.reset(); });
    g.def("parse_count", &GGUFFile::parse_count, "GGUF parses this process has made (each open that found no shared one)");
}
