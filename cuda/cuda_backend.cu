// CudaDevice (buffers, streams, events, copies) and the matmul dispatch between the vector
// kernel (mmvq.cu) and the tiled tensor-core kernel (mmq.cu).
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <memory>
#include <mutex>
#include <set>
#include <utility>

#include "cuda_backend.h"
#include "cuda_common.cuh"

namespace stowlm::cuda {

namespace {
constexpr size_t kStagingBytes = 4u << 20;  // per pinned staging buffer (two of them)

int current_cc_major() {
    int dev = 0, major = 0;
    check_cuda(cudaGetDevice(&dev), "cudaGetDevice");
    check_cuda(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev), "cudaDeviceGetAttribute");
    return major;
}
}  // namespace

thread_local uint64_t t_launches = 0;
bool pdl_enabled() {
    static const bool asked = env_is("STOWLM_CUDA_PDL", "1");
    if (!asked) return false;
    thread_local int dev = -1, ok = 0;  // the current device's answer, per thread
    int cur = 0;
    check_cuda(cudaGetDevice(&cur), "cudaGetDevice");
    if (cur != dev) dev = cur, ok = current_cc_major() >= 9;
    return ok;
}

uint64_t launches_on_this_thread() { return t_launches; }

namespace {
// What holds a timed stream: a host function on the stream waits here until the host lets go.
struct Hold {
    std::mutex mu;
    std::condition_variable cv;
    bool released = false, late = false;
};
void CUDART_CB hold_stream(void* p) {
    Hold* h = (Hold*)p;
    std::unique_lock<std::mutex> lk(h->mu);
    // The timeout keeps a host wait for this stream inside the span from hanging the process.
    const auto limit = std::chrono::duration<double>(CudaDevice::kHoldSeconds);
    if (!h->cv.wait_for(lk, limit, [h] { return h->released; })) h->late = true;
}
void let_go(Hold& h) {
    {
        std::lock_guard<std::mutex> lk(h.mu);
        h.released = true;
    }
    h.cv.notify_all();
}
}  // namespace

struct CudaDevice::Timing {
    struct Span {
        std::unique_ptr<Hold> hold;
        cudaEvent_t start = nullptr, end = nullptr;
    };
    std::vector<Span> spans;  // the last one open between begin_timed and end_timed
    bool open = false;
};

int device_count(std::string* why_none) {
    int n = 0;
    const cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
        cudaGetLastError();
        if (why_none) *why_none = std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e);
        return 0;
    }
    if (n == 0 && why_none) *why_none = "the CUDA runtime reports 0 devices";
    return n;
}

CudaDevice::CudaDevice(int index) : index_(index), name_("cuda:" + std::to_string(index)) {
    std::string why;
    const int n = device_count(&why);
    if (n == 0) throw Unsupported("no CUDA device is present (asked for " + name_ + "): " + why);
    if (index < 0 || index >= n)
        throw Unsupported("no CUDA device " + name_ + ": this machine has " + std::to_string(n) + " (cuda:0..cuda:" +
                          std::to_string(n - 1) + ")");
    set_current();
    cudaDeviceProp p;
    check_cuda(cudaGetDeviceProperties(&p, index), "cudaGetDeviceProperties");
    sm_count_ = p.multiProcessorCount;
    total_ = p.totalGlobalMem;
    cudaStream_t a, b, c;
    check_cuda(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking), "cudaStreamCreate");
    check_cuda(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking), "cudaStreamCreate");
    check_cuda(cudaStreamCreateWithFlags(&c, cudaStreamNonBlocking), "cudaStreamCreate");
    compute_ = a, copy_ = b, capture_ = c;
}

CudaDevice::~CudaDevice() {
    cudaSetDevice(index_);
    if (timing_ && timing_->open) let_go(*timing_->spans.back().hold);
    cudaStreamSynchronize((cudaStream_t)compute_);
    cudaStreamSynchronize((cudaStream_t)copy_);
    if (timing_)
        for (auto& sp : timing_->spans) {
            if (sp.start) cudaEventDestroy(sp.start);
            if (sp.end) cudaEventDestroy(sp.end);
        }
    for (int i = 0; i < 2; i++) {
        if (staging_done_[i]) cudaEventDestroy((cudaEvent_t)staging_done_[i]);
        if (staging_[i]) cudaFreeHost(staging_[i]);
    }
    for (auto& kv : live_) cudaFree(kv.first);
    for (auto& r : pinned_) cudaHostUnregister(r.first);
    cudaStreamDestroy((cudaStream_t)compute_);
    cudaStreamDestroy((cudaStream_t)copy_);
    cudaStreamDestroy((cudaStream_t)capture_);
}

