#include "dist/remote_device.h"

#include <string>

#include "common.h"
#include "dist/mpi.h"
#include "error.h"

namespace stowlm::dist {

namespace {

// A device of another rank: it has the real device's kind (so the scheduler inserts the same
// copies) and budget (for reports), and buffers without bytes; nothing runs on it here.
class RemoteBackend : public Backend {
public:
    RemoteBackend(int id, const DeviceSpec& spec) : id_(id), rank_(spec.rank), name_(spec.name()),
        host_(spec.kind == "cpu"), budget_(spec.mem_bytes) {}
    const std::string& name() const override { return name_; }
    int id() const override { return id_; }
    bool host_accessible() const override { return host_; }
    int64_t batched_min_tokens() const override { return host_ ? kCpuBatchedMinTokens : kCudaBatchedMinTokens; }
    size_t memory_total() const override { return budget_; }
    size_t memory_used() const override { return 0; }
    BufferPtr alloc_buffer(size_t bytes, const std::string& purpose) override { return placeholder(bytes, purpose); }
    BufferPtr import_host(const void*, size_t bytes, const std::string& purpose) override {
        return placeholder(bytes, purpose);
    }
    void free_buffer(BackendBuffer& b) override { b.backend = nullptr; }
    bool supports(const Tensor& node) const override { return node.op != Op::NONE; }
    void compute(const Split&, void*, size_t) override { elsewhere("compute"); }
    size_t scratch_bytes(const Tensor&) const override { return 0; }
    void copy_from_host(Tensor&, const void*, size_t, size_t) override {}  // its rank fills its own inputs
    void copy_to_host(const Tensor& src, void*, size_t, size_t) override { elsewhere("read " + src.name + " of"); }
    void copy_from_peer(Tensor& dst, const Tensor&, Backend&) override { elsewhere("copy " + dst.name + " to"); }
    void synchronize() override {}
    int rank() const { return rank_; }

private:
    BufferPtr placeholder(size_t bytes, const std::string& purpose) {
        auto b = std::make_unique<BackendBuffer>();
        b->backend = this;
        b->size = bytes;
        b->external = true;
        b->purpose = purpose;
        return b;
    }
    [[noreturn]] void elsewhere(const std::string& what) const {
        throw Unsupported("cannot " + what + " " + name_ + ": it is a device of MPI rank " + std::to_string(rank_));
    }
    int id_, rank_;
    std::string name_;
    bool host_;
    size_t budget_;
};

}  // namespace

int this_rank() {
    World* w = World::get();
    return w ? w->rank() : 0;
}

std::unique_ptr<Backend> make_device(int id, const DeviceSpec& spec) {
    if (spec.rank < 0 || spec.rank == this_rank()) return make_backend(id, spec);
    if (World* w = World::get(); w && spec.rank >= w->size())
        throw InvalidInput("device " + spec.name() + ": there is no MPI rank " + std::to_string(spec.rank) + " (the job has " +
                           std::to_string(w->size()) + ")");
    return std::make_unique<RemoteBackend>(id, spec);
}

bool is_remote(const Backend* b) { return dynamic_cast<const RemoteBackend*>(b) != nullptr; }

int owner_rank(const Backend* b) {
    const auto* r = dynamic_cast<const RemoteBackend*>(b);
    return r ? r->rank() : this_rank();
}

}  // namespace stowlm::dist
