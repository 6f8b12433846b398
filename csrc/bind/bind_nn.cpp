// numpy-facing wrappers of the CPU ops (stowlm._core.ops), for tests and tools: each takes
// C-contiguous arrays, checks shapes (ValueError naming the argument) and returns new arrays.
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "bind.h"
#include "cpu/moe.h"
#include "cpu/ops.h"
#include "cpu/ops_kernels.h"
#include "error.h"
#include "quant/types.h"

namespace nb = nanobind;
using namespace stowlm;

namespace {

template <class T>
using In = nb::ndarray<const T, nb::c_contig, nb::device::cpu>;
template <class T>
using Out = nb::ndarray<nb::numpy, T>;

template <class T>
Out<T> new_array(std::vector<size_t> shape) {
    size_t n = 1;
    for (size_t s : shape) n *= s;
    T* data = new T[n > 0 ? n : 1]();
    nb::capsule owner(data, [](void* p) noexcept { delete[] (T*)p; });
    return Out<T>(data, shape.size(), shape.data(), owner);
}

template <class A>
void need_ndim(const A& a, size_t ndim, const char* name) {
    if (a.ndim() != ndim)
        throw InvalidInput(std::string(name) + " must have " + std::to_string(ndim) + " dimensions, got " +
                           std::to_string(a.ndim()));
}

template <class A>
void need_len(const A& a, size_t dim, int64_t n, const char* name) {
    if ((int64_t)a.shape(dim) != n)
        throw InvalidInput(std::string(name) + ": dimension " + std::to_string(dim) + " is " +
                           std::to_string(a.shape(dim)) + ", expected " + std::to_string(n));
}

QType parse_qtype(const nb::handle& h, const char* what) {
    if (nb::isinstance<nb::int_>(h)) {
        const uint32_t id = nb::cast<uint32_t>(h);
        qtype_checked(id);
        return (QType)id;
    }
    const std::string name = nb::cast<std::string>(h);
    for (uint32_t id = 0; id < 64; id++) {
        const QTypeInfo* i = qtype_info(id);
        if (i && name == i->name) {
            qtype_checked(id);
            return (QType)id;
        }
    }
    throw InvalidInput(std::string(what) + ": unknown type '" + name + "'");
}

ThreadPool& pool() { return ThreadPool::global(); }

// rows x dim view of a 1-D or 2-D float array
std::pair<int64_t, int64_t> rows_dim(const In<float>& a, const char* name) {
    if (a.ndim() == 1) return {1, (int64_t)a.shape(0)};
    if (a.ndim() == 2) return {(int64_t)a.shape(0), (int64_t)a.shape(1)};
    throw InvalidInput(std::string(name) + " must be 1-D or 2-D");
}

std::vector<size_t> shape_of(const In<float>& a) {
    std::vector<size_t> s;
    for (size_t i = 0; i < a.ndim(); i++) s.push_back(a.shape(i));
    return s;
}

template <class Fn>
Out<float> gated(const In<float>& g, const In<float>& u, Fn fn, const char* op) {
    auto [n, dim] = rows_dim(g, "gate");
    if (shape_of(g) != shape_of(u)) throw InvalidInput(std::string(op) + ": gate and up shapes differ");
    Out<float> o = new_array<float>(shape_of(g));
    fn(g.data(), dim, u.data(), dim, n, dim, o.data(), dim, pool());
    return o;
}

template <class Fn>
Out<float> binary(const In<float>& a, const In<float>& b, Fn fn, const char* op) {
    auto [n, dim] = rows_dim(a, "a");
    int64_t ld_b = dim;
    if (b.ndim() == 1 && a.ndim() == 2) {
        if ((int64_t)b.shape(0) != dim) throw InvalidInput(std::string(op) + ": broadcast row b has the wrong length");
        ld_b = 0;
    } else if (shape_of(a) != shape_of(b)) {
        throw InvalidInput(std::string(op) + ": a and b shapes differ");
    }
    Out<float> o = new_array<float>(shape_of(a));
    fn(a.data(), dim, b.data(), ld_b, n, dim, o.data(), dim, pool());
    return o;
}

// KV cells [n_kv][n_head_kv][head_dim] from float32 (encoded with store_kv) or float16 bits.
std::vector<uint8_t> encode_kv(const void* data, nb::dlpack::dtype dt, QType kv_type, int64_t n_kv,
                               int64_t n_head_kv, int64_t head_dim, const char* name) {
    const size_t rb = row_bytes(kv_type, head_dim);
    std::vector<uint8_t> cells((size_t)n_kv * n_head_kv * rb + 1);
    if (dt == nb::dtype<float>()) {
        std::vector<int32_t> dst((size_t)n_kv);
        for (int64_t j = 0; j < n_kv; j++) dst[j] = (int32_t)j;
        cpu::store_kv((const float*)data, n_kv, n_head_kv * head_dim, n_head_kv, head_dim, kv_type, cells.data(),
                      n_head_kv * rb, dst.data(), pool(), n_kv);
    } else if (dt.code == (uint8_t)nb::dlpack::dtype_code::Float && dt.bits == 16 && kv_type == QType::F16) {
        std::memcpy(cells.data(), data, (size_t)n_kv * n_head_kv * rb);
    } else {
        throw InvalidInput(std::string(name) + " must be float32 (or float16 for kv_type F16)");
    }
    return cells;
}

}  // namespace

