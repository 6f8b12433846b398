// stowlm._core.cuda_ops: the CUDA launchers on numpy arrays (upload, run, download), with the
// same signatures as stowlm._core.ops where an op exists on both, so tests run one op body
// per device. Only built with CUDA; every call raises RuntimeError when no device is present.
#ifdef STOWLM_HAVE_CUDA
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "bind.h"
#include "cuda_backend.h"
#include "error.h"
#include "quant/dot_q8_1.h"
#include "quant/types.h"

namespace nb = nanobind;
namespace cu = stowlm::cuda;
using stowlm::InvalidInput;
using stowlm::QType;

namespace {

template <typename T>
using In = nb::ndarray<const T, nb::c_contig, nb::device::cpu>;
template <typename T>
using Out = nb::ndarray<nb::numpy, T>;

cu::CudaDevice& device(int index) {
    static std::mutex mu;
    static std::map<int, std::unique_ptr<cu::CudaDevice>> devs;
    std::lock_guard<std::mutex> lk(mu);
    auto& d = devs[index];
    if (!d) d = std::make_unique<cu::CudaDevice>(index);
    return *d;
}

// A device allocation freed on scope exit.
struct Buf {
    cu::CudaDevice& dev;
    void* p = nullptr;
    Buf(cu::CudaDevice& d, size_t bytes) : dev(d), p(d.alloc(bytes, "test")) {}
    Buf(cu::CudaDevice& d, const void* host, size_t bytes) : Buf(d, bytes) { d.copy_to_device(p, host, bytes, d.compute_stream()); }
    Buf(Buf&& o) noexcept : dev(o.dev), p(o.p) { o.p = nullptr; }
    Buf(const Buf&) = delete;
    ~Buf() { dev.free(p); }
    template <typename T>
    T* as() const { return (T*)p; }
};

template <typename T>
Out<T> new_array(std::vector<size_t> shape) {
    size_t n = 1;
    for (size_t s : shape) n *= s;
    T* p = new T[n ? n : 1];
    nb::capsule owner(p, [](void* q) noexcept { delete[] (T*)q; });
    return Out<T>(p, shape.size(), shape.data(), owner);
}

template <typename T>
Out<T> download(cu::CudaDevice& d, const Buf& b, std::vector<size_t> shape) {
    Out<T> o = new_array<T>(shape);
    d.copy_to_host(o.data(), b.p, o.size() * sizeof(T), d.compute_stream());
    return o;
}

template <typename A>
std::vector<size_t> shape_of(const A& a) {
    std::vector<size_t> s(a.ndim());
    for (size_t i = 0; i < a.ndim(); i++) s[i] = a.shape(i);
    return s;
}

// (rows, last dim) of an array viewed as rows.
template <typename A>
std::pair<int64_t, int64_t> rows_dim(const A& a) {
    if (a.ndim() == 0) throw InvalidInput("expected an array with at least one dimension");
    const int64_t dim = (int64_t)a.shape(a.ndim() - 1);
    return {dim ? (int64_t)(a.size() / dim) : 0, dim};
}

cu::MatmulPath parse_path(const std::string& p) {
    if (p == "auto") return cu::MatmulPath::Auto;
    if (p == "vector") return cu::MatmulPath::Vector;
    if (p == "tiled") return cu::MatmulPath::Tiled;
    throw InvalidInput("path must be auto, vector or tiled, not '" + p + "'");
}

Out<float> matmul_raw(In<uint8_t> w, uint32_t qtype, int64_t rows, int64_t cols, In<float> x, const std::string& path,
                      int dev_index) {
    stowlm::qtype_checked(qtype);
    const QType tt = (QType)qtype;
    const size_t rb = stowlm::row_bytes(tt, cols);
    if (w.size() != rb * (size_t)rows) throw InvalidInput("matmul: w has " + std::to_string(w.size()) + " bytes, expected rows*row_bytes");
    if (x.ndim() != 2 || (int64_t)x.shape(1) != cols) throw InvalidInput("matmul: x must be (n_tok, cols)");
    cu::CudaDevice& d = device(dev_index);
    const int64_t n = (int64_t)x.shape(0);
    Buf wb(d, w.data(), w.size()), xb(d, x.data(), x.size() * 4), yb(d, (size_t)(n * rows) * 4),
        sb(d, cu::matmul_scratch_bytes(tt, cols, n));
    cu::matmul({wb.p, tt, rows, cols}, xb.as<float>(), n, cols, yb.as<float>(), rows, sb.p, d.compute_stream(),
               parse_path(path));
    return download<float>(d, yb, {(size_t)n, (size_t)rows});
}

// The products of two weights of one type and shape with the same x, the second reusing the
// activations the first quantized into the scratch (x_quantized): (y1, y2) stacked.
Out<float> matmul_reusing(In<uint8_t> w1, In<uint8_t> w2, uint32_t qtype, int64_t rows, int64_t cols, In<float> x,
                          const std::string& path, int dev_index) {
    stowlm::qtype_checked(qtype);
    const QType tt = (QType)qtype;
    const size_t rb = stowlm::row_bytes(tt, cols);
    if (w1.size() != rb * (size_t)rows || w2.size() != rb * (size_t)rows)
        throw InvalidInput("matmul_reusing: w1 and w2 must have rows*row_bytes bytes each");
    if (x.ndim() != 2 || (int64_t)x.shape(1) != cols) throw InvalidInput("matmul_reusing: x must be (n_tok, cols)");
    cu::CudaDevice& d = device(dev_index);
    const int64_t n = (int64_t)x.shape(0);
    Buf wb1(d, w1.data(), w1.size()), wb2(d, w2.data(), w2.size()), xb(d, x.data(), x.size() * 4),
        yb(d, (size_t)(2 * n * rows) * 4), sb(d, cu::matmul_scratch_bytes(tt, cols, n));
    cu::matmul({wb1.p, tt, rows, cols}, xb.as<float>(), n, cols, yb.as<float>(), rows, sb.p, d.compute_stream(),
               parse_path(path));
    cu::matmul({wb2.p, tt, rows, cols}, xb.as<float>(), n, cols, yb.as<float>() + n * rows, rows, sb.p,
               d.compute_stream(), parse_path(path), true);
    return download<float>(d, yb, {2, (size_t)n, (size_t)rows});
}

// The gate and up products of x joined by their GLU in one kernel (matmul_glu): (g, u, act).
nb::tuple matmul_glu(In<uint8_t> wg, In<uint8_t> wu, uint32_t qtype, int64_t rows, int64_t cols, In<float> x,
                     bool gelu, int dev_index) {
    stowlm::qtype_checked(qtype);
    const QType tt = (QType)qtype;
    const size_t rb = stowlm::row_bytes(tt, cols);
    if (wg.size() != rb * (size_t)rows || wu.size() != rb * (size_t)rows)
        throw InvalidInput("matmul_glu: wg and wu must have rows*row_bytes bytes each");
    if (x.ndim() != 2 || (int64_t)x.shape(1) != cols) throw InvalidInput("matmul_glu: x must be (n_tok, cols)");
    cu::CudaDevice& d = device(dev_index);
    const int64_t n = (int64_t)x.shape(0);
    const size_t out = (size_t)(n * rows) * 4;
    Buf gb(d, wg.data(), wg.size()), ub(d, wu.data(), wu.size()), xb(d, x.data(), x.size() * 4), yg(d, out),
        yu(d, out), ya(d, out), sb(d, cu::matmul_scratch_bytes(tt, cols, n));
    cu::matmul_glu({gb.p, tt, rows, cols}, {ub.p, tt, rows, cols}, xb.as<float>(), n, cols, yg.as<float>(),
                   yu.as<float>(), ya.as<float>(), rows, gelu, sb.p, d.compute_stream());
    const std::vector<size_t> shape = {(size_t)n, (size_t)rows};
    return nb::make_tuple(download<float>(d, yg, shape), download<float>(d, yu, shape), download<float>(d, ya, shape));
}

// Products of one x by 1..3 weights of one type and width in one kernel (matmul_multi): a list
// of (n_tok, rows_i) arrays.
nb::list matmul_multi(const std::vector<In<uint8_t>>& ws, uint32_t qtype, const std::vector<int64_t>& rows,
                      int64_t cols, In<float> x, int dev_index) {
    stowlm::qtype_checked(qtype);
    const QType tt = (QType)qtype;
    const int n = (int)ws.size();
    if (n < 1 || n > cu::kMmvMulti || rows.size() != ws.size())
        throw InvalidInput("matmul_multi: 1 to 3 weights, a row count for each");
    if (x.ndim() != 2 || (int64_t)x.shape(1) != cols) throw InvalidInput("matmul_multi: x must be (n_tok, cols)");
    cu::CudaDevice& d = device(dev_index);
    const int64_t n_tok = (int64_t)x.shape(0);
    std::vector<std::unique_ptr<Buf>> wb, yb;
    cu::DeviceWeight dw[cu::kMmvMulti];
    float* ys[cu::kMmvMulti];
    int64_t ldys[cu::kMmvMulti];
    for (int i = 0; i < n; i++) {
        if (ws[i].size() != stowlm::row_bytes(tt, cols) * (size_t)rows[i])
            throw InvalidInput("matmul_multi: weight " + std::to_string(i) + " must have rows*row_bytes bytes");
        wb.push_back(std::make_unique<Buf>(d, ws[i].data(), ws[i].size()));
        yb.push_back(std::make_unique<Buf>(d, (size_t)(n_tok * rows[i]) * 4));
        dw[i] = {wb[i]->p, tt, rows[i], cols};
        ys[i] = yb[i]->as<float>(), ldys[i] = rows[i];
    }
    Buf xb(d, x.data(), x.size() * 4), sb(d, cu::matmul_scratch_bytes(tt, cols, n_tok));
    cu::matmul_multi(dw, n, xb.as<float>(), n_tok, cols, ys, ldys, sb.p, d.compute_stream());
    nb::list out;
    for (int i = 0; i < n; i++) out.append(download<float>(d, *yb[i], {(size_t)n_tok, (size_t)rows[i]}));
    return out;
}

Out<uint8_t> quantize_q8_1(In<float> x, int dev_index) {
    if (x.ndim() != 2) throw InvalidInput("quantize_q8_1: x must be 2-D");
    cu::CudaDevice& d = device(dev_index);
    const int64_t n = (int64_t)x.shape(0), cols = (int64_t)x.shape(1);
    Buf xb(d, x.data(), x.size() * 4), qb(d, cu::q8_1_bytes(n, cols));
    cu::quantize_q8_1(xb.as<float>(), n, cols, cols, qb.p, d.compute_stream());
    return download<uint8_t>(d, qb, {(size_t)n, (size_t)(cols / 32 * sizeof(stowlm::block_q8_1))});
}

QType kv_type_of(const std::string& name) {
    if (name == "F16") return QType::F16;
    if (name == "Q8_0") return QType::Q8_0;
    throw InvalidInput("kv_type must be F16 or Q8_0, not '" + name + "'");
}

using AnyArr = nb::ndarray<nb::c_contig, nb::device::cpu>;

// KV cells [n_kv][n_head_kv][head_dim] on the device: float16 bits (uint16) as they are for F16,
// or float32 encoded by the device's store_kv into kv_type.
Buf upload_kv(cu::CudaDevice& d, const AnyArr& a, QType kv_type, int64_t n_kv, int64_t n_head_kv, int64_t hd,
              const char* name) {
    const size_t cell = (size_t)n_head_kv * stowlm::row_bytes(kv_type, hd);
    Buf cells(d, cell * (size_t)n_kv);
    if (a.dtype() == nb::dtype<uint16_t>()) {
        if (kv_type != QType::F16) throw InvalidInput(std::string(name) + ": float16 bits only for kv_type F16");
        d.copy_to_device(cells.p, a.data(), a.nbytes(), d.compute_stream());
    } else if (a.dtype() == nb::dtype<float>()) {
        Buf x(d, a.data(), a.nbytes());
        std::vector<int32_t> ids((size_t)n_kv);
        for (int64_t j = 0; j < n_kv; j++) ids[j] = (int32_t)j;
        Buf ib(d, ids.data(), ids.size() * 4);
        cu::store_kv(x.as<float>(), n_kv, n_head_kv * hd, n_head_kv, hd, kv_type, cells.p, cell, ib.as<int32_t>(),
                     d.compute_stream());
        d.synchronize();  // x and ib are freed on return
    } else {
        throw InvalidInput(std::string(name) + " must be uint16 (float16 bits) or float32");
    }
    return cells;
}

// Optional int32 / float32 arrays on the device (or nothing).
template <typename T>
std::unique_ptr<Buf> upload_opt(cu::CudaDevice& d, const std::optional<In<T>>& a, size_t len, const char* name) {
    if (!a) return nullptr;
    if (a->size() != len) throw InvalidInput(std::string("flash_attn: ") + name + " has the wrong length");
    return std::make_unique<Buf>(d, a->data(), a->size() * sizeof(T));
}

// With q8_1: (out, its block_q8_1 rows as the kernel wrote them beside it).
nb::object flash_attn(In<float> q, AnyArr k, AnyArr v, In<int32_t> q_pos, In<int32_t> kv_pos, float scale, float softcap,
                      int window, bool causal, int n_split, const std::string& kv_type_name,
                      std::optional<In<float>> sinks, std::optional<In<int32_t>> q_seq,
                      std::optional<In<int32_t>> kv_seq, int split_cells, int seq_cells, bool q8_1, int dev_index) {
    const QType kv_type = kv_type_of(kv_type_name);
    if (q.ndim() != 3 || k.ndim() != 3 || v.ndim() != 3) throw InvalidInput("flash_attn: q, k, v must be 3-D");
    const int64_t n_tok = q.shape(0), n_head = q.shape(1), hd = q.shape(2), n_kv = k.shape(0), n_head_kv = k.shape(1);
    const int64_t hd_v = v.shape(2);
    for (size_t i = 0; i < 2; i++)
        if (v.shape(i) != k.shape(i)) throw InvalidInput("flash_attn: v cells / heads != k's");
    if ((int64_t)k.shape(2) != hd) throw InvalidInput("flash_attn: k head_dim != q head_dim");
    if ((int64_t)q_pos.size() != n_tok || (int64_t)kv_pos.size() != n_kv) throw InvalidInput("flash_attn: positions length");
    if (!q_seq != !kv_seq) throw InvalidInput("flash_attn: q_seq and kv_seq go together");
    cu::CudaDevice& d = device(dev_index);
    if (n_split <= 0) n_split = cu::flash_attn_auto_splits(n_tok, n_head, n_kv, d.sm_count(), split_cells);
    Buf kb = upload_kv(d, k, kv_type, n_kv, n_head_kv, hd, "k"), vb = upload_kv(d, v, kv_type, n_kv, n_head_kv, hd_v, "v");
    Buf qb(d, q.data(), q.size() * 4), qpb(d, q_pos.data(), q_pos.size() * 4), kpb(d, kv_pos.data(), kv_pos.size() * 4),
        ob(d, (size_t)(n_tok * n_head * hd_v) * 4), sb(d, cu::flash_attn_scratch_bytes(n_tok, n_head, hd_v, n_split));
    auto snb = upload_opt(d, sinks, (size_t)n_head, "sinks");
    auto qsb = upload_opt(d, q_seq, (size_t)n_tok, "q_seq");
    auto ksb = upload_opt(d, kv_seq, (size_t)n_kv, "kv_seq");
    stowlm::cpu::AttnParams p;
    p.scale = scale, p.softcap = softcap, p.window = window, p.causal = causal;
    p.sinks = snb ? snb->as<float>() : nullptr;
    p.q_seq = qsb ? qsb->as<int32_t>() : nullptr;
    p.kv_seq = ksb ? ksb->as<int32_t>() : nullptr;
    p.split_cells = split_cells, p.seq_cells = seq_cells;
    stowlm::cpu::KvView kv;
    kv.k = kb.p, kv.v = vb.p, kv.type = kv_type, kv.n_kv = n_kv, kv.n_head_kv = n_head_kv;
    kv.k_cell_bytes = (size_t)n_head_kv * stowlm::row_bytes(kv_type, hd);
    kv.v_cell_bytes = (size_t)n_head_kv * stowlm::row_bytes(kv_type, hd_v);
    kv.hd_k = hd, kv.hd_v = hd_v;
    std::unique_ptr<Buf> yb;
    if (q8_1) yb = std::make_unique<Buf>(d, cu::q8_1_bytes(n_tok, n_head * hd_v));
    cu::flash_attn(qb.as<float>(), n_tok, n_head, n_head * hd, kv, qpb.as<int32_t>(), kpb.as<int32_t>(), p,
                   ob.as<float>(), n_head * hd_v, n_split, sb.p, d.compute_stream(), yb ? yb->p : nullptr);
    nb::object out = nb::cast(download<float>(d, ob, {(size_t)n_tok, (size_t)n_head, (size_t)hd_v}));
    if (!q8_1) return out;
    const size_t row = (size_t)(n_head * hd_v / 32) * sizeof(stowlm::block_q8_1);
    return nb::make_tuple(out, download<uint8_t>(d, *yb, {(size_t)n_tok, row}));
}

// Multi-head latent attention's layout: V is the first hd_v values of each K cell (one KV head,
// F16 cells of hd_k), read through a view with K's cell stride.
Out<float> flash_attn_v_in_k(In<float> q, In<uint16_t> k, int64_t hd_v, In<int32_t> q_pos, In<int32_t> kv_pos,
                             float scale, int n_split, int dev_index) {
    if (q.ndim() != 3 || k.ndim() != 2) throw InvalidInput("flash_attn_v_in_k: q (n_tok, n_head, hd_k), k (n_kv, hd_k)");
    const int64_t n_tok = q.shape(0), n_head = q.shape(1), hd = q.shape(2), n_kv = k.shape(0);
    if ((int64_t)k.shape(1) != hd || hd_v <= 0 || hd_v > hd) throw InvalidInput("flash_attn_v_in_k: widths");
    cu::CudaDevice& d = device(dev_index);
    Buf kb(d, k.data(), k.size() * 2), qb(d, q.data(), q.size() * 4), qpb(d, q_pos.data(), q_pos.size() * 4),
        kpb(d, kv_pos.data(), kv_pos.size() * 4), ob(d, (size_t)(n_tok * n_head * hd_v) * 4),
        sb(d, cu::flash_attn_scratch_bytes(n_tok, n_head, hd_v, n_split));
    stowlm::cpu::AttnParams p;
    p.scale = scale;
    stowlm::cpu::KvView kv;
    kv.k = kv.v = kb.p, kv.type = QType::F16, kv.n_kv = n_kv, kv.n_head_kv = 1;
    kv.k_cell_bytes = kv.v_cell_bytes = (size_t)hd * 2, kv.hd_k = hd, kv.hd_v = hd_v;
    cu::flash_attn(qb.as<float>(), n_tok, n_head, n_head * hd, kv, qpb.as<int32_t>(), kpb.as<int32_t>(), p,
                   ob.as<float>(), n_head * hd_v, n_split, sb.p, d.compute_stream());
    return download<float>(d, ob, {(size_t)n_tok, (size_t)n_head, (size_t)hd_v});
}

Out<float> get_rows(In<uint8_t> raw, uint32_t qtype, In<int32_t> ids, int64_t n_cols, int dev_index) {
    const QType t = (QType)qtype;
    stowlm::qtype_checked(qtype);
    const size_t rb = stowlm::row_bytes(t, n_cols);
    if (rb == 0 || raw.size() % rb) throw InvalidInput("get_rows: raw is not a whole number of rows");
    cu::CudaDevice& d = device(dev_index);
    const int64_t n_ids = ids.size();
    Buf tb(d, raw.data(), raw.size()), ib(d, ids.data(), ids.size() * 4), ob(d, (size_t)(n_ids * n_cols) * 4);
    cu::get_rows(tb.p, t, (int64_t)(raw.size() / rb), n_cols, ib.as<int32_t>(), ids.data(), n_ids, ob.as<float>(), n_cols,
                 d.compute_stream());
    return download<float>(d, ob, {(size_t)n_ids, (size_t)n_cols});
}

// n_mat matrices repacked into 16-row groups (ops.repack_rows16_raw each), put back in GGUF's
// layout in place on the device (unrepack_rows16: a staged copy of experts the CPU keeps repacked).
Out<uint8_t> unrepack_rows16(In<uint8_t> packed, uint32_t qtype, int64_t n_mat, int64_t rows, int64_t cols, int dev_index) {
    const QType t = (QType)qtype;
    stowlm::qtype_checked(qtype);
    if (n_mat <= 0 || rows <= 0 || packed.size() != stowlm::row_bytes(t, cols) * (size_t)(rows * n_mat))
        throw InvalidInput("unrepack_rows16: packed is not n_mat * rows rows of that type");
    cu::CudaDevice& d = device(dev_index);
    Buf b(d, packed.data(), packed.size());
    cu::unrepack_rows16(b.p, t, n_mat, rows, cols, d.compute_stream());
    return download<uint8_t>(d, b, {packed.size()});
}

// One token's gate and up expert products joined by their GLU (moe_matmul_glu): (g, u, act), (k, rows) each.
nb::tuple moe_glu(In<uint8_t> wg, In<uint8_t> wu, uint32_t qtype, int n_expert, int64_t rows, int64_t cols,
                  In<float> x, In<int32_t> ids, bool gelu, int dev_index) {
    const QType t = (QType)qtype;
    const size_t rb = stowlm::row_bytes(t, cols);
    if (wg.size() != rb * (size_t)rows * (size_t)n_expert || wu.size() != wg.size())
        throw InvalidInput("moe_glu: wg and wu bytes != n_expert*rows*row_bytes");
    if (ids.ndim() != 2 || ids.shape(0) != 1) throw InvalidInput("moe_glu: ids must be (1, k)");
    const int k = (int)ids.shape(1);
    if (x.ndim() != 2 || x.shape(0) != 1 || (int64_t)x.shape(1) != cols) throw InvalidInput("moe_glu: x must be (1, cols)");
    for (size_t i = 0; i < ids.size(); i++)
        if (ids.data()[i] < -1 || ids.data()[i] >= n_expert) throw InvalidInput("moe_glu: expert id out of range");
    cu::CudaDevice& d = device(dev_index);
    cu::DeviceWeight dw{nullptr, t, rows, cols};
    const size_t out = (size_t)(k * rows) * 4;
    Buf gb(d, wg.data(), wg.size()), ub(d, wu.data(), wu.size()), xb(d, x.data(), x.size() * 4),
        ib(d, ids.data(), ids.size() * 4), yg(d, out), yu(d, out), ya(d, out),
        sb(d, cu::moe_scratch_bytes(dw, n_expert, 1, k));
    cu::DeviceWeight g = dw, u = dw;
    g.data = gb.p, u.data = ub.p;
    cu::moe_matmul_glu(g, u, n_expert, xb.as<float>(), ib.as<int32_t>(), k, yg.as<float>(), yu.as<float>(),
                       ya.as<float>(), rows, gelu, sb.p, d.compute_stream());
    const std::vector<size_t> shape = {(size_t)k, (size_t)rows};
    return nb::make_tuple(download<float>(d, yg, shape), download<float>(d, yu, shape), download<float>(d, ya, shape));
}

Out<float> moe(In<uint8_t> w, uint32_t qtype, int n_expert, int64_t rows, int64_t cols, In<float> x, In<int32_t> ids,
               bool per_slot_input, int dev_index) {
    const QType t = (QType)qtype;
    const size_t rb = stowlm::row_bytes(t, cols);
    if (w.size() != rb * (size_t)rows * (size_t)n_expert) throw InvalidInput("moe: w bytes != n_expert*rows*row_bytes");
    if (ids.ndim() != 2) throw InvalidInput("moe: ids must be (n_tok, k)");
    const int64_t n_tok = ids.shape(0);
    const int k = (int)ids.shape(1);
    const int64_t n_act = per_slot_input ? n_tok * k : n_tok;
    if (x.ndim() != 2 || (int64_t)x.shape(0) != n_act || (int64_t)x.shape(1) != cols) throw InvalidInput("moe: x shape");
    for (size_t i = 0; i < ids.size(); i++)  // -1: the expert is on another shard (a zero row)
        if (ids.data()[i] < -1 || ids.data()[i] >= n_expert) throw InvalidInput("moe: expert id out of range");
    cu::CudaDevice& d = device(dev_index);
    cu::DeviceWeight dw{nullptr, t, rows, cols};
    Buf wb(d, w.data(), w.size()), xb(d, x.data(), x.size() * 4), ib(d, ids.data(), ids.size() * 4),
        yb(d, (size_t)(n_tok * k * rows) * 4), sb(d, cu::moe_scratch_bytes(dw, n_expert, n_act, n_tok * k));
    dw.data = wb.p;
    cu::moe_matmul(dw, n_expert, xb.as<float>(), cols, per_slot_input, ib.as<int32_t>(), n_tok, k, yb.as<float>(), rows,
                   sb.p, d.compute_stream());
    return download<float>(d, yb, {(size_t)n_tok, (size_t)k, (size_t)rows});
}

}  // namespace