void CudaDevice::set_current() const { check_cuda(cudaSetDevice(index_), "cudaSetDevice"); }

size_t CudaDevice::memory_used() const {
    std::lock_guard<std::mutex> lk(mu_);
    return used_;
}

void* CudaDevice::alloc(size_t bytes, const std::string& purpose) {
    if (bytes == 0) return nullptr;
    set_current();
    void* p = nullptr;
    const cudaError_t e = cudaMalloc(&p, bytes);
    if (e != cudaSuccess) {
        cudaGetLastError();  // not sticky: clear it so later calls start clean
        size_t free_b = 0, total_b = 0;
        cudaMemGetInfo(&free_b, &total_b);
        throw OutOfDeviceMemory(name_ + ": cannot allocate " + std::to_string(bytes) + " bytes for " + purpose + " (" +
                                cudaGetErrorName(e) + "; " + std::to_string(free_b) + " bytes free of " +
                                std::to_string(total_b) + ")");
    }
    std::lock_guard<std::mutex> lk(mu_);
    live_[p] = bytes;
    used_ += bytes;
    return p;
}

void CudaDevice::free(void* p) {
    if (p == nullptr) return;
    size_t bytes;
    {
        std::lock_guard<std::mutex> lk(mu_);
        auto it = live_.find(p);
        if (it == live_.end()) throw InvalidInput(name_ + ": free of a pointer this device did not allocate");
        bytes = it->second;
        live_.erase(it);
        used_ -= bytes;
    }
    set_current();
    check_cuda(cudaFree(p), "cudaFree");
}

