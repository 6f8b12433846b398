#include "dist/context_link.h"

#include <cstring>
#include <exception>

#include "common.h"
#include "dist/mpi.h"
#include "error.h"

namespace stowlm::dist {

namespace {

World& world() {
    World* w = World::get();
    if (!w)
        throw Unsupported("the device list names devices of other MPI ranks (dev@RANK), but this process is not "
                          "part of an MPI job: start it with mpirun (pip install 'stowlm[mpi]')");
    return *w;
}

enum CommandType : int64_t { kOpen = 1, kEval, kTruncate, kClear, kClose, kEnd };

struct Command {
    int64_t type = 0;
    int64_t v[8] = {0, 0, 0, 0, 0, 0, 0, 0};
};

struct Reply {
    int64_t ok = 1;
    int64_t len = 0;  // bytes of the message that follows
};

void to_all(const Command& c) {
    World& w = world();
    for (int r = 1; r < w.size(); r++) w.send(r, kTagCommand, &c, sizeof(c), "a command");
}

uint64_t mix(uint64_t h, uint64_t v) {
    for (int i = 0; i < 8; i++) h = (h ^ ((v >> (8 * i)) & 0xff)) * 1099511628211ull;
    return h;
}

}  // namespace

uint64_t schedule_signature(const Graph& g) {
    uint64_t h = 1469598103934665603ull;
    for (const Split& s : g.splits) {
        h = mix(h, (uint64_t)s.device);
        for (const Tensor* n : s.nodes) {
            h = mix(h, (uint64_t)n->op);
            h = mix(h, (uint64_t)n->type);
            h = mix(h, (uint64_t)n->device);
            for (int i = 0; i < 4; i++) h = mix(h, (uint64_t)n->ne[i]);
        }
    }
    return h;
}

std::unique_ptr<ContextLink> ContextLink::make(const Model& m, const ContextParams& p, uint64_t signature) {
    const auto backends = m.backends();
    bool any = false;
    for (Backend* b : backends) any = any || is_remote(b);
    if (!any) return nullptr;
    World& w = world();
    if (m.tensor_parallel())
        throw Unsupported("tensor parallelism across MPI ranks is not supported: split the layers over the ranks");
    std::unique_ptr<ContextLink> l(new ContextLink());
    l->rank_ = w.rank();
    l->size_ = w.size();
    l->signature_ = signature;
    for (Backend* b : backends) {
        l->remote_.push_back(is_remote(b) ? 1 : 0);
        l->owner_.push_back(owner_rank(b));
    }
    if (!l->driver()) return l;
    // Ask every other rank to open the same context; all answer before any failure is raised.
    Command c;
    c.type = kOpen;
    c.v[0] = p.n_ctx, c.v[1] = p.n_ubatch, c.v[2] = p.n_outputs, c.v[3] = (int64_t)p.kv_type;
    c.v[4] = p.n_copies, c.v[5] = p.n_seq, c.v[6] = (int64_t)signature, c.v[7] = p.embeddings;
    to_all(c);
    std::string failed;
    std::vector<int> opened;
    for (int r = 1; r < w.size(); r++) {
        Reply rep;
        w.recv(r, kTagReply, &rep, sizeof(rep), "its answer to opening a context");
        std::string msg((size_t)rep.len, '\0');
        if (rep.len) w.recv(r, kTagReply, msg.data(), msg.size(), "its answer to opening a context");
        if (rep.ok) opened.push_back(r);
        else if (failed.empty()) failed = w.who(r) + ": " + msg;
    }
    if (!failed.empty()) {
        Command close;
        close.type = kClose;
        for (int r : opened) w.send(r, kTagCommand, &close, sizeof(close), "a command");
        throw Unsupported(failed);
    }
    return l;
}

ContextLink::~ContextLink() {
    if (!driver()) return;
    Command c;
    c.type = kClose;
    to_all(c);
}

int ContextLink::tag(const Graph& g, const Tensor* copy, int micro) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = copy_index_.find(&g);
    if (it == copy_index_.end()) {
        std::unordered_map<const Tensor*, int> index;
        for (const Split& s : g.splits)
            for (const Tensor* n : s.nodes)
                if (n->op == Op::COPY) index.emplace(n, (int)index.size());
        if (((int64_t)index.size() << kMicroBits) + kTagData > world().tag_ub())
            throw Unsupported("the graph has " + std::to_string(index.size()) + " copies between devices, more than "
                              "this MPI's tags can tell apart (MPI_TAG_UB " + std::to_string(world().tag_ub()) + ")");
        it = copy_index_.emplace(&g, std::move(index)).first;
    }
    return kTagData + (it->second.at(copy) << kMicroBits) + (micro & ((1 << kMicroBits) - 1));
}

