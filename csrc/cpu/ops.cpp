// The CPU ops besides matmul and attention (ops.h). Rows are spread over the pool only when a
// call has enough work to pay for waking the workers (decoding calls are mostly single rows).
#include "cpu/ops.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common.h"
#include "cpu/act_kernels.h"
#include "cpu/attn_math.h"
#include "cpu/ops_kernels.h"
#include "error.h"
#include "quant/blocks.h"
#include "quant/dequant.h"

namespace stowlm::cpu {

namespace {

constexpr int64_t kInlineWork = 1 << 15;  // elements below which a call runs on the caller alone

// fn(begin, end) over rows [0, n); elems_per_row sizes the decision to go parallel.
template <class F>
void for_rows(ThreadPool& pool, int64_t n, int64_t elems_per_row, F&& fn) {
    if (n <= 0) return;
    if (pool.size() == 1 || n == 1 || n * elems_per_row < kInlineWork) {
        fn((int64_t)0, n);
        return;
    }
    pool.parallel_for(n, [&](int64_t b, int64_t e, int) { fn(b, e); });
}

void check_dims(const char* op, int64_t n, int64_t dim) {
    if (n < 0 || dim < 0)
        throw InvalidInput(std::string(op) + ": negative size (n=" + std::to_string(n) + ", dim=" +
                           std::to_string(dim) + ")");
}

void quantize_q8_0(const float* x, block_q8_0* y, int64_t n) {
    for (int64_t b = 0; b < n / QK; b++) {
        const float* xb = x + b * QK;
        float amax = 0;
        for (int i = 0; i < QK; i++) amax = std::max(amax, std::fabs(xb[i]));
        const float d = amax / 127.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        y[b].d = f32_to_fp16(d);
        for (int i = 0; i < QK; i++) y[b].qs[i] = (int8_t)roundf(xb[i] * id);
    }
}

// cos/sin of every (token, pair) of a call. A layer's q and k, and every layer of a
// micro-batch, rotate by the same positions, so the last table is kept and reused when the
// positions and parameters match (a memcmp instead of n_tok * n_rot/2 sincos).
struct RopeTable {
    std::vector<int32_t> pos;
    RopeParams p;
    std::vector<float> cs;  // [n_tok][cc[n_rot], ss[n_rot]] in rope_head's form for this mode
};

bool same_rope(const RopeParams& a, const RopeParams& b) {
    return a.n_rot == b.n_rot && a.freq_base == b.freq_base && a.freq_scale == b.freq_scale && a.neox == b.neox &&
           a.ext_factor == b.ext_factor && a.attn_factor == b.attn_factor && a.beta_fast == b.beta_fast &&
           a.beta_slow == b.beta_slow && a.n_ctx_orig == b.n_ctx_orig;
}

std::shared_ptr<const RopeTable> rope_table(const int32_t* pos, int64_t n_tok, const RopeParams& p) {
    static std::mutex mu;
    static std::shared_ptr<const RopeTable> last;
    {
        std::lock_guard<std::mutex> lock(mu);
        if (last && same_rope(last->p, p) && (int64_t)last->pos.size() == n_tok &&
            std::memcmp(last->pos.data(), pos, (size_t)n_tok * 4) == 0)
            return last;
    }
    auto t = std::make_shared<RopeTable>();
    t->pos.assign(pos, pos + n_tok);
    t->p = p;
    const int64_t half = p.n_rot / 2, n_rot = p.n_rot;
    const bool yarn = p.ext_factor != 0.0f || p.attn_factor != 1.0f;
    float corr_lo = 0, corr_hi = 0;
    if (yarn) rope_yarn_corr_dims(p.n_rot, p.n_ctx_orig, p.freq_base, p.beta_fast, p.beta_slow, &corr_lo, &corr_hi);
    std::vector<float> inv((size_t)half);
    for (int64_t i = 0; i < half; i++) inv[i] = rope_inv_freq((int)i, p.n_rot, p.freq_base);
    t->cs.resize((size_t)(n_tok * n_rot * 2));
    for (int64_t tk = 0; tk < n_tok; tk++) {
        float* cc = t->cs.data() + (size_t)tk * n_rot * 2;
        float* ss = cc + n_rot;
        for (int64_t i = 0; i < half; i++) {
            float c, sn;
            if (yarn) {
                rope_yarn((float)pos[tk] * inv[i], p.freq_scale, corr_lo, corr_hi, (int)i, p.ext_factor, p.attn_factor,
                          &c, &sn);
            } else {
                const float th = rope_theta_f(pos[tk], inv[i], p.freq_scale);
                c = std::cos(th), sn = std::sin(th);
            }
            // pair (a, b): y_a = x_a cos - x_b sin, y_b = x_b cos + x_a sin
            const int64_t a = p.neox ? i : 2 * i, b = p.neox ? i + half : 2 * i + 1;
            cc[a] = cc[b] = c;
            ss[a] = -sn;
            ss[b] = sn;
        }
    }
    std::lock_guard<std::mutex> lock(mu);
    last = t;
    return t;
}

}  // namespace

void get_rows(const void* table, QType type, int64_t n_rows, int64_t n_cols, const int32_t* ids, int64_t n_ids,
              float* out, int64_t ld_out, ThreadPool& pool) {
    check_dims("get_rows", n_ids, n_cols);
    const size_t rb = row_bytes(type, n_cols);
    for (int64_t i = 0; i < n_ids; i++)
        if (ids[i] < 0 || ids[i] >= n_rows)
            throw InvalidInput("get_rows: id " + std::to_string(ids[i]) + " (at index " + std::to_string(i) +
                               ") is outside [0, " + std::to_string(n_rows) + ")");
    if (n_ids == 0) return;
    // The first row on the caller, so an undecodable type throws here, not on a worker.
    dequantize_row(type, (const unsigned char*)table + (size_t)ids[0] * rb, out, n_cols);
    for_rows(pool, n_ids - 1, n_cols, [&](int64_t b, int64_t e) {
        for (int64_t i = b + 1; i < e + 1; i++)
            dequantize_row(type, (const unsigned char*)table + (size_t)ids[i] * rb, out + i * ld_out, n_cols);
    });
}

void rms_norm(const float* x, int64_t n_rows, int64_t dim, int64_t ldx, const float* weight, float eps, float* y,
              int64_t ldy, ThreadPool& pool) {
    check_dims("rms_norm", n_rows, dim);
    if (dim == 0) return;
    const OpsKernels& kr = ops_kernels();
    for_rows(pool, n_rows, dim, [&](int64_t b, int64_t e) {
        for (int64_t r = b; r < e; r++) {
            const float* xr = x + r * ldx;
            const float ms = kr.sum_sq(xr, dim) / (float)dim;
            kr.scale_mul(xr, 1.0f / std::sqrt(ms + eps), weight, y + r * ldy, dim);
        }
    });
}

void rope(float* x, int64_t n_tok, int64_t n_head, int64_t head_dim, int64_t ld_tok, const int32_t* pos,
          const RopeParams& p, ThreadPool& pool) {
    check_dims("rope", n_tok, n_head);
    if (p.n_rot <= 0 || p.n_rot % 2 != 0 || p.n_rot > head_dim)
        throw InvalidInput("rope: n_rot " + std::to_string(p.n_rot) + " must be even, > 0 and <= head_dim " +
                           std::to_string(head_dim));
    const std::shared_ptr<const RopeTable> tab = rope_table(pos, n_tok, p);
    const std::vector<float>& cs = tab->cs;
    const OpsKernels& kr = ops_kernels();
    const int64_t n_rot = p.n_rot;
    for_rows(pool, n_tok * n_head, p.n_rot, [&](int64_t b, int64_t e) {
        int64_t t = b / n_head, h = b % n_head;  // (token, head) of row b, then stepped
        for (int64_t r = b; r < e; r++) {
            const float* cc = cs.data() + (size_t)t * n_rot * 2;
            kr.rope_head(x + t * ld_tok + h * head_dim, cc, cc + n_rot, n_rot, p.neox);
            if (++h == n_head) {
                h = 0;
                t++;
            }
        }
    });
}

void store_kv(const float* x, int64_t n_tok, int64_t ld_x, int64_t n_head_kv, int64_t head_dim, QType kv_type,
              void* cache, size_t kv_cell_bytes, const int32_t* dst_cells, ThreadPool& pool, int64_t n_cells) {
    if (kv_type != QType::F16 && kv_type != QType::Q8_0)
        throw InvalidInput(std::string("store_kv: kv_type ") + qtype_name(kv_type) + " is not F16 or Q8_0");
    check_dims("store_kv", n_tok, head_dim);
    const size_t rb = row_bytes(kv_type, head_dim);
    if (kv_cell_bytes < (size_t)n_head_kv * rb)
        throw InvalidInput("store_kv: kv_cell_bytes " + std::to_string(kv_cell_bytes) + " < n_head_kv * row bytes " +
                           std::to_string((size_t)n_head_kv * rb));
    for (int64_t i = 0; i < n_tok; i++)
        if (dst_cells[i] < 0 || (n_cells >= 0 && dst_cells[i] >= n_cells))
            throw InvalidInput("store_kv: destination cell " + std::to_string(dst_cells[i]) + " (token " +
                               std::to_string(i) + ") is outside the cache");
    const OpsKernels& kr = ops_kernels();
    for_rows(pool, n_tok, n_head_kv * head_dim, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; i++) {
            unsigned char* cell = (unsigned char*)cache + (size_t)dst_cells[i] * kv_cell_bytes;
            for (int64_t h = 0; h < n_head_kv; h++) {
                const float* src = x + i * ld_x + h * head_dim;
                if (kv_type == QType::F16) kr.to_f16(src, (uint16_t*)(cell + h * rb), head_dim);
                else quantize_q8_0(src, (block_q8_0*)(cell + h * rb), head_dim);
            }
        }
    });
}

