// An inference context over a loaded model: the KV cache, one compute buffer per device sized
// for the worst micro-batch (n_ubatch tokens, the whole context, logits for every token), and
// the graphs of each micro-batch shape built once and reused (a one-token decode graph serves
// every generated token until the visible KV range grows past its bucket).
#pragma once
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "common.h"
#include "engine/pipeline.h"
#include "graph/planner.h"
#include "kv/kv_cache.h"
#include "models/model.h"

namespace stowlm {

namespace dist {
class ContextLink;  // devices of other MPI ranks (dist/context_link.h)
}

struct ContextParams {
    int64_t n_ctx = 4096;
    int64_t n_ubatch = 512;
    // Most rows of logits one micro-batch returns (0: n_ubatch). The logits tensor is the
    // largest in the compute buffer (n_vocab floats per row), so a context that mostly wants
    // the last token's logits can keep it small; "all" requests then go n_outputs at a time.
    int64_t n_outputs = 0;
    QType kv_type = QType::F16;
    // Copies of the tensors that cross devices, one per micro-batch in flight (pipeline
    // parallelism, engine/pipeline.h); 1: the devices take turns.
    int n_copies = 4;
    // Independent sequences sharing the n_ctx cells (a server's slots); each token of a batch
    // names its sequence.
    int n_seq = 1;
    // Micro-batches of at least this many tokens run the expert products of experts kept in host
    // memory on the GPU that computes the rest of their layer, which copies the experts in as it
    // goes (graph/scheduler.h); smaller ones (decoding) leave them to the CPU. 0: never.
    int64_t moe_offload_min = kMoeOffloadMin;
    // In those micro-batches, the host computes this share of each such layer's experts itself
    // (from RAM, while the GPU copies in and multiplies the rest: the bus is the bound there), the
    // first experts of the layer, at least one. 0: the GPU takes them all. A measurement's setting
    // until a GPU session sets its default (STOWLM_MOE_CPU_SHARE).
    float moe_cpu_share = (float)env_number("STOWLM_MOE_CPU_SHARE", 0.0);
    // The graphs end at the output norm: eval returns each wanted row's final hidden state
    // (n_embd floats, what embeddings pool) instead of its logits, and the head is never run.
    bool embeddings = false;
};

// Whether a context pipelines its micro-batches over the devices, and why not when it does not.
struct PipelineMode {
    int n_copies = 1;    // copy slots it plans (1: no pipelining)
    std::string reason;  // why it is off ("" when on)
};

struct DeviceMemory {
    std::string name;
    size_t weights = 0, kv = 0, compute = 0, copies = 0, total = 0, budget = 0;
};

struct Projection {
    std::vector<DeviceMemory> devices;
    PipelineMode pipeline;
};

// Bytes per device a context with these parameters would take, from the same planner path
// the context allocates with. Allocates nothing.
Projection project_memory(const Model& model, const ContextParams& p);
// The KV cache a context with these parameters has (parameters checked as a Context does).
KVLayout context_kv_layout(const Model& model, const ContextParams& p);

class Context {
public:
    Context(Model& model, const ContextParams& p);
    ~Context();

