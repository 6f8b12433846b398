// The memory planner: liveness over a scheduled graph's execution order gives each device's
// compute buffer (tensor offsets, in-place reuse of a dying input where the op allows it,
// peak bytes) plus one scratch region per device sized for its hungriest node, and ending in two
// slots for staged weights (Backend::staging_bytes) where the device stages any. For pipeline
// parallelism the tensors that cross devices (COPY nodes) leave the liveness region for a copy
// area of `copy_slots` slots, one per micro-batch in flight: only they are kept in copies.
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
    size_t tensor_bytes = 0;   // peak of the live tensors (copies of other devices' tensors included
                               // when there is one slot)
    size_t copy_bytes = 0;     // bytes of COPY destinations ever placed (all slots of the copy area)
    size_t slot_bytes = 0;     // with several slots: one slot of the copy area, after the tensors
    int slots = 1;
    bool copy_area = false;    // COPY destinations have their own area (pipelining, or devices that run at once)
    size_t scratch_bytes = 0;  // kernels' scratch, after the tensors (and the copy area)
    size_t copy_area_offset() const;  // where slot 0 starts in the device's buffer
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

// copy_slots > 1: every COPY node gets its own bytes in each of that many slots. copy_area: the
// same with one slot, for devices that run at once (tensor parallelism): a producer writes into
// its consumer whenever it finishes, so the destination cannot share bytes with anything else.
ComputePlan plan_compute(const Graph& g, const std::vector<Backend*>& backends, int copy_slots = 1,
                         bool copy_area = false);

// Independent check of a plan: every placed tensor lies inside its device's buffer, and no two
// tensors whose lifetimes overlap share bytes (except an in-place output taking over the input
// that dies at it). Returns an empty string when the plan is sound, else what is wrong.
std::string check_plan(const Graph& g, const ComputePlan& plan);

struct ComputeBuffers {
    std::vector<BufferPtr> buffers;  // one per backend (null where the plan needs no bytes)
};

ComputeBuffers allocate_compute(const ComputePlan& plan, const std::vector<Backend*>& backends);
// Buffers for several plans used in turn: each device's is the largest of theirs.
ComputeBuffers allocate_compute(const std::vector<const ComputePlan*>& plans, const std::vector<Backend*>& backends);

// Points every tensor of g at its bytes: nodes into the compute buffers by the plan (which may
// come from a larger graph of the same topology), COPY nodes into copy slot `slot`, views into
// their sources.
void place_graph(Graph& g, const ComputePlan& plan, const ComputeBuffers& bufs, int slot = 0);

}  // namespace stowlm
