// stowlm._core.ops.mul_mat_id_raw: the CPU expert products (cpu/matmul.h) on numpy arrays.
#include <nanobind/ndarray.h>

#include <memory>
#include <string>
#include <vector>

#include "bind.h"
#include "cpu/matmul.h"
#include "error.h"
#include "quant/types.h"

namespace nb = nanobind;
using stowlm::InvalidInput;
using stowlm::QType;

namespace {

using WArr = nb::ndarray<const uint8_t, nb::c_contig, nb::device::cpu>;
using XArr = nb::ndarray<const float, nb::ndim<3>, nb::c_contig, nb::device::cpu>;
using IArr = nb::ndarray<const int32_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;

nb::ndarray<nb::numpy, float, nb::ndim<3>> mul_mat_id_raw(WArr w, uint32_t qtype, int64_t n_expert, int64_t rows,
                                                          int64_t cols, XArr x, IArr ids, int threads, bool rows16) {
    stowlm::qtype_checked(qtype);
    const QType t = (QType)qtype;
    if (n_expert <= 0 || rows < 0) throw InvalidInput("mul_mat_id: n_expert must be > 0 and rows >= 0");
    const size_t scratch_probe = stowlm::cpu::mul_mat_id_scratch_bytes(t, rows, cols, n_expert, 1, 1);  // checks cols
    (void)scratch_probe;
    const size_t rb = stowlm::row_bytes(t, cols);
    if (w.size() != rb * (size_t)rows * (size_t)n_expert)
        throw InvalidInput("mul_mat_id: W_raw has " + std::to_string(w.size()) + " bytes, expected n_expert*rows*" +
                           "row_bytes = " + std::to_string(rb * (size_t)rows * (size_t)n_expert));
    const int64_t n_tok = (int64_t)ids.shape(0), k = (int64_t)ids.shape(1);
    if ((int64_t)x.shape(0) != n_tok || (int64_t)x.shape(2) != cols)
        throw InvalidInput("mul_mat_id: x must be (n_tok, 1 or k, cols) = (" + std::to_string(n_tok) + ", ., " +
                           std::to_string(cols) + ")");
    const int64_t x_rows = (int64_t)x.shape(1);
    const size_t scratch_bytes = stowlm::cpu::mul_mat_id_scratch_bytes(t, rows, cols, n_expert, k, n_tok);
    float* out = new float[(size_t)std::max<int64_t>(1, n_tok * k * rows)];
    nb::capsule owner(out, [](void* p) noexcept { delete[] (float*)p; });
    {
        std::vector<uint8_t> scratch(scratch_bytes);
        nb::gil_scoped_release nogil;
        std::unique_ptr<stowlm::ThreadPool> own;
        stowlm::ThreadPool* pool = &stowlm::ThreadPool::global();
        if (threads > 0) own = std::make_unique<stowlm::ThreadPool>(threads), pool = own.get();
        stowlm::cpu::WeightRef wr{w.data(), t, rows, cols, rows16};
        stowlm::cpu::mul_mat_id(wr, n_expert, ids.data(), k, x.data(), x_rows, cols, n_tok, out, rows, scratch.data(),
                                *pool);
    }
    return nb::ndarray<nb::numpy, float, nb::ndim<3>>(out, {(size_t)n_tok, (size_t)k, (size_t)rows}, owner);
}

}  // namespace

STOWLM_BIND(matmul_id) {
    nb::module_ ops = stowlm::bind::submodule(m, "ops");
    ops.def("mul_mat_id_raw", &mul_mat_id_raw, nb::arg("w"), nb::arg("qtype"), nb::arg("n_expert"), nb::arg("rows"),
            nb::arg("cols"), nb::arg("x"), nb::arg("ids"), nb::arg("threads") = 0, nb::arg("rows16") = false,
            "y[t, j, r] = sum_c W[ids[t, j]][r, c] x[t, j or 0, c] for raw GGUF bytes of n_expert stacked "
            "(rows, cols) matrices of type id `qtype` (rows16: each expert repacked, repack_rows16); returns "
            "float32 (n_tok, k, rows).");
}