STOWLM_BIND(cuda_ops) {
    nb::module_ co = stowlm::bind::submodule(m, "cuda_ops");
    co.def("matmul_raw", &matmul_raw, nb::arg("w"), nb::arg("qtype"), nb::arg("rows"), nb::arg("cols"), nb::arg("x"),
           nb::arg("path") = "auto", nb::arg("device") = 0);
    co.def("matmul_reusing", &matmul_reusing, nb::arg("w1"), nb::arg("w2"), nb::arg("qtype"), nb::arg("rows"),
           nb::arg("cols"), nb::arg("x"), nb::arg("path") = "auto", nb::arg("device") = 0);
    co.def("matmul_glu", &matmul_glu, nb::arg("wg"), nb::arg("wu"), nb::arg("qtype"), nb::arg("rows"), nb::arg("cols"),
           nb::arg("x"), nb::arg("gelu") = false, nb::arg("device") = 0);
    co.def("matmul_multi", &matmul_multi, nb::arg("ws"), nb::arg("qtype"), nb::arg("rows"), nb::arg("cols"),
           nb::arg("x"), nb::arg("device") = 0);
    co.def("quantize_q8_1", &quantize_q8_1, nb::arg("x"), nb::arg("device") = 0,
           "block_q8_1 bytes (n, cols/32*48) as the device quantizer writes them");
    co.def("flash_attn", &flash_attn, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("q_pos"), nb::arg("kv_pos"),
           nb::arg("scale"), nb::arg("softcap") = 0.0f, nb::arg("window") = 0, nb::arg("causal") = true,
           nb::arg("n_split") = 1, nb::arg("kv_type") = "F16", nb::arg("sinks").none() = nb::none(),
           nb::arg("q_seq").none() = nb::none(), nb::arg("kv_seq").none() = nb::none(), nb::arg("split_cells") = 0,
           nb::arg("seq_cells") = 0, nb::arg("q8_1") = false, nb::arg("device") = 0,
           "k (n_kv, n_head_kv, hd_k), v (n_kv, n_head_kv, hd_v): float16 bits as uint16, or float32 stored into "
           "kv_type cells on the device; n_split <= 0: the launcher's choice; q8_1: (out, its block_q8_1 rows)");
    co.def("flash_attn_v_in_k", &flash_attn_v_in_k, nb::arg("q"), nb::arg("k"), nb::arg("hd_v"), nb::arg("q_pos"),
           nb::arg("kv_pos"), nb::arg("scale"), nb::arg("n_split") = 1, nb::arg("device") = 0);
    co.def("unrepack_rows16", &unrepack_rows16, nb::arg("packed"), nb::arg("qtype"), nb::arg("n_mat"), nb::arg("rows"),
           nb::arg("cols"), nb::arg("device") = 0);
    co.def("get_rows", &get_rows, nb::arg("raw"), nb::arg("qtype"), nb::arg("ids"), nb::arg("n_cols"), nb::arg("device") = 0);
    co.def("moe_matmul_glu", &moe_glu, nb::arg("wg"), nb::arg("wu"), nb::arg("qtype"), nb::arg("n_expert"),
           nb::arg("rows"), nb::arg("cols"), nb::arg("x"), nb::arg("ids"), nb::arg("gelu") = false,
           nb::arg("device") = 0);
    co.def("moe_matmul", &moe, nb::arg("w"), nb::arg("qtype"), nb::arg("n_expert"), nb::arg("rows"), nb::arg("cols"),
           nb::arg("x"), nb::arg("ids"), nb::arg("per_slot_input") = false, nb::arg("device") = 0);

    co.def("rms_norm", [](In<float> x, In<float> w, float eps, int di) {
        auto [n, dim] = rows_dim(x);
        if ((int64_t)w.size() != dim) throw InvalidInput("rms_norm: weight length != last dim");
        cu::CudaDevice& d = device(di);
        Buf xb(d, x.data(), x.size() * 4), wb(d, w.data(), w.size() * 4), yb(d, x.size() * 4);
        cu::rms_norm(xb.as<float>(), n, dim, dim, wb.as<float>(), eps, yb.as<float>(), dim, d.compute_stream());
        return download<float>(d, yb, shape_of(x));
    }, nb::arg("x"), nb::arg("weight"), nb::arg("eps"), nb::arg("device") = 0);

    co.def("add_rms_norm", [](In<float> a, std::optional<In<float>> b, In<float> w, float eps, bool y_in_a,
                              bool quantized, int di) {
        auto [n, dim] = rows_dim(a);
        if ((b && b->size() != a.size()) || (int64_t)w.size() != dim)
            throw InvalidInput("add_rms_norm: b must have a's shape and the weight a's last dim");
        cu::CudaDevice& d = device(di);
        Buf ab(d, a.data(), a.size() * 4), bb(d, b ? b->data() : nullptr, b ? b->size() * 4 : 0),
            wb(d, w.data(), w.size() * 4), sb(d, b ? a.size() * 4 : 0), yb(d, y_in_a ? 0 : a.size() * 4),
            qb(d, quantized ? cu::q8_1_bytes(n, dim) : 0);
        float* y = y_in_a ? ab.as<float>() : yb.as<float>();  // the planner may give y a's bytes
        cu::add_rms_norm(ab.as<float>(), b ? bb.as<float>() : nullptr, n, dim, b ? sb.as<float>() : nullptr,
                         wb.as<float>(), eps, y, quantized ? qb.p : nullptr, d.compute_stream());
        nb::object s = b ? nb::cast(download<float>(d, sb, shape_of(a))) : nb::none();
        nb::object q = quantized ? nb::cast(download<uint8_t>(d, qb, {(size_t)n, (size_t)(dim / 32 * sizeof(stowlm::block_q8_1))}))
                                 : nb::none();
        return nb::make_tuple(s, download<float>(d, y_in_a ? ab : yb, shape_of(a)), q);
    }, nb::arg("a"), nb::arg("b").none(), nb::arg("weight"), nb::arg("eps"), nb::arg("y_in_a") = false,
       nb::arg("quantized") = false, nb::arg("device") = 0,
       "(a + b or None, rms_norm(a [+ b]) * weight, its block_q8_1 bytes or None) in one kernel");

    co.def("rope_pair", [](In<float> q, In<float> k, In<int32_t> pos, int n_rot, float base, float scale, bool neox,
                           int di) {
        if (q.ndim() != 3 || k.ndim() != 3 || q.shape(0) != k.shape(0) || q.shape(2) != k.shape(2) ||
            (size_t)pos.size() != q.shape(0))
            throw InvalidInput("rope_pair: q and k (n_tok, n_head, head_dim) of one head width, pos (n_tok,)");
        cu::CudaDevice& d = device(di);
        Buf qb(d, q.data(), q.size() * 4), kb(d, k.data(), k.size() * 4), pb(d, pos.data(), pos.size() * 4);
        stowlm::cpu::RopeParams p;
        p.n_rot = n_rot, p.freq_base = base, p.freq_scale = scale, p.neox = neox;
        const int64_t hd = q.shape(2);
        cu::rope_pair(qb.as<float>(), q.shape(1), q.shape(1) * hd, kb.as<float>(), k.shape(1), k.shape(1) * hd,
                      q.shape(0), hd, pb.as<int32_t>(), p, d.compute_stream());
        return nb::make_tuple(download<float>(d, qb, shape_of(q)), download<float>(d, kb, shape_of(k)));
    }, nb::arg("q"), nb::arg("k"), nb::arg("pos"), nb::arg("n_rot"), nb::arg("base") = 10000.0f,
       nb::arg("scale") = 1.0f, nb::arg("neox") = false, nb::arg("device") = 0);

    co.def("rope", [](In<float> x, In<int32_t> pos, int n_rot, float base, float scale, bool neox, float ext_factor,
                      float attn_factor, float beta_fast, float beta_slow, int n_ctx_orig, int di) {
        if (x.ndim() != 3 || (size_t)pos.size() != x.shape(0)) throw InvalidInput("rope: x (n_tok, n_head, head_dim), pos (n_tok,)");
        cu::CudaDevice& d = device(di);
        const int64_t n_tok = x.shape(0), n_head = x.shape(1), hd = x.shape(2);
        Buf xb(d, x.data(), x.size() * 4), pb(d, pos.data(), pos.size() * 4);
        stowlm::cpu::RopeParams p;
        p.n_rot = n_rot, p.freq_base = base, p.freq_scale = scale, p.neox = neox;
        p.ext_factor = ext_factor, p.attn_factor = attn_factor, p.beta_fast = beta_fast, p.beta_slow = beta_slow;
        p.n_ctx_orig = n_ctx_orig;
        cu::rope(xb.as<float>(), n_tok, n_head, hd, n_head * hd, pb.as<int32_t>(), p, d.compute_stream());
        return download<float>(d, xb, shape_of(x));
    }, nb::arg("x"), nb::arg("pos"), nb::arg("n_rot"), nb::arg("base") = 10000.0f, nb::arg("scale") = 1.0f,
       nb::arg("neox") = false, nb::arg("ext_factor") = 0.0f, nb::arg("attn_factor") = 1.0f,
       nb::arg("beta_fast") = 32.0f, nb::arg("beta_slow") = 1.0f, nb::arg("n_ctx_orig") = 0, nb::arg("device") = 0);

    co.def("softmax", [](In<float> x, float scale, int di) {
        auto [n, dim] = rows_dim(x);
        cu::CudaDevice& d = device(di);
        Buf xb(d, x.data(), x.size() * 4), yb(d, x.size() * 4);
        cu::softmax(xb.as<float>(), n, dim, dim, scale, yb.as<float>(), dim, d.compute_stream());
        return download<float>(d, yb, shape_of(x));
    }, nb::arg("x"), nb::arg("scale") = 1.0f, nb::arg("device") = 0);

    // Binary ops: a 1-D b against a 2-D a is a broadcast row (as stowlm._core.ops).
    auto binary = [](const char* name, auto fn) {
        return [name, fn](In<float> a, In<float> b, int di) {
            auto [n, dim] = rows_dim(a);
            const bool bcast = b.ndim() == 1 && a.ndim() == 2;
            if (bcast && (int64_t)b.shape(0) != dim) throw InvalidInput(std::string(name) + ": broadcast row b has the wrong length");
            if (!bcast && shape_of(a) != shape_of(b)) throw InvalidInput(std::string(name) + ": a and b shapes differ");
            cu::CudaDevice& d = device(di);
            Buf ab(d, a.data(), a.size() * 4), bb(d, b.data(), b.size() * 4), ob(d, a.size() * 4);
            fn(ab.as<float>(), dim, bb.as<float>(), bcast ? 0 : dim, n, dim, ob.as<float>(), dim, d.compute_stream());
            return download<float>(d, ob, shape_of(a));
        };
    };
    co.def("add", binary("add", cu::add), nb::arg("a"), nb::arg("b"), nb::arg("device") = 0);
    co.def("mul", binary("mul", cu::mul), nb::arg("a"), nb::arg("b"), nb::arg("device") = 0);
    co.def("swiglu", binary("swiglu", cu::swiglu), nb::arg("gate"), nb::arg("up"), nb::arg("device") = 0);
    co.def("geglu", binary("geglu", cu::geglu), nb::arg("gate"), nb::arg("up"), nb::arg("device") = 0);

    auto inplace = [](auto fn) {
        return [fn](In<float> x, float c, int di) {
            auto [n, dim] = rows_dim(x);
            cu::CudaDevice& d = device(di);
            Buf xb(d, x.data(), x.size() * 4);
            fn(xb.as<float>(), n, dim, dim, c, d.compute_stream());
            return download<float>(d, xb, shape_of(x));
        };
    };
    co.def("scale", inplace(cu::scale), nb::arg("x"), nb::arg("s"), nb::arg("device") = 0);
    co.def("softcap", inplace(cu::softcap), nb::arg("x"), nb::arg("cap"), nb::arg("device") = 0);

    co.def("f32_to_f16", [](In<float> x, int di) {
        cu::CudaDevice& d = device(di);
        Buf xb(d, x.data(), x.size() * 4), yb(d, x.size() * 2);
        cu::f32_to_f16(xb.as<float>(), yb.as<uint16_t>(), x.size(), d.compute_stream());
        return download<uint16_t>(d, yb, shape_of(x));
    }, nb::arg("x"), nb::arg("device") = 0);
    co.def("f16_to_f32", [](In<uint16_t> x, int di) {
        cu::CudaDevice& d = device(di);
        Buf xb(d, x.data(), x.size() * 2), yb(d, x.size() * 4);
        cu::f16_to_f32(xb.as<uint16_t>(), yb.as<float>(), x.size(), d.compute_stream());
        return download<float>(d, yb, shape_of(x));
    }, nb::arg("x"), nb::arg("device") = 0);

    co.def("store_kv", [](In<float> x, const std::string& kv_type_name,
                          nb::ndarray<uint8_t, nb::ndim<2>, nb::c_contig, nb::device::cpu> cache, In<int32_t> cells, int di) {
        const QType kv_type = kv_type_of(kv_type_name);
        if (x.ndim() != 3 || (size_t)cells.size() != x.shape(0)) throw InvalidInput("store_kv: x (n_tok, n_head_kv, head_dim)");
        for (size_t i = 0; i < cells.size(); i++)
            if (cells.data()[i] >= (int64_t)cache.shape(0)) throw InvalidInput("store_kv: cell out of range");
        cu::CudaDevice& d = device(di);
        Buf xb(d, x.data(), x.size() * 4), cb(d, cache.data(), cache.size()), ib(d, cells.data(), cells.size() * 4);
        cu::store_kv(xb.as<float>(), x.shape(0), x.shape(1) * x.shape(2), x.shape(1), x.shape(2), kv_type, cb.p,
                     cache.shape(1), ib.as<int32_t>(), d.compute_stream());
        d.copy_to_host(cache.data(), cb.p, cache.size(), d.compute_stream());
    }, nb::arg("x"), nb::arg("kv_type"), nb::arg("cache"), nb::arg("dst_cells"), nb::arg("device") = 0);

    co.def("store_kv_pair", [](In<float> k, In<float> v, const std::string& kv_type_name,
                               nb::ndarray<uint8_t, nb::ndim<2>, nb::c_contig, nb::device::cpu> k_cache,
                               nb::ndarray<uint8_t, nb::ndim<2>, nb::c_contig, nb::device::cpu> v_cache,
                               In<int32_t> cells, int di) {
        const QType kv_type = kv_type_of(kv_type_name);
        if (k.ndim() != 3 || v.ndim() != 3 || k.shape(0) != v.shape(0) || (size_t)cells.size() != k.shape(0))
            throw InvalidInput("store_kv_pair: k and v (n_tok, n_head_kv, head_dim), a cell per token");
        for (size_t i = 0; i < cells.size(); i++)
            if (cells.data()[i] >= (int64_t)std::min(k_cache.shape(0), v_cache.shape(0)))
                throw InvalidInput("store_kv_pair: cell out of range");
        cu::CudaDevice& d = device(di);
        Buf kb(d, k.data(), k.size() * 4), vb(d, v.data(), v.size() * 4), kc(d, k_cache.data(), k_cache.size()),
            vc(d, v_cache.data(), v_cache.size()), ib(d, cells.data(), cells.size() * 4);
        const cu::KvRows kr{kb.as<float>(), (int64_t)(k.shape(1) * k.shape(2)), (int64_t)k.shape(1),
                            (int64_t)k.shape(2), kc.p, k_cache.shape(1)};
        const cu::KvRows vr{vb.as<float>(), (int64_t)(v.shape(1) * v.shape(2)), (int64_t)v.shape(1),
                            (int64_t)v.shape(2), vc.p, v_cache.shape(1)};
        cu::store_kv_pair(kr, vr, k.shape(0), kv_type, ib.as<int32_t>(), d.compute_stream());
        d.copy_to_host(k_cache.data(), kc.p, k_cache.size(), d.compute_stream());
        d.copy_to_host(v_cache.data(), vc.p, v_cache.size(), d.compute_stream());
    }, nb::arg("k"), nb::arg("v"), nb::arg("kv_type"), nb::arg("k_cache"), nb::arg("v_cache"), nb::arg("dst_cells"),
       nb::arg("device") = 0);

    // rope_pair(q, k) then store_kv_pair(k, v) in one launch: (q, k) rotated; the caches written.
    co.def("rope_store", [](In<float> q, In<float> k, In<float> v, In<int32_t> pos, int n_rot, float base, float scale,
                            bool neox, const std::string& kv_type_name,
                            nb::ndarray<uint8_t, nb::ndim<2>, nb::c_contig, nb::device::cpu> k_cache,
                            nb::ndarray<uint8_t, nb::ndim<2>, nb::c_contig, nb::device::cpu> v_cache, In<int32_t> cells,
                            int di) {
        const QType kv_type = kv_type_of(kv_type_name);
        if (q.ndim() != 3 || k.ndim() != 3 || v.ndim() != 3 || q.shape(0) != k.shape(0) || v.shape(0) != k.shape(0) ||
            q.shape(2) != k.shape(2) || (size_t)pos.size() != q.shape(0) || (size_t)cells.size() != q.shape(0))
            throw InvalidInput("rope_store: q, k, v (n_tok, n_head, head_dim), q and k of one head width, a position "
                               "and a cell per token");
        for (size_t i = 0; i < cells.size(); i++)
            if (cells.data()[i] >= (int64_t)std::min(k_cache.shape(0), v_cache.shape(0)))
                throw InvalidInput("rope_store: cell out of range");
        cu::CudaDevice& d = device(di);
        Buf qb(d, q.data(), q.size() * 4), kb(d, k.data(), k.size() * 4), vb(d, v.data(), v.size() * 4),
            pb(d, pos.data(), pos.size() * 4), kc(d, k_cache.data(), k_cache.size()), vc(d, v_cache.data(), v_cache.size()),
            ib(d, cells.data(), cells.size() * 4);
        stowlm::cpu::RopeParams p;
        p.n_rot = n_rot, p.freq_base = base, p.freq_scale = scale, p.neox = neox;
        const cu::KvRows kr{kb.as<float>(), (int64_t)(k.shape(1) * k.shape(2)), (int64_t)k.shape(1),
                            (int64_t)k.shape(2), kc.p, k_cache.shape(1)};
        const cu::KvRows vr{vb.as<float>(), (int64_t)(v.shape(1) * v.shape(2)), (int64_t)v.shape(1),
                            (int64_t)v.shape(2), vc.p, v_cache.shape(1)};
        cu::rope_store(qb.as<float>(), q.shape(1), q.shape(1) * q.shape(2), kr, vr, q.shape(0), pb.as<int32_t>(), p,
                       kv_type, ib.as<int32_t>(), d.compute_stream());
        d.copy_to_host(k_cache.data(), kc.p, k_cache.size(), d.compute_stream());
        d.copy_to_host(v_cache.data(), vc.p, v_cache.size(), d.compute_stream());
        return nb::make_tuple(download<float>(d, qb, shape_of(q)), download<float>(d, kb, shape_of(k)));
    }, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("pos"), nb::arg("n_rot"), nb::arg("base"), nb::arg("scale"),
       nb::arg("neox"), nb::arg("kv_type"), nb::arg("k_cache"), nb::arg("v_cache"), nb::arg("dst_cells"),
       nb::arg("device") = 0);

    co.def("router_topk", [](In<float> logits, int k, bool softmax_all, bool normalize, int di) {
        if (logits.ndim() != 2) throw InvalidInput("router_topk: logits must be (n_tok, n_expert)");
        cu::CudaDevice& d = device(di);
        const int64_t n = logits.shape(0);
        stowlm::RouterParams p;
        p.k = k, p.softmax_all = softmax_all, p.normalize = normalize;
        Buf lb(d, logits.data(), logits.size() * 4), ib(d, (size_t)(n * k) * 4), wb(d, (size_t)(n * k) * 4);
        cu::router_topk(lb.as<float>(), n, (int)logits.shape(1), p, ib.as<int32_t>(), wb.as<float>(), d.compute_stream());
        return nb::make_tuple(download<int32_t>(d, ib, {(size_t)n, (size_t)k}), download<float>(d, wb, {(size_t)n, (size_t)k}));
    }, nb::arg("logits"), nb::arg("k"), nb::arg("softmax_all") = true, nb::arg("normalize") = false, nb::arg("device") = 0);

    // The engine's TOP_K then MOE_WEIGHTS on (n_tok, n) logits: (ids, weights), each (n_tok, k).
    co.def("top_k_moe_weights", [](In<float> logits, int k, bool sigmoid_gate, bool normalize, float scale, int di) {
        if (logits.ndim() != 2) throw InvalidInput("top_k_moe_weights: logits must be (n_tok, n_expert)");
        cu::CudaDevice& d = device(di);
        const int64_t n = logits.shape(0), ne = logits.shape(1);
        Buf lb(d, logits.data(), logits.size() * 4), ib(d, (size_t)(n * k) * 4), wb(d, (size_t)(n * k) * 4);
        stowlm::cpu::TopKParams tp;
        tp.k = k;
        cu::top_k(lb.as<float>(), n, ne, ne, tp, ib.as<int32_t>(), d.compute_stream());
        cu::moe_weights(lb.as<float>(), n, ne, ib.as<int32_t>(), k,
                        sigmoid_gate ? stowlm::cpu::Gating::Sigmoid : stowlm::cpu::Gating::Softmax, normalize, scale,
                        wb.as<float>(), d.compute_stream());
        return nb::make_tuple(download<int32_t>(d, ib, {(size_t)n, (size_t)k}), download<float>(d, wb, {(size_t)n, (size_t)k}));
    }, nb::arg("logits"), nb::arg("k"), nb::arg("sigmoid_gate") = false, nb::arg("normalize") = false,
       nb::arg("scale") = 0.0f, nb::arg("device") = 0);

    // The same signatures as stowlm._core.ops.top_k / moe_weights / add_id / swiglu_oai.
    co.def("top_k", [](In<float> x, int k, int gating, std::optional<In<float>> bias, int n_groups, int n_group_used,
                       int di) {
        auto [n, dim] = rows_dim(x);
        if (bias && (int64_t)bias->size() != dim) throw InvalidInput("top_k: bias length != row length");
        cu::CudaDevice& d = device(di);
        Buf xb(d, x.data(), x.size() * 4), ib(d, (size_t)(n * k) * 4);
        std::unique_ptr<Buf> bb = bias ? std::make_unique<Buf>(d, bias->data(), bias->size() * 4) : nullptr;
        stowlm::cpu::TopKParams p;
        p.k = k, p.gating = (stowlm::cpu::Gating)gating, p.bias = bb ? bb->as<float>() : nullptr;
        p.n_groups = n_groups, p.n_group_used = n_group_used;
        cu::top_k(xb.as<float>(), n, dim, dim, p, ib.as<int32_t>(), d.compute_stream());
        return download<int32_t>(d, ib, {(size_t)n, (size_t)k});
    }, nb::arg("x"), nb::arg("k"), nb::arg("gating") = 0, nb::arg("bias").none() = nb::none(), nb::arg("n_groups") = 0,
       nb::arg("n_group_used") = 0, nb::arg("device") = 0);
    co.def("moe_weights", [](In<float> logits, In<int32_t> ids, int gating, bool normalize, float scale, int di) {
        auto [n, ne] = rows_dim(logits);
        if (ids.ndim() != 2 || (int64_t)ids.shape(0) != n) throw InvalidInput("moe_weights: ids must be (n_tok, k)");
        const int64_t k = ids.shape(1);
        cu::CudaDevice& d = device(di);
        Buf lb(d, logits.data(), logits.size() * 4), ib(d, ids.data(), ids.size() * 4), wb(d, (size_t)(n * k) * 4);
        cu::moe_weights(lb.as<float>(), n, ne, ib.as<int32_t>(), k, (stowlm::cpu::Gating)gating, normalize, scale,
                        wb.as<float>(), d.compute_stream());
        return download<float>(d, wb, {(size_t)n, (size_t)k});
    }, nb::arg("logits"), nb::arg("ids"), nb::arg("gating") = 0, nb::arg("normalize") = false, nb::arg("scale") = 0.0f,
       nb::arg("device") = 0);
    co.def("top_k_weights", [](In<float> logits, int k, int gating, bool normalize, float scale, int di) {
        auto [n, ne] = rows_dim(logits);
        cu::CudaDevice& d = device(di);
        Buf lb(d, logits.data(), logits.size() * 4), ib(d, (size_t)(n * k) * 4), wb(d, (size_t)(n * k) * 4);
        stowlm::cpu::TopKParams p;
        p.k = k, p.gating = (stowlm::cpu::Gating)gating;
        cu::top_k_weights(lb.as<float>(), n, ne, ne, p, ib.as<int32_t>(), lb.as<float>(), p.gating, normalize, scale,
                          wb.as<float>(), d.compute_stream());
        return nb::make_tuple(download<int32_t>(d, ib, {(size_t)n, (size_t)k}),
                              download<float>(d, wb, {(size_t)n, (size_t)k}));
    }, nb::arg("logits"), nb::arg("k"), nb::arg("gating") = 0, nb::arg("normalize") = false, nb::arg("scale") = 0.0f,
       nb::arg("device") = 0, "the router's plain top-k and the picked experts' weights in one kernel: (ids, weights)");
    co.def("add_id", [](In<float> x, In<float> bias, In<int32_t> ids, int di) {
        if (x.ndim() != 3 || bias.ndim() != 2 || ids.ndim() != 2 || bias.shape(1) != x.shape(2) ||
            ids.shape(0) != x.shape(0) || ids.shape(1) != x.shape(1))
            throw InvalidInput("add_id: x (n_tok, k, d), bias (n_expert, d), ids (n_tok, k)");
        cu::CudaDevice& d = device(di);
        Buf xb(d, x.data(), x.size() * 4), bb(d, bias.data(), bias.size() * 4), ib(d, ids.data(), ids.size() * 4);
        cu::add_id(xb.as<float>(), bb.as<float>(), bias.shape(0), ib.as<int32_t>(), x.shape(0), x.shape(1), x.shape(2),
                   d.compute_stream());
        return download<float>(d, xb, shape_of(x));
    }, nb::arg("x"), nb::arg("bias"), nb::arg("ids"), nb::arg("device") = 0);
    co.def("swiglu_oai", [](In<float> g, In<float> u, float alpha, float limit, int di) {
        if (g.size() != u.size()) throw InvalidInput("swiglu_oai: gate and up differ in size");
        cu::CudaDevice& d = device(di);
        Buf gb(d, g.data(), g.size() * 4), ub(d, u.data(), u.size() * 4), ob(d, g.size() * 4);
        cu::swiglu_oai(gb.as<float>(), ub.as<float>(), g.size(), alpha, limit, ob.as<float>(), d.compute_stream());
        return download<float>(d, ob, shape_of(g));
    }, nb::arg("gate"), nb::arg("up"), nb::arg("alpha") = 1.702f, nb::arg("limit") = 7.0f, nb::arg("device") = 0);

    // cont / concat of column ranges: x (rows, width) viewed as columns [first, first + n) of each
    // row (the views deepseek2 takes of its projections), copied contiguous on the device.
    co.def("cont_cols", [](In<float> x, int64_t first, int64_t n, int di) {
        if (x.ndim() != 2 || first < 0 || n <= 0 || first + n > (int64_t)x.shape(1)) throw InvalidInput("cont_cols: x (rows, width), columns in range");
        cu::CudaDevice& d = device(di);
        const int64_t rows = x.shape(0), w = x.shape(1);
        Buf xb(d, x.data(), x.size() * 4), ob(d, (size_t)(rows * n) * 4);
        const int64_t ne[4] = {n, rows, 1, 1};
        const size_t nbs[4] = {4, (size_t)w * 4, (size_t)(w * rows) * 4, (size_t)(w * rows) * 4};
        cu::cont(xb.as<float>() + first, ne, nbs, ob.as<float>(), d.compute_stream());
        return download<float>(d, ob, {(size_t)rows, (size_t)n});
    }, nb::arg("x"), nb::arg("first"), nb::arg("n"), nb::arg("device") = 0);
    co.def("concat_cols", [](In<float> a, int64_t a_first, int64_t a_n, In<float> b, int64_t b_first, int64_t b_n, int di) {
        if (a.ndim() != 2 || b.ndim() != 2 || a.shape(0) != b.shape(0) || a_first < 0 || b_first < 0 ||
            a_first + a_n > (int64_t)a.shape(1) || b_first + b_n > (int64_t)b.shape(1))
            throw InvalidInput("concat_cols: a, b (rows, width), columns in range");
        cu::CudaDevice& d = device(di);
        const int64_t rows = a.shape(0), wa = a.shape(1), wb = b.shape(1);
        Buf ab(d, a.data(), a.size() * 4), bb(d, b.data(), b.size() * 4), ob(d, (size_t)(rows * (a_n + b_n)) * 4);
        const int64_t ne[4] = {a_n, rows, 1, 1};
        const size_t anb[4] = {4, (size_t)wa * 4, (size_t)(wa * rows) * 4, (size_t)(wa * rows) * 4};
        const size_t bnb[4] = {4, (size_t)wb * 4, (size_t)(wb * rows) * 4, (size_t)(wb * rows) * 4};
        cu::concat(ab.as<float>() + a_first, ne, anb, bb.as<float>() + b_first, b_n, bnb, ob.as<float>(),
                   d.compute_stream());
        return download<float>(d, ob, {(size_t)rows, (size_t)(a_n + b_n)});
    }, nb::arg("a"), nb::arg("a_first"), nb::arg("a_n"), nb::arg("b"), nb::arg("b_first"), nb::arg("b_n"),
       nb::arg("device") = 0);

    // Allocation accounting: memory_used after allocating each size, then after freeing all.
    co.def("alloc_accounting", [](std::vector<size_t> sizes, int di) {
        cu::CudaDevice& d = device(di);
        const size_t base = d.memory_used();
        std::vector<void*> ps;
        nb::list after;
        for (size_t s : sizes) {
            ps.push_back(d.alloc(s, "accounting test"));
            after.append(d.memory_used() - base);
        }
        for (void* p : ps) d.free(p);
        return nb::make_tuple(after, d.memory_used() - base);
    }, nb::arg("sizes"), nb::arg("device") = 0);
    co.def("alloc", [](size_t bytes, int di) {
        cu::CudaDevice& d = device(di);
        d.free(d.alloc(bytes, "test buffer"));
    }, nb::arg("bytes"), nb::arg("device") = 0);
    // host -> device (pageable, staged) -> device copy -> (peer copy to device `peer`) -> host.
    co.def("copy_roundtrip", [](In<uint8_t> data, int di, int peer) {
        cu::CudaDevice& d = device(di);
        Buf a(d, data.data(), data.size()), b(d, data.size());
        d.copy_device(b.p, a.p, data.size(), d.compute_stream());
        Out<uint8_t> o = new_array<uint8_t>({data.size()});
        if (peer >= 0) {
            cu::CudaDevice& e = device(peer);
            d.synchronize();
            Buf c(e, data.size());
            e.copy_from_peer(c.p, d, b.p, data.size(), e.compute_stream());
            e.copy_to_host(o.data(), c.p, data.size(), e.compute_stream());
        } else {
            d.copy_to_host(o.data(), b.p, data.size(), d.compute_stream());
        }
        return o;
    }, nb::arg("data"), nb::arg("device") = 0, nb::arg("peer") = -1);
    // Tensor parallelism: LOCAL_IDS, and the all-reduce's sum of parts (n_parts, n) in shard order.
    co.def("local_ids", [](In<int32_t> ids, int32_t first, int32_t count, int di) {
        cu::CudaDevice& d = device(di);
        Buf ib(d, ids.data(), ids.size() * 4), ob(d, ids.size() * 4);
        cu::local_ids(ib.as<int32_t>(), ids.size(), first, count, ob.as<int32_t>(), d.compute_stream());
        return download<int32_t>(d, ob, shape_of(ids));
    }, nb::arg("ids"), nb::arg("first"), nb::arg("count"), nb::arg("device") = 0);
    co.def("all_reduce_sum", [](In<float> parts, int di) {
        if (parts.ndim() != 2) throw InvalidInput("all_reduce_sum: parts must be (n_parts, n)");
        const size_t n_parts = parts.shape(0), n = parts.shape(1);
        cu::CudaDevice& d = device(di);
        std::vector<Buf> bufs;  // one allocation per partial, as the shards' are
        std::vector<const float*> ptrs;
        for (size_t s = 0; s < n_parts; s++) {
            bufs.emplace_back(d, parts.data() + s * n, n * 4);
            ptrs.push_back(bufs.back().as<float>());
        }
        Buf ob(d, n * 4);
        cu::all_reduce_sum(ptrs.data(), (int)n_parts, n, ob.as<float>(), d.compute_stream());
        return download<float>(d, ob, {n});
    }, nb::arg("parts"), nb::arg("device") = 0);
    // The all-gather's placing of rows: parts laid end to end in `flat` (part s: widths[s] rows by
    // cols columns), each in an allocation of its own; the output [cols, sum of widths].
    co.def("all_gather_rows", [](In<float> flat, const std::vector<int64_t>& widths, int64_t cols, int di) {
        cu::CudaDevice& d = device(di);
        std::vector<Buf> bufs;
        std::vector<const float*> ptrs;
        std::vector<int64_t> row0 = {0};
        size_t at = 0;
        for (int64_t w : widths) {
            const size_t n = (size_t)(w * cols);
            if (at + n > flat.size()) throw InvalidInput("all_gather_rows: flat is smaller than the parts");
            if (n) bufs.emplace_back(d, flat.data() + at, n * 4);
            else bufs.emplace_back(d, (size_t)4);  // a part of no rows: never read
            ptrs.push_back(bufs.back().as<float>());
            at += n;
            row0.push_back(row0.back() + w);
        }
        Buf ob(d, std::max<size_t>((size_t)(row0.back() * cols), 1) * 4);
        cu::all_gather_rows(ptrs.data(), row0.data(), (int)widths.size(), row0.back(), cols, ob.as<float>(),
                            d.compute_stream());
        return download<float>(d, ob, {(size_t)cols, (size_t)row0.back()});
    }, nb::arg("flat"), nb::arg("widths"), nb::arg("cols"), nb::arg("device") = 0);
    co.def("open_device", [](int di) { return device(di).name(); }, nb::arg("device") = 0);
}
#endif  // STOWLM_HAVE_CUDA