namespace {
// out[r, i] = f(a[r, i], b[r, i]) over n rows of dim, threaded by rows; ld_b == 0 broadcasts b's row.
template <class F>
void rowwise_binary(const char* op, const float* a, int64_t ld_a, const float* b, int64_t ld_b, int64_t n,
                    int64_t dim, float* out, int64_t ld_out, ThreadPool& pool, F f) {
    check_dims(op, n, dim);
    for_rows(pool, n, dim, [&](int64_t rb, int64_t re) {
        for (int64_t r = rb; r < re; r++) {
            const float* x = a + r * ld_a;
            const float* y = b + r * ld_b;
            float* o = out + r * ld_out;
            for (int64_t i = 0; i < dim; i++) o[i] = f(x[i], y[i]);
        }
    });
}
}  // namespace

namespace {
// The vector row kernels (act_kernels.h) of the active ISA; null on the scalar path.
const ActKernels* act_kernels() {
#ifdef STOWLM_X86
    switch (ops_isa()) {
        case OpsIsa::Avx512: return &act_kernels_avx512();
        case OpsIsa::Avx2: return &act_kernels_avx2();
        default: break;
    }
#endif
    return nullptr;
}

void gated_rows(const char* op, GatedRowFn fn, const float* gate, int64_t ld_gate, const float* up, int64_t ld_up,
                int64_t n, int64_t dim, float* out, int64_t ld_out, ThreadPool& pool) {
    check_dims(op, n, dim);
    for_rows(pool, n, dim, [&](int64_t rb, int64_t re) {
        for (int64_t r = rb; r < re; r++) fn(gate + r * ld_gate, up + r * ld_up, out + r * ld_out, dim);
    });
}
}  // namespace

