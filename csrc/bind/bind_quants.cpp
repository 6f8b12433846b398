// stowlm._core.quants: raw GGUF blocks <-> float32 over flat buffers. Shapes, type-name
// resolution and friendly argument handling live in python/stowlm/quants.py.
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>

#include <string>

#include "bind.h"
#include "cpu/threadpool.h"
#include "error.h"
#include "quant/dequant.h"
#include "quant/quantize.h"
#include "quant/types.h"

namespace nb = nanobind;
using namespace stowlm;

namespace {

using BytesIn = nb::ndarray<const uint8_t, nb::c_contig, nb::device::cpu>;
using BytesOut = nb::ndarray<uint8_t, nb::c_contig, nb::device::cpu>;
using FloatsIn = nb::ndarray<const float, nb::c_contig, nb::device::cpu>;
using FloatsOut = nb::ndarray<float, nb::c_contig, nb::device::cpu>;

// Below this many elements the pool's wake-up costs more than the work.
constexpr int64_t kParallelMin = 1 << 16;

// Runs fn(first_block, n_blocks) over nb blocks, split across the global pool when large.
template <class F>
void over_blocks(int64_t nb, int64_t block_elems, F&& fn) {
    if (nb * block_elems < kParallelMin) {
        fn(0, nb);
        return;
    }
    const int64_t chunk = (kParallelMin / 4 + block_elems - 1) / block_elems;
    ThreadPool::global().parallel_for_dynamic(nb, chunk, [&](int64_t b, int64_t e, int) { fn(b, e - b); });
}

std::string sz(size_t v) { return std::to_string(v); }

}  // namespace

STOWLM_BIND(quants) {
    nb::module_ q = stowlm::bind::submodule(m, "quants");

    q.def(
        "type_info",
        [](int64_t id) {
            const QTypeInfo* i = id >= 0 && id <= 0xffffffffLL ? qtype_info((uint32_t)id) : nullptr;
            if (!i) throw InvalidInput("unknown tensor type id " + std::to_string(id));
            return nb::make_tuple(std::string(i->name), id, i->block_elems, i->block_bytes, i->supported,
                                  i->supported && can_quantize((QType)id));
        },
        "type_info(id) -> (name, id, block_elems, block_bytes, decodable, quantizable); ValueError if unknown");

    q.def(
        "type_id",
        [](const std::string& name) {
            for (uint32_t id = 0; id < 256; id++) {
                const QTypeInfo* i = qtype_info(id);
                if (i && name == i->name) return id;
            }
            throw InvalidInput("unknown tensor type name '" + name + "'");
        },
        "type_id(name) -> GGUF type id; ValueError if unknown");

    q.def(
        "dequantize_into",
        [](BytesIn src, uint32_t id, FloatsOut dst) {
            const QTypeInfo& info = qtype_checked(id);
            const int64_t n = (int64_t)dst.size();
            const size_t need = row_bytes((QType)id, n);
            if (src.size() != need)
                throw InvalidInput(std::string("dequantize: ") + info.name + " data for " + std::to_string(n) +
                                   " elements must be " + sz(need) + " bytes, got " + sz(src.size()));
            const uint8_t* s = src.data();
            float* d = dst.data();
            const int64_t be = info.block_elems, bb = info.block_bytes;
            nb::gil_scoped_release nogil;
            over_blocks(n / be, be, [&](int64_t b0, int64_t cnt) {
                dequantize_row((QType)id, s + b0 * bb, d + b0 * be, cnt * be);
            });
        },
        nb::arg("src"), nb::arg("type_id"), nb::arg("dst"),
        "Decodes the raw blocks in src (uint8, C-contiguous) into dst (float32, C-contiguous).");

    q.def(
        "quantize_into",
        [](FloatsIn src, uint32_t id, BytesOut dst) {
            const QTypeInfo& info = qtype_checked(id);
            if (!can_quantize((QType)id))
                throw InvalidInput(std::string("quantize: producing ") + info.name +
                                   " is not implemented (supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q8_K)");
            const int64_t n = (int64_t)src.size();
            const size_t need = row_bytes((QType)id, n);
            if (dst.size() != need)
                throw InvalidInput(std::string("quantize: ") + info.name + " output for " + std::to_string(n) +
                                   " elements must be " + sz(need) + " bytes, got " + sz(dst.size()));
            const float* s = src.data();
            uint8_t* d = dst.data();
            const int64_t be = info.block_elems, bb = info.block_bytes;
            nb::gil_scoped_release nogil;
            over_blocks(n / be, be, [&](int64_t b0, int64_t cnt) {
                quantize_row((QType)id, s + b0 * be, d + b0 * bb, cnt * be);
            });
        },
        nb::arg("src"), nb::arg("type_id"), nb::arg("dst"),
        "Quantizes src (float32, C-contiguous) into raw blocks in dst (uint8, C-contiguous).");
}
