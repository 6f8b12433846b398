#include "models/blocks.h"

#include <algorithm>
#include <cmath>
#include <functional>

#include "error.h"
#include "kv/kv_cache.h"

namespace stowlm {

std::string layer_tensor(int il, const char* what) { return "blk." + std::to_string(il) + "." + what; }

void load_moe_layer(Model& m, int il, LayerWeights& w) {
    const HParams& hp = m.hp();
    auto req = [&](const char* n) { return m.require(layer_tensor(il, n)); };
    w.ffn_gate_inp = req("ffn_gate_inp.weight");
    w.ffn_gate_exps = req("ffn_gate_exps.weight");
    w.ffn_up_exps = req("ffn_up_exps.weight");
    w.ffn_down_exps = req("ffn_down_exps.weight");
    auto bad = [&](const Tensor* t, const std::string& want) {
        throw InvalidInput(m.file().path() + ": " + t->name + " has shape [" + std::to_string(t->ne[0]) + ", " +
                           std::to_string(t->ne[1]) + ", " + std::to_string(t->ne[2]) + "], expected " + want);
    };
    const std::string E = std::to_string(hp.n_embd), N = std::to_string(hp.n_expert);
    if (w.ffn_gate_inp->ne[0] != hp.n_embd || w.ffn_gate_inp->ne[1] != hp.n_expert || w.ffn_gate_inp->ne[2] != 1)
        bad(w.ffn_gate_inp, "[" + E + ", " + N + "] (n_embd, expert_count)");
    const int64_t ff = w.ffn_gate_exps->ne[1];
    const std::string F = std::to_string(ff);
    for (const Tensor* t : {w.ffn_gate_exps, w.ffn_up_exps})
        if (t->ne[0] != hp.n_embd || t->ne[1] != ff || t->ne[2] != hp.n_expert)
            bad(t, "[" + E + ", " + F + ", " + N + "] (n_embd, expert ff, expert_count)");
    if (w.ffn_down_exps->ne[0] != ff || w.ffn_down_exps->ne[1] != hp.n_embd || w.ffn_down_exps->ne[2] != hp.n_expert)
        bad(w.ffn_down_exps, "[" + F + ", " + E + ", " + N + "] (expert ff, n_embd, expert_count)");
    auto opt = [&](const char* n) { return m.optional(layer_tensor(il, n)); };
    w.ffn_gate_inp_b = opt("ffn_gate_inp.bias");
    w.ffn_exp_probs_b = opt("exp_probs_b.bias");
    for (const Tensor* b : {w.ffn_gate_inp_b, w.ffn_exp_probs_b})
        if (b && (b->ne[0] != hp.n_expert || b->n_rows() != 1)) bad(b, "[" + N + "] (expert_count)");
    w.ffn_gate_exps_b = opt("ffn_gate_exps.bias");
    w.ffn_up_exps_b = opt("ffn_up_exps.bias");
    w.ffn_down_exps_b = opt("ffn_down_exps.bias");
    for (const Tensor* b : {w.ffn_gate_exps_b, w.ffn_up_exps_b})
        if (b && (b->ne[0] != ff || b->ne[1] != hp.n_expert)) bad(b, "[" + F + ", " + N + "] (expert ff, expert_count)");
    if (w.ffn_down_exps_b && (w.ffn_down_exps_b->ne[0] != hp.n_embd || w.ffn_down_exps_b->ne[1] != hp.n_expert))
        bad(w.ffn_down_exps_b, "[" + E + ", " + N + "] (n_embd, expert_count)");
    w.ffn_up_shexp = opt("ffn_up_shexp.weight");
    if (w.ffn_up_shexp) {
        w.ffn_gate_shexp = req("ffn_gate_shexp.weight");
        w.ffn_down_shexp = req("ffn_down_shexp.weight");
        w.ffn_gate_inp_shexp = opt("ffn_gate_inp_shexp.weight");
        if (w.ffn_gate_inp_shexp && (w.ffn_gate_inp_shexp->ne[0] != hp.n_embd || w.ffn_gate_inp_shexp->ne[1] != 1))
            bad(w.ffn_gate_inp_shexp, "[" + E + "] (n_embd)");
    }
}

void load_attention_layer(Model& m, int il, LayerWeights& w) {
    auto req = [&](const char* n) { return m.require(layer_tensor(il, n)); };
    auto opt = [&](const char* n) { return m.optional(layer_tensor(il, n)); };
    w.attn_norm = req("attn_norm.weight");
    w.wq = req("attn_q.weight");
    w.wk = req("attn_k.weight");
    w.wv = req("attn_v.weight");
    w.wo = req("attn_output.weight");
    w.bq = opt("attn_q.bias");
    w.bk = opt("attn_k.bias");
    w.bv = opt("attn_v.bias");
    w.bo = opt("attn_output.bias");
    w.q_norm = opt("attn_q_norm.weight");
    w.k_norm = opt("attn_k_norm.weight");
    w.post_attn_norm = opt("post_attention_norm.weight");
    w.attn_sinks = opt("attn_sinks.weight");
    if (w.attn_sinks && w.attn_sinks->ne[0] != m.hp().n_head)
        throw InvalidInput(m.file().path() + ": " + w.attn_sinks->name + " must have one value per head (" +
                           std::to_string(m.hp().n_head) + ")");
}

void load_ffn_layer(Model& m, int il, LayerWeights& w) {
    auto req = [&](const char* n) { return m.require(layer_tensor(il, n)); };
    if (m.hp().n_expert > 0 && il >= m.hp().n_layer_dense_lead) {
        load_moe_layer(m, il, w);
    } else {
        w.ffn_gate = req("ffn_gate.weight");
        w.ffn_up = req("ffn_up.weight");
        w.ffn_down = req("ffn_down.weight");
    }
    w.post_ffn_norm = m.optional(layer_tensor(il, "post_ffw_norm.weight"));
}

void load_layer_norm_named_post_attention(Model& m, int il, LayerWeights& w) {
    load_attention_layer(m, il, w);
    w.ffn_norm = w.post_attn_norm ? w.post_attn_norm : m.require(layer_tensor(il, "post_attention_norm.weight"));
    w.post_attn_norm = nullptr;
    load_ffn_layer(m, il, w);
}

void load_standard_layer(Model& m, int il, LayerWeights& w) {
    load_attention_layer(m, il, w);
    w.ffn_norm = m.require(layer_tensor(il, "ffn_norm.weight"));
    load_ffn_layer(m, il, w);
}

static Tensor* named(Tensor* t, int il, const char* what) {
    t->name = il >= 0 ? layer_tensor(il, what) : what;
    return t;
}

Tensor* build_embedding(BuildContext& c) {
    Tensor* x = named(get_rows(c.g, c.model.tok_embd(), c.in.tokens), -1, "inp_embd");
    if (c.model.hp().embed_scale != 1.0f) x = named(scale(c.g, x, c.model.hp().embed_scale), -1, "inp_scaled");
    return x;
}

RopeSpec rope_spec(const HParams& hp, bool swa) {
    RopeSpec r;
    r.n_rot = (int32_t)hp.n_rot;
    r.freq_base = swa ? hp.rope_base_swa : hp.rope_base;
    r.freq_scale = swa ? hp.rope_scale_swa : hp.rope_scale;
    r.neox = hp.rope_neox;
    r.ext_factor = hp.yarn_ext_factor, r.attn_factor = hp.yarn_attn_factor;
    r.beta_fast = hp.yarn_beta_fast, r.beta_slow = hp.yarn_beta_slow, r.n_ctx_orig = hp.n_ctx_orig;
    return r;
}

AttnMask attn_mask(const BuildContext& c) {
    AttnMask m;
    m.q_pos = c.in.pos, m.kv_pos = c.in.kv_pos, m.q_seq = c.in.q_seq, m.kv_seq = c.in.kv_seq;
    // Several sequences: fixed KV splits, so a token's attention is the same in any batch.
    // Fixed splits for several sequences, on boundaries every region shares, so results are batch-independent.
    m.split_cells = c.in.q_seq ? kv_split_cells(c.kv.seq_ctx()) : 0;
    m.seq_cells = c.in.q_seq ? (int32_t)c.kv.seq_ctx() : 0;
    m.seq_end = c.in.seq_end;
    m.ctx_cells = (int32_t)c.kv.n_ctx();
    return m;
}

Tensor* build_attention(BuildContext& c, int il, Tensor* x) {
    const HParams& hp = c.model.hp();
    const LayerWeights& w = c.w(il);
    const ShardGeometry& geom = c.geom(il);
    Graph& g = c.g;
    const int64_t hd = hp.head_dim_k, n = c.n_tok;

    Tensor* q = named(mul_mat(g, w.wq, x), il, "q");
    Tensor* k = named(mul_mat(g, w.wk, x), il, "k");
    Tensor* v = named(mul_mat(g, w.wv, x), il, "v");
    if (w.bq) q = named(add(g, q, w.bq), il, "q_bias");
    if (w.bk) k = named(add(g, k, w.bk), il, "k_bias");
    if (w.bv) v = named(add(g, v, w.bv), il, "v_bias");
    q = reshape(g, q, hd, geom.q_heads, n);
    k = reshape(g, k, hd, geom.kv_heads, n);
    v = reshape(g, v, hd, geom.kv_heads, n);
    if (w.q_norm) q = named(rms_norm(g, q, w.q_norm, hp.eps), il, "q_norm");
    if (w.k_norm) k = named(rms_norm(g, k, w.k_norm, hp.eps), il, "k_norm");

    const bool swa = hp.swa_layer[il];
    const RopeSpec r = rope_spec(hp, swa);
    q = named(rope(g, q, c.in.pos, r), il, "q_rope");
    k = named(rope(g, k, c.in.pos, r), il, "k_rope");

    Tensor* k_stored = named(store_kv(g, k, c.kv.k(il, c.shard), c.in.cells), il, "k_store");
    Tensor* v_stored = named(store_kv(g, v, c.kv.v(il, c.shard), c.in.cells), il, "v_store");
    Tensor* k_cells = view_rows(g, c.kv.k(il, c.shard), c.n_kv);
    Tensor* v_cells = view_rows(g, c.kv.v(il, c.shard), c.n_kv);
    const float kq_scale = hp.attn_scale > 0 ? hp.attn_scale : 1.0f / std::sqrt((float)hd);
    // Query heads [j0, j0 + nh) of this shard over its KV heads [k0, k0 + nk), nh a multiple of nk.
    auto attend = [&](int64_t j0, int64_t nh, int64_t k0, int64_t nk) {
        const bool all = nh == geom.q_heads;
        const int64_t hv = hp.head_dim_v;
        Tensor* qs = all ? q : reshape(g, cont(g, view_cols(g, reshape(g, q, hd * geom.q_heads, n), hd * nh, hd * j0)),
                                       hd, nh, n);
        Tensor* ks = all ? k_cells : view_cols(g, k_cells, hd * nk, hd * k0);
        Tensor* vs = all ? v_cells : view_cols(g, v_cells, hv * nk, hv * k0);
        Tensor* sinks = all || !w.attn_sinks ? w.attn_sinks : view_cols(g, w.attn_sinks, nh, j0);
        return flash_attn(g, qs, ks, vs, attn_mask(c), k_stored, v_stored, kq_scale, hp.attn_softcap,
                          swa ? hp.sliding_window : 0, sinks);
    };
    // A shard's query heads may begin or end inside a KV head's group (a tensor split by query
    // heads): those partial groups are attended apart from the whole ones.
    const int64_t n_rep = hp.n_head / hp.n_head_kv, lead = (n_rep - geom.q_head0 % n_rep) % n_rep;
    const int64_t first = std::min(lead, geom.q_heads), whole = (geom.q_heads - first) / n_rep * n_rep;
    Tensor* a = nullptr;
    auto append = [&](Tensor* part) { a = a ? concat(g, a, part) : part; };
    if (first) append(attend(0, first, 0, 1));
    if (whole) append(attend(first, whole, first ? 1 : 0, whole / n_rep));
    if (first + whole < geom.q_heads) append(attend(first + whole, geom.q_heads - first - whole, geom.kv_heads - 1, 1));
    return named(a, il, "attn");  // the decoder applies the output projection (build_decoder)
}

SubBlock projected(BuildContext& c, int il, Tensor* mid, Tensor* proj, const char* name) {
    SubBlock sb;
    sb.mid = {mid};
    sb.out = [&c, il, proj, name](const std::vector<Tensor*>& v) -> Tensor* {
        return v[0] && proj ? named(mul_mat(c.g, proj, v[0]), il, name) : nullptr;
    };
    return sb;
}

SubBlock build_ffn(BuildContext& c, int il, Tensor* x, FfnAct act) {
    const LayerWeights& w = c.w(il);
    Tensor* h = nullptr;
    if (c.geom(il).ff > 0) {
        Tensor* gate = named(mul_mat(c.g, w.ffn_gate, x), il, "ffn_gate");
        Tensor* up = named(mul_mat(c.g, w.ffn_up, x), il, "ffn_up");
        h = named(act == FfnAct::SILU ? swiglu(c.g, gate, up) : geglu(c.g, gate, up), il, "ffn_act");
    }
    return projected(c, il, h, w.ffn_down, "ffn_out");
}

namespace {

// Some of a layer's experts: their stacks, per-expert biases, and the slots' ids renumbered for
// them (-1: a slot picked another's expert, and its rows come out zero).
struct ExpertSet {
    Tensor *gate = nullptr, *up = nullptr, *down = nullptr;
    Tensor *gate_b = nullptr, *up_b = nullptr, *down_b = nullptr;
    Tensor* ids = nullptr;
};

// Experts [e0, e0 + n) of a stack (dim 2) or of its biases (dim 1): a weight leaf of the graph
// over the same bytes (repacked ones included: a repacked expert keeps its place and size).
Tensor* expert_range(Graph& g, const Tensor* t, int dim, int64_t e0, int64_t n) {
    if (!t) return nullptr;
    int64_t ne[4] = {t->ne[0], t->ne[1], t->ne[2], t->ne[3]};
    ne[dim] = n;
    Tensor* r = g.new_tensor(t->name + "[" + std::to_string(e0) + ":" + std::to_string(e0 + n) + "]", t->type, ne[0],
                             ne[1], ne[2], ne[3], TensorRole::WEIGHT);
    r->data = (uint8_t*)t->data + (size_t)e0 * t->nb[dim];
    r->buffer = t->buffer, r->device = t->device, r->rows16 = t->rows16;
    return r;
}

// All of w's experts, picked by ids.
ExpertSet whole_set(const LayerWeights& w, Tensor* ids) {
    return {w.ffn_gate_exps, w.ffn_up_exps, w.ffn_down_exps, w.ffn_gate_exps_b, w.ffn_up_exps_b, w.ffn_down_exps_b, ids};
}

ExpertSet expert_set(Graph& g, const LayerWeights& w, Tensor* ids, int64_t e0, int64_t n, int64_t n_expert) {
    if (e0 == 0 && n == n_expert) return whole_set(w, ids);
    return {expert_range(g, w.ffn_gate_exps, 2, e0, n), expert_range(g, w.ffn_up_exps, 2, e0, n),
            expert_range(g, w.ffn_down_exps, 2, e0, n), expert_range(g, w.ffn_gate_exps_b, 1, e0, n),
            expert_range(g, w.ffn_up_exps_b, 1, e0, n), expert_range(g, w.ffn_down_exps_b, 1, e0, n),
            local_ids(g, ids, e0, n)};
}

Tensor* expert_product(BuildContext& c, int il, Tensor* stack, Tensor* bias, Tensor* in, Tensor* ids,
                       const std::string& what, Tensor::Share share) {
    Tensor* y = named(mul_mat_id(c.g, stack, in, ids), il, what.c_str());
    y->share = share;
    if (!bias) return y;
    Tensor* biased = named(add_id(c.g, y, bias, ids), il, (what + "_biased").c_str());
    biased->share = share;  // its biases are staged or not with the product (staged_weight)
    return biased;
}

// e's products of x3 [n_embd, 1, n] (gate and up, with their biases) and their activation.
Tensor* expert_act(BuildContext& c, int il, const ExpertSet& e, Tensor* x3, const std::string& sfx, Tensor::Share share) {
    Tensor* gate = expert_product(c, il, e.gate, e.gate_b, x3, e.ids, "ffn_moe_gate" + sfx, share);
    Tensor* up = expert_product(c, il, e.up, e.up_b, x3, e.ids, "ffn_moe_up" + sfx, share);
    const HParams& hp = c.model.hp();
    return named(hp.expert_act_oai ? swiglu_oai(c.g, gate, up, 1.702f, 7.0f) : swiglu(c.g, gate, up), il,
                 ("ffn_moe_act" + sfx).c_str());
}

// e's down products of their activations, summed with the routing weights: [n_embd, n].
Tensor* expert_out(BuildContext& c, int il, const ExpertSet& e, Tensor* act, Tensor* weights, const std::string& sfx,
                   Tensor::Share share) {
    Tensor* down = expert_product(c, il, e.down, e.down_b, act, e.ids, "ffn_moe_down" + sfx, share);
    return named(moe_sum(c.g, down, weights), il, ("ffn_moe_out" + sfx).c_str());
}

// How many of layer il's experts the host computes itself while a GPU stages the rest (0: none):
// in a staged graph (BuildContext::host_expert_share), one shard, experts in host memory and the
// router, which the expert products follow, on a device that is not.
int64_t host_experts(const BuildContext& c, int il) {
    const LayerWeights& w = c.w(il);
    const int64_t n = c.model.hp().n_expert;
    if (c.host_expert_share <= 0 || c.model.n_shards() > 1 || !w.ffn_gate_exps || !w.ffn_gate_inp) return 0;
    const auto backends = c.model.backends();
    if (!backends.at(w.ffn_gate_exps->device)->host_accessible() ||
        backends.at(w.ffn_gate_inp->device)->host_accessible())
        return 0;
    return std::clamp<int64_t>(std::llround(c.host_expert_share * (double)n), 1, n - 1);
}

}  // namespace

// Mixture-of-experts FFN: the router and the selection run whole on every shard (same bits
// everywhere); a shard computes its part of the picked experts (whole experts: the others'
// slots give zero rows) and of the shared expert. The weighted sum over the picked experts and
// the shared expert's gate come after the meeting, so one meeting serves them all.
// Where a GPU stages experts kept in host memory, the host may take the first of them (built
// first, so that they run while the GPU copies in and multiplies the rest): their weighted sum is
// added to the GPU's.
SubBlock build_moe_ffn(BuildContext& c, int il, Tensor* x) {
    const HParams& hp = c.model.hp();
    const LayerWeights& w = c.w(il);
    const ShardGeometry& geom = c.geom(il);
    const bool has_shexp = c.model.layers()[il].ffn_up_shexp != nullptr;
    Graph& g = c.g;
    const int64_t n = c.n_tok, k = hp.n_expert_used;
    Tensor *weights = nullptr, *act = nullptr, *host_out = nullptr;
    ExpertSet mine;
    if (geom.experts > 0) {
        Tensor* logits = named(mul_mat(g, w.ffn_gate_inp, x), il, "ffn_moe_logits");
        if (w.ffn_gate_inp_b) logits = named(add(g, logits, w.ffn_gate_inp_b), il, "ffn_moe_logits_biased");
        Tensor* ids = named(top_k(g, logits, k, hp.expert_gating, w.ffn_exp_probs_b, hp.n_expert_groups,
                                  hp.n_group_used),
                            il, "ffn_moe_topk");
        weights = named(moe_weights(g, logits, ids, hp.expert_gating, hp.expert_weights_norm, hp.expert_weights_scale),
                        il, "ffn_moe_weights");
        const int64_t on_host = geom.expert_ff > 0 ? host_experts(c, il) : 0;
        if (on_host > 0) {
            Tensor* x3 = reshape(g, x, hp.n_embd, 1, n);
            const ExpertSet host = expert_set(g, w, ids, 0, on_host, hp.n_expert);
            named(host.ids, il, "ffn_moe_local_ids_host");
            host_out = expert_out(c, il, host, expert_act(c, il, host, x3, "_host", Tensor::Share::HOST), weights, "_host",
                                  Tensor::Share::HOST);
        }
        // (a tensor-parallel shard's stacks hold its experts only: their ids renumbered)
        mine = geom.experts == hp.n_expert ? expert_set(g, w, ids, on_host, hp.n_expert - on_host, hp.n_expert)
                                           : whole_set(w, local_ids(g, ids, geom.expert0, geom.experts));
        if (mine.ids != ids) named(mine.ids, il, "ffn_moe_local_ids");
    }
    if (geom.experts > 0 && geom.expert_ff > 0)
        act = expert_act(c, il, mine, reshape(g, x, hp.n_embd, 1, n), "", Tensor::Share::NONE);
    Tensor* sh_act = nullptr;
    if (geom.shexp_ff > 0) {
        Tensor* sg = named(mul_mat(g, w.ffn_gate_shexp, x), il, "ffn_shexp_gate");
        Tensor* su = named(mul_mat(g, w.ffn_up_shexp, x), il, "ffn_shexp_up");
        sh_act = named(swiglu(g, sg, su), il, "ffn_shexp_act");
    }
    SubBlock sb;
    sb.mid = {act};
    if (has_shexp) sb.mid.push_back(sh_act);
    sb.out = [&c, il, x, &w, weights, mine, host_out](const std::vector<Tensor*>& v) -> Tensor* {
        Graph& g = c.g;
        Tensor* out = nullptr;
        if (v[0] && w.ffn_down_exps) out = expert_out(c, il, mine, v[0], weights, "", Tensor::Share::NONE);
        if (host_out) {
            out = named(add(g, out, host_out), il, "ffn_moe_out_joined");
            out->share = Tensor::Share::JOIN;
        }
        if (v.size() < 2 || !v[1] || !w.ffn_down_shexp) return out;
        Tensor* shared = named(mul_mat(g, w.ffn_down_shexp, v[1]), il, "ffn_shexp");
        if (w.ffn_gate_inp_shexp) {
            // The sigmoid gate as a one-expert routing: top-1 of one logit is index 0, its sigmoid
            // weight scales the shared expert's output (moe_sum over k = 1).
            Tensor* gl = named(mul_mat(g, w.ffn_gate_inp_shexp, x), il, "ffn_shexp_gate_logit");
            Tensor* zero = named(top_k(g, gl, 1), il, "ffn_shexp_id");
            Tensor* gw = named(moe_weights(g, gl, zero, /*sigmoid*/ 1, false, 0.0f), il, "ffn_shexp_gate_w");
            shared = named(moe_sum(g, reshape(g, shared, shared->ne[0], 1, c.n_tok), gw), il, "ffn_shexp_out");
        }
        return out ? named(add(g, out, shared), il, "ffn_moe_shexp_out") : shared;
    };
    return sb;
}

Tensor* build_output(BuildContext& c, const std::vector<Tensor*>& xs) {
    const HParams& hp = c.model.hp();
    Tensor* logits = nullptr;
    for (int s = 0; s < (int)xs.size(); s++) {
        Tensor* head = c.model.shard_output(s);
        if (!head) continue;  // no vocabulary rows on this shard
        Tensor* x = named(get_rows(c.g, xs[s], c.in.out_ids), -1, "out_rows");
        x = named(rms_norm(c.g, x, c.model.shard_output_norm(s), hp.eps), -1, "out_norm");
        if (c.embeddings) return x;  // every shard holds the whole rows: the first one's
        Tensor* l = named(mul_mat(c.g, head, x), -1, "logits");
        if (hp.final_softcap > 0) l = named(softcap(c.g, l, hp.final_softcap), -1, "logits_softcap");
        // the shards' vocabulary rows, in order
        logits = logits ? named(concat(c.g, logits, l), -1, "logits_gathered") : l;
    }
    return logits;
}

// Tensor parallelism's meetings, on each shard's device: the parts summed in shard order, or
// their rows gathered in shard order (the same bits on every shard either way). A gather of no
// rows at all gives nulls.
static std::vector<Tensor*> meet(BuildContext& c, int il, const std::vector<Tensor*>& parts, bool gather,
                                 const std::string& what) {
    std::vector<int> devices;
    bool any = false;
    for (int s = 0; s < (int)parts.size(); s++) devices.push_back(c.model.shard_device(s, il)), any |= parts[s] != nullptr;
    if (!any) return parts;
    std::vector<Tensor*> out = gather ? all_gather(c.g, parts, devices)
                                      : all_reduce(c.g, parts, devices, c.model.hp().n_embd, c.n_tok);
    for (Tensor* t : out) named(t, il, what.c_str());
    return out;
}

Tensor* build_decoder(BuildContext& c, AttentionFn attention) {
    const HParams& hp = c.model.hp();
    const int S = c.model.n_shards();
    const bool gathers = S > 1 && c.model.tp_gathers();
    Graph& g = c.g;
    c.shard = 0;
    std::vector<Tensor*> xs(S, build_embedding(c)), rows(S);
    std::vector<SubBlock> subs(S);
    // Each sub-block: norm, this shard's part up to its last projection, the meeting, its bias
    // and post-norm, the residual. With gathers the shards meet twice: the parts the last
    // projection reads are gathered whole, each shard computes its rows of n_embd, those are
    // gathered. Otherwise once: each shard projects its own part and the products are summed.
    // Shards are built last to first so that the first device's embedding is sent off before
    // it starts on layer 0.
    auto block = [&](int il, Tensor* LayerWeights::*norm, Tensor* LayerWeights::*post, const char* what,
                     const std::function<SubBlock(Tensor*)>& part) {
        for (int s = S - 1; s >= 0; s--) {
            c.shard = s;
            const LayerWeights& w = c.w(il);
            Tensor* h = named(rms_norm(g, xs[s], w.*norm, hp.eps), il, (std::string(what) + "_normed").c_str());
            subs[s] = part(h);
        }
        std::vector<std::vector<Tensor*>> in(S);
        for (int s = 0; s < S; s++) in[s] = subs[s].mid;
        if (gathers)
            for (size_t j = 0; j < subs[0].mid.size(); j++) {
                std::vector<Tensor*> parts;
                for (int s = 0; s < S; s++) parts.push_back(subs[s].mid[j]);
                std::vector<Tensor*> whole = meet(c, il, parts, true, std::string(what) + "_mid");
                for (int s = 0; s < S; s++) in[s][j] = whole[s];
            }
        for (int s = 0; s < S; s++) {
            c.shard = s;
            rows[s] = subs[s].out(in[s]);
        }
        std::vector<Tensor*> sum = S == 1 ? rows : meet(c, il, rows, gathers, std::string(what) + "_sum");
        for (int s = 0; s < S; s++) {
            c.shard = s;
            const LayerWeights& w = c.w(il);
            Tensor* o = sum[s];
            if (what[0] == 'a' && w.bo) o = named(add(g, o, w.bo), il, "attn_out_bias");
            if (w.*post) o = named(rms_norm(g, o, w.*post, hp.eps), il, (std::string(what) + "_post_norm").c_str());
            xs[s] = named(add(g, xs[s], o), il, (std::string(what) + "_residual").c_str());
        }
    };
    for (int il = 0; il < hp.n_layer; il++) {
        block(il, &LayerWeights::attn_norm, &LayerWeights::post_attn_norm, "attn", [&](Tensor* h) {
            return projected(c, il, c.geom(il).q_heads > 0 ? attention(c, il, h) : nullptr, c.w(il).wo, "attn_out");
        });
        block(il, &LayerWeights::ffn_norm, &LayerWeights::post_ffn_norm, "ffn", [&](Tensor* h) {
            if (c.model.layers()[il].ffn_gate_inp) return build_moe_ffn(c, il, h);
            return build_ffn(c, il, h, hp.ffn_gelu ? FfnAct::GELU : FfnAct::SILU);
        });
    }
    c.shard = 0;
    return build_output(c, xs);
}

Tensor* build_prenorm_decoder(BuildContext& c) { return build_decoder(c, build_attention); }

}  // namespace stowlm