namespace {
// The start of row (i1, i2, i3) of a strided tensor.
inline const float* row_at(const float* base, const size_t nb[4], int64_t i1, int64_t i2, int64_t i3) {
    return (const float*)((const char*)base + i1 * nb[1] + i2 * nb[2] + i3 * nb[3]);
}
}  // namespace

void cont(const float* x, const int64_t ne[4], const size_t nb[4], float* out, ThreadPool& pool) {
    const int64_t rows = ne[1] * ne[2] * ne[3];
    for_rows(pool, rows, ne[0], [&](int64_t b, int64_t e) {
        for (int64_t r = b; r < e; r++)
            std::memcpy(out + r * ne[0], row_at(x, nb, r % ne[1], r / ne[1] % ne[2], r / (ne[1] * ne[2])),
                        (size_t)ne[0] * 4);
    });
}

void concat(const float* a, const int64_t a_ne[4], const size_t a_nb[4], const float* b, int64_t b_ne0,
            const size_t b_nb[4], float* out, ThreadPool& pool) {
    const int64_t rows = a_ne[1] * a_ne[2] * a_ne[3], w = a_ne[0] + b_ne0;
    for_rows(pool, rows, w, [&](int64_t rb, int64_t re) {
        for (int64_t r = rb; r < re; r++) {
            const int64_t i1 = r % a_ne[1], i2 = r / a_ne[1] % a_ne[2], i3 = r / (a_ne[1] * a_ne[2]);
            std::memcpy(out + r * w, row_at(a, a_nb, i1, i2, i3), (size_t)a_ne[0] * 4);
            std::memcpy(out + r * w + a_ne[0], row_at(b, b_nb, i1, i2, i3), (size_t)b_ne0 * 4);
        }
    });
}

