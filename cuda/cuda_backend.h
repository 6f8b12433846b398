// The CUDA backend's host side: a device object (buffers with exact accounting, streams,
// events, async and peer copies through pinned staging memory) and one launcher per kernel
// family. Plain C++ (no CUDA headers), so host code and the bindings include it directly.
//
// Launchers take device pointers and mirror the CPU API (cpu/matmul.h, cpu/ops.h): same
// arguments, same layouts, same semantics. They enqueue work on `stream` (nullptr: the
// legacy default stream) and return without waiting. Argument errors throw InvalidInput
// before anything is enqueued; a CUDA failure throws Unsupported naming the kernel.
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "collective_math.h"
#include "cpu/moe.h"
#include "cpu/ops.h"
#include "moe_router.h"
#include "moe_select.h"
#include "quant/types.h"

namespace stowlm::cuda {

using Stream = void*;  // a cudaStream_t
using Event = void*;   // a cudaEvent_t

// ---- device -------------------------------------------------------------------------

class CudaDevice {
public:
    // Throws Unsupported ("no CUDA device ...: <reason>") when device `index` does not exist.
    explicit CudaDevice(int index);
    ~CudaDevice();
    CudaDevice(const CudaDevice&) = delete;
    CudaDevice& operator=(const CudaDevice&) = delete;

    int index() const { return index_; }
    const std::string& name() const { return name_; }  // "cuda:0"
    int sm_count() const { return sm_count_; }
    size_t memory_total() const { return total_; }
    // Bytes this object holds from cudaMalloc: exactly the sum of the live alloc() sizes.
    size_t memory_used() const;

    // cudaMalloc of exactly `bytes`; throws OutOfDeviceMemory naming the device, the purpose,
    // the bytes asked and the bytes free. alloc(0) returns nullptr and counts nothing.
    void* alloc(size_t bytes, const std::string& purpose);
    void free(void* p);  // p from alloc(); nullptr is a no-op; anything else throws InvalidInput

    // Makes this the calling thread's current device: launchers enqueue on the current one.
    void set_current() const;

    Stream compute_stream() const { return compute_; }
    Stream copy_stream() const { return copy_; }
    Stream capture_stream() const { return capture_; }  // only ever captured on, never run
    Event record(Stream s);                // a new event recorded on s (destroy with release)
    void wait(Stream s, Event e);          // s waits for e without blocking the host
    void release(Event e);
    void synchronize();                    // both streams

    // Host -> device: pageable host memory goes through pinned staging buffers (double
    // buffered) so the copy is asynchronous with respect to the device; returns when the
    // host bytes may be reused.
    void copy_to_device(void* dst, const void* src, size_t bytes, Stream s);
    void copy_to_host(void* dst, const void* src, size_t bytes, Stream s);  // synchronous for the host
    void copy_device(void* dst, const void* src, size_t bytes, Stream s);
    // dst on this device, src on device `from` (cudaMemcpyPeerAsync; staged by the driver
    // when peer access is not possible).
    void copy_from_peer(void* dst, const CudaDevice& from, const void* src, size_t bytes, Stream s);
    // Page-locks host memory [p, p + bytes) (page-aligned; read-only, portable to every device) so
    // that copies from it go by DMA straight from it instead of through the staging buffers and a
    // host memcpy. False where the driver refuses (the copies stay staged); a range pinned by
    // another device object already counts as pinned. This object unpins what it pinned when it dies.
    bool pin_host(const void* p, size_t bytes);
    size_t pinned_bytes() const;  // pinned by this object

    // Kernel timing (stowlm-bench -v). begin_timed holds stream s on the device (a host function
    // waits until end_timed, or kHoldSeconds if the host itself waits for the device meanwhile)
    // and records a start event; end_timed records the end and lets s go. The work enqueued
    // between them then runs back to back, so the events time the device's work without the gaps
    // between the host's launches. take_timed waits for the device and returns the total since
    // the last call.
    struct TimedTotal {
        double seconds = 0;
        uint64_t spans = 0, late = 0;  // late: spans let go by the timeout (their time includes host gaps)
        std::vector<double> span_s;    // each span's seconds, in the order they began
    };
    static constexpr double kHoldSeconds = 2.0;
    void begin_timed(Stream s);
    void end_timed(Stream s);
    TimedTotal take_timed();

