// The scheduler assigns every node to a device and cuts the graph into per-device splits.
// Weights and KV caches decide where a node runs (their bytes do not move); other ops follow
// their most recently produced input (so a residual add stays with its layer); an op a backend
// cannot run falls back to the first host-accessible device.
// A tensor used on a device other than its own gets a COPY node at the start of the split
// that needs it (one copy per tensor and device). Graph inputs live in host memory and are
// read in place by host-accessible devices. Each split records what it pushes to other splits
// and which it waits for; a device's consecutive splits with nothing crossing between them are
// one split. With stage_host_experts, an expert product (MUL_MAT_ID) whose experts live in host
// memory runs where its activations come from when that device can stage them (a GPU copying
// the experts in as it goes: Backend::can_stage), instead of on the host; the host's share of a
// layer's experts split between the two (Tensor::Share) stays on the host, concurrently.
#pragma once
#include <vector>

#include "backend/backend.h"
#include "graph/graph.h"

namespace stowlm {

void schedule(Graph& g, const std::vector<Backend*>& backends, bool stage_host_experts = false);

}  // namespace stowlm
