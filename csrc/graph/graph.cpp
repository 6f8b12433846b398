#include "graph/graph.h"

#include <chrono>
#include <thread>

#include "error.h"
#include "spin.h"

namespace stowlm {

const char* op_name(Op op) {
    switch (op) {
        case Op::NONE: return "none";
        case Op::VIEW: return "view";
        case Op::GET_ROWS: return "get_rows";
        case Op::MUL_MAT: return "mul_mat";
        case Op::ADD: return "add";
        case Op::MUL: return "mul";
        case Op::SCALE: return "scale";
        case Op::SOFTCAP: return "softcap";
        case Op::RMS_NORM: return "rms_norm";
        case Op::ROPE: return "rope";
        case Op::STORE_KV: return "store_kv";
        case Op::FLASH_ATTN: return "flash_attn";
        case Op::SWIGLU: return "swiglu";
        case Op::GEGLU: return "geglu";
        case Op::COPY: return "copy";
        case Op::CONT: return "cont";
        case Op::CONCAT: return "concat";
        case Op::SWIGLU_OAI: return "swiglu_oai";
        case Op::ADD_ID: return "add_id";
        case Op::TOP_K: return "top_k";
        case Op::MOE_WEIGHTS: return "moe_weights";
        case Op::MUL_MAT_ID: return "mul_mat_id";
        case Op::MOE_SUM: return "moe_sum";
        case Op::LOCAL_IDS: return "local_ids";
        case Op::ALL_REDUCE: return "all_reduce";
        case Op::ALL_GATHER: return "all_gather";
    }
    return "?";
}

size_t tensor_row_bytes(QType t, int64_t n) {
    if (t == QType::I32) return (size_t)n * 4;
    return row_bytes(t, n);
}

size_t Tensor::row_size() const { return tensor_row_bytes(type, ne[0]); }

void set_contiguous_strides(Tensor& t) {
    t.nb[0] = t.type == QType::I32 ? 4 : qtype_info((uint32_t)t.type)->block_bytes;
    t.nb[1] = tensor_row_bytes(t.type, t.ne[0]);
    t.nb[2] = t.nb[1] * t.ne[1];
    t.nb[3] = t.nb[2] * t.ne[2];
}

bool Tensor::is_contiguous() const {
    return nb[1] == row_size() && nb[2] == nb[1] * ne[1] && nb[3] == nb[2] * ne[2];
}

Tensor* Graph::new_tensor(const std::string& name, QType type, int64_t ne0, int64_t ne1, int64_t ne2, int64_t ne3,
                          TensorRole role) {
    owned_.emplace_back();
    Tensor* t = &owned_.back();
    t->name = name;
    t->type = type;
    t->ne[0] = ne0, t->ne[1] = ne1, t->ne[2] = ne2, t->ne[3] = ne3;
    t->role = role;
    set_contiguous_strides(*t);
    return t;
}

Tensor* Graph::new_input(const std::string& name, QType type, int64_t n) {
    Tensor* t = new_tensor(name, type, n, 1, 1, 1, TensorRole::INPUT);
    inputs_.push_back(t);
    return t;
}

std::vector<Tensor*> Graph::exec_order() const {
    std::vector<Tensor*> out;
    for (const Split& s : splits) out.insert(out.end(), s.nodes.begin(), s.nodes.end());
    return out;
}

std::unordered_map<const Tensor*, int> Graph::split_of() const {
    std::unordered_map<const Tensor*, int> at;
    for (int j = 0; j < (int)splits.size(); j++)
        for (const Tensor* n : splits[j].nodes) at[n] = j;
    return at;
}

namespace {

Tensor* node(Graph& g, Op op, const Tensor* shape_of, QType type, std::initializer_list<Tensor*> srcs) {
    Tensor* t = g.new_tensor(std::string(op_name(op)), type, shape_of->ne[0], shape_of->ne[1], shape_of->ne[2],
                             shape_of->ne[3]);
    t->op = op;
    int i = 0;
    for (Tensor* s : srcs) t->src[i++] = s;
    g.add_node(t);
    return t;
}

void check(bool ok, const char* op, const Tensor* a, const char* what) {
    if (!ok) throw InvalidInput(std::string("graph: ") + op + " on '" + a->name + "': " + what);
}

bool same_shape(const Tensor* a, const Tensor* b) {
    return a->ne[0] == b->ne[0] && a->ne[1] == b->ne[1] && a->ne[2] == b->ne[2] && a->ne[3] == b->ne[3];
}

}  // namespace

Tensor* get_rows(Graph& g, Tensor* table, Tensor* ids) {
    check(ids->type == QType::I32, "get_rows", ids, "ids must be I32");
    Tensor* t = g.new_tensor("get_rows", QType::F32, table->ne[0], ids->ne[0]);
    t->op = Op::GET_ROWS;
    t->src[0] = table, t->src[1] = ids;
    g.add_node(t);
    return t;
}

Tensor* mul_mat(Graph& g, Tensor* w, Tensor* x) {
    check(w->ne[0] == x->ne[0], "mul_mat", w, "weight columns differ from activation length");
    check(x->type == QType::F32, "mul_mat", x, "activation must be F32");
    Tensor* t = g.new_tensor("mul_mat", QType::F32, w->ne[1], x->n_rows());
    t->op = Op::MUL_MAT;
    t->src[0] = w, t->src[1] = x;
    g.add_node(t);
    return t;
}

static Tensor* binary(Graph& g, Op op, Tensor* a, Tensor* b) {
    check(a->ne[0] == b->ne[0] && (b->n_rows() == 1 || b->n_rows() == a->n_rows()), op_name(op), a,
          "operands differ in shape");
    return node(g, op, a, QType::F32, {a, b});
}
Tensor* add(Graph& g, Tensor* a, Tensor* b) { return binary(g, Op::ADD, a, b); }
Tensor* mul(Graph& g, Tensor* a, Tensor* b) { return binary(g, Op::MUL, a, b); }

Tensor* scale(Graph& g, Tensor* a, float s) {
    Tensor* t = node(g, Op::SCALE, a, QType::F32, {a});
    t->fparams[0] = s;
    return t;
}

Tensor* softcap(Graph& g, Tensor* a, float cap) {
    Tensor* t = node(g, Op::SOFTCAP, a, QType::F32, {a});
    t->fparams[0] = cap;
    return t;
}

Tensor* rms_norm(Graph& g, Tensor* x, Tensor* weight, float eps) {
    check(!weight || weight->ne[0] == x->ne[0], "rms_norm", x, "weight length differs from row length");
    Tensor* t = node(g, Op::RMS_NORM, x, QType::F32, {x, weight});
    t->fparams[0] = eps;
    return t;
}

Tensor* reshape(Graph& g, Tensor* x, int64_t ne0, int64_t ne1, int64_t ne2) {
    check(x->is_contiguous() && ne0 * ne1 * ne2 == x->n_elements(), "reshape", x, "element count or layout");
    Tensor* t = g.new_tensor(x->name + ".view", x->type, ne0, ne1, ne2);
    t->op = Op::VIEW;
    t->src[0] = x;
    t->view_src = x;
    t->role = x->role;
    return t;  // a view is no node: it computes nothing
}

Tensor* view_rows(Graph& g, Tensor* x, int64_t n) {
    check(n <= x->ne[1] && x->ne[2] == 1, "view_rows", x, "row count");
    Tensor* t = g.new_tensor(x->name + ".rows", x->type, x->ne[0], n);
    t->op = Op::VIEW;
    t->src[0] = x;
    t->view_src = x;
    t->role = x->role;
    return t;
}

Tensor* rope(Graph& g, Tensor* x, Tensor* pos, const RopeSpec& r) {
    check(pos->type == QType::I32 && pos->ne[0] == x->ne[2], "rope", x, "positions must be I32, one per token");
    check(r.n_rot <= x->ne[0] && r.n_rot % 2 == 0, "rope", x, "n_rot must be even and <= head_dim");
    check(x->is_contiguous(), "rope", x, "must be contiguous (cont() a view first)");
    Tensor* t = node(g, Op::ROPE, x, QType::F32, {x, pos});
    t->iparams[0] = r.n_rot, t->iparams[1] = r.neox, t->iparams[2] = r.n_ctx_orig;
    t->fparams[0] = r.freq_base, t->fparams[1] = r.freq_scale, t->fparams[2] = r.ext_factor;
    t->fparams[3] = r.attn_factor, t->fparams[4] = r.beta_fast, t->fparams[5] = r.beta_slow;
    return t;
}

Tensor* view_cols(Graph& g, Tensor* x, int64_t n, int64_t first) {
    check(first >= 0 && n > 0 && first + n <= x->ne[0], "view_cols", x, "columns out of range");
    const int64_t block = x->type == QType::I32 ? 1 : qtype_info((uint32_t)x->type)->block_elems;
    check(first % block == 0 && n % block == 0, "view_cols", x, "a quantized view must cover whole blocks");
    Tensor* t = g.new_tensor(x->name + ".cols", x->type, n, x->ne[1], x->ne[2], x->ne[3]);
    t->nb[1] = x->nb[1], t->nb[2] = x->nb[2], t->nb[3] = x->nb[3];
    t->op = Op::VIEW;
    t->src[0] = x;
    t->view_src = x;
    t->view_offset = tensor_row_bytes(x->type, first);
    t->role = x->role;
    return t;
}

Tensor* cont(Graph& g, Tensor* x) {
    check(x->type == QType::F32, "cont", x, "F32 only");
    Tensor* t = g.new_tensor("cont", QType::F32, x->ne[0], x->ne[1], x->ne[2], x->ne[3]);
    t->op = Op::CONT;
    t->src[0] = x;
    g.add_node(t);
    return t;
}

Tensor* concat(Graph& g, Tensor* a, Tensor* b) {
    check(a->type == QType::F32 && b->type == QType::F32 && a->ne[1] == b->ne[1] && a->ne[2] == b->ne[2] &&
              a->ne[3] == b->ne[3],
          "concat", a, "F32 operands with the same rows");
    Tensor* t = g.new_tensor("concat", QType::F32, a->ne[0] + b->ne[0], a->ne[1], a->ne[2], a->ne[3]);
    t->op = Op::CONCAT;
    t->src[0] = a, t->src[1] = b;
    g.add_node(t);
    return t;
}

Tensor* swiglu_oai(Graph& g, Tensor* gate, Tensor* up, float alpha, float limit) {
    check(same_shape(gate, up) && gate->is_contiguous() && up->is_contiguous(), "swiglu_oai", gate,
          "gate and up differ in shape or are not contiguous");
    Tensor* t = node(g, Op::SWIGLU_OAI, gate, QType::F32, {gate, up});
    t->fparams[0] = alpha, t->fparams[1] = limit;
    return t;
}

Tensor* add_id(Graph& g, Tensor* x, Tensor* bias, Tensor* ids) {
    check(x->type == QType::F32 && x->is_contiguous() && bias->type == QType::F32 && bias->ne[0] == x->ne[0] &&
              ids->type == QType::I32 && ids->ne[0] == x->ne[1] && ids->ne[1] == x->ne[2],
          "add_id", x, "x [d, k, n] F32, bias [d, n_expert] F32, ids I32 [k, n]");
    Tensor* t = node(g, Op::ADD_ID, x, QType::F32, {x, bias, ids});
    return t;
}

Tensor* store_kv(Graph& g, Tensor* x, Tensor* cache, Tensor* cells) {
    check(x->ne[0] * x->ne[1] == cache->ne[0], "store_kv", x, "row length differs from the cache's");
    check(cells->ne[0] == x->ne[2], "store_kv", x, "one cell per token");
    Tensor* t = g.new_tensor("store_kv", QType::F32, 0);  // ordering token, no bytes
    t->ne[0] = 0;
    set_contiguous_strides(*t);
    t->op = Op::STORE_KV;
    t->src[0] = x, t->src[1] = cache, t->src[2] = cells;
    g.add_node(t);
    return t;
}

Tensor* flash_attn(Graph& g, Tensor* q, Tensor* k, Tensor* v, const AttnMask& mask, Tensor* k_stored,
                   Tensor* v_stored, float scale, float softcap, int32_t window, Tensor* sinks) {
    Tensor *q_pos = mask.q_pos, *kv_pos = mask.kv_pos;
    check(!mask.q_seq == !mask.kv_seq && (!mask.q_seq || (mask.q_seq->ne[0] == q->ne[2] &&
                                                          mask.kv_seq->ne[0] == kv_pos->ne[0])),
          "flash_attn", q, "sequence ids: one per query and one per cell, or none");
    const int64_t n_head_kv = k->ne[0] / q->ne[0];
    check(n_head_kv >= 1 && k->ne[0] % q->ne[0] == 0 && q->ne[1] % n_head_kv == 0, "flash_attn", q,
          "query heads not a multiple of KV heads");
    check(v->ne[0] % n_head_kv == 0 && v->ne[1] == k->ne[1], "flash_attn", v, "V rows differ from K's");
    check(k->ne[1] == kv_pos->ne[0], "flash_attn", k, "KV cells differ from kv_pos length");
    check(!sinks || (sinks->type == QType::F32 && sinks->ne[0] == q->ne[1]), "flash_attn", q,
          "sinks must be F32 [n_head]");
    Tensor* t = g.new_tensor("flash_attn", QType::F32, v->ne[0] / n_head_kv * q->ne[1], q->ne[2]);
    t->op = Op::FLASH_ATTN;
    t->src[0] = q, t->src[1] = k, t->src[2] = v, t->src[3] = q_pos, t->src[4] = kv_pos;
    t->src[5] = k_stored, t->src[6] = v_stored, t->src[7] = sinks, t->src[8] = mask.q_seq, t->src[9] = mask.kv_seq;
    t->src[10] = mask.seq_end;
    t->fparams[0] = scale, t->fparams[1] = softcap;
    t->iparams[0] = window, t->iparams[1] = mask.split_cells, t->iparams[2] = mask.seq_cells;
    t->iparams[4] = mask.ctx_cells;  // [3] is the batched mark
    g.add_node(t);
    return t;
}

Tensor* swiglu(Graph& g, Tensor* gate, Tensor* up) {
    check(same_shape(gate, up), "swiglu", gate, "gate and up differ in shape");
    return node(g, Op::SWIGLU, gate, QType::F32, {gate, up});
}

Tensor* geglu(Graph& g, Tensor* gate, Tensor* up) {
    check(same_shape(gate, up), "geglu", gate, "gate and up differ in shape");
    return node(g, Op::GEGLU, gate, QType::F32, {gate, up});
}

Tensor* copy_to_device(Graph& g, Tensor* src, int device) {
    Tensor* t = g.new_tensor(src->name + ".copy", src->type, src->ne[0], src->ne[1], src->ne[2], src->ne[3]);
    t->op = Op::COPY;
    t->src[0] = src;
    t->device = device;
    return t;  // the scheduler places it in its split
}

Tensor* top_k(Graph& g, Tensor* x, int64_t k, int32_t gating, Tensor* bias, int32_t n_groups, int32_t n_group_used) {
    check(x->type == QType::F32 && k >= 1 && k <= x->ne[0], "top_k", x, "k must be in [1, row length] (F32 rows)");
    check(!bias || (bias->type == QType::F32 && bias->ne[0] == x->ne[0]), "top_k", x, "bias must be F32 [n]");
    check(n_groups <= 1 || (x->ne[0] % n_groups == 0 && n_group_used >= 1 && n_group_used <= n_groups &&
                            k <= x->ne[0] / n_groups * n_group_used),
          "top_k", x, "groups must divide the row, and the kept groups hold at least k");
    Tensor* t = g.new_tensor("top_k", QType::I32, k, x->n_rows());
    t->op = Op::TOP_K;
    t->src[0] = x, t->src[1] = bias;
    t->iparams[0] = (int32_t)k, t->iparams[1] = gating, t->iparams[2] = n_groups, t->iparams[3] = n_group_used;
    g.add_node(t);
    return t;
}

Tensor* moe_weights(Graph& g, Tensor* logits, Tensor* ids, int32_t gating, bool normalize, float scale) {
    check(ids->type == QType::I32 && ids->ne[1] == logits->n_rows(), "moe_weights", logits,
          "ids must be I32 [k, tokens]");
    Tensor* t = g.new_tensor("moe_weights", QType::F32, ids->ne[0], ids->ne[1]);
    t->op = Op::MOE_WEIGHTS;
    t->src[0] = logits, t->src[1] = ids;
    t->iparams[0] = gating, t->iparams[1] = normalize;
    t->fparams[0] = scale;
    g.add_node(t);
    return t;
}

Tensor* mul_mat_id(Graph& g, Tensor* experts, Tensor* x, Tensor* ids) {
    const int64_t k = ids->ne[0], n = ids->ne[1];
    check(experts->ne[0] == x->ne[0], "mul_mat_id", experts, "expert columns differ from activation length");
    check(x->type == QType::F32 && x->is_contiguous(), "mul_mat_id", x, "activation must be contiguous F32");
    check(ids->type == QType::I32, "mul_mat_id", ids, "ids must be I32 [k, tokens]");
    check((x->ne[1] == 1 || x->ne[1] == k) && x->ne[2] == n, "mul_mat_id", x,
          "activation must be [cols, 1 or k, tokens]");
    Tensor* t = g.new_tensor("mul_mat_id", QType::F32, experts->ne[1], k, n);
    t->op = Op::MUL_MAT_ID;
    t->src[0] = experts, t->src[1] = x, t->src[2] = ids;
    g.add_node(t);
    return t;
}

Tensor* moe_sum(Graph& g, Tensor* e, Tensor* weights) {
    check(weights->ne[0] == e->ne[1] && weights->ne[1] == e->ne[2], "moe_sum", e, "weights must be [k, tokens]");
    Tensor* t = g.new_tensor("moe_sum", QType::F32, e->ne[0], e->ne[2]);
    t->op = Op::MOE_SUM;
    t->src[0] = e, t->src[1] = weights;
    g.add_node(t);
    return t;
}

Tensor* local_ids(Graph& g, Tensor* ids, int64_t first, int64_t n) {
    check(ids->type == QType::I32 && ids->is_contiguous(), "local_ids", ids, "ids must be contiguous I32");
    Tensor* t = node(g, Op::LOCAL_IDS, ids, QType::I32, {ids});
    t->iparams[0] = (int32_t)first, t->iparams[1] = (int32_t)n;
    return t;
}

// A collective over parts (one per shard, null where a shard gives nothing) and its nodes: one
// per shard, on devices[s], of shape ne, reading that shard's part.
static std::vector<Tensor*> collective_nodes(Graph& g, Op op, const std::vector<Tensor*>& parts,
                                             const std::vector<int>& devices, const int64_t (&ne)[4],
                                             std::vector<int64_t> row0 = {}) {
    Collective* c = g.new_collective();
    c->parts = parts;
    c->shards.resize(parts.size());
    c->row0 = std::move(row0);
    for (size_t s = 0; s < parts.size(); s++) {
        Tensor* t = g.new_tensor(op_name(op), QType::F32, ne[0], ne[1], ne[2], ne[3]);
        t->op = op;
        t->src[0] = parts[s];
        t->device = devices[s];
        t->iparams[0] = (int32_t)s;
        t->collective = c;
        g.add_node(t);
        c->outs.push_back(t);
    }
    return c->outs;
}

static void check_shards(const std::vector<Tensor*>& parts, const std::vector<int>& devices, const char* what) {
    if (parts.size() != devices.size() || parts.empty())
        throw InvalidInput(std::string("graph: ") + what + " needs one part (or null) per device");
}

std::vector<Tensor*> all_reduce(Graph& g, const std::vector<Tensor*>& parts, const std::vector<int>& devices,
                                int64_t ne0, int64_t ne1) {
    check_shards(parts, devices, "all_reduce");
    for (Tensor* p : parts)
        if (p) check(p->type == QType::F32 && p->is_contiguous() && p->ne[0] == ne0 && p->n_rows() == ne1, "all_reduce",
                     p, "parts must be contiguous F32 of the reduced shape");
    return collective_nodes(g, Op::ALL_REDUCE, parts, devices, {ne0, ne1, 1, 1});
}

std::vector<Tensor*> all_gather(Graph& g, const std::vector<Tensor*>& parts, const std::vector<int>& devices) {
    check_shards(parts, devices, "all_gather");
    const Tensor* shape = nullptr;
    for (Tensor* p : parts)
        if (p && !shape) shape = p;
    if (!shape) throw InvalidInput("graph: all_gather of no parts");
    std::vector<int64_t> row0 = {0};
    for (Tensor* p : parts) {
        if (p) check(p->type == QType::F32 && p->is_contiguous() && p->ne[1] == shape->ne[1] &&
                         p->ne[2] == shape->ne[2] && p->ne[3] == shape->ne[3],
                     "all_gather", p, "parts must be contiguous F32 alike but for their rows");
        row0.push_back(row0.back() + (p ? p->ne[0] : 0));
    }
    const int64_t ne[4] = {row0.back(), shape->ne[1], shape->ne[2], shape->ne[3]};
    return collective_nodes(g, Op::ALL_GATHER, parts, devices, ne, std::move(row0));
}

// A barrier of outs.size() shards: the last to arrive opens it for all. Waiters spin a little
// first (a generated token meets here two or four times a layer, and a sleep costs more than
// the wait), then sleep.
void Collective::wait_all() {
    const uint64_t gen = generation_.load(std::memory_order_acquire);
    if (aborted_.load()) throw InvalidInput("all_reduce: another device failed");
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == (int)outs.size()) {
        arrived_.store(0, std::memory_order_relaxed);
        generation_.fetch_add(1, std::memory_order_acq_rel);
        std::lock_guard<std::mutex> lock(mu_);
        cv_.notify_all();
        return;
    }
    // A short spin, then looks between yields for up to 2 ms (a yield returns at once when the
    // core has nothing else to run, and gives it away when the machine has more threads than
    // cores), then sleep. Sleeping sooner makes the devices take turns waking each other.
    for (int i = 0; i < 1 << 11; i++) {
        if (generation_.load(std::memory_order_acquire) != gen) return;
        if (aborted_.load(std::memory_order_relaxed)) break;
        cpu_pause();
    }
    const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(2);
    while (!aborted_.load(std::memory_order_relaxed) && std::chrono::steady_clock::now() < until) {
        if (generation_.load(std::memory_order_acquire) != gen) return;
        std::this_thread::yield();
    }
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return generation_.load(std::memory_order_acquire) != gen || aborted_.load(); });
    if (generation_.load(std::memory_order_acquire) == gen) throw InvalidInput("all_reduce: another device failed");
}

void Collective::abort() {
    std::lock_guard<std::mutex> lock(mu_);
    aborted_ = true;
    cv_.notify_all();
}

void Collective::reset() {
    std::lock_guard<std::mutex> lock(mu_);
    aborted_ = false;
    arrived_ = 0;
}

}  // namespace stowlm
