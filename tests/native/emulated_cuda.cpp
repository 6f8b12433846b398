// An emulated CUDA device for tests/native/cuda_engine_emulated.cpp: cuda_backend.h's device
// object and launchers on the host. "Device memory" is host memory in a table of live
// allocations (filled with a NaN pattern, as cudaMalloc leaves garbage); every launcher aborts
// unless each pointer it gets lies inside a live device allocation (so a host pointer, e.g. a
// graph input the engine forgot to upload or a weight it did not copy, is caught), enforces the
// real launchers' 65535-row limits and argument rules (fixed attention splits: n_split 1 or
// their count), then runs the CPU op the launcher mirrors, or the launcher's own HOST_DEVICE code
// where it has one (expert selection and gates: moe_router.h, cuda/moe_select.h). The kernels
// themselves are checked by tests/test_cuda_ops.py on a GPU; this checks the engine's plumbing.
// Each launcher counts the kernels its real counterpart launches for the same arguments (the
// backend's launch counter), and a timed span is the host time between begin_timed and end_timed
// (the emulated kernels run synchronously, so that is their time). A CUDA graph is the list of
// the launchers' CPU work recorded between begin_capture and end_capture, each with the arguments
// it was called with, run again at every replay: as on a GPU, a replay sees what device memory
// holds then but the arguments of its capture, so an argument that should have changed between
// steps gives other logits than running without graphs.
#include <unistd.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <iterator>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "collective_math.h"
#include "cpu/matmul.h"
#include "cpu/moe.h"
#include "cpu/ops.h"
#include "cuda_backend.h"
#include "error.h"
#include "moe_router.h"
#include "moe_select.h"
#include "quant/dot_q8_1.h"
#include "quant/rows16.h"

