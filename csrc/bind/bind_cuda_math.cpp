// stowlm._core.cuda_math: the HOST_DEVICE arithmetic the CUDA kernels run (quant/dot_q8_1.h,
// cpu/attn_math.h, attn_visibility.h, moe_router.h, cuda/moe_select.h, collective_math.h),
// compiled for the host so the CPU tests check the same functions without a GPU.
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/vector.h>

#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include "attn_visibility.h"
#include "bind.h"
#include "collective_math.h"
#include "cpu/attn_math.h"
#include "error.h"
#include "moe_router.h"
#include "quant/dot_q8_1.h"
#include "quant/types.h"
// cuda/ is not on the include path of a build without CUDA; the header needs only csrc/.
#include "../../cuda/moe_select.h"

namespace nb = nanobind;
using stowlm::InvalidInput;
using stowlm::QType;

namespace {

template <typename T, size_t D>
using Out = nb::ndarray<nb::numpy, T, nb::ndim<D>>;

template <typename T, size_t D>
Out<T, D> make_out(std::vector<T>&& v, std::initializer_list<size_t> shape) {
    auto* p = new std::vector<T>(std::move(v));
    nb::capsule owner(p, [](void* q) noexcept { delete (std::vector<T>*)q; });
    return Out<T, D>(p->data(), shape, owner);
}

using F2 = nb::ndarray<const float, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using F1 = nb::ndarray<const float, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using U8 = nb::ndarray<const uint8_t, nb::c_contig, nb::device::cpu>;

std::vector<stowlm::block_q8_1> quantize_rows(const F2& x) {
    const size_t n = x.shape(0), k = x.shape(1);
    if (k == 0 || k % 32) throw InvalidInput("quantize_q8_1: x has " + std::to_string(k) + " columns, not a positive multiple of 32");
    std::vector<stowlm::block_q8_1> q(n * (k / 32));
    for (size_t i = 0; i < n * (k / 32); i++) stowlm::quantize_block_q8_1(x.data() + i * 32, &q[i]);
    return q;
}

// (qs int8 (n, k), d (n, k/32), s (n, k/32, 2))
nb::tuple quantize_q8_1(F2 x) {
    const size_t n = x.shape(0), k = x.shape(1), nb_ = k / 32;
    const auto q = quantize_rows(x);
    std::vector<int8_t> qs(n * k);
    std::vector<float> d(n * nb_), s(n * nb_ * 2);
    for (size_t i = 0; i < q.size(); i++) {
        memcpy(&qs[i * 32], q[i].qs, 32);
        d[i] = q[i].d;
        s[2 * i] = q[i].s0, s[2 * i + 1] = q[i].s1;
    }
    return nb::make_tuple(make_out<int8_t, 2>(std::move(qs), {n, k}), make_out<float, 2>(std::move(d), {n, nb_}),
                          make_out<float, 3>(std::move(s), {n, nb_, 2}));
}

const stowlm::QTypeInfo& weight_type(uint32_t qtype, int64_t cols, const char* fn) {
    const stowlm::QTypeInfo& info = stowlm::qtype_checked(qtype);
    stowlm::WSub w;
    uint8_t probe[512] = {};
    if (!stowlm::load_wsub((QType)qtype, probe, 0, w))
        throw InvalidInput(std::string(fn) + ": " + info.name + " is not a quantized weight type");
    if (cols <= 0 || cols % info.block_elems)
        throw InvalidInput(std::string(fn) + ": cols=" + std::to_string(cols) + " is not a positive multiple of the " +
                           info.name + " block size " + std::to_string(info.block_elems));
    return info;
}

// Every 32-element sub-block of one row: (q int8 (cols,), d (cols/32, 2), m (cols/32, 2)).
nb::tuple unpack_row(U8 row, uint32_t qtype, int64_t cols) {
    weight_type(qtype, cols, "unpack_row");
    const size_t rb = stowlm::row_bytes((QType)qtype, cols);
    if (row.size() != rb) throw InvalidInput("unpack_row: row has " + std::to_string(row.size()) + " bytes, expected " + std::to_string(rb));
    const size_t ns = (size_t)cols / 32;
    std::vector<int8_t> q(cols);
    std::vector<float> d(ns * 2), m(ns * 2);
    for (size_t s = 0; s < ns; s++) {
        stowlm::WSub w;
        stowlm::load_wsub((QType)qtype, row.data(), (int)s, w);
        memcpy(&q[s * 32], w.q, 32);
        d[2 * s] = w.d[0], d[2 * s + 1] = w.d[1], m[2 * s] = w.m[0], m[2 * s + 1] = w.m[1];
    }
    return nb::make_tuple(make_out<int8_t, 1>(std::move(q), {(size_t)cols}), make_out<float, 2>(std::move(d), {ns, 2}),
                          make_out<float, 2>(std::move(m), {ns, 2}));
}

// y[t, r] = sum over sub-blocks of dot_wsub_q8_1(W[r] sub s, quantize_q8_1(x[t]) block s).
Out<float, 2> matmul_q8_1(U8 w, uint32_t qtype, int64_t rows, int64_t cols, F2 x) {
    weight_type(qtype, cols, "matmul_q8_1");
    const size_t rb = stowlm::row_bytes((QType)qtype, cols);
    if (rows < 0 || w.size() != rb * (size_t)rows)
        throw InvalidInput("matmul_q8_1: w has " + std::to_string(w.size()) + " bytes, expected rows*row_bytes");
    if ((int64_t)x.shape(1) != cols) throw InvalidInput("matmul_q8_1: x columns != cols");
    const auto xq = quantize_rows(x);
    const size_t n = x.shape(0), ns = (size_t)cols / 32;
    std::vector<float> y(n * (size_t)rows);
    for (int64_t r = 0; r < rows; r++)
        for (size_t s = 0; s < ns; s++) {
            stowlm::WSub ws;
            stowlm::load_wsub((QType)qtype, w.data() + r * rb, (int)s, ws);
            for (size_t t = 0; t < n; t++) y[t * rows + r] += stowlm::dot_wsub_q8_1(ws, xq[t * ns + s]);
        }
    return make_out<float, 2>(std::move(y), {n, (size_t)rows});
}

// Attention of one query over scores s[j] and values v[j, :], the way the kernels do it:
// online updates within each chunk of `chunk` cells, then the chunks' (m, l, acc) merged in
// order. Returns (out, m, l).
nb::tuple online_softmax_attend(F1 scores, F2 values, int64_t chunk) {
    const size_t n = scores.shape(0), dim = values.shape(1);
    if (values.shape(0) != n) throw InvalidInput("online_softmax_attend: values rows != scores length");
    if (chunk <= 0) throw InvalidInput("online_softmax_attend: chunk must be > 0");
    float M = -INFINITY, L = 0;
    std::vector<float> acc(dim, 0.0f), part(dim);
    for (size_t c0 = 0; c0 < n; c0 += (size_t)chunk) {
        float m = -INFINITY, l = 0;
        std::fill(part.begin(), part.end(), 0.0f);
        for (size_t j = c0; j < std::min(n, c0 + (size_t)chunk); j++) {
            const float s = scores.data()[j];
            if (s == -INFINITY) continue;  // masked cell: the kernels skip it
            float f;
            const float p = stowlm::online_softmax_update(m, l, s, &f);
            for (size_t i = 0; i < dim; i++) part[i] = part[i] * f + p * values.data()[j * dim + i];
        }
        float fa, fb;
        stowlm::online_softmax_merge(M, L, m, l, &fa, &fb);
        for (size_t i = 0; i < dim; i++) acc[i] = acc[i] * fa + part[i] * fb;
    }
    for (size_t i = 0; i < dim; i++) acc[i] = L > 0 ? acc[i] / L : 0.0f;
    return nb::make_tuple(make_out<float, 1>(std::move(acc), {dim}), M, L);
}

// The CUDA attention kernel's arithmetic (cuda/flash_attn.cu) for one query over n cells with
// scores s[j] (-inf: not visible) and values v[j, :]: the cells cut at multiples of split_len;
// within split [j0, j1), restricted to [lo, hi), warp w of 4 takes cells j0 + w + 4i with its own
// online state, the warps' states merged in order; the splits' states folded in order by
// attn_fold_acc (the splits outside [lo, hi) have none), either as they come (one block folding
// them; stored_partials false) or every split's state stored first and folded afterwards (blocks
// of their own and the combine kernel); then attn_out_scale with the optional sink.
Out<float, 1> attend_splits(F1 scores, F2 values, int64_t split_len, int64_t lo, int64_t hi, std::optional<float> sink,
                            bool stored_partials) {
    constexpr int W = 4;
    const int64_t n = (int64_t)scores.shape(0), dim = (int64_t)values.shape(1);
    if ((int64_t)values.shape(0) != n) throw InvalidInput("attend_splits: values rows != scores length");
    if (split_len <= 0 || lo < 0 || hi > n || lo > hi) throw InvalidInput("attend_splits: split_len > 0, 0 <= lo <= hi <= n");
    const int64_t n_splits = std::max<int64_t>(1, (n + split_len - 1) / split_len);
    std::vector<float> part((size_t)(n_splits * (dim + 2)));
    float M = -INFINITY, L = 0.0f;
    std::vector<float> A((size_t)dim, 0.0f);
    for (int64_t sp = 0; sp < n_splits; sp++) {
        const int64_t j0 = sp * split_len;
        int64_t jb, je;
        if (!stowlm::attn_split_cells(sp, split_len, n, lo, hi, &jb, &je)) continue;  // no state, either way
        float wm[W], wl[W];
        std::vector<float> wacc((size_t)(W * dim), 0.0f);
        for (int w = 0; w < W; w++) {
            float m = -INFINITY, l = 0.0f;
            int64_t j = j0 + w;
            if (j < jb) j += (jb - j + W - 1) / W * W;
            for (; j < je; j += W) {
                const float sc = scores.data()[j];
                if (sc == -INFINITY) continue;  // a cell the query does not see
                float f;
                const float p = stowlm::online_softmax_update(m, l, sc, &f);
                for (int64_t d = 0; d < dim; d++)
                    wacc[w * dim + d] = fmaf(p, values.data()[j * dim + d], wacc[w * dim + d] * f);
            }
            wm[w] = m, wl[w] = l;
        }
        float ms = -INFINITY, ls = 0.0f, fs[W];
        for (int w = 0; w < W; w++) {
            float fa, fb;
            stowlm::online_softmax_merge(ms, ls, wm[w], wl[w], &fa, &fb);
            for (int u = 0; u < w; u++) fs[u] *= fa;
            fs[w] = fb;
        }
        float fa = 0.0f, fb = 0.0f;
        float* ps = &part[sp * (dim + 2)];
        if (stored_partials) ps[0] = ms, ps[1] = ls;
        else stowlm::online_softmax_merge(M, L, ms, ls, &fa, &fb);
        for (int64_t d = 0; d < dim; d++) {
            float r = 0.0f;
            for (int w = 0; w < W; w++) r = fmaf(fs[w], wacc[w * dim + d], r);
            if (stored_partials) ps[2 + d] = r;
            else A[d] = stowlm::attn_fold_acc(A[d], fa, r, fb);
        }
    }
    std::vector<float> out((size_t)dim);
    for (int64_t d = 0; d < dim; d++) {
        float m = M, l = L, a = A[d];
        if (stored_partials) {  // the combine kernel
            m = -INFINITY, l = 0.0f, a = 0.0f;
            for (int64_t sp = 0; sp < n_splits; sp++) {
                int64_t jb, je;
                if (!stowlm::attn_split_cells(sp, split_len, n, lo, hi, &jb, &je)) continue;
                const float* ps = &part[sp * (dim + 2)];
                float fa, fb;
                stowlm::online_softmax_merge(m, l, ps[0], ps[1], &fa, &fb);
                a = stowlm::attn_fold_acc(a, fa, ps[2 + d], fb);
            }
        }
        out[d] = a * stowlm::attn_out_scale(m, l, sink.has_value(), sink.value_or(0.0f));
    }
    return make_out<float, 1>(std::move(out), {(size_t)dim});
}

// The CUDA rope kernel's angles and cos/sin magnitudes, (n_pos, n_rot/2) each: rope_pair_angle
// with the launcher's YaRN set-up (rope_is_yarn, rope_yarn_corr_dims on the host).
nb::tuple rope_angles(nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> pos, int n_rot, float base,
                      float scale, float ext_factor, float attn_factor, float beta_fast, float beta_slow,
                      int n_ctx_orig) {
    if (n_rot <= 0 || n_rot % 2) throw InvalidInput("rope_angles: n_rot must be even and > 0");
    stowlm::RopeAngleParams a;
    a.n_rot = n_rot, a.freq_base = base, a.freq_scale = scale;
    a.yarn = stowlm::rope_is_yarn(ext_factor, attn_factor), a.ext_factor = ext_factor, a.attn_factor = attn_factor;
    if (a.yarn) stowlm::rope_yarn_corr_dims(n_rot, n_ctx_orig, base, beta_fast, beta_slow, &a.corr_lo, &a.corr_hi);
    const size_t n = pos.shape(0), half = (size_t)n_rot / 2;
    std::vector<float> th(n * half), ms(n * half);
    for (size_t t = 0; t < n; t++)
        for (size_t i = 0; i < half; i++) stowlm::rope_pair_angle(pos.data()[t], (int)i, a, &th[t * half + i], &ms[t * half + i]);
    return nb::make_tuple(make_out<float, 2>(std::move(th), {n, half}), make_out<float, 2>(std::move(ms), {n, half}));
}

// The TOP_K op of the CUDA backend (moe_select.h expert_select), rows of x: ids (n_tok, k).
Out<int, 2> expert_select(F2 x, int k, int gating, std::optional<F1> bias, int n_groups, int n_group_used) {
    const size_t n_tok = x.shape(0);
    const int n = (int)x.shape(1);
    if (k <= 0 || k > n) throw InvalidInput("expert_select: k=" + std::to_string(k) + " outside 1..n_expert");
    if (bias && (int)bias->shape(0) != n) throw InvalidInput("expert_select: bias length != n_expert");
    if (n_groups > 1 && (n % n_groups || n_groups > stowlm::kMaxExpertGroups || n_group_used < 1 ||
                         n_group_used > n_groups || k > n / n_groups * n_group_used))
        throw InvalidInput("expert_select: the groups must divide the experts and the kept groups hold at least k");
    stowlm::ExpertSelect p;
    p.n = n, p.k = k, p.gating = gating, p.bias = bias ? bias->data() : nullptr;
    p.n_groups = n_groups > 1 ? n_groups : 0, p.n_group_used = n_groups > 1 ? n_group_used : 0;
    std::vector<int> ids(n_tok * k);
    std::vector<float> score((size_t)n);
    for (size_t t = 0; t < n_tok; t++) stowlm::expert_select(x.data() + t * n, p, score.data(), &ids[t * k]);
    return make_out<int, 2>(std::move(ids), {n_tok, (size_t)k});
}

// The MOE_WEIGHTS op of the CUDA backend (moe_select.h moe_gate_weights_any): w (n_tok, k).
Out<float, 2> gate_weights(F2 logits, nb::ndarray<const int32_t, nb::ndim<2>, nb::c_contig, nb::device::cpu> ids,
                           int gating, bool normalize, float scale) {
    const size_t n_tok = logits.shape(0), k = ids.shape(1);
    const int n = (int)logits.shape(1);
    if (ids.shape(0) != n_tok || k == 0 || (int)k > n) throw InvalidInput("gate_weights: ids must be (n_tok, k), k <= n");
    for (size_t i = 0; i < ids.size(); i++)
        if (ids.data()[i] < 0 || ids.data()[i] >= n) throw InvalidInput("gate_weights: expert id out of range");
    std::vector<float> w(n_tok * k);
    for (size_t t = 0; t < n_tok; t++)
        stowlm::moe_gate_weights_any(logits.data() + t * n, n, ids.data() + t * k, (int)k, gating, normalize, scale,
                                     &w[t * k]);
    return make_out<float, 2>(std::move(w), {n_tok, k});
}

nb::tuple router_topk(F1 logits, int k, bool softmax_all, bool normalize) {
    const int n = (int)logits.shape(0);
    if (n <= 0 || n > 256) throw InvalidInput("router_topk: expert count " + std::to_string(n) + " outside 1..256");
    if (k <= 0 || k > n) throw InvalidInput("router_topk: k=" + std::to_string(k) + " outside 1..n_expert");
    stowlm::RouterParams p;
    p.k = k, p.softmax_all = softmax_all, p.normalize = normalize;
    std::vector<int> ids(k);
    std::vector<float> w(k);
    stowlm::router_topk(logits.data(), n, p, ids.data(), w.data());
    return nb::make_tuple(make_out<int, 1>(std::move(ids), {(size_t)k}), make_out<float, 1>(std::move(w), {(size_t)k}));
}

// The TOP_K and MOE_WEIGHTS ops row by row: logits (n_tok, n) -> ids (n_tok, k), weights (n_tok, k).
nb::tuple top_k_moe_weights(F2 logits, int k, bool sigmoid_gate, bool normalize, float scale) {
    const size_t n_tok = logits.shape(0);
    const int n = (int)logits.shape(1);
    if (k <= 0 || k > n) throw InvalidInput("top_k_moe_weights: k=" + std::to_string(k) + " outside 1..n_expert");
    std::vector<int> ids(n_tok * k);
    std::vector<float> w(n_tok * k);
    for (size_t t = 0; t < n_tok; t++) {
        stowlm::router_top_ids(logits.data() + t * n, n, k, &ids[t * k]);
        stowlm::moe_gate_weights(logits.data() + t * n, n, &ids[t * k], k, sigmoid_gate, normalize, scale, &w[t * k]);
    }
    return nb::make_tuple(make_out<int, 2>(std::move(ids), {n_tok, (size_t)k}),
                          make_out<float, 2>(std::move(w), {n_tok, (size_t)k}));
}

// Tensor parallelism (collective_math.h): parts (n_parts, n) summed per element in shard order.
Out<float, 1> shard_order_sum(F2 parts) {
    const size_t n_parts = parts.shape(0), n = parts.shape(1);
    std::vector<const float*> ptrs(n_parts);
    for (size_t s = 0; s < n_parts; s++) ptrs[s] = parts.data() + s * n;
    std::vector<float> out(n);
    for (size_t i = 0; i < n; i++) out[i] = stowlm::shard_order_sum(ptrs.data(), (int)n_parts, (int64_t)i);
    return make_out<float, 1>(std::move(out), {n});
}

// The all-gather (collective_math.h gather_source): parts laid end to end in `flat`, part s of
// widths[s] rows by cols columns; the output [cols, sum of widths].
Out<float, 2> gather_rows(F1 flat, const std::vector<int64_t>& widths, int64_t cols) {
    if (widths.empty() || widths.size() > (size_t)stowlm::kMaxShards || cols < 0)
        throw stowlm::InvalidInput("gather_rows: 1 to 16 parts and cols >= 0");
    std::vector<int64_t> row0 = {0};
    std::vector<const float*> ptrs;
    int64_t at = 0;
    for (int64_t w : widths) {
        if (w < 0) throw stowlm::InvalidInput("gather_rows: a negative width");
        ptrs.push_back(flat.data() + at);
        at += w * cols;
        row0.push_back(row0.back() + w);
    }
    if (at != (int64_t)flat.shape(0)) throw stowlm::InvalidInput("gather_rows: flat is not the parts' size");
    const int64_t d = row0.back();
    std::vector<float> out((size_t)(d * cols));
    for (int64_t i = 0; i < d * cols; i++) {
        int64_t off;
        const int s = stowlm::gather_source(row0.data(), (int)widths.size(), d, i, &off);
        out[i] = ptrs[s][off];
    }
    return make_out<float, 2>(std::move(out), {(size_t)cols, (size_t)d});
}

Out<int32_t, 1> local_expert_ids(nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> ids,
                                 int32_t first, int32_t count) {
    std::vector<int32_t> out(ids.shape(0));
    for (size_t i = 0; i < out.size(); i++) out[i] = stowlm::local_expert_id(ids.data()[i], first, count);
    return make_out<int32_t, 1>(std::move(out), {out.size()});
}

}  // namespace

