// Pipeline stages on several processes (MPI ranks, possibly on several hosts).
//
// Design: every rank loads the same model over the same global device list (each rank's own
// devices plus the other ranks' devices, which a DeviceSpec marks with their rank), builds the
// same graphs, and schedules and plans them the same way; a device of another rank is a
// RemoteBackend here, whose buffers are empty placeholders (no byte of its weights, KV cache
// or compute buffer is mapped, uploaded or allocated on this rank). Each rank then runs only the
// splits of its own devices, with the pipeline executor it uses for local devices
// (engine/pipeline.h): a copy whose producer is here and consumer there is an MPI message sent
// when the producer's split finishes, received by the consumer's thread right before its split
// runs; so prompt micro-batches overlap across ranks exactly as they do across local devices,
// and the bytes every kernel sees are those of one process with the same layer split.
//
// Rank 0 drives: its Context sends each call that changes the KV cache (eval_batch with its
// tokens, sequences, positions and wanted rows, kv_truncate, clear) to every rank before it runs
// it, and the others repeat it on their own Context in serve(); the logits come back to rank 0
// from the rank that computes them. Every rank makes the same choices from the same inputs, so
// only those calls, the activations that cross ranks, and the logits are ever sent.
//
// Failure: an error after a call was sent (the ranks are then mid-way through it) ends the job:
// the rank prints what happened, naming itself and its host, and aborts every rank (MPI_Abort).
// A rank that cannot load its share or make its context answers rank 0's request to open one
// with the reason, which rank 0 raises; a rank that dies is noticed by the launcher, and by a
// waiting rank of the same host within 100 ms.
#pragma once
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "dist/remote_device.h"
#include "engine/context.h"

namespace stowlm::dist {

// A hash of how a graph is scheduled (ops, shapes and devices of every split's nodes): equal on
// every rank, or the ranks would disagree on what crosses between them.
uint64_t schedule_signature(const Graph& g);

class ContextLink {
public:
    // Null when every device the context uses is this process's. On rank 0 this asks every
    // other rank to open the same context and raises the first failure (naming its rank and
    // host); `signature` is schedule_signature() of the context's worst-case graph.
    static std::unique_ptr<ContextLink> make(const Model& m, const ContextParams& p, uint64_t signature);
    ~ContextLink();  // rank 0: the others close their context too

    bool driver() const { return rank_ == 0; }
    uint64_t signature() const { return signature_; }
    const std::vector<char>& remote() const { return remote_; }  // per device

    // The pipeline's side (PipelineLink): copies into split s of a device here from devices of
    // other ranks, received before it runs; copy c (its source here) sent to its consumer's rank.
    void receive(int micro, const Graph& g, const Split& s, const std::vector<Backend*>& backends);
    void send(int micro, const Graph& g, const Tensor& c, const std::vector<Backend*>& backends);
    // Logits of a micro-batch (the rows of out, `bytes`): true when messages moved them (rank 0
    // received them into dst, or this rank sent them to rank 0) or this rank has nothing to do;
    // false when rank 0 computes them itself.
    bool logits(int micro, const Tensor& out, float* dst, size_t bytes, const std::vector<Backend*>& backends);

    // Rank 0: the calls the other ranks repeat.
    void send_eval(const std::vector<int32_t>& tokens, const std::vector<int32_t>& seqs,
                   const std::vector<int32_t>& positions, const std::vector<int32_t>& out_rows);
    void send_truncate(int seq, int64_t n);
    void send_clear(int seq);

    // The current exception (or `why`) ends the job: see the top of this file.
    [[noreturn]] void fatal_current(const char* during) const;

private:
    ContextLink() = default;
    int tag(const Graph& g, const Tensor* copy, int micro);
    int rank_ = 0, size_ = 1;
    uint64_t signature_ = 0;
    std::vector<char> remote_;
    std::vector<int> owner_;  // per device: its rank
    std::mutex mu_;
    std::map<const Graph*, std::unordered_map<const Tensor*, int>> copy_index_;
};

// Ranks other than 0: opens and runs the contexts rank 0 opens, repeating its calls, until rank
// 0 ends the job; returns the exit status it sends. model is null when this rank could not load
// its share (load_error says why, and rank 0 is told so when it asks for a context).
int serve(Model* model, const std::string& load_error);
// Rank 0: every other rank leaves serve() with `status`.
void end_job(int status);

}  // namespace stowlm::dist