void swiglu_oai(const float* gate, const float* up, int64_t n, float alpha, float limit, float* out, ThreadPool& pool) {
    constexpr int64_t kChunk = 4096;
    for_rows(pool, (n + kChunk - 1) / kChunk, kChunk, [&](int64_t b, int64_t e) {
        for (int64_t i = b * kChunk; i < std::min(n, e * kChunk); i++) out[i] = stowlm::swiglu_oai(gate[i], up[i], alpha, limit);
    });
}

void swiglu(const float* gate, int64_t ld_gate, const float* up, int64_t ld_up, int64_t n, int64_t dim, float* out,
            int64_t ld_out, ThreadPool& pool) {
    if (const ActKernels* ak = act_kernels())
        return gated_rows("swiglu", ak->swiglu, gate, ld_gate, up, ld_up, n, dim, out, ld_out, pool);
    rowwise_binary("swiglu", gate, ld_gate, up, ld_up, n, dim, out, ld_out, pool,
                   [](float g, float u) { return silu(g) * u; });
}

void geglu(const float* gate, int64_t ld_gate, const float* up, int64_t ld_up, int64_t n, int64_t dim, float* out,
           int64_t ld_out, ThreadPool& pool) {
    if (const ActKernels* ak = act_kernels())
        return gated_rows("geglu", ak->geglu, gate, ld_gate, up, ld_up, n, dim, out, ld_out, pool);
    rowwise_binary("geglu", gate, ld_gate, up, ld_up, n, dim, out, ld_out, pool,
                   [](float g, float u) { return gelu_tanh(g) * u; });
}

void add(const float* a, int64_t ld_a, const float* b, int64_t ld_b, int64_t n, int64_t dim, float* out,
         int64_t ld_out, ThreadPool& pool) {
    rowwise_binary("add", a, ld_a, b, ld_b, n, dim, out, ld_out, pool, [](float x, float y) { return x + y; });
}

void mul(const float* a, int64_t ld_a, const float* b, int64_t ld_b, int64_t n, int64_t dim, float* out,
         int64_t ld_out, ThreadPool& pool) {
    rowwise_binary("mul", a, ld_a, b, ld_b, n, dim, out, ld_out, pool, [](float x, float y) { return x * y; });
}

void scale(float* x, int64_t n, int64_t dim, int64_t ldx, float s, ThreadPool& pool) {
    check_dims("scale", n, dim);
    const OpsKernels& kr = ops_kernels();
    for_rows(pool, n, dim, [&](int64_t b, int64_t e) {
        for (int64_t r = b; r < e; r++) kr.scale(x + r * ldx, s, dim);
    });
}

void softcap(float* x, int64_t n, int64_t dim, int64_t ldx, float cap, ThreadPool& pool) {
    check_dims("softcap", n, dim);
    if (cap == 0.0f) throw InvalidInput("softcap: cap must be non-zero");
    for_rows(pool, n, dim, [&](int64_t b, int64_t e) {
        for (int64_t r = b; r < e; r++) {
            float* xr = x + r * ldx;
            for (int64_t i = 0; i < dim; i++) xr[i] = apply_softcap(xr[i], cap);
        }
    });
}

}  // namespace stowlm::cpu
