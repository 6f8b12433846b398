// The memory planner: liveness over a scheduled graph's execution order gives each device's
// compute buffer (tensor offsets, in-place reuse of a dying input where the op allows it,
// peak bytes) plus one scratch region per device sized for its hungriest node.
// plan_compute() allocates nothing; allocate_compute() allocates exactly what a plan says, so
// projected bytes equal allocated bytes per device by construction.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "graph/graph.h"

namespace stowlm {

struct DeviceComputePlan {
    size_t tensor_bytes = 0;   // peak of the live tensors (copies of other devices' tensors included)
    size_t copy_bytes = 0;     // of which: bytes of COPY destinations ever placed (staging)
    size_t scratch_bytes = 0;  // kernels' scratch, after the tensors
    size_t total() const;      // bytes of the device's compute buffer
};

struct ComputePlan {
    std::vector<DeviceComputePlan> devices;  // one per backend
    // Per node of the execution order: byte offset in its device's buffer (-1: not placed,
    // e.g. an ordering token) and the bytes reserved there.
    std::vector<int64_t> offsets;
    std::vector<size_t> sizes;
    std::vector<Op> ops;  // to check that a graph applying this plan has the same topology
    int n_inplace = 0;    // nodes that reused a dying input's bytes
};

ComputePlan plan_compute(const Graph& g, const std::vector<Backend*>& backends);

// Independent check of a plan: every placed tensor lies inside its device's buffer, and no two
// tensors whose lifetimes overlap share bytes (except an in-place output taking over the input
// that dies at it). Returns an empty string when the plan is sound, else what is wrong.
std::string check_plan(const Graph& g, const ComputePlan& plan);

struct ComputeBuffers {
    std::vector<BufferPtr> buffers;  // one per backend (null where the plan needs no bytes)
};

ComputeBuffers allocate_compute(const ComputePlan& plan, const std::vector<Backend*>& backends);

// Points every tensor of g at its bytes: nodes into the compute buffers by the plan (which may
// come from a larger graph of the same topology), views into their sources.
void place_graph(Graph& g, const ComputePlan& plan, const ComputeBuffers& bufs,
                 const std::vector<Backend*>& backends);

}  // namespace stowlm
