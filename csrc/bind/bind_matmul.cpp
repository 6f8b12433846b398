// stowlm._core.ops.matmul: the CPU quantized matrix product on numpy arrays.
#include <nanobind/ndarray.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "bind.h"
#include "cpu/matmul.h"
#include "cpu/repack.h"
#include "error.h"
#include "quant/types.h"

namespace nb = nanobind;
using stowlm::InvalidInput;
using stowlm::QType;

namespace {

// Pools are made once per thread count and kept: no thread creation per call.
stowlm::ThreadPool& pool_for(int threads) {
    if (threads <= 0) return stowlm::ThreadPool::global();
    static std::mutex mu;
    static std::map<int, std::unique_ptr<stowlm::ThreadPool>> pools;
    std::lock_guard<std::mutex> lk(mu);
    auto& p = pools[threads];
    if (!p) p = std::make_unique<stowlm::ThreadPool>(threads);
    return *p;
}

using WArr = nb::ndarray<const uint8_t, nb::c_contig, nb::device::cpu>;
using XArr = nb::ndarray<const float, nb::ndim<2>, nb::c_contig, nb::device::cpu>;

nb::ndarray<nb::numpy, float, nb::ndim<2>> matmul_raw(WArr w, uint32_t qtype, int64_t rows, int64_t cols, XArr x,
                                                      int threads, bool rows16, bool batched) {
    const stowlm::QTypeInfo& info = stowlm::qtype_checked(qtype);
    const QType t = (QType)qtype;
    if (rows < 0) throw InvalidInput("matmul: rows must be >= 0");
    if (cols <= 0 || cols % info.block_elems)
        throw InvalidInput("matmul: cols=" + std::to_string(cols) + " is not a positive multiple of the " +
                           info.name + " block size " + std::to_string(info.block_elems));
    const size_t rb = stowlm::row_bytes(t, cols);
    if (w.size() != rb * (size_t)rows)
        throw InvalidInput("matmul: W_raw has " + std::to_string(w.size()) + " bytes, expected rows*row_bytes = " +
                           std::to_string(rows) + "*" + std::to_string(rb) + " for " + info.name + " with cols=" +
                           std::to_string(cols));
    if ((int64_t)x.shape(1) != cols)
        throw InvalidInput("matmul: x has " + std::to_string(x.shape(1)) + " columns, W has cols=" + std::to_string(cols));
    const int64_t n_tok = (int64_t)x.shape(0);
    const size_t scratch_bytes = stowlm::cpu::matmul_scratch_bytes(t, cols, n_tok);
    float* out = new float[(size_t)std::max<int64_t>(1, n_tok * rows)];
    nb::capsule owner(out, [](void* p) noexcept { delete[] (float*)p; });
    {
        std::vector<uint8_t> scratch(scratch_bytes);
        nb::gil_scoped_release nogil;
        stowlm::cpu::WeightRef wr{w.data(), t, rows, cols, rows16};
        stowlm::cpu::matmul(wr, x.data(), n_tok, cols, out, rows, scratch.data(), pool_for(threads), batched);
    }
    return nb::ndarray<nb::numpy, float, nb::ndim<2>>(out, {(size_t)n_tok, (size_t)rows}, owner);
}

// Several weights against the same x through cpu::matmul_multi (the decoder's q/k/v and
// gate/up products): a list of (raw bytes, qtype, rows), all with `cols` columns.
std::vector<nb::ndarray<nb::numpy, float, nb::ndim<2>>> matmul_multi_raw(
    const std::vector<std::tuple<WArr, uint32_t, int64_t>>& ws, int64_t cols, XArr x, int threads,
    const std::vector<bool>& rows16) {
    const int n = (int)ws.size();
    if (n < 1 || n > stowlm::cpu::kMaxMulti)
        throw InvalidInput("matmul_multi: between 1 and " + std::to_string(stowlm::cpu::kMaxMulti) +
                           " weights, got " + std::to_string(n));
    if ((int64_t)x.shape(1) != cols)
        throw InvalidInput("matmul_multi: x has " + std::to_string(x.shape(1)) + " columns, cols=" + std::to_string(cols));
    const int64_t n_tok = (int64_t)x.shape(0);
    stowlm::cpu::WeightRef wr[stowlm::cpu::kMaxMulti];
    float* ys[stowlm::cpu::kMaxMulti];
    int64_t ldys[stowlm::cpu::kMaxMulti];
    std::vector<nb::ndarray<nb::numpy, float, nb::ndim<2>>> outs;
    size_t scratch_bytes = 0;
    for (int i = 0; i < n; i++) {
        const auto& [w, qtype, rows] = ws[i];
        const stowlm::QTypeInfo& info = stowlm::qtype_checked(qtype);
        const QType t = (QType)qtype;
        if (rows <= 0) throw InvalidInput("matmul_multi: weight " + std::to_string(i) + " rows must be > 0");
        if (cols <= 0 || cols % info.block_elems)
            throw InvalidInput("matmul_multi: cols=" + std::to_string(cols) + " is not a positive multiple of the " +
                               info.name + " block size " + std::to_string(info.block_elems));
        if (w.size() != stowlm::row_bytes(t, cols) * (size_t)rows)
            throw InvalidInput("matmul_multi: weight " + std::to_string(i) + " has " + std::to_string(w.size()) +
                               " bytes, expected rows*row_bytes");
        scratch_bytes = std::max(scratch_bytes, stowlm::cpu::matmul_scratch_bytes(t, cols, n_tok));
        float* out = new float[(size_t)std::max<int64_t>(1, n_tok * rows)];
        nb::capsule owner(out, [](void* p) noexcept { delete[] (float*)p; });
        outs.emplace_back(out, std::initializer_list<size_t>{(size_t)n_tok, (size_t)rows}, owner);
        wr[i] = stowlm::cpu::WeightRef{w.data(), t, rows, cols, i < (int)rows16.size() && rows16[i]};
        ys[i] = out;
        ldys[i] = rows;
    }
    {
        std::vector<uint8_t> scratch(scratch_bytes);
        nb::gil_scoped_release nogil;
        stowlm::cpu::matmul_multi(wr, n, x.data(), n_tok, cols, ys, ldys, scratch.data(), pool_for(threads));
    }
    return outs;
}

// The activations as matmul quantizes them for weight type `qtype` on the active path: raw
// bytes (n_tok, matmul_act_row_bytes), for tests.
nb::ndarray<nb::numpy, uint8_t, nb::ndim<2>> quantize_act_raw(XArr x, uint32_t qtype) {
    const QType t = (QType)qtype;
    stowlm::qtype_checked(qtype);
    const int64_t n_tok = (int64_t)x.shape(0), cols = (int64_t)x.shape(1);
    const size_t rb = stowlm::cpu::matmul_act_row_bytes(t, cols);
    // 64-byte aligned like matmul's scratch: the blocks hold floats
    uint8_t* out = (uint8_t*)std::aligned_alloc(64, std::max<size_t>(64, (rb * (size_t)n_tok + 63) & ~(size_t)63));
    nb::capsule owner(out, [](void* p) noexcept { std::free(p); });
    stowlm::cpu::quantize_activations(t, cols, x.data(), n_tok, cols, out);
    return nb::ndarray<nb::numpy, uint8_t, nb::ndim<2>>(out, {(size_t)n_tok, rb}, owner);
}

// Raw weight bytes repacked into 16-row groups (cpu/repack.h), and row r of such bytes back in
// the GGUF layout.
nb::ndarray<nb::numpy, uint8_t, nb::ndim<1>> repack_rows16_raw(WArr w, uint32_t qtype, int64_t rows, int64_t cols) {
    const QType t = (QType)qtype;
    stowlm::qtype_checked(qtype);
    if (!stowlm::cpu::repack_supported(t, rows, cols))
        throw InvalidInput(std::string("repack_rows16: ") + stowlm::qtype_checked(qtype).name + " " + std::to_string(rows) +
                           " x " + std::to_string(cols) + " cannot be repacked");
    const size_t bytes = stowlm::row_bytes(t, cols) * (size_t)rows;
    if (w.size() != bytes) throw InvalidInput("repack_rows16: W_raw has " + std::to_string(w.size()) + " bytes, expected " + std::to_string(bytes));
    uint8_t* out = new uint8_t[bytes];
    nb::capsule owner(out, [](void* p) noexcept { delete[] (uint8_t*)p; });
    stowlm::cpu::repack_rows16(t, rows, cols, w.data(), out);
    return nb::ndarray<nb::numpy, uint8_t, nb::ndim<1>>(out, {bytes}, owner);
}
nb::ndarray<nb::numpy, uint8_t, nb::ndim<1>> unrepack_row16_raw(WArr w, uint32_t qtype, int64_t rows, int64_t cols, int64_t r) {
    const QType t = (QType)qtype;
    if (!stowlm::cpu::repack_supported(t, rows, cols) || w.size() != stowlm::row_bytes(t, cols) * (size_t)rows)
        throw InvalidInput("unrepack_row16: not a repacked matrix of that type and shape");
    if (r < 0 || r >= rows) throw InvalidInput("unrepack_row16: row " + std::to_string(r) + " is outside [0, " + std::to_string(rows) + ")");
    const size_t rb = stowlm::row_bytes(t, cols);
    uint8_t* out = new uint8_t[rb];
    nb::capsule owner(out, [](void* p) noexcept { delete[] (uint8_t*)p; });
    stowlm::cpu::unrepack_row16(t, rows, cols, w.data(), r, out);
    return nb::ndarray<nb::numpy, uint8_t, nb::ndim<1>>(out, {rb}, owner);
}

}  // namespace