Event CudaDevice::record(Stream s) {
    set_current();
    cudaEvent_t e;
    check_cuda(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate");
    check_cuda(cudaEventRecord(e, (cudaStream_t)s), "cudaEventRecord");
    return e;
}
void CudaDevice::wait(Stream s, Event e) {
    set_current();  // the pipeline calls this from the thread of another device
    check_cuda(cudaStreamWaitEvent((cudaStream_t)s, (cudaEvent_t)e, 0), "cudaStreamWaitEvent");
}
void CudaDevice::release(Event e) {
    if (e) check_cuda(cudaEventDestroy((cudaEvent_t)e), "cudaEventDestroy");
}
void CudaDevice::synchronize() {
    set_current();
    check_cuda(cudaStreamSynchronize((cudaStream_t)compute_), "synchronize compute stream");
    check_cuda(cudaStreamSynchronize((cudaStream_t)copy_), "synchronize copy stream");
}

void CudaDevice::begin_timed(Stream s) {
    if (!timing_) timing_ = std::make_unique<Timing>();
    if (timing_->open) throw InvalidInput(name_ + ": begin_timed while a timed span is open");
    set_current();
    Timing::Span sp;
    sp.hold = std::make_unique<Hold>();
    check_cuda(cudaEventCreate(&sp.start), "cudaEventCreate");
    check_cuda(cudaEventCreate(&sp.end), "cudaEventCreate");
    Hold* h = sp.hold.get();
    timing_->spans.push_back(std::move(sp));
    timing_->open = true;  // from here on end_timed lets the stream go, whatever fails below
    check_cuda(cudaLaunchHostFunc((cudaStream_t)s, hold_stream, h), "cudaLaunchHostFunc");
    check_cuda(cudaEventRecord(timing_->spans.back().start, (cudaStream_t)s), "cudaEventRecord");
}

void CudaDevice::end_timed(Stream s) {
    if (!timing_ || !timing_->open) throw InvalidInput(name_ + ": end_timed without begin_timed");
    timing_->open = false;
    Timing::Span& sp = timing_->spans.back();
    const cudaError_t e = cudaEventRecord(sp.end, (cudaStream_t)s);
    let_go(*sp.hold);  // whatever the record gave: the stream must not stay held
    check_cuda(e, "cudaEventRecord");
}

CudaDevice::TimedTotal CudaDevice::take_timed() {
    TimedTotal t;
    if (!timing_) return t;
    if (timing_->open) throw InvalidInput(name_ + ": take_timed while a timed span is open");
    synchronize();
    for (auto& sp : timing_->spans) {
        float ms = 0;
        check_cuda(cudaEventElapsedTime(&ms, sp.start, sp.end), "cudaEventElapsedTime");
        t.seconds += ms / 1e3;
        t.span_s.push_back(ms / 1e3);
        t.spans++;
        {
            std::lock_guard<std::mutex> lk(sp.hold->mu);
            t.late += sp.hold->late ? 1 : 0;
        }
        cudaEventDestroy(sp.start);
        cudaEventDestroy(sp.end);
    }
    timing_->spans.clear();
    return t;
}

void CudaDevice::begin_capture(Stream s) {
    set_current();
    // Relaxed: a launcher's attribute queries may go on while this thread captures.
    check_cuda(cudaStreamBeginCapture((cudaStream_t)s, cudaStreamCaptureModeRelaxed), "cudaStreamBeginCapture");
}

CudaDevice::GraphExec CudaDevice::end_capture(Stream s) {
    cudaGraph_t g = nullptr;
    cudaError_t e = cudaStreamEndCapture((cudaStream_t)s, &g);
    if (e != cudaSuccess || !g) {
        cudaGetLastError();  // an invalidated capture is not sticky: the caller runs the work itself
        if (g) cudaGraphDestroy(g);
        return nullptr;
    }
    cudaGraphExec_t x = nullptr;
    e = cudaGraphInstantiate(&x, g, 0);
    cudaGraphDestroy(g);
    if (e != cudaSuccess) {
        cudaGetLastError();
        return nullptr;
    }
    return x;
}

void CudaDevice::launch_graph(GraphExec g, Stream s) {
    check_cuda(cudaGraphLaunch((cudaGraphExec_t)g, (cudaStream_t)s), "cudaGraphLaunch");
}

void CudaDevice::destroy_graph(GraphExec g) {
    if (g) cudaGraphExecDestroy((cudaGraphExec_t)g);
}

void CudaDevice::copy_to_device(void* dst, const void* src, size_t bytes, Stream s) {
    if (bytes == 0) return;
    set_current();
    cudaPointerAttributes attr;
    if (cudaPointerGetAttributes(&attr, src) == cudaSuccess && attr.type == cudaMemoryTypeHost) {
        check_cuda(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, (cudaStream_t)s), "copy_to_device");
        return;
    }
    cudaGetLastError();
    // Pageable memory: stage through two pinned buffers; a buffer is refilled only after the
    // copy that read it has finished (its event), so host memcpy overlaps the DMA.
    std::lock_guard<std::mutex> lk(mu_);
    for (int i = 0; i < 2; i++) {
        if (!staging_[i]) {
            check_cuda(cudaHostAlloc(&staging_[i], kStagingBytes, cudaHostAllocDefault), "cudaHostAlloc staging");
            cudaEvent_t e;
            check_cuda(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate");
            staging_done_[i] = e;
        }
    }
    size_t off = 0;
    for (int i = 0; off < bytes; i ^= 1) {
        const size_t n = std::min(kStagingBytes, bytes - off);
        check_cuda(cudaEventSynchronize((cudaEvent_t)staging_done_[i]), "staging wait");
        memcpy(staging_[i], (const uint8_t*)src + off, n);
        check_cuda(cudaMemcpyAsync((uint8_t*)dst + off, staging_[i], n, cudaMemcpyHostToDevice, (cudaStream_t)s),
                   "copy_to_device");
        check_cuda(cudaEventRecord((cudaEvent_t)staging_done_[i], (cudaStream_t)s), "cudaEventRecord");
        off += n;
    }
}

bool CudaDevice::pin_host(const void* p, size_t bytes) {
    if (!bytes) return true;
    set_current();
    void* q = const_cast<void*>(p);  // read-only: the registration never writes through it
    const cudaError_t e = cudaHostRegister(q, bytes, cudaHostRegisterPortable | cudaHostRegisterReadOnly);
    if (e == cudaSuccess) {
        std::lock_guard<std::mutex> lk(mu_);
        pinned_.emplace_back(q, bytes);
        return true;
    }
    cudaGetLastError();  // a refusal is not sticky: clear it for the next call
    return e == cudaErrorHostMemoryAlreadyRegistered;
}

size_t CudaDevice::pinned_bytes() const {
    std::lock_guard<std::mutex> lk(mu_);
    size_t n = 0;
    for (auto& r : pinned_) n += r.second;
    return n;
}

void CudaDevice::copy_to_host(void* dst, const void* src, size_t bytes, Stream s) {
    if (bytes == 0) return;
    set_current();
    check_cuda(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, (cudaStream_t)s), "copy_to_host");
    check_cuda(cudaStreamSynchronize((cudaStream_t)s), "copy_to_host");
}