void ContextLink::receive(int micro, const Graph& g, const Split& s, const std::vector<Backend*>& backends) {
    for (Tensor* n : s.nodes) {
        if (n->op != Op::COPY) continue;
        const Tensor* src = n->src[0]->storage_root();
        if (src->role == TensorRole::INPUT || !remote_[src->device]) continue;
        Backend& b = *backends[n->device];
        const size_t bytes = n->nbytes();
        if (b.host_accessible()) {
            world().recv(owner_[src->device], tag(g, n, micro), n->data, bytes, "activations");
        } else {
            std::vector<char> staging(bytes);
            world().recv(owner_[src->device], tag(g, n, micro), staging.data(), bytes, "activations");
            b.copy_from_host(*n, staging.data(), bytes);
        }
    }
}

void ContextLink::send(int micro, const Graph& g, const Tensor& c, const std::vector<Backend*>& backends) {
    const Tensor& src = *c.src[0];
    Backend& from = *backends[src.storage_root()->device];
    const size_t bytes = src.nbytes();
    if (bytes != c.nbytes()) throw InvalidInput("pipeline: " + c.name + " and its source differ in size");
    std::vector<char> copy(bytes);  // the producer's next split may overwrite src at once
    if (from.host_accessible()) memcpy(copy.data(), src.data, bytes);
    else from.copy_to_host(src, copy.data(), bytes);
    world().post(owner_[c.device], tag(g, &c, micro), std::move(copy), "activations");
}

bool ContextLink::logits(int micro, const Tensor& out, float* dst, size_t bytes, const std::vector<Backend*>& backends) {
    const int owner = owner_[out.device];
    const int t = kTagLogits + (micro & ((1 << kMicroBits) - 1));
    if (driver()) {
        if (owner == rank_) return false;
        world().recv(owner, t, dst, bytes, "logits");
        return true;
    }
    if (owner != rank_) return true;
    std::vector<char> host(bytes);
    backends[out.device]->copy_to_host(out, host.data(), bytes);
    world().post(0, t, std::move(host), "logits");
    return true;
}

void ContextLink::send_eval(const std::vector<int32_t>& tokens, const std::vector<int32_t>& seqs,
                            const std::vector<int32_t>& positions, const std::vector<int32_t>& out_rows) {
    Command c;
    c.type = kEval;
    c.v[0] = (int64_t)tokens.size(), c.v[1] = (int64_t)positions.size(), c.v[2] = (int64_t)out_rows.size();
    std::vector<int32_t> payload(tokens);
    payload.insert(payload.end(), seqs.begin(), seqs.end());
    payload.insert(payload.end(), positions.begin(), positions.end());
    payload.insert(payload.end(), out_rows.begin(), out_rows.end());
    World& w = world();
    for (int r = 1; r < w.size(); r++) {
        w.send(r, kTagCommand, &c, sizeof(c), "a command");
        w.send(r, kTagCommand, payload.data(), payload.size() * sizeof(int32_t), "a command");
    }
}

