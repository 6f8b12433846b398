// TEMPORARY (engine branch only): naive float reference versions of the pieces other helpers
// are building (GGUF reader, matmul, CPU ops), so the engine can be tested end
// to end before they land on main. Deleted once the real ones are merged.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "common.h"
#include "cpu/matmul.h"
#include "cpu/ops.h"
#include "error.h"
#include "gguf/gguf.h"
#include "quant/blocks.h"
#include "quant/dequant.h"

namespace stowlm {

// ---------------- GGUF (minimal, trusting) ----------------
namespace {
struct Cur {
    const uint8_t* p;
    const uint8_t* end;
    const std::string* path;
    template <class T>
    T rd() {
        if (p + sizeof(T) > end) throw InvalidInput(*path + ": truncated");
        T v;
        memcpy(&v, p, sizeof(T));
        p += sizeof(T);
        return v;
    }
    std::string str() {
        uint64_t n = rd<uint64_t>();
        if (p + n > end) throw InvalidInput(*path + ": truncated string");
        std::string s((const char*)p, n);
        p += n;
        return s;
    }
};
size_t type_size(GGUFType t) {
    switch (t) {
        case GGUFType::UINT8: case GGUFType::INT8: case GGUFType::BOOL: return 1;
        case GGUFType::UINT16: case GGUFType::INT16: return 2;
        case GGUFType::UINT32: case GGUFType::INT32: case GGUFType::FLOAT32: return 4;
        default: return 8;
    }
}
void read_scalar(Cur& c, GGUFType t, GGUFValue& v) {
    switch (t) {
        case GGUFType::UINT8: v.i = c.rd<uint8_t>(); break;
        case GGUFType::INT8: v.i = c.rd<int8_t>(); break;
        case GGUFType::BOOL: v.i = c.rd<uint8_t>(); break;
        case GGUFType::UINT16: v.i = c.rd<uint16_t>(); break;
        case GGUFType::INT16: v.i = c.rd<int16_t>(); break;
        case GGUFType::UINT32: v.i = c.rd<uint32_t>(); break;
        case GGUFType::INT32: v.i = c.rd<int32_t>(); break;
        case GGUFType::UINT64: v.i = (int64_t)c.rd<uint64_t>(); break;
        case GGUFType::INT64: v.i = c.rd<int64_t>(); break;
        case GGUFType::FLOAT32: v.f = c.rd<float>(); break;
        case GGUFType::FLOAT64: v.f = c.rd<double>(); break;
        case GGUFType::STRING: v.s = c.str(); break;
        default: throw InvalidInput(*c.path + ": bad type");
    }
}
}  // namespace

std::unique_ptr<GGUFFile> GGUFFile::open(const std::string& path) {
    std::unique_ptr<GGUFFile> f(new GGUFFile());
    f->path_ = path;
    int fd = ::open(path.c_str(), O_RDONLY);
    if (fd < 0) throw InvalidInput(path + ": cannot open");
    struct stat st;
    fstat(fd, &st);
    void* base = mmap(nullptr, st.st_size, PROT_READ, MAP_SHARED, fd, 0);
    if (base == MAP_FAILED) throw InvalidInput(path + ": mmap failed");
    f->maps_.push_back({path, (const uint8_t*)base, (size_t)st.st_size, fd});
    Cur c{(const uint8_t*)base, (const uint8_t*)base + st.st_size, &f->path_};
    if (c.rd<uint32_t>() != 0x46554747) throw InvalidInput(path + ": not GGUF");
    f->version_ = c.rd<uint32_t>();
    uint64_t nt = c.rd<uint64_t>(), nkv = c.rd<uint64_t>();
    for (uint64_t i = 0; i < nkv; i++) {
        std::string key = c.str();
        GGUFValue v;
        v.type = (GGUFType)c.rd<uint32_t>();
        if (v.type == GGUFType::ARRAY) {
            v.elem_type = (GGUFType)c.rd<uint32_t>();
            v.count = c.rd<uint64_t>();
            if (v.elem_type == GGUFType::STRING) {
                for (uint64_t j = 0; j < v.count; j++) v.strings.push_back(c.str());
            } else {
                v.data = c.p;
                c.p += v.count * type_size(v.elem_type);
            }
        } else {
            read_scalar(c, v.type, v);
        }
        f->kv_[key] = std::move(v);
    }
    size_t align = (size_t)f->get_int("general.alignment", 32);
    for (uint64_t i = 0; i < nt; i++) {
        GGUFTensor t;
        t.name = c.str();
        t.n_dims = (int)c.rd<uint32_t>();
        for (int d = 0; d < t.n_dims; d++) t.ne[d] = (int64_t)c.rd<uint64_t>();
        t.type = (QType)c.rd<uint32_t>();
        t.file_offset = c.rd<uint64_t>();
        t.nbytes = row_bytes(t.type, t.ne[0]) * t.n_rows();
        f->tensor_index_[t.name] = f->tensors_.size();
        f->tensors_.push_back(t);
    }
    size_t data_start = ((size_t)(c.p - (const uint8_t*)base) + align - 1) / align * align;
    for (auto& t : f->tensors_) {
        t.file_offset += data_start;
        if (t.file_offset + t.nbytes > (size_t)st.st_size) throw InvalidInput(path + ": tensor out of file " + t.name);
        t.data = (const uint8_t*)base + t.file_offset;
    }
    return f;
}
GGUFFile::~GGUFFile() {
    for (auto& m : maps_) {
        munmap((void*)m.base, m.size);
        ::close(m.fd);
    }
}
size_t GGUFFile::total_file_bytes() const {
    size_t n = 0;
    for (auto& m : maps_) n += m.size;
    return n;
}
const GGUFValue* GGUFFile::find(const std::string& key) const {
    auto it = kv_.find(key);
    return it == kv_.end() ? nullptr : &it->second;
}
std::string GGUFFile::get_str(const std::string& key) const {
    auto v = find(key);
    if (!v || v->type != GGUFType::STRING) throw InvalidInput(path_ + ": key " + key + " missing");
    return v->s;
}
std::string GGUFFile::get_str(const std::string& key, const std::string& d) const { return has(key) ? get_str(key) : d; }
int64_t GGUFFile::get_int(const std::string& key) const {
    auto v = find(key);
    if (!v) throw InvalidInput(path_ + ": key " + key + " missing");
    return v->i;
}
int64_t GGUFFile::get_int(const std::string& key, int64_t d) const { return has(key) ? get_int(key) : d; }
double GGUFFile::get_float(const std::string& key) const {
    auto v = find(key);
    if (!v) throw InvalidInput(path_ + ": key " + key + " missing");
    return (v->type == GGUFType::FLOAT32 || v->type == GGUFType::FLOAT64) ? v->f : (double)v->i;
}
double GGUFFile::get_float(const std::string& key, double d) const { return has(key) ? get_float(key) : d; }
bool GGUFFile::get_bool(const std::string& key, bool d) const { return has(key) ? get_int(key) != 0 : d; }
const GGUFTensor* GGUFFile::find_tensor(const std::string& name) const {
    auto it = tensor_index_.find(name);
    return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}
const GGUFTensor& GGUFFile::tensor(const std::string& name) const {
    auto t = find_tensor(name);
    if (!t) throw InvalidInput(path_ + ": no tensor " + name);
    return *t;
}

// Dequantization is the real one (quant/dequant.h).
namespace {
void deq_row(const void* src, QType type, int64_t n, float* y) { dequantize_row(type, src, y, n); }
}  // namespace

namespace cpu {

size_t matmul_scratch_bytes(QType, int64_t cols, int64_t) { return (size_t)cols * 4 * 64; }

void matmul(const WeightRef& w, const float* x, int64_t n_tok, int64_t ldx, float* y, int64_t ldy, void* scratch,
            ThreadPool& pool) {
    const size_t rb = row_bytes(w.type, w.cols);
    pool.parallel_for(w.rows, [&](int64_t r0, int64_t r1, int ith) {
        float* row = (float*)scratch + (size_t)ith * w.cols;
        for (int64_t r = r0; r < r1; r++) {
            deq_row((const uint8_t*)w.data + r * rb, w.type, w.cols, row);
            for (int64_t t = 0; t < n_tok; t++) {
                const float* xt = x + t * ldx;
                double s = 0;
                for (int64_t c = 0; c < w.cols; c++) s += row[c] * xt[c];
                y[t * ldy + r] = (float)s;
            }
        }
    });
}

void get_rows(const void* table, QType type, int64_t n_rows, int64_t n_cols, const int32_t* ids, int64_t n_ids,
              float* out, int64_t ld_out, ThreadPool&) {
    const size_t rb = row_bytes(type, n_cols);
    for (int64_t i = 0; i < n_ids; i++) {
        if (ids[i] < 0 || ids[i] >= n_rows) throw InvalidInput("get_rows: id out of range");
        deq_row((const uint8_t*)table + ids[i] * rb, type, n_cols, out + i * ld_out);
    }
}

void rms_norm(const float* x, int64_t n_rows, int64_t dim, int64_t ldx, const float* w, float eps, float* y,
              int64_t ldy, ThreadPool&) {
    for (int64_t r = 0; r < n_rows; r++) {
        double s = 0;
        for (int64_t i = 0; i < dim; i++) s += (double)x[r * ldx + i] * x[r * ldx + i];
        const float sc = (float)(1.0 / std::sqrt(s / dim + eps));
        for (int64_t i = 0; i < dim; i++) y[r * ldy + i] = x[r * ldx + i] * sc * (w ? w[i] : 1.0f);
    }
}

void rope(float* x, int64_t n_tok, int64_t n_head, int64_t head_dim, int64_t ld_tok, const int32_t* pos,
          const RopeParams& p, ThreadPool&) {
    for (int64_t t = 0; t < n_tok; t++)
        for (int64_t h = 0; h < n_head; h++) {
            float* v = x + t * ld_tok + h * head_dim;
            for (int i = 0; i < p.n_rot / 2; i++) {
                const double theta = pos[t] * p.freq_scale * std::pow((double)p.freq_base, -2.0 * i / p.n_rot);
                const float c = (float)std::cos(theta), s = (float)std::sin(theta);
                const int a = p.neox ? i : 2 * i, b = p.neox ? i + p.n_rot / 2 : 2 * i + 1;
                const float x0 = v[a], x1 = v[b];
                v[a] = x0 * c - x1 * s;
                v[b] = x0 * s + x1 * c;
            }
        }
}

size_t flash_attn_scratch_bytes(int64_t, int64_t, int64_t, int) { return 0; }

void flash_attn(const float* q, int64_t n_tok, int64_t n_head, int64_t ld_q, const void* k, const void* v,
                QType kv_type, int64_t n_kv, int64_t n_head_kv, size_t cell_bytes, int64_t hd, const int32_t* q_pos,
                const int32_t* kv_pos, const AttnParams& p, float* out, int64_t ld_out, void*, ThreadPool&) {
    const size_t head_bytes = row_bytes(kv_type, hd);
    std::vector<float> kr(hd), vr(hd), sc(n_kv), acc(hd);
    for (int64_t t = 0; t < n_tok; t++)
        for (int64_t h = 0; h < n_head; h++) {
            const int64_t hk = h / (n_head / n_head_kv);
            const float* qv = q + t * ld_q + h * hd;
            float mx = -INFINITY;
            for (int64_t j = 0; j < n_kv; j++) {
                const bool vis = kv_pos[j] >= 0 && kv_pos[j] <= q_pos[t] &&
                                 (p.window == 0 || q_pos[t] - kv_pos[j] < p.window);
                if (!vis) {
                    sc[j] = -INFINITY;
                    continue;
                }
                deq_row((const uint8_t*)k + j * cell_bytes + hk * head_bytes, kv_type, hd, kr.data());
                double s = 0;
                for (int64_t i = 0; i < hd; i++) s += qv[i] * kr[i];
                float f = (float)s * p.scale;
                if (p.softcap > 0) f = p.softcap * std::tanh(f / p.softcap);
                sc[j] = f;
                mx = std::max(mx, f);
            }
            std::fill(acc.begin(), acc.end(), 0.f);
            double sum = 0;
            for (int64_t j = 0; j < n_kv; j++) {
                if (sc[j] == -INFINITY) continue;
                const float e = std::exp(sc[j] - mx);
                sum += e;
                deq_row((const uint8_t*)v + j * cell_bytes + hk * head_bytes, kv_type, hd, vr.data());
                for (int64_t i = 0; i < hd; i++) acc[i] += e * vr[i];
            }
            for (int64_t i = 0; i < hd; i++) out[t * ld_out + h * hd + i] = sum > 0 ? (float)(acc[i] / sum) : 0.f;
        }
}

void store_kv(const float* x, int64_t n_tok, int64_t ld_x, int64_t n_head_kv, int64_t hd, QType kv_type, void* cache,
              size_t cell_bytes, const int32_t* cells, ThreadPool&) {
    const size_t hb = row_bytes(kv_type, hd);
    for (int64_t t = 0; t < n_tok; t++)
        for (int64_t h = 0; h < n_head_kv; h++) {
            const float* src = x + t * ld_x + h * hd;
            uint8_t* dst = (uint8_t*)cache + cells[t] * cell_bytes + h * hb;
            if (kv_type == QType::F32) {
                memcpy(dst, src, hd * 4);
            } else if (kv_type == QType::F16) {
                for (int64_t i = 0; i < hd; i++) ((uint16_t*)dst)[i] = f32_to_fp16(src[i]);
            } else if (kv_type == QType::Q8_0) {
                for (int64_t b = 0; b < hd / 32; b++) {
                    block_q8_0& o = ((block_q8_0*)dst)[b];
                    float amax = 0;
                    for (int j = 0; j < 32; j++) amax = std::max(amax, std::fabs(src[b * 32 + j]));
                    const float d = amax / 127, id = d ? 1 / d : 0;
                    o.d = f32_to_fp16(d);
                    for (int j = 0; j < 32; j++) o.qs[j] = (int8_t)std::lround(src[b * 32 + j] * id);
                }
            } else {
                throw InvalidInput("tmp store_kv: type");
            }
        }
}

void swiglu(const float* g, int64_t ldg, const float* u, int64_t ldu, int64_t n, int64_t dim, float* o, int64_t ldo,
            ThreadPool&) {
    for (int64_t r = 0; r < n; r++)
        for (int64_t i = 0; i < dim; i++) {
            const float x = g[r * ldg + i];
            o[r * ldo + i] = x / (1 + std::exp(-x)) * u[r * ldu + i];
        }
}
void geglu(const float* g, int64_t ldg, const float* u, int64_t ldu, int64_t n, int64_t dim, float* o, int64_t ldo,
           ThreadPool&) {
    for (int64_t r = 0; r < n; r++)
        for (int64_t i = 0; i < dim; i++) {
            const float x = g[r * ldg + i];
            const float gl = 0.5f * x * (1 + std::tanh(0.7978845608f * (x + 0.044715f * x * x * x)));
            o[r * ldo + i] = gl * u[r * ldu + i];
        }
}
void add(const float* a, int64_t lda, const float* b, int64_t ldb, int64_t n, int64_t dim, float* o, int64_t ldo,
         ThreadPool&) {
    for (int64_t r = 0; r < n; r++)
        for (int64_t i = 0; i < dim; i++) o[r * ldo + i] = a[r * lda + i] + b[r * ldb + i];
}
void mul(const float* a, int64_t lda, const float* b, int64_t ldb, int64_t n, int64_t dim, float* o, int64_t ldo,
         ThreadPool&) {
    for (int64_t r = 0; r < n; r++)
        for (int64_t i = 0; i < dim; i++) o[r * ldo + i] = a[r * lda + i] * b[r * ldb + i];
}
void scale(float* x, int64_t n, int64_t dim, int64_t ldx, float s, ThreadPool&) {
    for (int64_t r = 0; r < n; r++)
        for (int64_t i = 0; i < dim; i++) x[r * ldx + i] *= s;
}
void softcap(float* x, int64_t n, int64_t dim, int64_t ldx, float cap, ThreadPool&) {
    for (int64_t r = 0; r < n; r++)
        for (int64_t i = 0; i < dim; i++) x[r * ldx + i] = cap * std::tanh(x[r * ldx + i] / cap);
}

}  // namespace cpu
}  // namespace stowlm
