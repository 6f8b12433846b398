#include "engine/context.h"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <set>
#include <string>

#include "backend/node_params.h"
#include "common.h"
#include "dist/context_link.h"
#include "error.h"
#include "graph/scheduler.h"

namespace stowlm {

namespace {

// The visible KV range grows in buckets, so decode reuses one graph for many tokens.
constexpr int64_t kKvBucket = 256;

// Checked and clamped parameters; projection and allocation both go through here, so they
// plan the same shapes.
ContextParams checked(const Model& m, ContextParams p) {
    if (p.n_ctx <= 0) throw InvalidInput("n_ctx must be positive, got " + std::to_string(p.n_ctx));
    if (p.n_ubatch <= 0) throw InvalidInput("n_ubatch must be positive, got " + std::to_string(p.n_ubatch));
    if (p.n_outputs < 0) throw InvalidInput("n_outputs must be >= 0, got " + std::to_string(p.n_outputs));
    if (p.n_copies < 1) throw InvalidInput("n_copies must be >= 1, got " + std::to_string(p.n_copies));
    if (p.moe_offload_min < 0)
        throw InvalidInput("moe_offload_min must be >= 0 (0: never), got " + std::to_string(p.moe_offload_min));
    if (!(p.moe_cpu_share >= 0 && p.moe_cpu_share < 1))
        throw InvalidInput("moe_cpu_share (STOWLM_MOE_CPU_SHARE) must be in [0, 1), got " +
                           std::to_string(p.moe_cpu_share));
    if (p.n_seq < 1 || p.n_seq > p.n_ctx)
        throw InvalidInput("n_seq must be in [1, n_ctx], got " + std::to_string(p.n_seq));
    if (p.n_ctx % p.n_seq)  // each sequence owns n_ctx / n_seq cells
        throw InvalidInput("n_ctx " + std::to_string(p.n_ctx) + " is not a multiple of n_seq " + std::to_string(p.n_seq));
    p.n_ubatch = std::min(p.n_ubatch, p.n_ctx);
    p.n_outputs = p.n_outputs == 0 ? p.n_ubatch : std::min(p.n_outputs, p.n_ubatch);
    const QTypeInfo* kv = qtype_info((uint32_t)p.kv_type);
    const int64_t hd = m.hp().head_dim_k;
    if (hd % kv->block_elems)
        throw InvalidInput(std::string("kv_type ") + kv->name + " stores blocks of " + std::to_string(kv->block_elems) +
                           " but the model's head_dim is " + std::to_string(hd));
    return p;
}

KVLayout kv_layout(const Model& m, const ContextParams& p) {
    KVLayout l;
    l.n_ctx = p.n_ctx;
    l.type = p.kv_type;
    const HParams& hp = m.hp();
    l.n_layer = (int)hp.n_layer;
    for (int il = 0; il < hp.n_layer; il++)
        for (int s = 0; s < m.n_shards(); s++) {
            const ShardGeometry& sg = m.shard_geometry(s, il);
            if (sg.kv_heads == 0) continue;
            // MLA: every shard keeps the whole compressed row (one shared KV head); V is in K
            l.entries.push_back({il, s, m.shard_device(s, il), sg.kv_heads * hp.head_dim_k,
                                 hp.kv_v_in_k ? 0 : sg.kv_heads * hp.head_dim_v});
        }
    return l;
}

// Pipelining needs several copies, several devices that compute (layers, or weights an
// override put there such as experts), and devices that do not keep tensors between their
// splits of a micro-batch.
PipelineMode pipeline_mode(const Model& m, const Graph& worst, int n_copies) {
    PipelineMode mode;
    std::vector<int> devices;
    for (const Split& s : worst.splits) devices.push_back(s.device);
    std::sort(devices.begin(), devices.end());
    devices.erase(std::unique(devices.begin(), devices.end()), devices.end());
    if (n_copies <= 1)
        mode.reason = "n_copies is 1";
    else if (devices.size() < 2)
        mode.reason = "one device computes everything";
    else if (m.tensor_parallel())  // (and a device would meet another micro-batch's shards)
        mode.reason = "tensor parallelism: every device works on every layer";
    else
        mode.reason = pipeline_blocker(worst, m.backends());
    mode.n_copies = mode.reason.empty() ? n_copies : 1;
    return mode;
}

// Copies get their own area where devices run at once: tensor parallelism, and the devices of
// several MPI ranks (dist/context_link.h), whose splits always run as a pipeline.
bool own_copy_area(const Model& m) {
    for (Backend* b : m.backends())
        if (dist::is_remote(b)) return true;
    return m.tensor_parallel();
}

// Whether g's host and a GPU each take a share of some layer's experts (ContextParams::
// moe_cpu_share): their splits then run at once, one thread per device, and copies get their own
// area as for tensor parallelism.
bool shares_experts(const Graph& g) {
    for (const Tensor* n : g.nodes())
        if (n->share == Tensor::Share::HOST) return true;
    return false;
}

// other: a second plan sharing the buffers (expert staging's smaller shapes), or null.
std::vector<DeviceMemory> report(const Model& m, const std::vector<size_t>& kv, const ComputePlan& plan,
                                 const ComputePlan* other = nullptr) {
    std::vector<DeviceMemory> r;
    auto backends = m.backends();
    for (size_t d = 0; d < backends.size(); d++) {
        DeviceMemory dm;
        dm.name = backends[d]->name();
        dm.weights = m.weight_bytes()[d];
        dm.kv = kv[d];
        dm.compute = plan.devices[d].total();
        dm.copies = plan.devices[d].copy_bytes;
        if (other) {
            dm.compute = std::max(dm.compute, other->devices[d].total());
            dm.copies = std::max(dm.copies, other->devices[d].copy_bytes);
        }
        dm.total = dm.weights + dm.kv + dm.compute;
        dm.budget = backends[d]->memory_total();
        r.push_back(dm);
    }
    return r;
}

}  // namespace

void build_scheduled_graph(const Model& model, KVCache& kv, int64_t n_tok, int64_t n_kv, int64_t n_out, Graph& g,
                           BuildInputs& in, std::vector<std::vector<int32_t>>* storage, const GraphOptions& o) {
    in.tokens = g.new_input("inp_tokens", QType::I32, n_tok);
    in.pos = g.new_input("inp_pos", QType::I32, n_tok);
    in.cells = g.new_input("inp_kv_cells", QType::I32, n_tok);
    in.kv_pos = g.new_input("inp_kv_pos", QType::I32, n_kv);
    in.out_ids = g.new_input("inp_out_ids", QType::I32, n_out);
    const HParams& hp = model.hp();
    if (hp.kv_lora_rank > 0)
        for (int il = 0; il < hp.n_layer; il++)
            for (int s = 0; s < model.n_shards(); s++) {
                const int64_t h = model.shard_geometry(s, il).q_heads;
                bool have = h == 0;
                for (Tensor* t : in.head_ids) have = have || t->ne[0] == h;
                if (!have)
                    in.head_ids.push_back(reshape(g, g.new_input("inp_head_ids", QType::I32, h * n_tok), h, n_tok));
            }
    if (kv.n_seq() > 1) {
        in.q_seq = g.new_input("inp_seq", QType::I32, n_tok);
        in.kv_seq = g.new_input("inp_kv_seq", QType::I32, n_kv);
        in.seq_end = g.new_input("inp_seq_end", QType::I32, kv.n_seq());
    }
    if (storage) {  // after every input exists: each gets host storage
        storage->clear();
        for (Tensor* t : g.inputs()) {
            storage->emplace_back(t->ne[0]);
            t->data = storage->back().data();
        }
    }
    BuildContext c{g, model, kv, in, n_tok, n_kv, n_out};
    c.host_expert_share = o.stage ? o.cpu_share : 0.0f;
    c.embeddings = o.embeddings;
    g.output = model.arch().build(c);
    if (o.batched) {  // every product over the tokens and the attention; the logits' rows follow their count
        std::set<const Tensor*> heads{model.output()};
        for (int s = 0; s < model.n_shards(); s++) heads.insert(model.shard_output(s));
        for (Tensor* t : g.nodes())
            if ((t->op == Op::MUL_MAT && !heads.count(t->src[0])) || t->op == Op::FLASH_ATTN) mark_batched(*t);
    }
    schedule(g, model.backends(), o.stage);
}

namespace {

// The worst-case graphs of a context and their plans. Expert staging (ContextParams::
// moe_offload_min) gives the micro-batches from stage_min tokens on another topology than the
// smaller ones: `ref` is the worst staged shape and `small` the worst of the others, planned
// apart into the same buffers (each device's buffer is the larger of the two; they never run at
// once: with staging the devices take turns). Without staging (no device stages, or none of
// the worst shape's expert products is staged), `ref` is the one worst shape and stage_min 0.
struct ContextPlans {
    ComputePlan plan, small_plan;
    int64_t stage_min = 0;
    PipelineMode pipeline;
};

// Builds `ref` (and `small` where the shapes have two topologies); returns stage_min.
int64_t context_graphs(const Model& m, const ContextParams& p, KVCache& shape_only, Graph& ref, Graph& small) {
    const bool may_stage = p.moe_offload_min > 0 && p.n_ubatch >= p.moe_offload_min && !own_copy_area(m);
    BuildInputs in;
    build_scheduled_graph(m, shape_only, p.n_ubatch, p.n_ctx, p.n_outputs, ref, in, nullptr,
                          {false, may_stage, p.embeddings, p.moe_cpu_share});
    bool staged = false;
    for (const Tensor* n : ref.nodes()) staged = staged || n->staged;
    if (!staged) return 0;
    if (p.moe_offload_min > 1) {
        const int64_t nt = p.moe_offload_min - 1;
        BuildInputs in_small;
        build_scheduled_graph(m, shape_only, nt, p.n_ctx, std::min(p.n_outputs, nt), small, in_small, nullptr,
                              {false, false, p.embeddings});
    }
    return p.moe_offload_min;
}

ContextPlans plan_context(const Model& m, const ContextParams& p, KVCache& shape_only, int n_copies, Graph& ref,
                          Graph& small) {
    ContextPlans r;
    r.stage_min = context_graphs(m, p, shape_only, ref, small);
    if (r.stage_min == 0) {
        r.pipeline = pipeline_mode(m, ref, n_copies);
        r.plan = plan_compute(ref, m.backends(), r.pipeline.n_copies, own_copy_area(m));
        return r;
    }
    r.pipeline.n_copies = 1;
    r.pipeline.reason = "micro-batches of " + std::to_string(r.stage_min) +
                        " tokens or more run host-resident experts on the GPU (moe_offload_min)";
    r.plan = plan_compute(ref, m.backends(), 1, shares_experts(ref));
    if (r.stage_min > 1) r.small_plan = plan_compute(small, m.backends(), 1, false);
    return r;
}

// Staged experts are copied from the model's mapping or its repacked weights at every staged
// micro-batch: page-locked, that copy is a DMA at the bus's speed instead of a host memcpy through
// bounce buffers. The
// pages of every device's staged weights, merged, are pinned by the first staging device (the
// pin is portable), unless that would lock more than half the RAM (STOWLM_PIN_EXPERTS=0: never).
// Returns the bytes pinned.
size_t pin_staged_weights(const Model& m, const Graph& g, const std::vector<Backend*>& backends) {
    if (env_is("STOWLM_PIN_EXPERTS", "0")) return 0;
    const uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    std::vector<std::pair<uintptr_t, uintptr_t>> spans;  // [begin, end), page-aligned
    Backend* stager = nullptr;
    for (const Tensor* n : g.nodes()) {
        if (!n->staged) continue;
        const Tensor* w = staged_weight(*n);
        if (!m.outlives_backends(w->data, w->nbytes())) continue;
        stager = stager ? stager : backends.at(n->device);
        const uintptr_t b = (uintptr_t)w->data;
        spans.emplace_back(b / page * page, (b + w->nbytes() + page - 1) / page * page);
    }
    if (!stager) return 0;
    std::sort(spans.begin(), spans.end());
    std::vector<std::pair<const void*, size_t>> ranges;
    size_t total = 0;
    for (size_t i = 0; i < spans.size();) {
        uintptr_t b = spans[i].first, e = spans[i].second;
        for (++i; i < spans.size() && spans[i].first <= e; ++i) e = std::max(e, spans[i].second);
        ranges.emplace_back((const void*)b, (size_t)(e - b));
        total += e - b;
    }
    if (total > (size_t)sysconf(_SC_PHYS_PAGES) * page / 2) return 0;
    return stager->pin_host(ranges);
}

}  // namespace

KVLayout context_kv_layout(const Model& model, const ContextParams& p) { return kv_layout(model, checked(model, p)); }

Projection project_memory(const Model& model, const ContextParams& params) {
    const ContextParams p = checked(model, params);
    const KVLayout layout = kv_layout(model, p);
    KVCache kv(layout, model.backends(), /*allocate=*/false, p.n_seq);
    Graph ref, small;
    const ContextPlans plans = plan_context(model, p, kv, p.n_copies, ref, small);
    Projection r;
    r.pipeline = plans.pipeline;
    r.devices = report(model, kv.device_bytes(), plans.plan, plans.stage_min > 1 ? &plans.small_plan : nullptr);
    return r;
}

Context::Context(Model& model, const ContextParams& p) : model_(model), params_(checked(model, p)) {
    backends_ = model.backends();
    // Plan on the worst shape first; the smaller shapes reuse its offsets (same topology,
    // every tensor no larger), so nothing is allocated per token or per shape. (With expert
    // staging, the worst of each of the two topologies: plan_context.)
    Graph ref, small;
    KVCache shape_only(kv_layout(model, params_), backends_, false, params_.n_seq);
    {
        ContextPlans plans = plan_context(model, params_, shape_only, params_.n_copies, ref, small);
        pipeline_ = plans.pipeline;
        plan_ = std::move(plans.plan);
        small_plan_ = std::move(plans.small_plan);
        stage_min_ = plans.stage_min;
    }
    if (stage_min_ > 0) pinned_ = pin_staged_weights(model, ref, backends_);
    kv_ = std::make_unique<KVCache>(kv_layout(model, params_), backends_, true, params_.n_seq);
    try {
        compute_ = stage_min_ > 1 ? allocate_compute({&plan_, &small_plan_}, backends_) : allocate_compute(plan_, backends_);
    } catch (const OutOfDeviceMemory& e) {
        if (pipeline_.n_copies == 1) throw;
        // What this attempt allocated is freed already (allocate_compute's buffers die with it).
        pipeline_.reason = "the compute buffers with " + std::to_string(pipeline_.n_copies) +
                           " copies of the crossing tensors did not fit (" + e.what() + "); retried with 1 copy";
        pipeline_.n_copies = 1;
        plan_ = plan_compute(ref, backends_, 1, own_copy_area(model));
        compute_ = allocate_compute(plan_, backends_);
    }
    // Devices of other MPI ranks: on rank 0, the others open the same context now.
    link_ = dist::ContextLink::make(model, params_, dist::schedule_signature(ref));
}

Context::~Context() = default;

void Context::kv_truncate(int64_t n, int seq) {
    std::lock_guard<std::mutex> lock(mu_);
    kv_->truncate(seq, n);
    if (link_ && link_->driver()) link_->send_truncate(seq, n);  // the other ranks' caches follow
}

void Context::kv_span(int seq, int n) {
    std::lock_guard<std::mutex> lock(mu_);
    if (link_) throw InvalidInput("kv_span: a sequence holding other sequences' cells is not supported across MPI ranks");
    kv_->set_span(seq, n);
}

void Context::clear(int seq) {
    std::lock_guard<std::mutex> lock(mu_);
    if (seq < 0) kv_->clear_all();
    else kv_->clear(seq);
    if (link_ && link_->driver()) link_->send_clear(seq);
}

std::string Context::check_plan_sound() const {
    Graph ref, small;
    KVCache shape_only(kv_layout(model_, params_), backends_, false, params_.n_seq);
    context_graphs(model_, params_, shape_only, ref, small);  // the graphs the plans were made for
    std::string why = check_plan(ref, plan_);
    if (why.empty() && stage_min_ > 1) why = check_plan(small, small_plan_);
    return why;
}

std::vector<uint8_t> Context::kv_bytes(int il, bool v) const {
    if (il < 0 || il >= (int)model_.hp().n_layer) throw InvalidInput("kv_bytes: no layer " + std::to_string(il));
    Tensor* t = v ? kv_->v(il) : kv_->k(il);
    std::vector<uint8_t> out(t->nb[1] * (size_t)kv_->n_used());
    if (!out.empty()) backends_[t->device]->copy_to_host(*t, out.data(), out.size());
    return out;
}

std::vector<DeviceMemory> Context::memory_report() const {
    return report(model_, kv_->device_bytes(), plan_, stage_min_ > 1 ? &small_plan_ : nullptr);
}

Context::ShapeGraph& Context::graph_for(int64_t n_tok, int64_t n_kv, int64_t n_out, int slot, bool batched) {
    auto key = std::make_tuple(n_tok, n_kv, n_out, slot, batched);
    auto it = graphs_.find(key);
    if (it != graphs_.end()) return *it->second;
    auto sg = std::make_unique<ShapeGraph>();
    const bool stage = stage_min_ > 0 && n_tok >= stage_min_;
    build_scheduled_graph(model_, *kv_, n_tok, n_kv, n_out, sg->g, sg->in, &sg->input_storage,
                          {batched, stage, params_.embeddings, params_.moe_cpu_share});
    sg->plan = stage || stage_min_ == 0 ? &plan_ : &small_plan_;
    sg->concurrent = stage && shares_experts(sg->g);
    place_graph(sg->g, *sg->plan, compute_, slot);
    plan_of_[&sg->g] = sg->plan;
    return *graphs_.emplace(key, std::move(sg)).first->second;
}

void Context::run_split(const Split& s, const ComputePlan& plan, bool pull_peers) {
    Backend& b = *backends_[s.device];
    for (Tensor* n : s.nodes) {
        if (n->op != Op::COPY) continue;
        const Tensor* src = n->src[0];
        if (src->storage_root()->role == TensorRole::INPUT)
            b.copy_from_host(*n, src->data, src->nbytes());
        else if (pull_peers)
            b.copy_from_peer(*n, *src, *backends_[src->storage_root()->device]);
    }
    BackendBuffer& buf = *compute_.buffers[s.device];
    const size_t scratch = plan.devices[s.device].scratch_bytes;
    b.compute(s, (char*)buf.data + (buf.size - scratch), scratch);
}

void Context::run(ShapeGraph& sg) {
    for (const Split& s : sg.g.splits) run_split(s, *sg.plan, true);
    for (Backend* b : backends_) b->synchronize();
}

void Context::prepare(ShapeGraph& sg, const std::vector<int32_t>& tokens, const std::vector<int32_t>& seqs,
                      const std::vector<int32_t>& pos, int64_t b0, int64_t nt, const std::vector<int32_t>& out) {
    int32_t* in_tok = (int32_t*)sg.in.tokens->data;
    int32_t* in_pos = (int32_t*)sg.in.pos->data;
    for (int64_t i = 0; i < nt; i++) {
        in_tok[i] = tokens[b0 + i];
        in_pos[i] = pos[b0 + i];
    }
    const int64_t n_kv = sg.in.kv_pos->ne[0];
    std::copy(kv_->cell_pos().begin(), kv_->cell_pos().begin() + n_kv, (int32_t*)sg.in.kv_pos->data);
    if (sg.in.q_seq) {
        std::copy(seqs.begin() + b0, seqs.begin() + b0 + nt, (int32_t*)sg.in.q_seq->data);
        std::copy(kv_->cell_seq().begin(), kv_->cell_seq().begin() + n_kv, (int32_t*)sg.in.kv_seq->data);
        for (int q = 0; q < kv_->n_seq(); q++) ((int32_t*)sg.in.seq_end->data)[q] = (int32_t)kv_->region_end(q);
    }
    int32_t* out_ids = (int32_t*)sg.in.out_ids->data;
    for (int64_t i = 0; i < sg.in.out_ids->ne[0]; i++) out_ids[i] = out.empty() ? (int32_t)(nt - 1) : out[i];
    for (Tensor* ids : sg.in.head_ids) {
        int32_t* h = (int32_t*)ids->view_src->data;
        const int64_t n_head = ids->ne[0];
        for (int64_t i = 0; i < n_head * nt; i++) h[i] = (int32_t)(i % n_head);
    }
}

std::vector<float> Context::eval(const std::vector<int32_t>& tokens, const std::vector<int32_t>& positions,
                                 bool all_logits) {
    const int64_t n = (int64_t)tokens.size();
    std::vector<int32_t> rows;
    if (all_logits)
        for (int64_t i = 0; i < n; i++) rows.push_back((int32_t)i);
    else if (n > 0)
        rows.push_back((int32_t)(n - 1));
    return eval_batch(tokens, std::vector<int32_t>((size_t)n, 0), positions, rows);
}

bool Context::can_force_batched() const {
    if (link_ || params_.n_ubatch < kCpuBatchedMinTokens) return false;
    for (Backend* b : backends_)
        if (b->batched_min_tokens() != kCpuBatchedMinTokens || !b->host_accessible()) return false;
    return true;
}

std::vector<float> Context::eval_batch(const std::vector<int32_t>& tokens, const std::vector<int32_t>& seqs,
                                       const std::vector<int32_t>& positions, const std::vector<int32_t>& out_rows,
                                       bool batched) {
    std::lock_guard<std::mutex> lock(mu_);
    const int64_t n = (int64_t)tokens.size();
    if (n == 0) throw InvalidInput("eval: no tokens");
    if (batched && !can_force_batched())
        throw InvalidInput("eval: batched passes need every device to be a CPU of this process and n_ubatch >= " +
                           std::to_string(kCpuBatchedMinTokens));
    if ((int64_t)seqs.size() != n)
        throw InvalidInput("eval: " + std::to_string(seqs.size()) + " sequence ids for " + std::to_string(n) + " tokens");
    if (!positions.empty() && (int64_t)positions.size() != n)
        throw InvalidInput("eval: " + std::to_string(positions.size()) + " positions for " + std::to_string(n) +
                           " tokens");
    const int64_t n_vocab = model_.hp().n_vocab;
    for (int64_t i = 0; i < n; i++) {
        if (tokens[i] < 0 || tokens[i] >= n_vocab)
            throw InvalidInput("eval: token id " + std::to_string(tokens[i]) + " at index " + std::to_string(i) +
                               " is outside the vocabulary [0, " + std::to_string(n_vocab) + ")");
        if (seqs[i] < 0 || seqs[i] >= params_.n_seq)
            throw InvalidInput("eval: sequence " + std::to_string(seqs[i]) + " at index " + std::to_string(i) +
                               " is outside [0, n_seq=" + std::to_string(params_.n_seq) + ")");
    }
    for (size_t r = 0; r < out_rows.size(); r++)
        if (out_rows[r] < 0 || out_rows[r] >= n || (r > 0 && out_rows[r] <= out_rows[r - 1]))
            throw InvalidInput("eval: the rows whose logits are wanted must be ascending token indices in [0, " +
                               std::to_string(n) + ")");
    std::vector<int64_t> n_start(params_.n_seq), n_new(params_.n_seq, 0);
    for (int64_t i = 0; i < n; i++) n_new[seqs[i]]++;
    for (int s = 0; s < params_.n_seq; s++) {
        n_start[s] = kv_->n_used(s);
        if (n_new[s] > 0 && kv_->borrowed_by(s) >= 0)
            throw InvalidInput("eval: sequence " + std::to_string(s) + "'s cells are held by sequence " +
                               std::to_string(kv_->borrowed_by(s)) + " (kv_span)");
        if (n_start[s] + n_new[s] > kv_->capacity(s))
            throw InvalidInput("eval: " + std::to_string(n_new[s]) + " tokens after " + std::to_string(n_start[s]) +
                               " cached need " + std::to_string(n_start[s] + n_new[s]) + " cells, but the context " +
                               (params_.n_seq > 1 ? "of sequence " + std::to_string(s) + " (n_ctx / n_seq" +
                                                        (kv_->span(s) > 1 ? " x " + std::to_string(kv_->span(s)) : "") + ")"
                                                  : std::string("(n_ctx)")) +
                               " is " + std::to_string(kv_->capacity(s)));
    }
    // The other MPI ranks repeat the call from here on (an error from here on ends the job).
    if (link_ && link_->driver()) link_->send_eval(tokens, seqs, positions, out_rows);
    std::vector<int32_t> pos(n);
    {
        std::vector<int64_t> next(n_start);
        for (int64_t i = 0; i < n; i++) pos[i] = positions.empty() ? (int32_t)next[seqs[i]]++ : positions[i];
    }

    // The micro-batches: at most n_ubatch tokens and n_outputs wanted rows each; one that wants
    // none still computes the last row's logits, which are discarded (the graph has one row).
    struct Micro {
        int64_t b0, nt;
        std::vector<int32_t> out;  // micro-batch relative
        int64_t first_out;         // index in out_rows of its first wanted row
    };
    std::vector<Micro> micro;
    size_t r = 0;
    for (int64_t b0 = 0; b0 < n;) {
        Micro m{b0, 0, {}, (int64_t)r};
        while (b0 + m.nt < n && m.nt < params_.n_ubatch) {
            const bool wanted = r < out_rows.size() && out_rows[r] == b0 + m.nt;
            if (wanted && (int64_t)m.out.size() == params_.n_outputs) break;
            if (wanted) m.out.push_back((int32_t)m.nt), r++;
            m.nt++;
        }
        b0 += m.nt;
        micro.push_back(std::move(m));
    }
    const int64_t width = row_width();
    std::vector<float> logits(out_rows.size() * (size_t)width);
    // Takes the micro-batch's cells, then the graph of its shape in copy slot `slot` (the KV range
    // it looks at is the cells in use, in buckets), and fills its inputs.
    std::vector<int32_t> cells(n);
    auto start = [&](int i, int slot) -> ShapeGraph& {
        const Micro& m = micro[i];
        kv_->take(pos.data() + m.b0, seqs.data() + m.b0, m.nt, cells.data() + m.b0);
        const int64_t n_kv = std::min(params_.n_ctx, (kv_->span() + kKvBucket - 1) / kKvBucket * kKvBucket);
        ShapeGraph& sg = graph_for(m.nt, n_kv, std::max<int64_t>(1, (int64_t)m.out.size()), slot, batched);
        std::copy(cells.begin() + m.b0, cells.begin() + m.b0 + m.nt, (int32_t*)sg.in.cells->data);
        prepare(sg, tokens, seqs, pos, m.b0, m.nt, m.out);
        return sg;
    };
    auto copy_logits = [&](int i, const Graph& g) {
        const Micro& m = micro[i];
        if (m.out.empty()) return;
        const Tensor* out = g.output;
        const size_t bytes = m.out.size() * (size_t)width * sizeof(float);
        if (link_ && link_->logits(i, *out, logits.data() + m.first_out * width, bytes, backends_)) return;
        backends_[out->device]->copy_to_host(*out, logits.data() + m.first_out * width, bytes);
    };
    try {
        // Tensor parallelism runs its devices at once (their all-reduces meet inside their splits).
        // So do the ranks of an MPI job, each running the splits of its own devices.
        if ((pipeline_.n_copies > 1 && micro.size() > 1) || model_.tensor_parallel() || link_) {
            const int slots = pipeline_.n_copies;
            PipelineLink pl;
            if (link_) {
                pl.remote = link_->remote();
                pl.receive = [&](int i, const Graph& g, const Split& s) { link_->receive(i, g, s, backends_); };
                pl.send = [&](int i, const Graph& g, const Tensor& c) { link_->send(i, g, c, backends_); };
            }
            run_pipeline(
                (int)micro.size(), slots, backends_, [&](int i) { return &start(i, i % slots).g; },
                [&](const Graph& g, const Split& s) { run_split(s, *plan_of_.at(&g), false); }, copy_logits, &stats_,
                link_ ? &pl : nullptr);
        } else {
            for (int i = 0; i < (int)micro.size(); i++) {
                ShapeGraph& sg = start(i, 0);
                if (sg.concurrent)  // the host's share of the experts while the GPU does the rest
                    run_pipeline(
                        1, 1, backends_, [&](int) { return &sg.g; },
                        [&](const Graph&, const Split& s) { run_split(s, *sg.plan, false); },
                        [&](int, const Graph& g) { copy_logits(i, g); }, nullptr);
                else {
                    run(sg);
                    copy_logits(i, sg.g);
                }
            }
        }
    } catch (...) {
        if (link_) link_->fatal_current("evaluating a batch");  // the ranks are mid-way through it
        for (int s = 0; s < params_.n_seq; s++) kv_->truncate(s, n_start[s]);  // leave the cache as it was
        throw;
    }
    return logits;
}

}  // namespace stowlm
