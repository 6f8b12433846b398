#include "graph/scheduler.h"

#include <map>
#include <utility>

#include "error.h"

namespace stowlm {

namespace {

int fallback_device(const std::vector<Backend*>& backends) {
    for (Backend* b : backends)
        if (b->host_accessible()) return b->id();
    throw Unsupported("scheduler: no host-accessible device to run unsupported ops on");
}

// Execution index of each node, so that a weightless op follows its most recently produced
// input: the residual add of a layer runs with that layer (its attention/FFN output), not where
// the residual stream came from, which would send the stream back and forth between devices.
using NodeIndex = std::map<const Tensor*, int>;

// The device of n's most recently produced computed input among src[first..] (-1: none).
int latest_source_device(const Tensor* n, const NodeIndex& index, int first = 0) {
    int dev = -1, latest = -1;
    for (int i = first; i < n->n_src(); i++) {
        const Tensor* s = n->src[i];
        if (!s) continue;
        const Tensor* r = s->storage_root();
        if (r->role != TensorRole::COMPUTE) continue;
        auto it = index.find(r);
        const int at = it == index.end() ? -1 : it->second;
        if (dev < 0 || at > latest) latest = at, dev = r->device;
    }
    return dev;
}

int choose_device(const Tensor* n, const std::vector<Backend*>& backends, const NodeIndex& index) {
    if (is_collective(n->op)) {  // one node per shard, on that shard's device
        if (!backends.at(n->device)->supports(*n))
            throw Unsupported("tensor parallelism: " + backends[n->device]->name() + " has no " + op_name(n->op) +
                              " yet");
        return n->device;
    }
    int dev = -1;
    // Bytes that cannot move decide first.
    for (int i = 0; i < n->n_src() && dev < 0; i++) {
        const Tensor* s = n->src[i];
        if (!s) continue;
        const Tensor* r = s->storage_root();
        if (r->role == TensorRole::WEIGHT || r->role == TensorRole::KV) dev = r->device;
    }
    if (dev < 0) dev = latest_source_device(n, index);
    if (dev < 0) dev = 0;
    if (!backends.at(dev)->supports(*n)) dev = fallback_device(backends);
    return dev;
}

// The device that stages n's host-resident experts (or their biases: staged_weight) where its
// activations come from, or -1.
int staging_device(const Tensor* n, const std::vector<Backend*>& backends, const NodeIndex& index) {
    const Tensor* sw = staged_weight(*n);
    if (!sw || n->share == Tensor::Share::HOST) return -1;
    const Tensor* w = sw->storage_root();
    if (w->role != TensorRole::WEIGHT || w->device < 0 || !backends.at(w->device)->host_accessible()) return -1;
    const int dev = latest_source_device(n, index);  // (weights are no computed inputs)
    if (dev < 0 || backends.at(dev)->host_accessible() || !backends[dev]->can_stage(*n)) return -1;
    return dev;
}

// Who pushes into whom (Split::pushes, Split::deps) and which split computes the output.
void link_splits(Graph& g) {
    const auto split_at = g.split_of();
    std::map<int, int> last_of_device;
    for (Split& s : g.splits) s.pushes.clear(), s.deps.clear();
    for (int j = 0; j < (int)g.splits.size(); j++) {
        Split& s = g.splits[j];
        auto prev = last_of_device.find(s.device);
        if (prev != last_of_device.end()) s.deps.push_back(prev->second);
        last_of_device[s.device] = j;
        for (Tensor* n : s.nodes) {
            if (n->op != Op::COPY || n->src[0]->storage_root()->role == TensorRole::INPUT) continue;
            auto it = split_at.find(n->src[0]->storage_root());
            if (it == split_at.end()) throw InvalidInput("scheduler: the source of " + n->name + " is computed by no split");
            g.splits[it->second].pushes.push_back(n);
            s.deps.push_back(it->second);
        }
    }
    auto out = g.output ? split_at.find(g.output->storage_root()) : split_at.end();
    g.output_split = out == split_at.end() ? -1 : out->second;
}

bool receives_copies(const Split& s) {
    for (const Tensor* n : s.nodes)
        if (n->op == Op::COPY) return true;
    return false;
}

// Joins each split that receives no copy to its device's previous split when that one sends none:
// nothing crosses devices between them, so the hand-over between them only costs time (a tensor
// split's devices meet 4 times a layer inside their splits, and each meeting started a split).
void join_quiet_splits(Graph& g) {
    link_splits(g);
    std::vector<Split> joined;
    std::map<int, int> last_of_device;  // device -> index in joined
    for (Split& s : g.splits) {
        auto prev = last_of_device.find(s.device);
        if (!receives_copies(s) && prev != last_of_device.end() && joined[prev->second].pushes.empty()) {
            Split& p = joined[prev->second];
            p.nodes.insert(p.nodes.end(), s.nodes.begin(), s.nodes.end());
            p.pushes = std::move(s.pushes);
            continue;
        }
        last_of_device[s.device] = (int)joined.size();
        joined.push_back(std::move(s));
    }
    g.splits = std::move(joined);
    link_splits(g);
}

}  // namespace

void schedule(Graph& g, const std::vector<Backend*>& backends, bool stage_host_experts) {
    g.splits.clear();
    std::map<std::pair<const Tensor*, int>, Tensor*> copies;
    NodeIndex index;
    for (Tensor* n : g.nodes()) index.emplace(n, (int)index.size());
    for (Tensor* n : g.nodes()) {
        const int staged_on = stage_host_experts ? staging_device(n, backends, index) : -1;
        n->staged = staged_on >= 0;
        const int dev = n->staged ? staged_on : choose_device(n, backends, index);
        n->device = dev;
        // An all-reduce waits for the other shards: it starts a split, so that what the split
        // before it sends to other devices is sent before the wait.
        // So does a gather (the tensor split's logits, shard by shard) of what another device
        // computes at the same time: a split waits for all its copies before its first node, and
        // this shard's own vocabulary rows must not wait for the other shards'. (Elsewhere a copy
        // waits for work already done, and one split per device and micro-batch keeps pipelining.)
        // And the sum joining the host's and a GPU's shares of a layer's experts.
        bool waits = false;
        const bool joins = n->op == Op::CONCAT || n->share == Tensor::Share::JOIN;
        for (int i = 0; i < n->n_src() && !waits && joins; i++) {
            const Tensor* s = n->src[i] ? n->src[i]->storage_root() : nullptr;
            waits = s && s->role == TensorRole::COMPUTE && s->device != dev && !copies.count({n->src[i], dev});
        }
        if (g.splits.empty() || g.splits.back().device != dev || is_collective(n->op) ||
            (waits && !g.splits.back().nodes.empty())) {
            g.splits.emplace_back();
            g.splits.back().device = dev;
        }
        Split& split = g.splits.back();
        for (int i = 0; i < n->n_src(); i++) {
            Tensor* s = n->src[i];
            if (!s) continue;
            Tensor* r = s->storage_root();
            if (n->staged && r->role == TensorRole::WEIGHT) continue;  // the device copies them in itself
            bool needs_copy;
            if (r->role == TensorRole::INPUT)
                needs_copy = !backends[dev]->host_accessible();
            else
                needs_copy = r->device != dev;
            if (!needs_copy) continue;
            if (r->role == TensorRole::WEIGHT || r->role == TensorRole::KV)
                throw InvalidInput("scheduler: node " + n->name + " on " + backends[dev]->name() + " needs " + r->name +
                                   " which lives on another device");
            Tensor*& c = copies[{s, dev}];
            if (!c) {
                c = copy_to_device(g, s, dev);
                // Copies go first in the split, before any node that reads them.
                split.nodes.insert(split.nodes.begin(), c);
            }
            n->src[i] = c;
        }
        split.nodes.push_back(n);
    }
    join_quiet_splits(g);
    for (const auto& c : g.collectives()) {
        c->leave_waits = false;
        for (const Tensor* o : c->outs) c->leave_waits = c->leave_waits || !backends[o->device]->host_accessible();
    }
}

}  // namespace stowlm