void ContextLink::send_truncate(int seq, int64_t n) {
    Command c;
    c.type = kTruncate;
    c.v[0] = seq, c.v[1] = n;
    to_all(c);
}

void ContextLink::send_clear(int seq) {
    Command c;
    c.type = kClear;
    c.v[0] = seq;
    to_all(c);
}

void ContextLink::fatal_current(const char* during) const {
    std::string why = "unknown error";
    try {
        throw;
    } catch (const std::exception& e) {
        why = e.what();
    } catch (...) {
    }
    world().fatal(std::string(during) + ": " + why);
}

int serve(Model* model, const std::string& load_error) {
    World& w = world();
    if (w.rank() == 0) throw InvalidInput("serve: rank 0 drives; the other ranks serve");
    std::unique_ptr<Context> ctx;
    for (;;) {
        Command c;
        w.recv(0, kTagCommand, &c, sizeof(c), "rank 0's next command", /*idle=*/true);
        switch (c.type) {
            case kOpen: {
                Reply rep;
                std::string msg;
                ctx.reset();
                if (!model) {
                    rep.ok = 0, msg = "could not load its share of the model: " + load_error;
                } else {
                    try {
                        ContextParams p;
                        p.n_ctx = c.v[0], p.n_ubatch = c.v[1], p.n_outputs = c.v[2], p.kv_type = (QType)c.v[3];
                        p.n_copies = (int)c.v[4], p.n_seq = (int)c.v[5], p.embeddings = c.v[7] != 0;
                        ctx = std::make_unique<Context>(*model, p);
                        if (!ctx->link() || ctx->link()->signature() != (uint64_t)c.v[6]) {
                            ctx.reset();
                            throw Unsupported("it scheduled the graph differently from rank 0 (do all ranks have the "
                                              "same model file and device list?)");
                        }
                    } catch (const std::exception& e) {
                        rep.ok = 0, msg = std::string("could not make its context: ") + e.what();
                    }
                }
                rep.len = (int64_t)msg.size();
                w.send(0, kTagReply, &rep, sizeof(rep), "its answer to opening a context");
                if (rep.len) w.send(0, kTagReply, msg.data(), msg.size(), "its answer to opening a context");
                break;
            }
            case kEval: {
                const size_t n = (size_t)c.v[0], np = (size_t)c.v[1], nr = (size_t)c.v[2];
                std::vector<int32_t> payload(2 * n + np + nr);
                w.recv(0, kTagCommand, payload.data(), payload.size() * sizeof(int32_t), "a command");
                if (!ctx) w.fatal("rank 0 evaluated tokens without an open context");
                const int32_t* p = payload.data();
                std::vector<int32_t> tokens(p, p + n), seqs(p + n, p + 2 * n), pos(p + 2 * n, p + 2 * n + np),
                    rows(p + 2 * n + np, p + 2 * n + np + nr);
                try {
                    ctx->eval_batch(tokens, seqs, pos, rows);
                } catch (...) {
                    ctx->link()->fatal_current("evaluating rank 0's batch");
                }
                break;
            }
            case kTruncate:
            case kClear:
                if (!ctx) w.fatal("rank 0 changed the KV cache without an open context");
                try {
                    if (c.type == kTruncate) ctx->kv_truncate(c.v[1], (int)c.v[0]);
                    else ctx->clear((int)c.v[0]);
                } catch (...) {
                    ctx->link()->fatal_current("repeating rank 0's KV cache change");
                }
                break;
            case kClose:
                ctx.reset();
                break;
            case kEnd:
                ctx.reset();
                return (int)c.v[0];
            default:
                w.fatal("unknown command " + std::to_string(c.type) + " from rank 0");
        }
    }
}

void end_job(int status) {
    World& w = world();
    if (w.rank() != 0) return;
    Command c;
    c.type = kEnd;
    c.v[0] = status;
    to_all(c);
}

}  // namespace stowlm::dist
