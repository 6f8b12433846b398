// Pipeline parallelism: with the layers split over several devices, device k works on
// micro-batch i while device k+1 works on micro-batch i-1. Only the tensors that cross devices
// (the COPY nodes) are kept once per micro-batch in flight, in the copy slots the planner lays
// out (graph/planner.h); everything else a device computes lives in its one compute buffer,
// which is why a device must not keep a tensor from one of its splits of a micro-batch to
// another (pipeline_blocker says when it would).
#pragma once
#include <functional>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "graph/graph.h"

namespace stowlm {

// Why the splits of g cannot be pipelined, "" when they can: a device that reads in one of its
// splits a tensor it computed in another split of the same micro-batch (tensor overrides that
// send part of a layer to another device and back) would need its compute buffer once per
// micro-batch in flight.
std::string pipeline_blocker(const Graph& g, const std::vector<Backend*>& backends);

struct PipelineStats {
    double wall_s = 0;
    std::vector<double> busy_s;  // per device: time spent computing and pushing copies
    int micro_batches = 0;
};

// Runs micro-batches 0..n_micro-1, one thread per device. Split j of a micro-batch starts once
// the splits it copies from are done (they pushed their outputs into its copy slots), and the
// previous split of its device; a device takes the first ready split in (micro-batch + split,
// micro-batch) order, the order of a full pipeline. Devices run concurrently within a
// micro-batch too, which tensor parallelism's all-reduces need (they meet inside their splits). prepare(i) runs on the calling thread, in order, once
// micro-batch i - n_slots is done (its copy slot and graph inputs are free again), and returns
// micro-batch i's graph, placed in copy slot i % n_slots with its inputs filled. run_split(g, s)
// computes one split (its copies of graph inputs included); finish(i, g) runs on the output's
// device right after the split that computes g.output. Every graph must have the splits of the
// first (same devices in the same order). The first error stops every device and is rethrown.
// link (devices of other MPI ranks, dist/context_link.h): their splits run there, not here (finish
// still runs for an output they compute); a copy between one of them and a device here is a
// message: send(i, g, c) right after the split here that computes c's source, receive(i, g, s)
// before split s here runs.
struct PipelineLink {
    std::vector<char> remote;  // per device
    std::function<void(int, const Graph&, const Split&)> receive;
    std::function<void(int, const Graph&, const Tensor&)> send;
};
void run_pipeline(int n_micro, int n_slots, const std::vector<Backend*>& backends,
                  const std::function<Graph*(int)>& prepare,
                  const std::function<void(const Graph&, const Split&)>& run_split,
                  const std::function<void(int, const Graph&)>& finish, PipelineStats* stats,
                  const PipelineLink* link = nullptr);

}  // namespace stowlm