STOWLM_BIND(nn) {
    nb::module_ ops = stowlm::bind::submodule(m, "ops");

    // The pool's contract under any scheduling: `jobs` jobs of nth parts, each part (busy for
    // work_us) run exactly once per job, each job with its own data on the caller's stack (a
    // worker that wakes after its job ended must not touch it). Returns how often each part ran,
    // how many parts ran on another thread than the caller, and how many ran other than once.
    ops.def("pool_parts", [](int threads, int jobs, int work_us) {
        nb::gil_scoped_release nogil;
        ThreadPool tp(threads);
        std::vector<std::atomic<int64_t>> runs(threads);
        int64_t elsewhere = 0, missed = 0;
        const auto caller = std::this_thread::get_id();
        for (int j = 0; j < jobs; j++) {
            std::vector<std::atomic<int>> seen(threads);  // this job's own data
            std::atomic<int> others{0};
            tp.run([&](int ith, int nth) {
                const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(work_us);
                while (std::chrono::steady_clock::now() < until) {
                }
                seen[ith].fetch_add(nth == threads ? 1 : 1000);
                runs[ith].fetch_add(1);
                if (std::this_thread::get_id() != caller) others.fetch_add(1);
            });
            for (auto& v : seen) missed += v.load() != 1;
            elsewhere += others.load();
        }
        std::vector<int64_t> out;
        for (auto& r : runs) out.push_back(r.load());
        return std::make_tuple(out, elsewhere, missed);
    }, nb::arg("threads"), nb::arg("jobs"), nb::arg("work_us") = 0);

    ops.def("rms_norm", [](In<float> x, std::optional<In<float>> w, float eps) {
        auto [n, dim] = rows_dim(x, "x");
        if (w) {
            need_ndim(*w, 1, "weight");
            need_len(*w, 0, dim, "weight");
        }
        Out<float> y = new_array<float>(shape_of(x));
        cpu::rms_norm(x.data(), n, dim, dim, w ? w->data() : nullptr, eps, y.data(), dim, pool());
        return y;
    }, nb::arg("x"), nb::arg("weight").none(), nb::arg("eps"));

    ops.def("rope", [](In<float> x, In<int32_t> pos, int n_rot, float base, float scale, bool neox, float ext_factor,
                       float attn_factor, float beta_fast, float beta_slow, int n_ctx_orig) {
        need_ndim(x, 3, "x");
        need_ndim(pos, 1, "pos");
        const int64_t n_tok = x.shape(0), n_head = x.shape(1), hd = x.shape(2);
        need_len(pos, 0, n_tok, "pos");
        Out<float> y = new_array<float>(shape_of(x));
        std::memcpy(y.data(), x.data(), x.size() * sizeof(float));
        cpu::RopeParams p;
        p.n_rot = n_rot;
        p.freq_base = base;
        p.freq_scale = scale;
        p.neox = neox;
        p.ext_factor = ext_factor, p.attn_factor = attn_factor, p.beta_fast = beta_fast, p.beta_slow = beta_slow;
        p.n_ctx_orig = n_ctx_orig;
        cpu::rope(y.data(), n_tok, n_head, hd, n_head * hd, pos.data(), p, pool());
        return y;
    }, nb::arg("x"), nb::arg("pos"), nb::arg("n_rot"), nb::arg("base") = 10000.0f, nb::arg("scale") = 1.0f,
       nb::arg("neox") = false, nb::arg("ext_factor") = 0.0f, nb::arg("attn_factor") = 1.0f,
       nb::arg("beta_fast") = 32.0f, nb::arg("beta_slow") = 1.0f, nb::arg("n_ctx_orig") = 0);

    ops.def("flash_attn",
            [](In<float> q, nb::ndarray<nb::c_contig, nb::device::cpu> k, nb::ndarray<nb::c_contig, nb::device::cpu> v,
               In<int32_t> q_pos, In<int32_t> kv_pos, float scale, float softcap, int window, bool causal,
               nb::handle kv_type_h, int threads, std::optional<In<float>> sinks) {
                const QType kv_type = parse_qtype(kv_type_h, "kv_type");
                if (kv_type != QType::F16 && kv_type != QType::Q8_0)
                    throw InvalidInput("kv_type must be F16 or Q8_0");
                need_ndim(q, 3, "q");
                need_ndim(k, 3, "k");
                need_ndim(v, 3, "v");
                const int64_t n_tok = q.shape(0), n_head = q.shape(1), hd = q.shape(2);
                const int64_t n_kv = k.shape(0), n_head_kv = k.shape(1), hd_v = v.shape(2);
                need_len(k, 2, hd, "k");
                for (size_t d = 0; d < 2; d++) need_len(v, d, (int64_t)k.shape(d), "v");
                if (sinks) need_len(*sinks, 0, n_head, "sinks");
                need_ndim(q_pos, 1, "q_pos");
                need_len(q_pos, 0, n_tok, "q_pos");
                need_ndim(kv_pos, 1, "kv_pos");
                need_len(kv_pos, 0, n_kv, "kv_pos");
                if (n_head_kv <= 0 || n_head % n_head_kv != 0)
                    throw InvalidInput("q heads " + std::to_string(n_head) + " not a multiple of k heads " +
                                       std::to_string(n_head_kv));
                const std::vector<uint8_t> kc = encode_kv(k.data(), k.dtype(), kv_type, n_kv, n_head_kv, hd, "k");
                const std::vector<uint8_t> vc = encode_kv(v.data(), v.dtype(), kv_type, n_kv, n_head_kv, hd_v, "v");
                Out<float> o = new_array<float>({(size_t)n_tok, (size_t)n_head, (size_t)hd_v});
                cpu::AttnParams p;
                p.scale = scale;
                p.softcap = softcap;
                p.window = window;
                p.causal = causal;
                p.sinks = sinks ? sinks->data() : nullptr;
                // threads > 0: a pool of that size for this call (tests of the KV split across threads).
                std::unique_ptr<ThreadPool> own = threads > 0 ? std::make_unique<ThreadPool>(threads) : nullptr;
                ThreadPool& tp = own ? *own : pool();
                std::vector<uint8_t> scratch(cpu::flash_attn_scratch_bytes(n_tok, n_head, hd, hd_v, tp.size()));
                cpu::KvView kv;
                kv.k = kc.data(), kv.v = vc.data(), kv.type = kv_type, kv.n_kv = n_kv, kv.n_head_kv = n_head_kv;
                kv.k_cell_bytes = n_head_kv * row_bytes(kv_type, hd), kv.v_cell_bytes = n_head_kv * row_bytes(kv_type, hd_v);
                kv.hd_k = hd, kv.hd_v = hd_v;
                {
                    nb::gil_scoped_release rel;
                    cpu::flash_attn(q.data(), n_tok, n_head, n_head * hd, kv, q_pos.data(), kv_pos.data(), p, o.data(),
                                    n_head * hd_v, scratch.data(), tp);
                }
                return o;
            },
            nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("q_pos"), nb::arg("kv_pos"), nb::arg("scale"),
            nb::arg("softcap") = 0.0f, nb::arg("window") = 0, nb::arg("causal") = true,
            nb::arg("kv_type") = "F16", nb::arg("threads") = 0, nb::arg("sinks").none() = nb::none());

    // Times `iters` calls of flash_attn on cells encoded once (for benchmarks): seconds per call.
    ops.def("bench_flash_attn",
            [](In<float> q, In<float> k, In<float> v, In<int32_t> q_pos, In<int32_t> kv_pos, float scale,
               nb::handle kv_type_h, int iters) {
                const QType kv_type = parse_qtype(kv_type_h, "kv_type");
                need_ndim(q, 3, "q");
                need_ndim(k, 3, "k");
                const int64_t n_tok = q.shape(0), n_head = q.shape(1), hd = q.shape(2);
                const int64_t n_kv = k.shape(0), n_head_kv = k.shape(1);
                if (k.shape(2) != (size_t)hd || v.ndim() != 3 || v.shape(0) != k.shape(0) || v.shape(1) != k.shape(1) ||
                    v.shape(2) != k.shape(2))
                    throw InvalidInput("k, v shapes do not match q");
                const std::vector<uint8_t> kc = encode_kv(k.data(), k.dtype(), kv_type, n_kv, n_head_kv, hd, "k");
                const std::vector<uint8_t> vc = encode_kv(v.data(), v.dtype(), kv_type, n_kv, n_head_kv, hd, "v");
                std::vector<float> o((size_t)(n_tok * n_head * hd));
                cpu::AttnParams p;
                p.scale = scale;
                std::vector<uint8_t> scratch(cpu::flash_attn_scratch_bytes(n_tok, n_head, hd, hd, pool().size()));
                cpu::KvView kv;
                kv.k = kc.data(), kv.v = vc.data(), kv.type = kv_type, kv.n_kv = n_kv, kv.n_head_kv = n_head_kv;
                kv.k_cell_bytes = kv.v_cell_bytes = n_head_kv * row_bytes(kv_type, hd);
                kv.hd_k = kv.hd_v = hd;
                nb::gil_scoped_release rel;
                auto t0 = std::chrono::steady_clock::now();
                for (int i = 0; i < iters; i++)
                    cpu::flash_attn(q.data(), n_tok, n_head, n_head * hd, kv, q_pos.data(), kv_pos.data(), p, o.data(),
                                    n_head * hd, scratch.data(), pool());
                return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / iters;
            },
            nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("q_pos"), nb::arg("kv_pos"), nb::arg("scale"),
            nb::arg("kv_type") = "F16", nb::arg("iters") = 100);

    ops.def("store_kv",
            [](In<float> x, nb::handle kv_type_h, nb::ndarray<uint8_t, nb::ndim<2>, nb::c_contig, nb::device::cpu> cache,
               In<int32_t> dst_cells) {
                const QType kv_type = parse_qtype(kv_type_h, "kv_type");
                need_ndim(x, 3, "x");
                need_ndim(dst_cells, 1, "dst_cells");
                const int64_t n_tok = x.shape(0), n_head_kv = x.shape(1), hd = x.shape(2);
                need_len(dst_cells, 0, n_tok, "dst_cells");
                cpu::store_kv(x.data(), n_tok, n_head_kv * hd, n_head_kv, hd, kv_type, cache.data(), cache.shape(1),
                              dst_cells.data(), pool(), (int64_t)cache.shape(0));
            },
            nb::arg("x"), nb::arg("kv_type"), nb::arg("cache"), nb::arg("dst_cells"));

    ops.def("get_rows", [](In<uint8_t> raw, nb::handle qtype_h, In<int32_t> ids, int64_t n_cols) {
        const QType t = parse_qtype(qtype_h, "qtype");
        need_ndim(ids, 1, "ids");
        const size_t rb = row_bytes(t, n_cols);
        if (rb == 0 || raw.size() % rb != 0)
            throw InvalidInput("raw: " + std::to_string(raw.size()) + " bytes is not a whole number of " +
                               qtype_name(t) + " rows of " + std::to_string(n_cols));
        const int64_t n_rows = raw.size() / rb;
        Out<float> o = new_array<float>({ids.shape(0), (size_t)n_cols});
        cpu::get_rows(raw.data(), t, n_rows, n_cols, ids.data(), ids.shape(0), o.data(), n_cols, pool());
        return o;
    }, nb::arg("raw"), nb::arg("qtype"), nb::arg("ids"), nb::arg("n_cols"));

    ops.def("swiglu", [](In<float> g, In<float> u) { return gated(g, u, cpu::swiglu, "swiglu"); }, nb::arg("gate"),
            nb::arg("up"));
    ops.def("geglu", [](In<float> g, In<float> u) { return gated(g, u, cpu::geglu, "geglu"); }, nb::arg("gate"),
            nb::arg("up"));
    ops.def("add", [](In<float> a, In<float> b) { return binary(a, b, cpu::add, "add"); }, nb::arg("a"), nb::arg("b"));
    ops.def("mul", [](In<float> a, In<float> b) { return binary(a, b, cpu::mul, "mul"); }, nb::arg("a"), nb::arg("b"));
    ops.def("scale", [](In<float> x, float s) {
        auto [n, dim] = rows_dim(x, "x");
        Out<float> y = new_array<float>(shape_of(x));
        std::memcpy(y.data(), x.data(), x.size() * sizeof(float));
        cpu::scale(y.data(), n, dim, dim, s, pool());
        return y;
    }, nb::arg("x"), nb::arg("s"));
    ops.def("softcap", [](In<float> x, float cap) {
        auto [n, dim] = rows_dim(x, "x");
        Out<float> y = new_array<float>(shape_of(x));
        std::memcpy(y.data(), x.data(), x.size() * sizeof(float));
        cpu::softcap(y.data(), n, dim, dim, cap, pool());
        return y;
    }, nb::arg("x"), nb::arg("cap"));

    // The kernel path these ops use now (follows stowlm._core.cpu.set_isa).
    ops.def("swiglu_oai", [](In<float> g, In<float> u, float alpha, float limit) {
        if (g.size() != u.size()) throw InvalidInput("swiglu_oai: gate and up differ in size");
        Out<float> y = new_array<float>(shape_of(g));
        cpu::swiglu_oai(g.data(), u.data(), (int64_t)g.size(), alpha, limit, y.data(), pool());
        return y;
    }, nb::arg("gate"), nb::arg("up"), nb::arg("alpha") = 1.702f, nb::arg("limit") = 7.0f);

    // Expert selection of (n_tok, n_expert) router logits: ids (n_tok, k) (cpu::top_k).
    ops.def("top_k", [](In<float> x, int k, int gating, std::optional<In<float>> bias, int n_groups, int n_group_used) {
        auto [n, dim] = rows_dim(x, "x");
        if (bias) need_len(*bias, 0, dim, "bias");
        cpu::TopKParams p;
        p.k = k, p.gating = (cpu::Gating)gating, p.bias = bias ? bias->data() : nullptr;
        p.n_groups = n_groups, p.n_group_used = n_group_used;
        Out<int32_t> ids = new_array<int32_t>({(size_t)n, (size_t)k});
        cpu::top_k(x.data(), n, dim, dim, p, ids.data(), pool());
        return ids;
    }, nb::arg("x"), nb::arg("k"), nb::arg("gating") = 0, nb::arg("bias").none() = nb::none(), nb::arg("n_groups") = 0,
       nb::arg("n_group_used") = 0);

    ops.def("moe_weights", [](In<float> logits, In<int32_t> ids, int gating, bool normalize, float scale) {
        auto [n, n_expert] = rows_dim(logits, "logits");
        need_ndim(ids, 2, "ids");
        need_len(ids, 0, n, "ids");
        const int64_t k = ids.shape(1);
        Out<float> w = new_array<float>({(size_t)n, (size_t)k});
        cpu::moe_weights(logits.data(), n, n_expert, ids.data(), k, (cpu::Gating)gating, normalize, scale, w.data(),
                         pool());
        return w;
    }, nb::arg("logits"), nb::arg("ids"), nb::arg("gating") = 0, nb::arg("normalize") = false, nb::arg("scale") = 0.0f);

    // x (n_tok, k, d) + bias[ids] with bias (n_expert, d), ids (n_tok, k).
    ops.def("add_id", [](In<float> x, In<float> bias, In<int32_t> ids) {
        need_ndim(x, 3, "x");
        need_ndim(bias, 2, "bias");
        need_ndim(ids, 2, "ids");
        const int64_t n = x.shape(0), k = x.shape(1), d = x.shape(2);
        need_len(bias, 1, d, "bias");
        need_len(ids, 0, n, "ids");
        need_len(ids, 1, k, "ids");
        Out<float> y = new_array<float>(shape_of(x));
        std::memcpy(y.data(), x.data(), x.size() * sizeof(float));
        cpu::add_id(y.data(), bias.data(), bias.shape(0), ids.data(), n, k, d, pool());
        return y;
    }, nb::arg("x"), nb::arg("bias"), nb::arg("ids"));

    ops.def("ops_isa", [] { return std::string(cpu::ops_isa_name(cpu::ops_isa())); });
}
