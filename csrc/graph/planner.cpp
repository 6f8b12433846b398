#include "graph/planner.h"

#include <algorithm>
#include <map>
#include <unordered_map>

#include "error.h"

namespace stowlm {

namespace {

constexpr size_t kAlign = 64;
size_t align_up(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

// Best-fit allocator over one device's offsets; tracks the high-water mark.
class OffsetAllocator {
public:
    size_t alloc(size_t size) {
        size = align_up(size);
        int best = -1;
        for (int i = 0; i < (int)free_.size(); i++)
            if (free_[i].second >= size && (best < 0 || free_[i].second < free_[best].second)) best = i;
        if (best >= 0) {
            const size_t off = free_[best].first;
            free_[best].first += size;
            free_[best].second -= size;
            if (free_[best].second == 0) free_.erase(free_.begin() + best);
            return off;
        }
        // Grow from the end, absorbing a free block that touches the top.
        if (!free_.empty() && free_.back().first + free_.back().second == top_) {
            const size_t off = free_.back().first;
            free_.pop_back();
            top_ = off + size;
            peak_ = std::max(peak_, top_);
            return off;
        }
        const size_t off = top_;
        top_ += size;
        peak_ = std::max(peak_, top_);
        return off;
    }
    void release(size_t off, size_t size) {
        size = align_up(size);
        auto it = std::lower_bound(free_.begin(), free_.end(), std::make_pair(off, (size_t)0));
        it = free_.insert(it, {off, size});
        // merge with neighbours
        size_t i = it - free_.begin();
        if (i + 1 < free_.size() && free_[i].first + free_[i].second == free_[i + 1].first) {
            free_[i].second += free_[i + 1].second;
            free_.erase(free_.begin() + i + 1);
        }
        if (i > 0 && free_[i - 1].first + free_[i - 1].second == free_[i].first) {
            free_[i - 1].second += free_[i].second;
            free_.erase(free_.begin() + i);
        }
    }
    size_t peak() const { return peak_; }

private:
    std::vector<std::pair<size_t, size_t>> free_;  // (offset, size), sorted by offset
    size_t top_ = 0, peak_ = 0;
};

bool may_run_in_place(Op op) {
    switch (op) {
        case Op::ADD:
        case Op::MUL:
        case Op::SCALE:
        case Op::SOFTCAP:
        case Op::RMS_NORM:
        case Op::ROPE:
        case Op::SWIGLU:
        case Op::GEGLU:
        case Op::SWIGLU_OAI:
        case Op::ADD_ID:
            return true;
        default:
            return false;
    }
}

bool is_placed(const Tensor* t) { return t->op != Op::NONE && t->op != Op::VIEW && t->nbytes() > 0; }

// Last use of every placed tensor (through any view of it). A collective's part whose shard
// leaves without waiting (Collective::leave_waits) is kept to its device's next collective, or
// to the end: the other shards may still read it until they meet there.
std::unordered_map<const Tensor*, int> last_uses(const std::vector<Tensor*>& order) {
    std::unordered_map<const Tensor*, int> last_use;
    std::map<int, const Tensor*> open_part;  // device -> part of its last collective that did not wait
    auto close = [&](int dev, int i) {
        auto it = open_part.find(dev);
        if (it == open_part.end()) return;
        last_use[it->second] = std::max(last_use[it->second], i);
        open_part.erase(it);
    };
    for (int i = 0; i < (int)order.size(); i++) {
        const Tensor* n = order[i];
        for (int s = 0; s < n->n_src(); s++)
            if (Tensor* src = n->src[s]) last_use[src->storage_root()] = i;
        if (!is_collective(n->op)) continue;
        close(n->device, i);
        if (!n->collective->leave_waits && n->src[0]) open_part[n->device] = n->src[0]->storage_root();
    }
    for (auto& [dev, part] : open_part) last_use[part] = (int)order.size() - 1;
    return last_use;
}

}  // namespace

size_t DeviceComputePlan::copy_area_offset() const { return align_up(tensor_bytes); }

size_t DeviceComputePlan::total() const {
    const size_t tensors = copy_area ? copy_area_offset() + (size_t)slots * slot_bytes : tensor_bytes;
    return scratch_bytes ? align_up(tensors) + scratch_bytes : tensors;
}

ComputePlan plan_compute(const Graph& g, const std::vector<Backend*>& backends, int copy_slots, bool copy_area) {
    copy_area = copy_area || copy_slots > 1;
    const std::vector<Tensor*> order = g.exec_order();
    ComputePlan plan;
    plan.devices.resize(backends.size());
    plan.offsets.assign(order.size(), -1);
    plan.sizes.assign(order.size(), 0);
    plan.ops.resize(order.size());

    std::unordered_map<const Tensor*, int> index;
    for (int i = 0; i < (int)order.size(); i++) {
        index[order[i]] = i;
        plan.ops[i] = order[i]->op;
    }
    std::unordered_map<const Tensor*, int> last_use = last_uses(order);
    std::vector<std::vector<const Tensor*>> dies_at(order.size());
    for (const auto& [t, i] : last_use) dies_at[i].push_back(t);
    const Tensor* out_root = g.output ? g.output->storage_root() : nullptr;

    std::vector<OffsetAllocator> alloc(backends.size());
    // offset held by each live tensor, and which tensors die at each step
    std::unordered_map<const Tensor*, size_t> held;
    std::vector<size_t> staging(backends.size(), 0);  // the largest staged node's weights, per device
    for (int i = 0; i < (int)order.size(); i++) {
        Tensor* n = order[i];
        const int dev = n->device;
        if (dev < 0 || dev >= (int)backends.size()) throw InvalidInput("planner: node " + n->name + " has no device");
        DeviceComputePlan& dp = plan.devices[dev];
        dp.scratch_bytes = std::max(dp.scratch_bytes, backends[dev]->scratch_bytes(*n));
        if (n->staged) staging[dev] = std::max(staging[dev], backends[dev]->staging_bytes(*n));
        if (copy_area && n->op == Op::COPY) {
            // Its own bytes in every slot, for the whole micro-batch: written when its producer
            // finishes, read by this device whenever it gets to the micro-batch.
            plan.offsets[i] = (int64_t)dp.slot_bytes;
            plan.sizes[i] = n->nbytes();
            dp.slot_bytes += align_up(n->nbytes());
            dp.slots = copy_slots;
            dp.copy_area = true;
            dp.copy_bytes = dp.slot_bytes * copy_slots;
        } else if (is_placed(n)) {
            const size_t size = n->nbytes();
            int64_t off = -1;
            if (may_run_in_place(n->op) && n != out_root) {
                for (int s = 0; s < n->n_src() && off < 0; s++) {
                    if (!n->src[s]) continue;
                    const Tensor* r = n->src[s]->storage_root();
                    auto h = held.find(r);
                    if (h == held.end() || r->device != dev || r == out_root || last_use[r] != i) continue;
                    const size_t r_size = plan.sizes[index[r]];
                    if (r_size < size) continue;
                    // Take over the dying input's bytes; its block now belongs to n.
                    off = (int64_t)h->second;
                    plan.sizes[i] = r_size;
                    held.erase(h);
                    plan.n_inplace++;
                }
            }
            if (off < 0) {
                off = (int64_t)alloc[dev].alloc(size);
                plan.sizes[i] = size;
            }
            plan.offsets[i] = off;
            if (n->op == Op::COPY) dp.copy_bytes += size;
            held[n] = (size_t)off;
        }
        // Free what dies here (never the graph output). A copy's source too: its producer
        // pushes it into the slot as its split ends, before that device runs anything else.
        for (const Tensor* r : dies_at[i]) {
            if (r == out_root) continue;
            auto h = held.find(r);
            if (h == held.end()) continue;  // not in the liveness region (a copy slot) or already freed
            alloc[r->device].release(h->second, plan.sizes[index[r]]);
            held.erase(h);
        }
        // A node nobody reads (an ordering token aside) dies at once.
        if (is_placed(n) && n != out_root && !last_use.count(n) && held.count(n)) {
            alloc[dev].release(held[n], plan.sizes[i]);
            held.erase(n);
        }
    }
    for (size_t d = 0; d < backends.size(); d++) {
        plan.devices[d].tensor_bytes = alloc[d].peak();
        // two staging slots after the kernels' own scratch (Backend::staging_bytes)
        if (staging[d]) plan.devices[d].scratch_bytes = align_up(plan.devices[d].scratch_bytes) + 2 * staging[d];
    }
    return plan;
}

std::string check_plan(const Graph& g, const ComputePlan& plan) {
    const std::vector<Tensor*> order = g.exec_order();
    std::unordered_map<const Tensor*, int> last_use = last_uses(order);
    const Tensor* out_root = g.output ? g.output->storage_root() : nullptr;
    struct Live {
        int i, birth, death, dev;
        size_t lo, hi;
    };
    std::vector<Live> live;
    for (int i = 0; i < (int)order.size(); i++) {
        if (plan.offsets[i] < 0) continue;
        const Tensor* n = order[i];
        int death = last_use.count(n) ? last_use[n] : i;
        if (n == out_root) death = (int)order.size();
        const DeviceComputePlan& dp = plan.devices[n->device];
        if (dp.copy_area && n->op == Op::COPY) {  // in slot 0 of the copy area, for the whole graph
            const size_t lo = dp.copy_area_offset() + (size_t)plan.offsets[i], hi = lo + n->nbytes();
            if (hi > dp.copy_area_offset() + dp.slot_bytes) return "copy " + n->name + " ends past its copy slot";
            live.push_back({i, 0, (int)order.size(), n->device, lo, hi});
            continue;
        }
        const size_t lo = (size_t)plan.offsets[i], hi = lo + n->nbytes();
        if (hi > dp.tensor_bytes)
            return "tensor " + n->name + " ends past its device's tensor region";
        live.push_back({i, i, death, n->device, lo, hi});
    }
    for (size_t a = 0; a < live.size(); a++)
        for (size_t b = a + 1; b < live.size(); b++) {
            const Live &x = live[a].birth <= live[b].birth ? live[a] : live[b];  // x born first
            const Live &y = &x == &live[a] ? live[b] : live[a];
            if (x.dev != y.dev || x.hi <= y.lo || y.hi <= x.lo) continue;
            if (y.birth > x.death) continue;  // x dead before y is born
            if (y.birth == x.death) {
                // Allowed only when y runs in place over x (x is one of y's inputs).
                const Tensor* yn = order[y.i];
                bool in_place = false;
                for (int s = 0; s < yn->n_src(); s++)
                    if (yn->src[s] && yn->src[s]->storage_root() == order[x.i]) in_place = true;
                if (in_place && may_run_in_place(yn->op) && x.lo == y.lo) continue;
            }
            return "tensors " + order[x.i]->name + " and " + order[y.i]->name + " share bytes while both live";
        }
    // (Stated apart from last_uses:) a part whose shard leaves its collective without waiting is
    // read by the other shards until they all meet again, so nothing its device computes up to
    // its next collective may take its bytes.
    std::unordered_map<const Tensor*, size_t> live_of;
    for (size_t k = 0; k < live.size(); k++) live_of[order[live[k].i]] = k;
    for (int i = 0; i < (int)order.size(); i++) {
        const Tensor* n = order[i];
        if (!is_collective(n->op) || n->collective->leave_waits || !n->src[0]) continue;
        auto it = live_of.find(n->src[0]->storage_root());
        if (it == live_of.end()) continue;
        const Live& x = live[it->second];
        int next = i + 1;
        while (next < (int)order.size() && !(is_collective(order[next]->op) && order[next]->device == n->device)) next++;
        for (const Live& y : live)
            if (y.dev == x.dev && y.birth > i && y.birth <= next && x.lo < y.hi && y.lo < x.hi)
                return "tensor " + order[y.i]->name + " takes the bytes of " + order[x.i]->name +
                       " while another shard of " + n->name + " may still read it";
    }
    return "";
}

ComputeBuffers allocate_compute(const std::vector<const ComputePlan*>& plans, const std::vector<Backend*>& backends) {
    ComputeBuffers bufs;
    bufs.buffers.resize(backends.size());
    for (size_t d = 0; d < backends.size(); d++) {
        size_t bytes = 0;
        for (const ComputePlan* p : plans) bytes = std::max(bytes, p->devices[d].total());
        if (bytes) bufs.buffers[d] = backends[d]->alloc_buffer(bytes, "compute buffer");
    }
    return bufs;  // on a throw, the buffers made so far are freed with `bufs`
}

ComputeBuffers allocate_compute(const ComputePlan& plan, const std::vector<Backend*>& backends) {
    return allocate_compute(std::vector<const ComputePlan*>{&plan}, backends);
}

void place_graph(Graph& g, const ComputePlan& plan, const ComputeBuffers& bufs, int slot) {
    const std::vector<Tensor*> order = g.exec_order();
    if (order.size() != plan.ops.size()) throw InvalidInput("planner: graph topology differs from its plan");
    for (size_t i = 0; i < order.size(); i++) {
        Tensor* n = order[i];
        if (n->op != plan.ops[i]) throw InvalidInput("planner: graph topology differs from its plan at " + n->name);
        if (plan.offsets[i] < 0) continue;
        if (n->nbytes() > plan.sizes[i])
            throw InvalidInput("planner: node " + n->name + " is larger than the plan's reservation");
        BackendBuffer* b = bufs.buffers[n->device].get();
        const DeviceComputePlan& dp = plan.devices[n->device];
        size_t off = (size_t)plan.offsets[i];
        if (dp.copy_area && n->op == Op::COPY) {
            if (slot < 0 || slot >= dp.slots) throw InvalidInput("planner: copy slot out of range");
            off += dp.copy_area_offset() + (size_t)slot * dp.slot_bytes;
        }
        n->buffer = b;
        n->data = (char*)b->data + off;
    }
    // Views: resolve after their sources (a view of a view resolves through the chain).
    std::vector<Tensor*> pending;
    for (Tensor* n : order)
        for (int s = 0; s < n->n_src(); s++)
            if (n->src[s] && n->src[s]->view_src) pending.push_back(n->src[s]);
    if (g.output && g.output->view_src) pending.push_back(g.output);
    for (Tensor* v : pending) {
        std::vector<Tensor*> chain;
        for (Tensor* t = v; t->view_src; t = t->view_src) chain.push_back(t);
        for (auto it = chain.rbegin(); it != chain.rend(); ++it) {
            Tensor* t = *it;
            t->data = (char*)t->view_src->data + t->view_offset;
            t->buffer = t->view_src->buffer;
            t->device = t->view_src->device;
        }
    }
}

}  // namespace stowlm
