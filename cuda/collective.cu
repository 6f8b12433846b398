// Tensor parallelism on the device: LOCAL_IDS (the routed expert ids a shard holds), the sum of
// an all-reduce and the placing of an all-gather's rows, all on the HOST_DEVICE arithmetic of
// collective_math.h that the CPU backend runs too (a CPU shard and a CUDA shard get the same
// bits). Moving the parts between devices is the engine's part (cuda_engine.cpp: peer copies,
// or NCCL below where it was found at build time).
#include <map>
#include <mutex>
#include <vector>

#include "collective_math.h"
#include "cuda_backend.h"
#include "cuda_common.cuh"

#ifdef STOWLM_HAVE_NCCL
#include <nccl.h>
#endif

namespace stowlm::cuda {

namespace {

__global__ void __launch_bounds__(256) local_ids_kernel(const int32_t* __restrict__ ids, int64_t n, int32_t first,
                                                        int32_t count, int32_t* __restrict__ out) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        out[i] = local_expert_id(ids[i], first, count);
}

// The partials' pointers by value (kernel parameter space), so no upload precedes the launch.
struct Parts {
    const float* p[kMaxShards];
};

// The pointers go to shared memory first (indexing the parameter array by a variable would copy
// it to local memory). No __restrict__ on out: it may be one of the parts (each element is read
// before it is written, by the same thread).
__global__ void __launch_bounds__(256) all_reduce_sum_kernel(Parts parts, int n_parts, int64_t n, float* out) {
    __shared__ const float* p[kMaxShards];
    if (threadIdx.x == 0) {
#pragma unroll
        for (int j = 0; j < kMaxShards; j++) p[j] = parts.p[j];  // constant offsets only
    }
    __syncthreads();
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        out[i] = shard_order_sum(p, n_parts, i);
}

// Row offsets by value too (kMaxShards + 1 entries).
struct Rows {
    int64_t r0[kMaxShards + 1];
};

__global__ void __launch_bounds__(256) all_gather_rows_kernel(Parts parts, Rows rows, int n_parts, int64_t d,
                                                              int64_t n, float* __restrict__ out) {
    __shared__ const float* p[kMaxShards];
    __shared__ int64_t r0[kMaxShards + 1];
    if (threadIdx.x == 0) {
#pragma unroll
        for (int j = 0; j < kMaxShards; j++) p[j] = parts.p[j];
#pragma unroll
        for (int j = 0; j <= kMaxShards; j++) r0[j] = rows.r0[j];
    }
    __syncthreads();
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        int64_t at;
        const int s = gather_source(r0, n_parts, d, i, &at);
        out[i] = p[s][at];
    }
}

unsigned grid_for(int64_t n) { return (unsigned)std::min<int64_t>(ceil_div(n, 256), 4096); }

}  // namespace

void local_ids(const int32_t* ids, int64_t n, int32_t first, int32_t count, int32_t* out, Stream s) {
    if (n < 0 || count < 0) throw InvalidInput("cuda local_ids: negative size");
    if (n == 0) return;
    local_ids_kernel<<<grid_for(n), 256, 0, (cudaStream_t)s>>>(ids, n, first, count, out);
    check_launch("local_ids_kernel");
}

void all_reduce_sum(const float* const* parts, int n_parts, int64_t n, float* out, Stream s) {
    if (n_parts < 0 || n_parts > kMaxShards)
        throw InvalidInput("cuda all_reduce_sum: " + std::to_string(n_parts) + " partials (at most " +
                           std::to_string(kMaxShards) + ")");
    if (n < 0) throw InvalidInput("cuda all_reduce_sum: negative size");
    if (n == 0) return;
    Parts p{};
    for (int i = 0; i < n_parts; i++) p.p[i] = parts[i];
    all_reduce_sum_kernel<<<grid_for(n), 256, 0, (cudaStream_t)s>>>(p, n_parts, n, out);
    check_launch("all_reduce_sum_kernel");
}

void all_gather_rows(const float* const* parts, const int64_t* row0, int n_parts, int64_t d, int64_t cols, float* out,
                     Stream s) {
    if (n_parts <= 0 || n_parts > kMaxShards)
        throw InvalidInput("cuda all_gather_rows: " + std::to_string(n_parts) + " parts (1 to " +
                           std::to_string(kMaxShards) + ")");
    if (d < 0 || cols < 0 || row0[0] != 0 || row0[n_parts] != d) throw InvalidInput("cuda all_gather_rows: bad rows");
    const int64_t n = d * cols;
    if (n == 0) return;
    Parts p{};
    Rows r{};
    for (int i = 0; i < n_parts; i++) p.p[i] = parts[i];
    for (int i = 0; i <= n_parts; i++) r.r0[i] = row0[i];
    all_gather_rows_kernel<<<grid_for(n), 256, 0, (cudaStream_t)s>>>(p, r, n_parts, d, n, out);
    check_launch("all_gather_rows_kernel");
}

#ifdef STOWLM_HAVE_NCCL

namespace {

void check_nccl(ncclResult_t r, const char* what) {
    if (r != ncclSuccess)
        throw Unsupported(std::string("NCCL error in ") + what + ": " + ncclGetErrorString(r));
}

// Communicators live as long as the process (a model reloaded over the same devices reuses them).
std::mutex g_nccl_mu;
std::map<std::vector<int>, std::vector<ncclComm_t>> g_nccl_comms;

}  // namespace

void* nccl_comm(const std::vector<int>& devices, int rank) {
    std::lock_guard<std::mutex> lk(g_nccl_mu);
    auto it = g_nccl_comms.find(devices);
    if (it == g_nccl_comms.end()) {
        std::vector<ncclComm_t> comms(devices.size());
        // one process, one thread per device: every rank's communicator made here at once
        check_nccl(ncclCommInitAll(comms.data(), (int)devices.size(), devices.data()), "ncclCommInitAll");
        it = g_nccl_comms.emplace(devices, std::move(comms)).first;
    }
    return it->second.at(rank);
}

void nccl_exchange(void* comm, const void* send, size_t bytes, const std::vector<int>& send_to,
                   const std::vector<int>& recv_from, const std::vector<void*>& recv,
                   const std::vector<size_t>& recv_bytes, Stream s) {
    ncclComm_t c = (ncclComm_t)comm;
    const cudaStream_t st = (cudaStream_t)s;
    check_nccl(ncclGroupStart(), "ncclGroupStart");
    try {
        if (send)
            for (int peer : send_to) check_nccl(ncclSend(send, bytes, ncclUint8, peer, c, st), "ncclSend");
        for (size_t i = 0; i < recv_from.size(); i++)
            check_nccl(ncclRecv(recv[i], recv_bytes[i], ncclUint8, recv_from[i], c, st), "ncclRecv");
    } catch (...) {
        ncclGroupEnd();
        throw;
    }
    check_nccl(ncclGroupEnd(), "ncclGroupEnd");
}

#endif  // STOWLM_HAVE_NCCL

}  // namespace stowlm::cuda