    // Evaluates tokens of sequence 0 (positions default to n_past, n_past+1, ...), appending them
    // to the KV cache in micro-batches of n_ubatch. Returns logits row-major [rows][n_vocab]:
    // every token's when all_logits, else the last token's.
    std::vector<float> eval(const std::vector<int32_t>& tokens, const std::vector<int32_t>& positions,
                            bool all_logits);
    // The general form: token i belongs to sequence seqs[i] (positions default to each sequence's
    // length, then on), and the logits of the tokens listed in out_rows (ascending) come back in
    // that order (their hidden states with ContextParams::embeddings: row_width() floats a row). On any error every sequence is left as it was. batched: every product and the
    // attention over the tokens take the kernels of a prompt-sized batch however few they are
    // (routed experts keep choosing by their own token counts): a prompt's tail after a reused
    // prefix gets the bits of the chunk it belongs to. CPU devices of this process only.
    std::vector<float> eval_batch(const std::vector<int32_t>& tokens, const std::vector<int32_t>& seqs,
                                  const std::vector<int32_t>& positions, const std::vector<int32_t>& out_rows,
                                  bool batched = false);
    // Whether eval_batch may be asked for `batched` passes (every device a CPU of this process, a
    // micro-batch large enough for the batched kernels).
    bool can_force_batched() const;
    void kv_truncate(int64_t n, int seq = 0);
    // Sequence seq holds the regions of the next n - 1 sequences too (they must hold nothing), or
    // gives them back (n 1): a long request in the cells idle slots leave (KVCache::set_span).
    void kv_span(int seq, int n);
    int kv_span_of(int seq) const { return kv_->span(seq); }
    int kv_held_by(int seq) const { return kv_->borrowed_by(seq); }  // -1: its region is its own
    int64_t capacity(int seq) const { return kv_->capacity(seq); }
    void clear(int seq = -1);  // -1: every sequence
    int64_t n_past(int seq = 0) const { return kv_->n_used(seq); }
    int64_t n_cells_used() const { return kv_->n_used(); }
    int n_seq() const { return params_.n_seq; }
    // The bytes of layer il's K (v=false) or V cache for the cells in use, read back to the host.
    std::vector<uint8_t> kv_bytes(int il, bool v) const;
    int64_t n_ctx() const { return params_.n_ctx; }
    int64_t n_vocab() const { return model_.hp().n_vocab; }
    // Floats per row eval returns: n_vocab (logits), or n_embd with ContextParams::embeddings.
    int64_t row_width() const { return params_.embeddings ? model_.hp().n_embd : model_.hp().n_vocab; }
    bool embeddings() const { return params_.embeddings; }
    std::vector<DeviceMemory> memory_report() const;
    const PipelineMode& pipeline() const { return pipeline_; }
    // Of the last eval that ran its micro-batches as a pipeline (micro_batches 0 if none did).
    const PipelineStats& pipeline_stats() const { return stats_; }
    size_t n_graphs() const { return graphs_.size(); }
    const ComputePlan& plan() const { return plan_; }
    // Micro-batches of this many tokens or more run the staged plan (0: one plan for all shapes).
    int64_t staging_from() const { return stage_min_; }
    // Host bytes of the staged experts page-locked for their copies (0: none, or copied the slow way).
    size_t pinned_host_bytes() const { return pinned_; }
    // check_plan() over the worst-case graph (the one the plan was made for).
    std::string check_plan_sound() const;
    // The other MPI ranks the context's devices are on (null when all are this process's).
    const dist::ContextLink* link() const { return link_.get(); }

private:
    // One micro-batch shape, built once per copy slot: a micro-batch in slot s reads its inputs
    // and crossing tensors there while the micro-batches of other slots run.
    struct ShapeGraph {
        Graph g;
        BuildInputs in;
        std::vector<std::vector<int32_t>> input_storage;
        const ComputePlan* plan = nullptr;  // plan_, or small_plan_ for an unstaged shape
        bool concurrent = false;  // its devices run at once (the host's and a GPU's shares of experts)
    };
    ShapeGraph& graph_for(int64_t n_tok, int64_t n_kv, int64_t n_out, int slot, bool batched);
    // Fills sg's inputs for the tokens [b0, b0 + nt) (out: the rows of them whose logits are
    // wanted, micro-batch relative) and takes their KV cells.
    void prepare(ShapeGraph& sg, const std::vector<int32_t>& tokens, const std::vector<int32_t>& seqs,
                 const std::vector<int32_t>& pos, int64_t b0, int64_t nt, const std::vector<int32_t>& out);
    void run_split(const Split& s, const ComputePlan& plan, bool pull_peers);
    void run(ShapeGraph& sg);

    Model& model_;
    ContextParams params_;
    std::vector<Backend*> backends_;
    std::unique_ptr<KVCache> kv_;
    ComputePlan plan_;
    // With expert staging (stage_min_ > 0) plan_ is the staged shapes' and small_plan_ the
    // smaller shapes' (another topology: the experts on the host); both use the same buffers.
    ComputePlan small_plan_;
    int64_t stage_min_ = 0;
    size_t pinned_ = 0;
    ComputeBuffers compute_;
    PipelineMode pipeline_;
    PipelineStats stats_;
    std::map<std::tuple<int64_t, int64_t, int64_t, int, bool>, std::unique_ptr<ShapeGraph>> graphs_;
    std::map<const Graph*, const ComputePlan*> plan_of_;
    std::mutex mu_;  // eval runs without the GIL: one call at a time per context
    std::unique_ptr<dist::ContextLink> link_;
};

// How one micro-batch shape's graph is built. batched: its products over the tokens and its
// attention marked for the batched kernels. stage: expert products of host-resident experts go
// to a GPU that stages them (Backend::can_stage), but cpu_share of each layer's experts
// (ContextParams::moe_cpu_share). embeddings: it ends at the output norm (ContextParams::embeddings).
struct GraphOptions {
    bool batched = false, stage = false, embeddings = false;
    float cpu_share = 0;
};

// Builds and schedules the graph of one micro-batch shape (inputs in host storage of sg).
void build_scheduled_graph(const Model& model, KVCache& kv, int64_t n_tok, int64_t n_kv, int64_t n_out, Graph& g,
                           BuildInputs& in, std::vector<std::vector<int32_t>>* storage, const GraphOptions& o);

}  // namespace stowlm