    // CUDA graphs: between begin_capture and end_capture the calling thread's work on stream s
    // is recorded, not run (the kernels' arguments are fixed then; what they read from device
    // memory is read at each replay). end_capture returns the instantiated graph, or nullptr
    // when the capture failed (nothing of it ran: the caller runs the work itself);
    // launch_graph enqueues a replay on s.
    using GraphExec = void*;
    void begin_capture(Stream s);
    GraphExec end_capture(Stream s);
    void launch_graph(GraphExec g, Stream s);
    void destroy_graph(GraphExec g);

private:
    int index_;
    std::string name_;
    int sm_count_ = 0;
    size_t total_ = 0;
    Stream compute_ = nullptr, copy_ = nullptr, capture_ = nullptr;
    void* staging_[2] = {nullptr, nullptr};  // pinned host buffers
    Event staging_done_[2] = {nullptr, nullptr};
    std::vector<std::pair<void*, size_t>> pinned_;  // host ranges this object registered
    mutable std::mutex mu_;
    std::map<void*, size_t> live_;
    size_t used_ = 0;
    struct Timing;  // the timed spans not yet taken (defined beside the device's implementation)
    std::unique_ptr<Timing> timing_;
};

// Devices present ("" when some), else why none: the text CudaDevice's error carries.
int device_count(std::string* why_none);

// Kernels the calling thread has launched so far: every launcher adds one per kernel (a
// thread-local increment), and the backend takes the difference around each split it runs.
uint64_t launches_on_this_thread();

// ---- matrix products (quantize.cu, mmvq.cu, mmq.cu) -----------------------------------

// Weights the float kernels take as they are; every other type goes through q8_1 activations.
inline bool is_float_type(QType t) { return t == QType::F32 || t == QType::F16 || t == QType::BF16; }

struct DeviceWeight {
    const void* data = nullptr;  // rows * row_bytes(type, cols) device bytes
    QType type = QType::F32;
    int64_t rows = 0, cols = 0;
};

// Activation rows quantized to block_q8_1 (quant/dot_q8_1.h): bytes for n rows of `cols`.
size_t q8_1_bytes(int64_t n_rows, int64_t cols);
void quantize_q8_1(const float* x, int64_t n_rows, int64_t cols, int64_t ldx, void* xq, Stream s);

// Scratch matmul() needs (the quantized activations).
size_t matmul_scratch_bytes(QType wtype, int64_t cols, int64_t n_tok);
enum class MatmulPath { Auto, Vector, Tiled };
// y[t * ldy + r] = sum_c W[r, c] * x[t * ldx + c]. Auto: the vector kernel (mmvq) for up to
// 8 tokens, the tiled tensor-core kernel (mmq) above; float weight types the float vector kernel
// for up to 8 tokens and the tiled float kernel (mmf) above. Quantized weights: x is quantized
// into scratch first, unless x_quantized says scratch holds x's block_q8_1 rows already (a
// product of the same x just before left them: the q, k and v products of one input quantize it once).
void matmul(const DeviceWeight& w, const float* x, int64_t n_tok, int64_t ldx, float* y, int64_t ldy, void* scratch,
            Stream s, MatmulPath path = MatmulPath::Auto, bool x_quantized = false);

// The gate and up products of the same x joined by their GLU (gelu false: silu(g) * u, the SWIGLU
// op; true: gelu_tanh(g) * u, GEGLU) for 1 to kCudaBatchedMinTokens - 1 tokens, in one kernel after
// x's quantization (skipped with x_quantized, as matmul's): g, u and act ([n_tok][ldy] each) get
// the bits of the two products and the GLU launched apart. Quantized weights of one type and
// shape only.
void matmul_glu(const DeviceWeight& gate, const DeviceWeight& up, const float* x, int64_t n_tok, int64_t ldx,
                float* g, float* u, float* act, int64_t ldy, bool gelu, void* scratch, Stream s,
                bool x_quantized = false);
constexpr int kMmvMulti = 3;
// n (1..kMmvMulti) products of the same x by quantized weights of one type and width (a layer's q, k and
// v), n_tok < kCudaBatchedMinTokens: one quantization of x (none with x_quantized) and one kernel;
// ys[i] ([n_tok][ldys[i]]) gets the bits matmul gives it.
void matmul_multi(const DeviceWeight* ws, int n, const float* x, int64_t n_tok, int64_t ldx, float* const* ys,
                  const int64_t* ldys, void* scratch, Stream s, bool x_quantized = false);

// ---- mixture of experts (moe.cu) -------------------------------------------------------

// Router for n_tok rows of n_expert logits: ids [n_tok][k] int32, weights [n_tok][k] f32.
void router_topk(const float* logits, int64_t n_tok, int n_expert, const RouterParams& p, int32_t* ids,
                 float* weights, Stream s);

// The graph's TOP_K and MOE_WEIGHTS ops (cpu/moe.h semantics; TopKParams::bias a device
// pointer) through the HOST_DEVICE expert_select / moe_gate_weights_any of moe_select.h, one
// thread per row (plain selection) or one warp (scores in shared memory). Expert groups: at most
// kMaxExpertGroups (moe_select.h); gated, biased or grouped scores: at most kTopKMaxScored experts.
constexpr int64_t kTopKMaxScored = 8192;
void top_k(const float* x, int64_t n_rows, int64_t n, int64_t ldx, const cpu::TopKParams& p, int32_t* ids, Stream s);
void moe_weights(const float* logits, int64_t n_tok, int64_t n_expert, const int32_t* ids, int64_t k,
                 cpu::Gating gating, bool normalize, float scale, float* w, Stream s);
// The selection the TOP_K kernels run (moe_select.h) for rows of n experts.
inline ExpertSelect expert_select_of(int64_t n, const cpu::TopKParams& p) {
    ExpertSelect e;
    e.n = (int)n, e.k = (int)p.k, e.gating = (int)p.gating, e.bias = p.bias;
    e.n_groups = p.n_groups > 1 ? (int)p.n_groups : 0, e.n_group_used = p.n_groups > 1 ? (int)p.n_group_used : 0;
    return e;
}
// Whether top_k takes its plain path for rows of n (one thread per row, no scores kept).
inline bool top_k_is_plain(int64_t n, const cpu::TopKParams& p) { return expert_select_plain(expert_select_of(n, p)); }
// top_k (plain selection only) and then moe_weights of the picked over `logits` ([n_rows][n], the
// router's logits) in one kernel, one thread per row: the ids and weights of the two launches.
void top_k_weights(const float* x, int64_t n_rows, int64_t n, int64_t ldx, const cpu::TopKParams& p, int32_t* ids,
                   const float* logits, cpu::Gating gating, bool normalize, float scale, float* w, Stream s);
// As cpu::add_id (in place): x[(t*k + j) * d + c] += bias[ids[t*k + j] * d + c]; the ids are on
// the device, so an id outside [0, n_expert) cannot be reported: that slot is left as it is.
void add_id(float* x, const float* bias, int64_t n_expert, const int32_t* ids, int64_t n_tok, int64_t k, int64_t d,
            Stream s);

size_t moe_scratch_bytes(const DeviceWeight& expert0, int n_expert, int64_t n_act_rows, int64_t n_slots);
// Expert products for n_tok tokens routed to k experts each (ids [n_tok][k], each id in
// [0, n_expert) or -1): y[(t*k + j) * ldy + r] = W_{ids[t,j]}[r, :] . x_row, where x_row is token
// t's row (per_slot_input false: gate/up) or slot t*k + j's row (true: down); a slot of id -1
// (tensor parallelism: its expert is on another shard) gets a zero row, as on the CPU. Experts
// are stacked: expert e at w.data + e * rows * row_bytes. One grouped launch for all experts.
void moe_matmul(const DeviceWeight& w, int n_expert, const float* x, int64_t ldx, bool per_slot_input,
                const int32_t* ids, int64_t n_tok, int k, float* y, int64_t ldy, void* scratch, Stream s);
// One token's gate and up expert products (the k slots of ids, ids outside [0, n_expert): zero
// rows) joined by their GLU (gelu false: SWIGLU), in one kernel after x's quantization: g, u and
// act ([k][ldy] each) get the bits of the two moe_matmul launches and the GLU kernel. Scratch:
// moe_scratch_bytes(gate, n_expert, 1, k).
void moe_matmul_glu(const DeviceWeight& gate, const DeviceWeight& up, int n_expert, const float* x, const int32_t* ids,
                    int k, float* g, float* u, float* act, int64_t ldy, bool gelu, void* scratch, Stream s);
// out[t, :] = sum_j weights[t, j] * y[(t*k + j), :]
void moe_combine(const float* y, int64_t ldy, const float* weights, int64_t n_tok, int k, int64_t dim, float* out,
                 int64_t ld_out, Stream s);

// ---- tensor parallelism (collective.cu) -------------------------------------------------

// As the CPU's LOCAL_IDS (collective_math.h local_expert_id): out[i] = ids[i] - first when it
// falls in [first, first + count), else -1.
void local_ids(const int32_t* ids, int64_t n, int32_t first, int32_t count, int32_t* out, Stream s);
// The all-reduce's sum on this device: out[i] = the n_parts partials (device pointers on the
// current device, at most kMaxShards) summed in shard order (collective_math.h
// shard_order_sum), the bits a CPU shard gets. out may be one of the parts.
void all_reduce_sum(const float* const* parts, int n_parts, int64_t n, float* out, Stream s);
// The all-gather's output [d, cols] on this device: part s (a device pointer, [row0[s + 1] -
// row0[s], cols]) gives rows [row0[s], row0[s + 1]) of every column (collective_math.h
// gather_source); row0 has n_parts + 1 entries, from 0 to d. Parts of no rows may be null.
void all_gather_rows(const float* const* parts, const int64_t* row0, int n_parts, int64_t d, int64_t cols, float* out,
                     Stream s);

#ifdef STOWLM_HAVE_NCCL
// NCCL moves the partials between the CUDA shards of an all-reduce (the gather only: NCCL's own
// reductions choose their order by algorithm and topology, which would not give the fixed
// shard-order bits, so all_reduce_sum does the arithmetic). One communicator per ordered list of
// distinct CUDA devices, made for all its ranks on first use; `rank` is this device's position.
void* nccl_comm(const std::vector<int>& devices, int rank);
// In one NCCL group on this rank's stream: `send` (bytes, null: nothing) to each rank of
// send_to, and from each rank of recv_from its part (recv_bytes[i]) into recv[i]. Every rank calls
// it for the same collective, in the same order.
void nccl_exchange(void* comm, const void* send, size_t bytes, const std::vector<int>& send_to,
                   const std::vector<int>& recv_from, const std::vector<void*>& recv,
                   const std::vector<size_t>& recv_bytes, Stream s);
#endif

// ---- attention (flash_attn.cu) ----------------------------------------------------------

// Largest K and V head widths the attention kernel takes (multi-head latent attention's
// absorbed 512 + 64 keys and 512 values included).
constexpr int kFlashAttnMaxHeadDimK = 576;
constexpr int kFlashAttnMaxHeadDimV = 512;
// Scratch for the split-KV partials (0 when n_split is 1): per query row and head, n_split
// partials of (m, l, acc[hd_v]).
inline size_t flash_attn_scratch_bytes(int64_t n_tok, int64_t n_head, int64_t hd_v, int64_t n_split) {
    return n_split > 1 ? (size_t)(n_tok * n_head) * (size_t)n_split * (size_t)(hd_v + 2) * sizeof(float) : 0;
}
// Fixed splits (AttnParams::split_cells > 0, contexts of several sequences): the splits of n_kv
// cells, every one starting at a multiple of split_cells.
inline int64_t flash_attn_fixed_splits(int64_t n_kv, int32_t split_cells) {
    return std::max<int64_t>(1, (n_kv + split_cells - 1) / split_cells);
}
// How many KV splits the launcher runs in blocks of their own for this shape on a device with
// sm_count SMs. Free splits (split_cells 0): enough blocks to fill the device twice, but no split
// under 256 cells. Fixed splits: all of them when the (token, head) blocks alone leave the device
// idle, else 1 (each block folds the fixed splits in order itself: the same bits). (Host
// arithmetic, inline so the engine's emulated-device test plans exactly as the GPU build does.)
inline int flash_attn_auto_splits(int64_t n_tok, int64_t n_head, int64_t n_kv, int sm_count, int32_t split_cells = 0) {
    const int64_t blocks = n_tok * n_head;
    if (split_cells > 0) {
        const int64_t nf = flash_attn_fixed_splits(n_kv, split_cells);
        return blocks > 0 && blocks < 2 * (int64_t)sm_count && nf <= 65535 ? (int)nf : 1;
    }
    if (blocks <= 0 || n_kv < 512 || blocks >= 2 * (int64_t)sm_count) return 1;
    int64_t n = (2 * (int64_t)sm_count + blocks - 1) / blocks;
    n = std::min<int64_t>(n, n_kv / 256);
    return (int)std::max<int64_t>(1, std::min<int64_t>(n, 64));
}
// As cpu::flash_attn (F16 or Q8_0 cells; K and V of their own widths and strides; sinks, q_seq,
// kv_seq device pointers). Free splits (p.split_cells 0): n_split > 1 cuts the cells into n_split
// equal ranges, one block each writing a partial (m, l, acc) that a second kernel merges in
// order. Fixed splits (p.split_cells > 0): the cells are cut at multiples of split_cells whatever
// the batch; n_split > 1 (it must then be flash_attn_fixed_splits) runs each in a block of its
// own, n_split 1 folds them in order in one block per (token, head): the same bits either way, so
// a query's result depends on its own cells only. With p.seq_cells > 0 a query reads only its
// sequence's region. Scratch: flash_attn_scratch_bytes(n_tok, n_head, hd_v, n_split).
// With yq, out's block_q8_1 rows too (as quantize_q8_1 would write them, for the product that
// reads out): ld_out must be n_head * hd_v and hd_v a multiple of 32.
void flash_attn(const float* q, int64_t n_tok, int64_t n_head, int64_t ld_q, const cpu::KvView& kv,
                const int32_t* q_pos, const int32_t* kv_pos, const cpu::AttnParams& p, float* out, int64_t ld_out,
                int n_split, void* scratch, Stream s, void* yq = nullptr);

// ---- elementwise (elementwise.cu) --------------------------------------------------------

// ids on the device; ids_host (optional, same values) lets the launcher reject bad ids.
void get_rows(const void* table, QType type, int64_t n_rows, int64_t n_cols, const int32_t* ids,
              const int32_t* ids_host, int64_t n_ids, float* out, int64_t ld_out, Stream s);
void rms_norm(const float* x, int64_t n_rows, int64_t dim, int64_t ldx, const float* weight, float eps, float* y,
              int64_t ldy, Stream s);
// sum = a + b and y = rms_norm(sum) * weight (weight may be null) over n_rows contiguous rows of
// dim: a residual add and the norm that reads it in one kernel, the bits of add then rms_norm
// (b null: no add, y = rms_norm(a) * weight). yq (optional): y's block_q8_1 rows as well, the
// bits of quantize_q8_1 (q8_1_bytes(n_rows, dim)), for the products that read y (dim a multiple
// of 32). y may be a's or b's bytes, not sum's.
void add_rms_norm(const float* a, const float* b, int64_t n_rows, int64_t dim, float* sum, const float* weight,
                  float eps, float* y, void* yq, Stream s);
// Plain RoPE or YaRN (p.ext_factor / p.attn_factor, attn_math.h rope_yarn_angle).
void rope(float* x, int64_t n_tok, int64_t n_head, int64_t head_dim, int64_t ld_tok, const int32_t* pos,
          const cpu::RopeParams& p, Stream s);
// As cpu::cont: a strided F32 tensor (rows contiguous, byte strides nb) into a contiguous one.
void cont(const float* x, const int64_t ne[4], const size_t nb[4], float* out, Stream s);
// As cpu::concat: each out row is a's row then b's row.
void concat(const float* a, const int64_t a_ne[4], const size_t a_nb[4], const float* b, int64_t b_ne0,
            const size_t b_nb[4], float* out, Stream s);
// As cpu::swiglu_oai over n contiguous elements (attn_math.h swiglu_oai).
void swiglu_oai(const float* gate, const float* up, int64_t n, float alpha, float limit, float* out, Stream s);
// y[r, :] = softmax(x[r, :] * scale)
void softmax(const float* x, int64_t n, int64_t dim, int64_t ldx, float scale, float* y, int64_t ldy, Stream s);
void swiglu(const float* gate, int64_t ld_gate, const float* up, int64_t ld_up, int64_t n, int64_t dim, float* out,
            int64_t ld_out, Stream s);
void geglu(const float* gate, int64_t ld_gate, const float* up, int64_t ld_up, int64_t n, int64_t dim, float* out,
           int64_t ld_out, Stream s);
void add(const float* a, int64_t ld_a, const float* b, int64_t ld_b, int64_t n, int64_t dim, float* out,
         int64_t ld_out, Stream s);
void mul(const float* a, int64_t ld_a, const float* b, int64_t ld_b, int64_t n, int64_t dim, float* out,
         int64_t ld_out, Stream s);
void scale(float* x, int64_t n, int64_t dim, int64_t ldx, float sc, Stream s);
void softcap(float* x, int64_t n, int64_t dim, int64_t ldx, float cap, Stream s);
void f32_to_f16(const float* x, uint16_t* y, int64_t n, Stream s);
void f16_to_f32(const uint16_t* x, float* y, int64_t n, Stream s);
// n_mat matrices (rows x cols each, back to back) that the CPU repacked into 16-row groups
// (cpu/repack.h) back in GGUF's layout, in place: a staged copy of experts the CPU keeps repacked.
// Each group must fit kStagedRows16GroupMax bytes; rows after the last whole group are left as they are.
void unrepack_rows16(void* data, QType type, int64_t n_mat, int64_t rows, int64_t cols, Stream s);
// Strided 2-D copy of n rows of `bytes` each.
void copy_rows(const void* src, size_t ld_src_bytes, void* dst, size_t ld_dst_bytes, int64_t n, size_t bytes,
               Stream s);
// rope() of a layer's q and k (the same tokens, head width, positions and parameters) in one launch.
void rope_pair(float* q, int64_t n_head_q, int64_t ld_q, float* k, int64_t n_head_k, int64_t ld_k, int64_t n_tok,
               int64_t head_dim, const int32_t* pos, const cpu::RopeParams& p, Stream s);
// Rows of a KV cache's tensor to store: n_tok rows of n_head_kv * head_dim floats, ld_x apart,
// into cells of cell_bytes.
struct KvRows {
    const float* x;
    int64_t ld_x, n_head_kv, head_dim;
    void* cache;
    size_t cell_bytes;
};
// store_kv() of a layer's K and V rows at the same cells, one launch.
void store_kv_pair(const KvRows& k, const KvRows& v, int64_t n_tok, QType kv_type, const int32_t* dst_cells, Stream s);
// rope_pair(q, k.x) and then store_kv_pair(k, v), one launch with their bits (a layer's q and k
// rotated in place, its K and V into the caches' cells); k.x is rotated in place.
void rope_store(float* q, int64_t n_head_q, int64_t ld_q, const KvRows& k, const KvRows& v, int64_t n_tok,
                const int32_t* pos, const cpu::RopeParams& p, QType kv_type, const int32_t* dst_cells, Stream s);
// As cpu::store_kv for F16 caches.
void store_kv(const float* x, int64_t n_tok, int64_t ld_x, int64_t n_head_kv, int64_t head_dim, QType kv_type,
              void* cache, size_t kv_cell_bytes, const int32_t* dst_cells, Stream s);

}  // namespace stowlm::cuda