void CudaDevice::copy_device(void* dst, const void* src, size_t bytes, Stream s) {
    if (bytes == 0) return;
    set_current();
    check_cuda(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, (cudaStream_t)s), "copy_device");
}

namespace {
// Peer access from device `to` to device `from`, enabled once per pair where the hardware allows
// it: cudaMemcpyPeerAsync then moves the bytes directly (NVLink or PCIe) instead of staging them
// through host memory. Never fails: where access is impossible the copy is staged as before.
void enable_peer_access(int to, int from) {
    static std::mutex mu;
    static std::set<std::pair<int, int>> tried;
    std::lock_guard<std::mutex> lk(mu);
    if (to == from || !tried.insert({to, from}).second) return;
    int can = 0;
    if (cudaDeviceCanAccessPeer(&can, to, from) != cudaSuccess || !can) {
        cudaGetLastError();
        return;
    }
    const cudaError_t e = cudaDeviceEnablePeerAccess(from, 0);  // from the current device, `to`
    if (e != cudaSuccess) cudaGetLastError();                    // already enabled, or not possible
}
}  // namespace

void CudaDevice::copy_from_peer(void* dst, const CudaDevice& from, const void* src, size_t bytes, Stream s) {
    if (bytes == 0) return;
    set_current();
    enable_peer_access(index_, from.index_);
    check_cuda(cudaMemcpyPeerAsync(dst, index_, src, from.index_, bytes, (cudaStream_t)s), "copy_from_peer");
}

// ---- matmul dispatch ---------------------------------------------------------------------

size_t matmul_scratch_bytes(QType wtype, int64_t cols, int64_t n_tok) {
    return is_float_type(wtype) ? 0 : q8_1_bytes(n_tok, cols);
}

void matmul(const DeviceWeight& w, const float* x, int64_t n_tok, int64_t ldx, float* y, int64_t ldy, void* scratch,
            Stream s, MatmulPath path, bool x_quantized) {
    const QTypeInfo& info = qtype_checked((uint32_t)w.type);
    if (w.rows < 0 || n_tok < 0) throw InvalidInput("cuda matmul: negative rows or n_tok");
    if (w.cols <= 0 || w.cols % info.block_elems || (!is_float_type(w.type) && w.cols % 32))
        throw InvalidInput("cuda matmul: cols=" + std::to_string(w.cols) + " is not a positive multiple of the " +
                           info.name + " block size " + std::to_string(info.block_elems));
    if (ldx < w.cols || ldy < w.rows) throw InvalidInput("cuda matmul: ldx < cols or ldy < rows");
    if (n_tok == 0 || w.rows == 0) return;
    const size_t rb = row_bytes(w.type, w.cols);
    const cudaStream_t st = (cudaStream_t)s;
    if (is_float_type(w.type)) {  // the tiled product for many rows (its own class, as the quantized ones')
        if (path == MatmulPath::Tiled || (path == MatmulPath::Auto && n_tok >= kCudaBatchedMinTokens))
            launch_mmf(w.type, (const uint8_t*)w.data, rb, w.rows, w.cols, x, ldx, n_tok, y, ldy, st);
        else
            launch_mmv_float(w.type, (const uint8_t*)w.data, rb, w.rows, w.cols, x, ldx, n_tok, TokenGroups{}, y, ldy,
                             st);
        return;
    }
    if (scratch == nullptr) throw InvalidInput("cuda matmul: quantized weights need matmul_scratch_bytes() of scratch");
    if (!x_quantized) quantize_q8_1(x, n_tok, w.cols, ldx, scratch, s);
    const block_q8_1* xq = (const block_q8_1*)scratch;
    bool tiled = path == MatmulPath::Tiled || (path == MatmulPath::Auto && n_tok >= kCudaBatchedMinTokens);
    if (tiled && current_cc_major() < 8) {
        if (path == MatmulPath::Tiled) throw Unsupported("cuda matmul: the tiled kernel needs compute capability 8.0+");
        tiled = false;
    }
    if (tiled)
        launch_mmq(w.type, (const uint8_t*)w.data, rb, w.rows, w.cols, xq, w.cols / 32, n_tok, y, ldy, st);
    else
        launch_mmvq(w.type, (const uint8_t*)w.data, rb, w.rows, w.cols, xq, w.cols / 32, n_tok, TokenGroups{}, y, ldy, st);
}