STOWLM_BIND(matmul) {
    nb::module_ ops = stowlm::bind::submodule(m, "ops");
    ops.def("matmul_raw", &matmul_raw, nb::arg("w"), nb::arg("qtype"), nb::arg("rows"), nb::arg("cols"),
            nb::arg("x"), nb::arg("threads") = 0, nb::arg("rows16") = false, nb::arg("batched") = false,
            "y[t, r] = sum_c W[r, c] x[t, c] for raw GGUF weight bytes of type id `qtype`; returns float32 "
            "(n_tok, rows). threads=0 uses the global pool. rows16: W_raw is repack_rows16_raw's layout. "
            "batched: the batched kernels whatever n_tok (a pass forced to the largest passes' kernels).");
    ops.attr("R16_ROWS_MAX") = stowlm::kCpuR16RowsMax;  // repacked rows keep the row kernels below it
    ops.def("repack_rows16_raw", &repack_rows16_raw, nb::arg("w"), nb::arg("qtype"), nb::arg("rows"), nb::arg("cols"),
            "W_raw (a type cpu::repack_supported takes) in groups of 16 interleaved rows, the rows after the "
            "last whole group as they were: the CPU keeps such weights so (cpu/repack.h).");
    ops.def("unrepack_row16_raw", &unrepack_row16_raw, nb::arg("w"), nb::arg("qtype"), nb::arg("rows"), nb::arg("cols"),
            nb::arg("r"), "Row r of repacked bytes in the GGUF layout again.");
    ops.def("matmul_multi_raw", &matmul_multi_raw, nb::arg("ws"), nb::arg("cols"), nb::arg("x"), nb::arg("threads") = 0,
            nb::arg("rows16") = std::vector<bool>{},
            "[W_i x] for a list of (raw bytes, qtype, rows) sharing x (n_tok, cols), in one pass where the "
            "weights share an activation format; results equal matmul_raw's.");
    ops.def("quantize_act_raw", &quantize_act_raw, nb::arg("x"), nb::arg("qtype"),
            "The bytes of x (n_tok, cols) quantized as matmul_raw quantizes activations for weight type `qtype` "
            "on the active ISA: block_q8_a (32 values) or block_q8_K32 (256 values) rows, see quant/dot.h.");
}