STOWLM_BIND(cuda_math) {
    nb::module_ cm = stowlm::bind::submodule(m, "cuda_math");
    cm.def("quantize_q8_1", &quantize_q8_1, nb::arg("x"));
    cm.def("unpack_row", &unpack_row, nb::arg("row"), nb::arg("qtype"), nb::arg("cols"));
    cm.def("matmul_q8_1", &matmul_q8_1, nb::arg("w"), nb::arg("qtype"), nb::arg("rows"), nb::arg("cols"), nb::arg("x"));
    cm.def("dp4a", [](int a, int b, int c) { return stowlm::dp4a(a, b, c); });
    cm.def("online_softmax_attend", &online_softmax_attend, nb::arg("scores"), nb::arg("values"), nb::arg("chunk"));
    cm.def("rope_theta", [](int pos, int i, int n_rot, float base, float scale) {
        return stowlm::rope_theta(pos, i, n_rot, base, scale);
    });
    cm.def("kv_visible", [](int32_t q, int32_t kv, bool causal, int32_t window) {
        return stowlm::kv_visible(q, kv, causal, window);
    });
    cm.def("router_topk", &router_topk, nb::arg("logits"), nb::arg("k"), nb::arg("softmax_all") = true,
           nb::arg("normalize") = false);
    cm.def("attend_splits", &attend_splits, nb::arg("scores"), nb::arg("values"), nb::arg("split_len"), nb::arg("lo"),
           nb::arg("hi"), nb::arg("sink").none() = nb::none(), nb::arg("stored_partials") = false);
    cm.def("attn_seq_region", [](int32_t q_seq, int32_t seq_cells, int64_t n_kv) {
        int64_t lo, hi;
        stowlm::attn_seq_region(q_seq, seq_cells, n_kv, &lo, &hi);
        return nb::make_tuple(lo, hi);
    });
    cm.def("rope_angles", &rope_angles, nb::arg("pos"), nb::arg("n_rot"), nb::arg("base") = 10000.0f,
           nb::arg("scale") = 1.0f, nb::arg("ext_factor") = 0.0f, nb::arg("attn_factor") = 1.0f,
           nb::arg("beta_fast") = 32.0f, nb::arg("beta_slow") = 1.0f, nb::arg("n_ctx_orig") = 0);
    cm.def("expert_select", &expert_select, nb::arg("x"), nb::arg("k"), nb::arg("gating") = 0,
           nb::arg("bias").none() = nb::none(), nb::arg("n_groups") = 0, nb::arg("n_group_used") = 0);
    cm.def("gate_weights", &gate_weights, nb::arg("logits"), nb::arg("ids"), nb::arg("gating") = 0,
           nb::arg("normalize") = false, nb::arg("scale") = 0.0f);
    cm.def("top_k_moe_weights", &top_k_moe_weights, nb::arg("logits"), nb::arg("k"), nb::arg("sigmoid_gate") = false,
           nb::arg("normalize") = false, nb::arg("scale") = 0.0f);
    cm.def("shard_order_sum", &shard_order_sum, nb::arg("parts"));
    cm.def("gather_rows", &gather_rows, nb::arg("flat"), nb::arg("widths"), nb::arg("cols"));
    cm.def("local_expert_ids", &local_expert_ids, nb::arg("ids"), nb::arg("first"), nb::arg("count"));
}