void matmul_multi(const DeviceWeight* ws, int n, const float* x, int64_t n_tok, int64_t ldx, float* const* ys,
                  const int64_t* ldys, void* scratch, Stream s, bool x_quantized) {
    if (n < 1 || n > kMmvMulti) throw InvalidInput("cuda matmul_multi: 1 to " + std::to_string(kMmvMulti) + " weights");
    const DeviceWeight& w0 = ws[0];
    for (int i = 0; i < n; i++) {
        if (is_float_type(ws[i].type) || ws[i].type != w0.type || ws[i].cols != w0.cols || ws[i].rows < 0)
            throw InvalidInput("cuda matmul_multi: the weights must be quantized, of one type and width");
        if (ldys[i] < ws[i].rows) throw InvalidInput("cuda matmul_multi: ldy < rows");
    }
    if (w0.cols <= 0 || w0.cols % 32 || w0.cols % qtype_checked((uint32_t)w0.type).block_elems)
        throw InvalidInput("cuda matmul_multi: cols=" + std::to_string(w0.cols) + " is not a multiple of the block");
    if (n_tok < 0 || n_tok >= kCudaBatchedMinTokens)
        throw InvalidInput("cuda matmul_multi: " + std::to_string(n_tok) + " tokens (the vector kernel takes fewer than " +
                           std::to_string(kCudaBatchedMinTokens) + ")");
    if (ldx < w0.cols) throw InvalidInput("cuda matmul_multi: ldx < cols");
    if (n_tok == 0) return;
    if (scratch == nullptr) throw InvalidInput("cuda matmul_multi: needs matmul_scratch_bytes() of scratch");
    if (!x_quantized) quantize_q8_1(x, n_tok, w0.cols, ldx, scratch, s);
    MmvqMulti m;
    for (int i = 0; i < n; i++)
        m.w[i] = (const uint8_t*)ws[i].data, m.y[i] = ys[i], m.rows[i] = ws[i].rows, m.ldy[i] = ldys[i];
    launch_mmvq_multi(w0.type, m, row_bytes(w0.type, w0.cols), w0.cols, (const block_q8_1*)scratch, w0.cols / 32, n_tok,
                      (cudaStream_t)s);
}

void matmul_glu(const DeviceWeight& gate, const DeviceWeight& up, const float* x, int64_t n_tok, int64_t ldx,
                float* g, float* u, float* act, int64_t ldy, bool gelu, void* scratch, Stream s, bool x_quantized) {
    if (is_float_type(gate.type) || gate.type != up.type || gate.rows != up.rows || gate.cols != up.cols)
        throw InvalidInput("cuda matmul_glu: gate and up must be quantized weights of one type and shape");
    if (gate.cols <= 0 || gate.cols % 32 || gate.cols % qtype_checked((uint32_t)gate.type).block_elems)
        throw InvalidInput("cuda matmul_glu: cols=" + std::to_string(gate.cols) + " is not a multiple of the block");
    if (n_tok < 0 || n_tok >= kCudaBatchedMinTokens)
        throw InvalidInput("cuda matmul_glu: " + std::to_string(n_tok) + " tokens (the vector kernel takes fewer than " +
                           std::to_string(kCudaBatchedMinTokens) + ")");
    if (ldx < gate.cols || ldy < gate.rows) throw InvalidInput("cuda matmul_glu: ldx < cols or ldy < rows");
    if (n_tok == 0 || gate.rows == 0) return;
    if (scratch == nullptr) throw InvalidInput("cuda matmul_glu: needs matmul_scratch_bytes() of scratch");
    if (!x_quantized) quantize_q8_1(x, n_tok, gate.cols, ldx, scratch, s);
    launch_mmvq_glu(gate.type, gelu, (const uint8_t*)gate.data, (const uint8_t*)up.data, row_bytes(gate.type, gate.cols),
                    gate.rows, gate.cols, (const block_q8_1*)scratch, gate.cols / 32, n_tok, TokenGroups{}, g, u, act,
                    ldy, (cudaStream_t)s);
}

}  // namespace stowlm::cuda