namespace stowlm::cuda {

int g_split_calls = 0;        // flash_attn calls with n_split > 1
std::atomic<int> g_graphs_made{0}, g_graph_launches{0};
int g_fixed_split_calls = 0;  // of which with fixed splits (several sequences)
size_t g_pinned_copy_bytes = 0;  // copied to a device from pinned host memory
size_t g_pinned_live = 0;        // bytes pinned now, by every emulated device
size_t g_unrepacked_bytes = 0;   // staged weights put back in GGUF's layout (unrepack_rows16)

namespace {

std::mutex g_mu;
std::map<const char*, size_t> g_live;  // every emulated device's allocations
std::map<const char*, size_t> g_pinned;  // host ranges pinned by any emulated device

// The pinned range [p, p + bytes) lies in, or null (call with g_mu held).
const char* pinned_at(const void* p, size_t bytes) {
    const char* c = (const char*)p;
    auto it = g_pinned.upper_bound(c);
    if (it == g_pinned.begin()) return nullptr;
    --it;
    return c + bytes <= it->first + it->second ? it->first : nullptr;
}

thread_local uint64_t t_launches = 0;
using Recorded = std::vector<std::function<void()>>;
thread_local Recorded* t_capture = nullptr;  // the graph this thread is capturing, if any
// Runs a launcher's work now, or records it (with copies of its arguments) while capturing.
void exec(std::function<void()> work) {
    if (t_capture) t_capture->push_back(std::move(work));
    else work();
}
// n kernels launched by the real launcher being emulated; none for an empty shape, as there.
void launched(bool work, uint64_t n = 1) {
    if (work) t_launches += n;
}

ThreadPool& pool() {
    static ThreadPool p(2);
    return p;
}

// Aborts unless [p, p + bytes) lies inside one live device allocation.
void dev_ptr(const void* p, size_t bytes, const char* what) {
    std::lock_guard<std::mutex> lk(g_mu);
    const char* c = (const char*)p;
    auto it = g_live.upper_bound(c);
    if (it == g_live.begin()) {
        fprintf(stderr, "%s: %p is not device memory\n", what, p);
        abort();
    }
    --it;
    if (c + bytes > it->first + it->second) {
        fprintf(stderr, "%s: %p + %zu bytes is outside the device allocation %p of %zu bytes\n", what, p, bytes,
                (const void*)it->first, it->second);
        abort();
    }
}
// Bytes spanned by n rows of `width` floats (or ints) `ld` apart.
size_t span(int64_t n, int64_t ld, int64_t width) { return n > 0 ? (size_t)((n - 1) * ld + width) * 4 : 0; }

void rows_limit(const char* op, int64_t n) {
    if (n > 65535) throw InvalidInput(std::string(op) + ": more than 65535 rows in one launch");
}

void cpu_matmul(const cpu::WeightRef& w, const float* x, int64_t n, int64_t ldx, float* y, int64_t ldy) {
    thread_local std::vector<char> scratch;  // per thread: pipelined devices run at once
    scratch.resize(cpu::matmul_scratch_bytes(w.type, w.cols, n) + 64);
    cpu::matmul(w, x, n, ldx, y, ldy, scratch.data(), pool());
}

// What cannot be captured (host copies and waits, timing; the engine must never capture them).
void not_capturing(const char* what) {
    if (t_capture) {
        fprintf(stderr, "%s while capturing a CUDA graph\n", what);
        abort();
    }
}

[[noreturn]] void unused(const char* what) { throw std::logic_error(std::string(what) + ": not used by the engine"); }

}  // namespace

int device_count(std::string*) { return 2; }
uint64_t launches_on_this_thread() { return t_launches; }

struct CudaDevice::Timing {
    using Clock = std::chrono::steady_clock;
    Clock::time_point start;
    bool open = false;
    TimedTotal total;
};

void CudaDevice::begin_timed(Stream) {
    not_capturing("timing");
    if (!timing_) timing_ = std::make_unique<Timing>();
    if (timing_->open) throw InvalidInput(name_ + ": begin_timed while a timed span is open");
    timing_->open = true;
    timing_->start = Timing::Clock::now();
}
void CudaDevice::end_timed(Stream) {
    not_capturing("timing");
    if (!timing_ || !timing_->open) throw InvalidInput(name_ + ": end_timed without begin_timed");
    timing_->open = false;
    const double s = std::chrono::duration<double>(Timing::Clock::now() - timing_->start).count();
    timing_->total.seconds += s;
    timing_->total.span_s.push_back(s);
    timing_->total.spans++;
}
CudaDevice::TimedTotal CudaDevice::take_timed() {
    if (!timing_) return {};
    if (timing_->open) throw InvalidInput(name_ + ": take_timed while a timed span is open");
    const TimedTotal t = timing_->total;
    timing_->total = TimedTotal();
    return t;
}

CudaDevice::CudaDevice(int index) : index_(index), name_("cuda:" + std::to_string(index)) {
    if (index < 0 || index >= 2) throw Unsupported("no CUDA device " + name_ + " (the emulation has two)");
    sm_count_ = 132;
    total_ = (size_t)80 << 30;
}

CudaDevice::~CudaDevice() {
    std::lock_guard<std::mutex> lk(g_mu);
    for (auto& r : pinned_) g_pinned.erase((const char*)r.first), g_pinned_live -= r.second;
    for (auto& kv : live_) {
        g_live.erase((const char*)kv.first);
        std::free(kv.first);
    }
}

void CudaDevice::set_current() const {}

size_t CudaDevice::memory_used() const {
    std::lock_guard<std::mutex> lk(mu_);
    return used_;
}

void* CudaDevice::alloc(size_t bytes, const std::string&) {
    if (!bytes) return nullptr;
    void* p = std::aligned_alloc(256, (bytes + 255) / 256 * 256);
    memset(p, 0xff, bytes);  // NaN pattern: reading bytes nobody wrote shows up in the logits
    {
        std::lock_guard<std::mutex> lk(g_mu);
        g_live[(const char*)p] = bytes;
    }
    std::lock_guard<std::mutex> lk(mu_);
    live_[p] = bytes;
    used_ += bytes;
    return p;
}

void CudaDevice::free(void* p) {
    if (!p) return;
    {
        std::lock_guard<std::mutex> lk(mu_);
        auto it = live_.find(p);
        if (it == live_.end()) throw InvalidInput(name_ + ": free of a pointer this device did not allocate");
        used_ -= it->second;
        live_.erase(it);
    }
    std::lock_guard<std::mutex> lk(g_mu);
    g_live.erase((const char*)p);
    std::free(p);
}

Event CudaDevice::record(Stream) { return (Event)1; }
void CudaDevice::wait(Stream, Event) {}
void CudaDevice::release(Event) {}
void CudaDevice::synchronize() {}

// As cudaHostRegister: page-aligned ranges (the engine's contract), a range inside one pinned
// already is "already registered", one overlapping another is refused.
bool CudaDevice::pin_host(const void* p, size_t bytes) {
    const uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    if ((uintptr_t)p % page || bytes % page) {
        fprintf(stderr, "pin_host: %p + %zu bytes is not page-aligned\n", p, bytes);
        abort();
    }
    std::lock_guard<std::mutex> lk(g_mu);
    if (pinned_at(p, bytes)) return true;
    const char* c = (const char*)p;
    auto next = g_pinned.lower_bound(c);
    if (next != g_pinned.end() && next->first < c + bytes) return false;
    if (next != g_pinned.begin() && std::prev(next)->first + std::prev(next)->second > c) return false;
    g_pinned[c] = bytes, g_pinned_live += bytes;
    pinned_.emplace_back(const_cast<void*>(p), bytes);
    return true;
}
size_t CudaDevice::pinned_bytes() const {
    std::lock_guard<std::mutex> lk(g_mu);
    size_t n = 0;
    for (auto& r : pinned_) n += r.second;
    return n;
}

void CudaDevice::copy_to_device(void* dst, const void* src, size_t bytes, Stream) {
    not_capturing("copy_to_device");
    if (!bytes) return;
    dev_ptr(dst, bytes, "copy_to_device dst");
    {
        std::lock_guard<std::mutex> lk(g_mu);
        if (pinned_at(src, bytes)) g_pinned_copy_bytes += bytes;
    }
    memcpy(dst, src, bytes);
}
void CudaDevice::copy_to_host(void* dst, const void* src, size_t bytes, Stream) {
    not_capturing("copy_to_host");
    if (!bytes) return;
    dev_ptr(src, bytes, "copy_to_host src");
    memcpy(dst, src, bytes);
}
// ---- graphs: the recorded work of the launchers called between begin_capture and end_capture --

void CudaDevice::begin_capture(Stream) {
    if (t_capture) throw InvalidInput(name_ + ": begin_capture while capturing");
    t_capture = new Recorded();
}
CudaDevice::GraphExec CudaDevice::end_capture(Stream) {
    if (!t_capture) throw InvalidInput(name_ + ": end_capture without begin_capture");
    Recorded* g = t_capture;
    t_capture = nullptr;
    g_graphs_made++;
    return g;
}
void CudaDevice::launch_graph(GraphExec g, Stream) {
    not_capturing("launch_graph");
    g_graph_launches++;
    for (auto& work : *(Recorded*)g) work();
}
void CudaDevice::destroy_graph(GraphExec g) { delete (Recorded*)g; }

void CudaDevice::copy_device(void* dst, const void* src, size_t bytes, Stream) {
    if (!bytes) return;
    dev_ptr(dst, bytes, "copy_device dst");
    dev_ptr(src, bytes, "copy_device src");
    exec([=] { memcpy(dst, src, bytes); });
}
void CudaDevice::copy_from_peer(void* dst, const CudaDevice&, const void* src, size_t bytes, Stream) {
    not_capturing("copy_from_peer");
    if (!bytes) return;
    dev_ptr(dst, bytes, "copy_from_peer dst");
    dev_ptr(src, bytes, "copy_from_peer src");
    memcpy(dst, src, bytes);
}

// ---- launchers: the real ones' scratch formulas, the CPU ops' arithmetic ----------------------

size_t q8_1_bytes(int64_t n_rows, int64_t cols) { return (size_t)n_rows * (size_t)(cols / 32) * sizeof(block_q8_1); }
void quantize_q8_1(const float*, int64_t, int64_t, int64_t, void*, Stream) { unused("quantize_q8_1"); }

size_t matmul_scratch_bytes(QType wtype, int64_t cols, int64_t n_tok) {
    return is_float_type(wtype) ? 0 : q8_1_bytes(n_tok, cols);
}

// x's block_q8_1 rows, as the device quantizer writes them into a product's scratch.
static std::vector<block_q8_1> q8_1_rows(const float* x, int64_t n_tok, int64_t cols, int64_t ldx) {
    std::vector<block_q8_1> q((size_t)(n_tok * (cols / 32)));
    for (int64_t t = 0; t < n_tok; t++)
        for (int64_t c = 0; c < cols / 32; c++) quantize_block_q8_1(x + t * ldx + c * 32, &q[t * (cols / 32) + c]);
    return q;
}

void matmul(const DeviceWeight& w, const float* x, int64_t n_tok, int64_t ldx, float* y, int64_t ldy, void* scratch,
            Stream, MatmulPath, bool x_quantized) {
    dev_ptr(w.data, row_bytes(w.type, w.cols) * w.rows, "matmul w");
    dev_ptr(x, span(n_tok, ldx, w.cols), "matmul x");
    dev_ptr(y, span(n_tok, ldy, w.rows), "matmul y");
    const bool quantized = !is_float_type(w.type);
    if (quantized) dev_ptr(scratch, q8_1_bytes(n_tok, w.cols), "matmul scratch");
    if (n_tok == 0 || w.rows == 0) return;
    launched(true, !quantized || x_quantized ? 1 : 2);  // quantize_q8_1 (unless done) + the product
    exec([=] {
        if (quantized) {  // the scratch holds x's rows after this: written here, or checked where reused
            const std::vector<block_q8_1> q = q8_1_rows(x, n_tok, w.cols, ldx);
            if (!x_quantized) {
                memcpy(scratch, q.data(), q.size() * sizeof(block_q8_1));
            } else if (memcmp(scratch, q.data(), q.size() * sizeof(block_q8_1)) != 0) {
                fprintf(stderr, "matmul: x_quantized, but the scratch does not hold x's quantized rows\n");
                abort();
            }
        }
        cpu_matmul(cpu::WeightRef{w.data, w.type, w.rows, w.cols}, x, n_tok, ldx, y, ldy);
    });
}

void matmul_multi(const DeviceWeight* ws, int n, const float* x, int64_t n_tok, int64_t ldx, float* const* ys,
                  const int64_t* ldys, void* scratch, Stream s, bool x_quantized) {
    if (n < 1 || n > kMmvMulti) throw InvalidInput("matmul_multi: 1 to 3 weights");
    for (int i = 0; i < n; i++)
        if (is_float_type(ws[i].type) || ws[i].type != ws[0].type || ws[i].cols != ws[0].cols)
            throw InvalidInput("matmul_multi: the weights must be quantized, of one type and width");
    if (n_tok < 0 || n_tok >= kCudaBatchedMinTokens) throw InvalidInput("matmul_multi: too many tokens");
    // each product as matmul (the first quantizes x unless x_quantized, the others check the
    // scratch holds its rows), counted as the real launcher's kernels: quantize_q8_1 + one
    const uint64_t before = t_launches;
    for (int i = 0; i < n; i++) matmul(ws[i], x, n_tok, ldx, ys[i], ldys[i], scratch, s, MatmulPath::Vector, x_quantized || i > 0);
    t_launches = before;
    launched(n_tok > 0, x_quantized ? 1 : 2);
}

void matmul_glu(const DeviceWeight& gate, const DeviceWeight& up, const float* x, int64_t n_tok, int64_t ldx,
                float* g, float* u, float* act, int64_t ldy, bool gelu, void* scratch, Stream s, bool x_quantized) {
    if (is_float_type(gate.type) || gate.type != up.type || gate.rows != up.rows || gate.cols != up.cols)
        throw InvalidInput("matmul_glu: gate and up must be quantized weights of one type and shape");
    if (n_tok < 0 || n_tok >= kCudaBatchedMinTokens) throw InvalidInput("matmul_glu: too many tokens");
    dev_ptr(up.data, row_bytes(up.type, up.cols) * up.rows, "matmul_glu up");
    dev_ptr(act, span(n_tok, ldy, gate.rows), "matmul_glu act");
    // the gate's product as matmul (quantizes x unless x_quantized, checks the scratch where reused),
    // then the up product of the same rows and the GLU, in one kernel
    const uint64_t before = t_launches;
    matmul(gate, x, n_tok, ldx, g, ldy, scratch, s, MatmulPath::Vector, x_quantized);
    t_launches = before;
    launched(n_tok > 0 && gate.rows > 0, x_quantized ? 1 : 2);  // quantize_q8_1 (unless done) + mmvq_glu
    dev_ptr(u, span(n_tok, ldy, up.rows), "matmul_glu u");
    exec([=] {
        cpu_matmul(cpu::WeightRef{up.data, up.type, up.rows, up.cols}, x, n_tok, ldx, u, ldy);
        (gelu ? cpu::geglu : cpu::swiglu)(g, ldy, u, ldy, n_tok, gate.rows, act, ldy, pool());
    });
}

void router_topk(const float*, int64_t, int, const RouterParams&, int32_t*, float*, Stream) { unused("router_topk"); }

void top_k(const float* x, int64_t n_rows, int64_t n, int64_t ldx, const cpu::TopKParams& p, int32_t* ids, Stream) {
    dev_ptr(x, span(n_rows, ldx, n), "top_k x");
    dev_ptr(ids, span(n_rows, p.k, p.k), "top_k ids");
    if (p.bias) dev_ptr(p.bias, span(1, n, n), "top_k bias");
    if (p.n_groups > kMaxExpertGroups) throw InvalidInput("top_k: more expert groups than the kernel takes");
    const ExpertSelect e = expert_select_of(n, p);
    if (!expert_select_plain(e) && n > kTopKMaxScored) throw InvalidInput("top_k: more experts than the kernel scores");
    launched(n_rows > 0);
    const int64_t k = p.k;
    exec([=] {
        std::vector<float> score((size_t)n);  // the kernel's shared-memory row
        for (int64_t r = 0; r < n_rows; r++) expert_select(x + r * ldx, e, score.data(), ids + r * k);
    });
}

void top_k_weights(const float* x, int64_t n_rows, int64_t n, int64_t ldx, const cpu::TopKParams& p, int32_t* ids,
                   const float* logits, cpu::Gating gating, bool normalize, float scale, float* w, Stream s) {
    if (!top_k_is_plain(n, p)) throw InvalidInput("top_k_weights: only the plain selection");
    const uint64_t before = t_launches;
    top_k(x, n_rows, n, ldx, p, ids, s);
    moe_weights(logits, n_rows, n, ids, p.k, gating, normalize, scale, w, s);
    t_launches = before;
    launched(n_rows > 0);  // one kernel
}

void moe_weights(const float* logits, int64_t n_tok, int64_t n_expert, const int32_t* ids, int64_t k,
                 cpu::Gating gating, bool normalize, float scale, float* w, Stream) {
    dev_ptr(logits, span(n_tok, n_expert, n_expert), "moe_weights logits");
    dev_ptr(ids, span(n_tok, k, k), "moe_weights ids");
    dev_ptr(w, span(n_tok, k, k), "moe_weights w");
    launched(n_tok > 0);
    exec([=] {
        for (int64_t t = 0; t < n_tok; t++)
            moe_gate_weights_any(logits + t * n_expert, (int)n_expert, ids + t * k, (int)k, (int)gating, normalize,
                                 scale, w + t * k);
    });
}

void add_id(float* x, const float* bias, int64_t n_expert, const int32_t* ids, int64_t n_tok, int64_t k, int64_t d,
            Stream) {
    dev_ptr(x, span(n_tok * k, d, d), "add_id x");
    dev_ptr(bias, span(n_expert, d, d), "add_id bias");
    dev_ptr(ids, span(n_tok * k, 1, 1), "add_id ids");
    launched(n_tok * k > 0 && d > 0);
    exec([=] { cpu::add_id(x, bias, n_expert, ids, n_tok, k, d, pool()); });
}

size_t moe_scratch_bytes(const DeviceWeight& w, int n_expert, int64_t n_act_rows, int64_t n_slots) {
    size_t b = ((sizeof(int32_t) * (size_t)(3 * n_expert + 1 + 2 * n_slots)) + 255) & ~(size_t)255;
    if (!is_float_type(w.type)) b += q8_1_bytes(n_act_rows, w.cols);
    return b;
}

void moe_matmul(const DeviceWeight& w, int n_expert, const float* x, int64_t ldx, bool per_slot_input,
                const int32_t* ids, int64_t n_tok, int k, float* y, int64_t ldy, void* scratch, Stream) {
    const int64_t n_act = per_slot_input ? n_tok * k : n_tok;
    dev_ptr(w.data, row_bytes(w.type, w.cols) * w.rows * n_expert, "moe_matmul w");
    dev_ptr(x, span(n_act, ldx, w.cols), "moe_matmul x");
    dev_ptr(ids, span(n_tok, k, k), "moe_matmul ids");
    dev_ptr(y, span(n_tok * k, ldy, w.rows), "moe_matmul y");
    dev_ptr(scratch, moe_scratch_bytes(w, n_expert, n_act, n_tok * k), "moe_matmul scratch");
    // One token: quantize_q8_1 and the product by slot (the float product alone). More: count,
    // scan, scatter, then quantize_q8_1 and the grouped product (the float product alone).
    const uint64_t kernels = n_tok == 1 ? 1 : 4;
    launched(n_tok > 0 && w.rows > 0, kernels + (is_float_type(w.type) ? 0 : 1));
    exec([=] {
        memset(scratch, 0x5a, moe_scratch_bytes(w, n_expert, n_act, n_tok * k));  // the device's counts and rows
        thread_local std::vector<char> sc;
        sc.resize(cpu::mul_mat_id_scratch_bytes(w.type, w.rows, w.cols, n_expert, k, n_tok) + 64);
        cpu::mul_mat_id(cpu::WeightRef{w.data, w.type, w.rows, w.cols}, n_expert, ids, k, x, per_slot_input ? k : 1,
                        ldx, n_tok, y, ldy, sc.data(), pool());
    });
}

void moe_matmul_glu(const DeviceWeight& gate, const DeviceWeight& up, int n_expert, const float* x, const int32_t* ids,
                    int k, float* g, float* u, float* act, int64_t ldy, bool gelu, void* scratch, Stream s) {
    if (is_float_type(gate.type) || gate.type != up.type || gate.rows != up.rows || gate.cols != up.cols)
        throw InvalidInput("moe_matmul_glu: gate and up must be quantized experts of one type and shape");
    // the two expert products of one token and the GLU (their checks and work), one kernel after the quantization
    const uint64_t before = t_launches;
    moe_matmul(gate, n_expert, x, gate.cols, false, ids, 1, k, g, ldy, scratch, s);
    moe_matmul(up, n_expert, x, gate.cols, false, ids, 1, k, u, ldy, scratch, s);
    dev_ptr(act, span(k, ldy, gate.rows), "moe_matmul_glu act");
    exec([=] { (gelu ? cpu::geglu : cpu::swiglu)(g, ldy, u, ldy, k, gate.rows, act, ldy, pool()); });
    t_launches = before;
    launched(gate.rows > 0, 2);
}

void moe_combine(const float* y, int64_t ldy, const float* weights, int64_t n_tok, int k, int64_t dim, float* out,
                 int64_t ld_out, Stream) {
    rows_limit("moe_combine", n_tok);
    dev_ptr(y, span(n_tok * k, ldy, dim), "moe_combine y");
    dev_ptr(weights, span(n_tok, k, k), "moe_combine weights");
    dev_ptr(out, span(n_tok, ld_out, dim), "moe_combine out");
    launched(n_tok > 0 && dim > 0);
    exec([=] {
        for (int64_t t = 0; t < n_tok; t++)
            for (int64_t i = 0; i < dim; i++) {
                float s = 0;
                for (int j = 0; j < k; j++) s += weights[t * k + j] * y[(t * k + j) * ldy + i];
                out[t * ld_out + i] = s;
            }
    });
}

void flash_attn(const float* q, int64_t n_tok, int64_t n_head, int64_t ld_q, const cpu::KvView& kv,
                const int32_t* q_pos, const int32_t* kv_pos, const cpu::AttnParams& p, float* out, int64_t ld_out,
                int n_split, void* scratch, Stream, void* yq) {
    if (kv.hd_k > kFlashAttnMaxHeadDimK || kv.hd_v > kFlashAttnMaxHeadDimV)
        throw InvalidInput("flash_attn: head widths beyond the kernel's");
    dev_ptr(q, span(n_tok, ld_q, n_head * kv.hd_k), "flash_attn q");
    if (kv.n_kv > 0) {  // V may be a narrower view into K's cells (multi-head latent attention)
        dev_ptr(kv.k, (kv.n_kv - 1) * kv.k_cell_bytes + kv.n_head_kv * row_bytes(kv.type, kv.hd_k), "flash_attn k");
        dev_ptr(kv.v, (kv.n_kv - 1) * kv.v_cell_bytes + kv.n_head_kv * row_bytes(kv.type, kv.hd_v), "flash_attn v");
    }
    dev_ptr(q_pos, span(n_tok, 1, 1), "flash_attn q_pos");
    dev_ptr(kv_pos, span(kv.n_kv, 1, 1), "flash_attn kv_pos");
    if (p.sinks) dev_ptr(p.sinks, span(1, n_head, n_head), "flash_attn sinks");
    if (p.q_seq) dev_ptr(p.q_seq, span(n_tok, 1, 1), "flash_attn q_seq");
    if (p.kv_seq) dev_ptr(p.kv_seq, span(kv.n_kv, 1, 1), "flash_attn kv_seq");
    if (p.q_seq && p.seq_end) dev_ptr(p.seq_end, span(1, 1, 1), "flash_attn seq_end");
    dev_ptr(out, span(n_tok, ld_out, n_head * kv.hd_v), "flash_attn out");
    if (n_split > 1) {
        if (p.split_cells > 0 && n_split != flash_attn_fixed_splits(kv.n_kv, p.split_cells))
            throw InvalidInput("flash_attn: with fixed splits n_split must be 1 or their count");
        dev_ptr(scratch, flash_attn_scratch_bytes(n_tok, n_head, kv.hd_v, n_split), "flash_attn scratch");
        g_split_calls++;
        if (p.split_cells > 0) g_fixed_split_calls++;
    }
    const int64_t cols = n_head * kv.hd_v;
    if (yq) {
        if (ld_out != cols || kv.hd_v % 32) throw InvalidInput("flash_attn: q8_1 rows need ld_out == n_head * hd_v, hd_v % 32 == 0");
        dev_ptr(yq, q8_1_bytes(n_tok, cols), "flash_attn yq");
        if (n_split > 1 && (char*)scratch < (char*)yq + q8_1_bytes(n_tok, cols) &&
            (char*)yq < (char*)scratch + flash_attn_scratch_bytes(n_tok, n_head, kv.hd_v, n_split))
            throw InvalidInput("flash_attn: the q8_1 rows overlap the split partials");
    }
    launched(n_tok > 0 && n_head > 0, n_split > 1 ? 2 : 1);  // the split partials' merge is a kernel of its own
    exec([=] {
        // the split partials overwrite the scratch, as on the device
        if (n_split > 1) memset(scratch, 0x5a, flash_attn_scratch_bytes(n_tok, n_head, kv.hd_v, n_split));
        cpu::flash_attn(q, n_tok, n_head, ld_q, kv, q_pos, kv_pos, p, out, ld_out, nullptr, pool());
        if (yq) {  // the kernel that writes out writes its q8_1 rows too
            const std::vector<block_q8_1> r = q8_1_rows(out, n_tok, cols, ld_out);
            memcpy(yq, r.data(), r.size() * sizeof(block_q8_1));
        }
    });
}

void get_rows(const void* table, QType type, int64_t n_rows, int64_t n_cols, const int32_t* ids,
              const int32_t* ids_host, int64_t n_ids, float* out, int64_t ld_out, Stream) {
    rows_limit("get_rows", n_ids);
    dev_ptr(table, row_bytes(type, n_cols) * n_rows, "get_rows table");
    dev_ptr(ids, span(n_ids, 1, 1), "get_rows ids");
    dev_ptr(out, span(n_ids, ld_out, n_cols), "get_rows out");
    if (ids_host && memcmp(ids_host, ids, (size_t)n_ids * 4) != 0) {
        fprintf(stderr, "get_rows: the host ids differ from the uploaded ones\n");
        abort();
    }
    launched(n_ids > 0 && n_cols > 0);
    exec([=] { cpu::get_rows(table, type, n_rows, n_cols, ids, n_ids, out, ld_out, pool()); });
}

void unrepack_rows16(void* data, QType type, int64_t n_mat, int64_t rows, int64_t cols, Stream) {
    const size_t gb = rows16_group_bytes(type, cols), mat = (size_t)rows * (gb / kRepackRows);
    if (gb == 0 || n_mat <= 0 || rows <= 0) throw InvalidInput("cuda unrepack_rows16: no 16-row layout");
    if (gb > kStagedRows16GroupMax) throw InvalidInput("cuda unrepack_rows16: a group over the shared memory");
    const int64_t groups = rows / kRepackRows;
    dev_ptr(data, (size_t)n_mat * mat, "unrepack_rows16 data");
    launched(groups > 0);
    g_unrepacked_bytes += (size_t)n_mat * mat;
    exec([=] {  // the kernel's work: each group through a copy, as through shared memory
        std::vector<uint8_t> grp(gb);
        for (int64_t m = 0; m < n_mat; m++)
            for (int64_t g = 0; g < groups; g++) {
                uint8_t* rows_at = (uint8_t*)data + m * mat + g * gb;
                memcpy(grp.data(), rows_at, gb);
                rows16_unpack_group(type, cols, grp.data(), rows_at);
            }
    });
}

void rms_norm(const float* x, int64_t n_rows, int64_t dim, int64_t ldx, const float* weight, float eps, float* y,
              int64_t ldy, Stream) {
    dev_ptr(x, span(n_rows, ldx, dim), "rms_norm x");
    if (weight) dev_ptr(weight, span(1, dim, dim), "rms_norm weight");
    dev_ptr(y, span(n_rows, ldy, dim), "rms_norm y");
    launched(n_rows > 0 && dim > 0);
    exec([=] { cpu::rms_norm(x, n_rows, dim, ldx, weight, eps, y, ldy, pool()); });
}

void rope(float* x, int64_t n_tok, int64_t n_head, int64_t head_dim, int64_t ld_tok, const int32_t* pos,
          const cpu::RopeParams& p, Stream) {
    dev_ptr(x, span(n_tok, ld_tok, n_head * head_dim), "rope x");
    dev_ptr(pos, span(n_tok, 1, 1), "rope pos");
    launched(n_tok > 0 && n_head > 0);
    exec([=] { cpu::rope(x, n_tok, n_head, head_dim, ld_tok, pos, p, pool()); });
}

void add_rms_norm(const float* a, const float* b, int64_t n_rows, int64_t dim, float* sum, const float* weight,
                  float eps, float* y, void* yq, Stream) {
    dev_ptr(a, span(n_rows, dim, dim), "add_rms_norm a");
    if (b) dev_ptr(b, span(n_rows, dim, dim), "add_rms_norm b");
    if (b) dev_ptr(sum, span(n_rows, dim, dim), "add_rms_norm sum");
    if (weight) dev_ptr(weight, span(1, dim, dim), "add_rms_norm weight");
    dev_ptr(y, span(n_rows, dim, dim), "add_rms_norm y");
    if (yq) dev_ptr(yq, q8_1_bytes(n_rows, dim), "add_rms_norm yq");
    if (b && y == sum) throw InvalidInput("add_rms_norm: y must not be sum's bytes");
    if (yq && dim % 32) throw InvalidInput("add_rms_norm: quantized rows need a multiple of 32 elements");
    launched(n_rows > 0 && dim > 0);
    exec([=] {
        if (b) cpu::add(a, dim, b, dim, n_rows, dim, sum, dim, pool());
        cpu::rms_norm(b ? sum : a, n_rows, dim, dim, weight, eps, y, dim, pool());
        if (yq) {
            const std::vector<block_q8_1> q = q8_1_rows(y, n_rows, dim, dim);
            memcpy(yq, q.data(), q.size() * sizeof(block_q8_1));
        }
    });
}

void rope_pair(float* q, int64_t n_head_q, int64_t ld_q, float* k, int64_t n_head_k, int64_t ld_k, int64_t n_tok,
               int64_t head_dim, const int32_t* pos, const cpu::RopeParams& p, Stream s) {
    // the two launches' checks and work, counted as one kernel
    const uint64_t before = t_launches;
    rope(q, n_tok, n_head_q, head_dim, ld_q, pos, p, s);
    rope(k, n_tok, n_head_k, head_dim, ld_k, pos, p, s);
    t_launches = before;
    launched(n_tok > 0 && (n_head_q > 0 || n_head_k > 0));
}

void softmax(const float*, int64_t, int64_t, int64_t, float, float*, int64_t, Stream) { unused("softmax"); }

// Bytes a strided F32 tensor spans from its first element.
static size_t strided_span(const int64_t ne[4], const size_t nb[4]) {
    if (ne[0] <= 0 || ne[1] <= 0 || ne[2] <= 0 || ne[3] <= 0) return 0;
    return (size_t)(ne[1] - 1) * nb[1] + (size_t)(ne[2] - 1) * nb[2] + (size_t)(ne[3] - 1) * nb[3] + (size_t)ne[0] * 4;
}
void cont(const float* x, const int64_t ne[4], const size_t nb[4], float* out, Stream) {
    dev_ptr(x, strided_span(ne, nb), "cont x");
    dev_ptr(out, (size_t)(ne[0] * ne[1] * ne[2] * ne[3]) * 4, "cont out");
    launched(ne[0] > 0 && ne[1] * ne[2] * ne[3] > 0);
    // ne and nb are the caller's arrays: a kernel's parameters are copies
    const std::array<int64_t, 4> e{ne[0], ne[1], ne[2], ne[3]};
    const std::array<size_t, 4> b{nb[0], nb[1], nb[2], nb[3]};
    exec([=] { cpu::cont(x, e.data(), b.data(), out, pool()); });
}
void concat(const float* a, const int64_t a_ne[4], const size_t a_nb[4], const float* b, int64_t b_ne0,
            const size_t b_nb[4], float* out, Stream) {
    const int64_t b_ne[4] = {b_ne0, a_ne[1], a_ne[2], a_ne[3]};
    dev_ptr(a, strided_span(a_ne, a_nb), "concat a");
    dev_ptr(b, strided_span(b_ne, b_nb), "concat b");
    dev_ptr(out, (size_t)((a_ne[0] + b_ne0) * a_ne[1] * a_ne[2] * a_ne[3]) * 4, "concat out");
    launched(a_ne[1] * a_ne[2] * a_ne[3] > 0 && a_ne[0] + b_ne0 > 0);
    const std::array<int64_t, 4> ae{a_ne[0], a_ne[1], a_ne[2], a_ne[3]};
    const std::array<size_t, 4> ab{a_nb[0], a_nb[1], a_nb[2], a_nb[3]}, bb{b_nb[0], b_nb[1], b_nb[2], b_nb[3]};
    exec([=] { cpu::concat(a, ae.data(), ab.data(), b, b_ne0, bb.data(), out, pool()); });
}
void swiglu_oai(const float* gate, const float* up, int64_t n, float alpha, float limit, float* out, Stream) {
    dev_ptr(gate, span(n, 1, 1), "swiglu_oai gate");
    dev_ptr(up, span(n, 1, 1), "swiglu_oai up");
    dev_ptr(out, span(n, 1, 1), "swiglu_oai out");
    launched(n > 0);
    exec([=] { cpu::swiglu_oai(gate, up, n, alpha, limit, out, pool()); });
}

using CpuBinary = void (*)(const float*, int64_t, const float*, int64_t, int64_t, int64_t, float*, int64_t,
                           ThreadPool&);
static void binary(const char* name, CpuBinary op, const float* a, int64_t ld_a, const float* b, int64_t ld_b,
                   int64_t n, int64_t dim, float* out, int64_t ld_out) {
    rows_limit(name, n);
    dev_ptr(a, span(n, ld_a, dim), name);
    dev_ptr(b, span(n, ld_b, dim), name);
    dev_ptr(out, span(n, ld_out, dim), name);
    launched(n > 0 && dim > 0);
    exec([=] { op(a, ld_a, b, ld_b, n, dim, out, ld_out, pool()); });
}
void swiglu(const float* g, int64_t ld_g, const float* u, int64_t ld_u, int64_t n, int64_t dim, float* out,
            int64_t ld_out, Stream) {
    binary("swiglu", cpu::swiglu, g, ld_g, u, ld_u, n, dim, out, ld_out);
}
void geglu(const float* g, int64_t ld_g, const float* u, int64_t ld_u, int64_t n, int64_t dim, float* out,
           int64_t ld_out, Stream) {
    binary("geglu", cpu::geglu, g, ld_g, u, ld_u, n, dim, out, ld_out);
}
void add(const float* a, int64_t ld_a, const float* b, int64_t ld_b, int64_t n, int64_t dim, float* out,
         int64_t ld_out, Stream) {
    binary("add", cpu::add, a, ld_a, b, ld_b, n, dim, out, ld_out);
}
void mul(const float* a, int64_t ld_a, const float* b, int64_t ld_b, int64_t n, int64_t dim, float* out,
         int64_t ld_out, Stream) {
    binary("mul", cpu::mul, a, ld_a, b, ld_b, n, dim, out, ld_out);
}

void scale(float* x, int64_t n, int64_t dim, int64_t ldx, float sc, Stream) {
    rows_limit("scale", n);
    dev_ptr(x, span(n, ldx, dim), "scale x");
    launched(n > 0 && dim > 0);
    exec([=] { cpu::scale(x, n, dim, ldx, sc, pool()); });
}
void softcap(float* x, int64_t n, int64_t dim, int64_t ldx, float cap, Stream) {
    rows_limit("softcap", n);
    dev_ptr(x, span(n, ldx, dim), "softcap x");
    launched(n > 0 && dim > 0);
    exec([=] { cpu::softcap(x, n, dim, ldx, cap, pool()); });
}

// Tensor parallelism: the kernels' HOST_DEVICE arithmetic (collective_math.h), element by element.
int g_all_reduce_calls = 0;
int g_local_ids_calls = 0;
void local_ids(const int32_t* ids, int64_t n, int32_t first, int32_t count, int32_t* out, Stream) {
    dev_ptr(ids, span(n, 1, 1), "local_ids ids");
    dev_ptr(out, span(n, 1, 1), "local_ids out");
    {
        std::lock_guard<std::mutex> lk(g_mu);
        g_local_ids_calls++;
    }
    launched(n > 0);
    exec([=] {
        for (int64_t i = 0; i < n; i++) out[i] = local_expert_id(ids[i], first, count);
    });
}
void all_reduce_sum(const float* const* parts, int n_parts, int64_t n, float* out, Stream) {
    not_capturing("a collective");
    if (n_parts < 0 || n_parts > kMaxShards) throw InvalidInput("all_reduce_sum: too many partials");
    for (int i = 0; i < n_parts; i++) dev_ptr(parts[i], span(n, 1, 1), "all_reduce_sum part");
    dev_ptr(out, span(n, 1, 1), "all_reduce_sum out");
    {
        std::lock_guard<std::mutex> lk(g_mu);
        g_all_reduce_calls++;
    }
    launched(n > 0);
    for (int64_t i = 0; i < n; i++) out[i] = shard_order_sum(parts, n_parts, i);
}
int g_all_gather_calls = 0;
void all_gather_rows(const float* const* parts, const int64_t* row0, int n_parts, int64_t d, int64_t cols, float* out,
                     Stream) {
    not_capturing("a collective");
    if (n_parts <= 0 || n_parts > kMaxShards || row0[0] != 0 || row0[n_parts] != d)
        throw InvalidInput("all_gather_rows: bad parts");
    for (int i = 0; i < n_parts; i++)
        if (row0[i + 1] > row0[i])
            dev_ptr(parts[i], span(cols, row0[i + 1] - row0[i], row0[i + 1] - row0[i]), "all_gather_rows part");
    dev_ptr(out, span(cols, d, d), "all_gather_rows out");
    {
        std::lock_guard<std::mutex> lk(g_mu);
        g_all_gather_calls++;
    }
    launched(d * cols > 0);
    for (int64_t i = 0; i < d * cols; i++) {
        int64_t at;
        const int s = gather_source(row0, n_parts, d, i, &at);
        out[i] = parts[s][at];
    }
}

void f32_to_f16(const float*, uint16_t*, int64_t, Stream) { unused("f32_to_f16"); }
void f16_to_f32(const uint16_t*, float*, int64_t, Stream) { unused("f16_to_f32"); }
void copy_rows(const void*, size_t, void*, size_t, int64_t, size_t, Stream) { unused("copy_rows"); }

void store_kv_pair(const KvRows& k, const KvRows& v, int64_t n_tok, QType kv_type, const int32_t* dst_cells,
                   Stream s) {
    const uint64_t before = t_launches;
    store_kv(k.x, n_tok, k.ld_x, k.n_head_kv, k.head_dim, kv_type, k.cache, k.cell_bytes, dst_cells, s);
    store_kv(v.x, n_tok, v.ld_x, v.n_head_kv, v.head_dim, kv_type, v.cache, v.cell_bytes, dst_cells, s);
    t_launches = before;
    launched(n_tok > 0);
}

void rope_store(float* q, int64_t n_head_q, int64_t ld_q, const KvRows& k, const KvRows& v, int64_t n_tok,
                const int32_t* pos, const cpu::RopeParams& p, QType kv_type, const int32_t* dst_cells, Stream s) {
    const uint64_t before = t_launches;
    rope_pair(q, n_head_q, ld_q, (float*)k.x, k.n_head_kv, k.ld_x, n_tok, k.head_dim, pos, p, s);
    store_kv_pair(k, v, n_tok, kv_type, dst_cells, s);
    t_launches = before;
    launched(n_tok > 0);
}

void store_kv(const float* x, int64_t n_tok, int64_t ld_x, int64_t n_head_kv, int64_t head_dim, QType kv_type,
              void* cache, size_t kv_cell_bytes, const int32_t* dst_cells, Stream) {
    rows_limit("store_kv", n_tok);
    dev_ptr(x, span(n_tok, ld_x, n_head_kv * head_dim), "store_kv x");
    dev_ptr(dst_cells, span(n_tok, 1, 1), "store_kv cells");
    launched(n_tok > 0 && n_head_kv * head_dim > 0);
    exec([=] {
        for (int64_t t = 0; t < n_tok; t++)  // the cells are device memory: read when the kernel runs
            dev_ptr((const char*)cache + (size_t)dst_cells[t] * kv_cell_bytes, kv_cell_bytes, "store_kv cell");
        cpu::store_kv(x, n_tok, ld_x, n_head_kv, head_dim, kv_type, cache, kv_cell_bytes, dst_cells, pool());
    });
}

}  // namespace stowlm::cuda
