// Tensor parallelism: every layer cut over the devices with a share (model.h: ShardGeometry).
// Row ranges of a file tensor are contiguous, so those shards are views into the mapping;
// column ranges (the output projections when the shards sum partial products) and the rows of
// every matrix of an expert stack are copied into their device's buffer at load. Small tensors
// every shard needs (norms, the router) are repeated.
#include <cmath>
#include <cstring>
#include <numeric>
#include <string>

#include "error.h"
#include "models/model.h"

namespace stowlm {

namespace {

// Counts per shard of `units` indivisible units in proportion to shares, by cumulative rounding
// (they sum to units; a share of 0 gets 0).
std::vector<int64_t> apportion(int64_t units, const std::vector<double>& shares) {
    const double total = std::accumulate(shares.begin(), shares.end(), 0.0);
    std::vector<int64_t> out;
    double cum = 0;
    int64_t prev = 0;
    for (double s : shares) {
        cum += s;
        const int64_t b = std::llround((double)units * cum / total);
        out.push_back(b - prev);
        prev = b;
    }
    return out;
}

int64_t block_elems(const Tensor* t) { return t ? qtype_info((uint32_t)t->type)->block_elems : 1; }

// Smallest number of items of `width` columns whose total is a multiple of `block`.
int64_t items_per_block(int64_t width, int64_t block) {
    int64_t g = 1;
    while ((g * width) % block) g++;
    return g;
}

// Ranges [first, first + n) per shard of `count` items taken in groups of `group` (the last
// group may be short): the groups are apportioned.
std::vector<std::pair<int64_t, int64_t>> ranges(int64_t count, int64_t group, const std::vector<double>& shares) {
    const int64_t units = (count + group - 1) / group;
    std::vector<std::pair<int64_t, int64_t>> r;
    int64_t at = 0;
    for (int64_t u : apportion(units, shares)) {
        const int64_t n = std::min(count - at, u * group);
        r.push_back({at, n});
        at += n;
    }
    return r;
}

}  // namespace

const LayerWeights& BuildContext::w(int il) const { return model.shard_layer(shard, il); }
const ShardGeometry& BuildContext::geom(int il) const { return model.shard_geometry(shard, il); }

const ShardGeometry& Model::shard_geometry(int s, int il) const {
    if (tensor_parallel()) return shard_geom_.at(s).at(il);
    // one shard: the whole layer
    static thread_local ShardGeometry whole;
    const LayerWeights& w = layers_.at(il);
    whole = ShardGeometry{};
    whole.q_heads = hp_.n_head;
    whole.kv_heads = hp_.kv_lora_rank > 0 ? 1 : hp_.n_head_kv;
    whole.ff = w.ffn_gate ? w.ffn_gate->ne[1] : 0;
    whole.experts = w.ffn_gate_exps ? hp_.n_expert : 0;
    whole.expert_ff = w.ffn_gate_exps ? w.ffn_gate_exps->ne[1] : 0;
    whole.shexp_ff = w.ffn_gate_shexp ? w.ffn_gate_shexp->ne[1] : 0;
    whole.embd = hp_.n_embd;
    return whole;
}

const LayerWeights& Model::shard_layer(int s, int il) const {
    return tensor_parallel() ? shard_layers_.at(s).at(il) : layers_.at(il);
}

void Model::build_shards(const std::vector<double>& shares_all) {
    const HParams& hp = hp_;
    std::vector<double> shares;
    for (size_t d = 0; d < shares_all.size(); d++)
        if (shares_all[d] > 0) {
            shard_device_.push_back((int)d);
            shares.push_back(shares_all[d]);
        }
    const int S = (int)shares.size();
    shard_geom_.assign(S, std::vector<ShardGeometry>(hp.n_layer));
    shard_layers_.assign(S, std::vector<LayerWeights>(hp.n_layer));

    auto make = [&](const Tensor* full, int s, const char* what) {
        shard_store_.push_back(std::make_unique<Tensor>(*full));
        Tensor* t = shard_store_.back().get();
        t->name = full->name + ".shard" + std::to_string(s) + (what[0] ? std::string(".") + what : "");
        t->device = shard_device_[s];
        return t;
    };
    auto repeat = [&](const Tensor* full, int s) -> Tensor* { return full ? make(full, s, "") : nullptr; };
    // Items [i0, i0 + n) of dimension dim (1: rows, 2: matrices of a stack, 0: elements of a
    // float vector): a contiguous range of the file tensor.
    auto slice = [&](const Tensor* full, int s, int dim, int64_t i0, int64_t n) -> Tensor* {
        if (!full || n == 0) return nullptr;
        if (dim == 0 && block_elems(full) != 1)
            throw InvalidInput(full->name + ": a quantized vector cannot be cut by elements");
        Tensor* t = make(full, s, "");
        t->ne[dim] = n;
        t->data = (uint8_t*)full->data + (size_t)i0 * (dim == 0 ? tensor_row_bytes(full->type, 1) : full->nb[dim]);
        set_contiguous_strides(*t);
        return t;
    };
    // Columns [c0, c0 + n) of every row: copied at load.
    auto columns = [&](const Tensor* full, int s, int64_t c0, int64_t n) -> Tensor* {
        if (!full || n == 0) return nullptr;
        const int64_t blk = block_elems(full);
        if (c0 % blk || (n % blk && c0 + n != full->ne[0]))
            throw InvalidInput(full->name + ": columns [" + std::to_string(c0) + ", " + std::to_string(c0 + n) +
                               ") do not fall on its blocks of " + std::to_string(blk));
        Tensor* t = make(full, s, "cols");
        t->ne[0] = n;
        t->data = nullptr;
        set_contiguous_strides(*t);
        column_slices_.push_back({t, full, c0, n});
        return t;
    };
    // Rows [r0, r0 + n) of each matrix of a stack (an expert's rows): copied at load.
    auto stack_rows = [&](const Tensor* full, int s, int64_t r0, int64_t n) -> Tensor* {
        if (!full || n == 0) return nullptr;
        Tensor* t = make(full, s, "rows");
        t->ne[1] = n;
        t->data = nullptr;
        set_contiguous_strides(*t);
        column_slices_.push_back({t, full, r0, n, true});
        return t;
    };

    const bool gathers = !tp_sum_;
    // With gathers every cut is by rows (of a weight matrix, or of a vector that is gathered),
    // so no cut needs to fall on a block; in groups of kRowGroup rows for the kernels' sake.
    constexpr int64_t kRowGroup = 16;
    // the step of a cut of rows whose columns `down` projects: summing, whole blocks of `down`
    auto row_step = [&](const Tensor* down) { return gathers ? kRowGroup : block_elems(down); };
    const auto embr = ranges(hp.n_embd, kRowGroup, shares);
    for (int il = 0; il < hp.n_layer; il++) {
        const LayerWeights& L = layers_[il];
        const bool mla = hp.kv_lora_rank > 0;
        // attention: query heads with the KV heads they read (MLA: query heads); summing partial
        // products, whole KV heads with their query heads, in groups whose output-projection
        // columns fall on its blocks
        std::vector<std::pair<int64_t, int64_t>> qr, kvr;
        if (mla) {
            qr = ranges(hp.n_head, gathers ? 1 : items_per_block(hp.head_dim_v_mla, block_elems(L.wo)), shares);
            for (auto& q : qr) kvr.push_back({0, q.second ? 1 : 0});
        } else if (gathers) {
            // query heads by the shares; a shard computes and caches the KV heads its query heads
            // read, so a KV head whose query heads two shards share is on both (3 KV heads over 2
            // devices went 2 + 1, and one device waited for the other's extra head at every layer)
            const int64_t n_rep = hp.n_head / hp.n_head_kv;
            qr = ranges(hp.n_head, 1, shares);
            for (auto& q : qr) {
                const int64_t k0 = q.first / n_rep, k1 = (q.first + q.second + n_rep - 1) / n_rep;
                kvr.push_back({k0, q.second ? k1 - k0 : 0});
            }
        } else {
            const int64_t n_rep = hp.n_head / hp.n_head_kv;
            kvr = ranges(hp.n_head_kv, items_per_block(n_rep * hp.head_dim_v, block_elems(L.wo)), shares);
            for (auto& k : kvr) qr.push_back({k.first * n_rep, k.second * n_rep});
        }
        // The FFN rows by the shares, like everything else that can be cut finely: the devices meet
        // after the attention and after the FFN, so each of the two is balanced on its own. (Rows
        // that evened out the heads' imbalance in bytes made the other device wait at the FFN's
        // meeting instead: smollm2, 3 KV heads 1:1, pp512 2950 -> 3090 and tg128 311 -> 322 t/s.)
        const int64_t n_ff = L.ffn_gate ? L.ffn_gate->ne[1] : 0;
        const auto ffr = ranges(n_ff, row_step(L.ffn_down), shares);
        // Routed experts: every expert's rows cut alike when they make enough blocks of the down
        // projection (a token's picked experts then load every shard evenly); else whole experts.
        const int64_t n_ffe = L.ffn_gate_exps ? L.ffn_gate_exps->ne[1] : 0;
        const bool cut_experts = n_ffe > 0 && (gathers || n_ffe / block_elems(L.ffn_down_exps) >= S);
        const auto exr = ranges(L.ffn_gate_exps && !cut_experts ? hp.n_expert : 0, 1, shares);
        const auto efr = ranges(cut_experts ? n_ffe : 0, row_step(L.ffn_down_exps), shares);
        int bias_shard = 0;  // the shard that adds a picked expert's down bias (once)
        while (bias_shard < S - 1 && cut_experts && efr[bias_shard].second == 0) bias_shard++;
        const int64_t n_sh = L.ffn_gate_shexp ? L.ffn_gate_shexp->ne[1] : 0;
        const auto shr = ranges(n_sh, row_step(L.ffn_down_shexp), shares);

        for (int s = 0; s < S; s++) {
            ShardGeometry& g = shard_geom_[s][il];
            g.q_head0 = qr[s].first, g.q_heads = qr[s].second;
            g.kv_head0 = kvr[s].first, g.kv_heads = kvr[s].second;
            g.ff0 = ffr[s].first, g.ff = ffr[s].second;
            if (gathers) g.embd0 = embr[s].first, g.embd = embr[s].second;
            if (cut_experts) {
                g.expert0 = 0, g.experts = efr[s].second || (gathers && g.embd) ? hp.n_expert : 0;
                g.expert_ff0 = efr[s].first, g.expert_ff = efr[s].second;
            } else {
                g.expert0 = exr[s].first, g.experts = exr[s].second;
                g.expert_ff0 = 0, g.expert_ff = g.experts ? n_ffe : 0;
            }
            g.shexp_ff0 = shr[s].first, g.shexp_ff = shr[s].second;
            LayerWeights& w = shard_layers_[s][il];
            const bool attn = g.q_heads > 0;
            // what the output projections read: the gathered whole (rows of n_embd), or this
            // shard's heads / FFN rows (columns)
            auto out_proj = [&](const Tensor* full, int64_t c0, int64_t n) {
                return gathers ? slice(full, s, 1, g.embd0, g.embd) : columns(full, s, c0, n);
            };
            w.attn_norm = repeat(L.attn_norm, s);
            w.ffn_norm = repeat(L.ffn_norm, s);
            w.post_attn_norm = repeat(L.post_attn_norm, s);
            w.post_ffn_norm = repeat(L.post_ffn_norm, s);
            w.bo = repeat(L.bo, s);  // added after the meeting, on every shard alike
            if (attn) {
                w.q_norm = repeat(L.q_norm, s);
                w.k_norm = repeat(L.k_norm, s);
                w.attn_sinks = slice(L.attn_sinks, s, 0, g.q_head0, g.q_heads);
                if (mla) {
                    const int64_t dq = hp.head_dim_qk_mla;
                    w.wq_a = repeat(L.wq_a, s);
                    w.q_a_norm = repeat(L.q_a_norm, s);
                    w.wq_b = slice(L.wq_b, s, 1, g.q_head0 * dq, g.q_heads * dq);
                    w.wq = slice(L.wq, s, 1, g.q_head0 * dq, g.q_heads * dq);
                    w.wkv_a = repeat(L.wkv_a, s);
                    w.kv_a_norm = repeat(L.kv_a_norm, s);
                    w.wk_b = slice(L.wk_b, s, 2, g.q_head0, g.q_heads);
                    w.wv_b = slice(L.wv_b, s, 2, g.q_head0, g.q_heads);
                } else {
                    const int64_t hk = hp.head_dim_k, hv = hp.head_dim_v;
                    w.wq = slice(L.wq, s, 1, g.q_head0 * hk, g.q_heads * hk);
                    w.wk = slice(L.wk, s, 1, g.kv_head0 * hk, g.kv_heads * hk);
                    w.wv = slice(L.wv, s, 1, g.kv_head0 * hv, g.kv_heads * hv);
                    w.bq = slice(L.bq, s, 0, g.q_head0 * hk, g.q_heads * hk);
                    w.bk = slice(L.bk, s, 0, g.kv_head0 * hk, g.kv_heads * hk);
                    w.bv = slice(L.bv, s, 0, g.kv_head0 * hv, g.kv_heads * hv);
                }
            }
            if (attn || gathers) {
                const int64_t hv = mla ? hp.head_dim_v_mla : hp.head_dim_v;
                w.wo = out_proj(L.wo, g.q_head0 * hv, g.q_heads * hv);
            }
            // dense FFN
            w.ffn_gate = slice(L.ffn_gate, s, 1, g.ff0, g.ff);
            w.ffn_up = slice(L.ffn_up, s, 1, g.ff0, g.ff);
            w.ffn_down = g.ff || gathers ? out_proj(L.ffn_down, g.ff0, g.ff) : nullptr;
            // routed experts, whole
            if (g.experts > 0 || g.shexp_ff > 0 || (gathers && g.embd)) {
                w.ffn_gate_inp = repeat(L.ffn_gate_inp, s);
                w.ffn_gate_inp_b = repeat(L.ffn_gate_inp_b, s);
                w.ffn_exp_probs_b = repeat(L.ffn_exp_probs_b, s);
            }
            if (cut_experts) {
                w.ffn_gate_exps = stack_rows(L.ffn_gate_exps, s, g.expert_ff0, g.expert_ff);
                w.ffn_up_exps = stack_rows(L.ffn_up_exps, s, g.expert_ff0, g.expert_ff);
                w.ffn_gate_exps_b = columns(L.ffn_gate_exps_b, s, g.expert_ff0, g.expert_ff);
                w.ffn_up_exps_b = columns(L.ffn_up_exps_b, s, g.expert_ff0, g.expert_ff);
                if (gathers) {  // rows of n_embd of every expert's down projection, and of its bias
                    w.ffn_down_exps = stack_rows(L.ffn_down_exps, s, g.embd0, g.embd);
                    w.ffn_down_exps_b = columns(L.ffn_down_exps_b, s, g.embd0, g.embd);
                } else {
                    w.ffn_down_exps = columns(L.ffn_down_exps, s, g.expert_ff0, g.expert_ff);
                    // the down bias of a picked expert goes in once: with the first shard's part
                    w.ffn_down_exps_b = s == bias_shard ? repeat(L.ffn_down_exps_b, s) : nullptr;
                }
            } else {
                w.ffn_gate_exps = slice(L.ffn_gate_exps, s, 2, g.expert0, g.experts);
                w.ffn_up_exps = slice(L.ffn_up_exps, s, 2, g.expert0, g.experts);
                w.ffn_down_exps = slice(L.ffn_down_exps, s, 2, g.expert0, g.experts);
                w.ffn_gate_exps_b = slice(L.ffn_gate_exps_b, s, 1, g.expert0, g.experts);
                w.ffn_up_exps_b = slice(L.ffn_up_exps_b, s, 1, g.expert0, g.experts);
                w.ffn_down_exps_b = slice(L.ffn_down_exps_b, s, 1, g.expert0, g.experts);
            }
            // shared expert, cut like a dense FFN
            if (g.shexp_ff > 0 || (gathers && g.embd)) w.ffn_gate_inp_shexp = repeat(L.ffn_gate_inp_shexp, s);
            w.ffn_gate_shexp = slice(L.ffn_gate_shexp, s, 1, g.shexp_ff0, g.shexp_ff);
            w.ffn_up_shexp = slice(L.ffn_up_shexp, s, 1, g.shexp_ff0, g.shexp_ff);
            w.ffn_down_shexp =
                L.ffn_down_shexp && (g.shexp_ff || gathers) ? out_proj(L.ffn_down_shexp, g.shexp_ff0, g.shexp_ff) : nullptr;
        }
    }
    // the LM head by vocabulary rows; the embedding lookup stays whole on the first shard
    const auto vr = ranges(hp.n_vocab, 1, shares);
    for (int s = 0; s < S; s++) {
        shard_output_norm_.push_back(repeat(output_norm_, s));
        shard_output_.push_back(slice(output_, s, 1, vr[s].first, vr[s].second));
    }
    tok_embd_->device = shard_device_[0];
}

bool Model::is_column_slice(const Tensor* t) const {
    for (const ColumnSlice& c : column_slices_)
        if (c.t == t) return true;
    return false;
}

bool Model::cuts_columns(const Tensor* t) const {
    for (const ColumnSlice& c : column_slices_)
        if (c.t == t) return !c.rows;
    return false;
}

void Model::place_shard_weights(bool count_weights) {
    const int n_dev = (int)backends_.size();
    auto packed = [&](const Tensor& t) {
        const size_t b = t.nbytes();
        return backends_[t.device]->host_accessible() ? b : (b + 255) / 256 * 256;
    };
    // A tied head's rows on the device holding the whole embedding read the embedding's bytes
    // (the mapping on a host device, the uploaded embedding on another).
    const bool tied = output_ == tok_embd_;
    const uint8_t* embd_host = (const uint8_t*)tok_embd_->data;
    auto aliases_embd = [&](const Tensor* t) {
        return tied && t->device == tok_embd_->device && (const uint8_t*)t->data >= embd_host &&
               (const uint8_t*)t->data < embd_host + tok_embd_->nbytes();
    };
    std::vector<size_t> mapped(n_dev, 0), copied(n_dev, 0);
    mapped[tok_embd_->device] += packed(*tok_embd_);
    for (const auto& t : shard_store_) {
        if (aliases_embd(t.get())) continue;
        (is_column_slice(t.get()) ? copied : mapped)[t->device] += packed(*t);
    }
    weight_bytes_.assign(n_dev, 0);
    for (int d = 0; d < n_dev; d++) weight_bytes_[d] = mapped[d] + copied[d];
    if (!count_weights) return;

    std::vector<uint8_t> staging;
    auto gather = [&](const ColumnSlice& c) {  // the columns of every row (or the rows of every matrix), contiguous
        if (c.rows) {
            const size_t rb = c.src->nb[1], per = rb * (size_t)c.cols;
            staging.resize(per * (size_t)c.src->ne[2]);
            for (int64_t m = 0; m < c.src->ne[2]; m++)
                std::memcpy(staging.data() + m * per, (const uint8_t*)c.src->data + m * c.src->nb[2] + c.col0 * rb, per);
            return staging.data();
        }
        const size_t rb_full = c.src->nb[1], rb = tensor_row_bytes(c.src->type, c.cols);
        const size_t off = tensor_row_bytes(c.src->type, c.col0);
        staging.resize(rb * (size_t)c.t->n_rows());
        for (int64_t r = 0; r < c.t->n_rows(); r++)
            std::memcpy(staging.data() + r * rb, (const uint8_t*)c.src->data + r * rb_full + off, rb);
        return staging.data();
    };
    for (int d = 0; d < n_dev; d++) {
        Backend& b = *backends_[d];
        if (!weight_bytes_[d]) continue;
        if (b.host_accessible()) {
            // views read the mapping in place; column slices get a buffer of their own
            if (mapped[d]) weight_buffers_.push_back(b.import_host(nullptr, mapped[d], "model weights"));
            if (!copied[d]) continue;
            BufferPtr buf = b.alloc_buffer(copied[d], "model weights (tensor-parallel column slices)");
            size_t off = 0;
            for (const ColumnSlice& c : column_slices_) {
                if (c.t->device != d) continue;
                c.t->data = (char*)buf->data + off;
                b.copy_from_host(*c.t, gather(c), c.t->nbytes());
                off += packed(*c.t);
            }
            weight_buffers_.push_back(std::move(buf));
            continue;
        }
        BufferPtr buf = b.alloc_buffer(weight_bytes_[d], "model weights");
        size_t off = 0;
        auto upload = [&](Tensor& t, const void* host) {
            t.data = (char*)buf->data + off;
            b.copy_from_host(t, host, t.nbytes());
            off += packed(t);
        };
        if (tok_embd_->device == d) upload(*tok_embd_, tok_embd_->data);
        for (const auto& t : shard_store_) {
            if (t->device != d) continue;
            if (aliases_embd(t.get())) {
                t->data = (uint8_t*)tok_embd_->data + ((const uint8_t*)t->data - embd_host);
                continue;
            }
            bool done = false;
            for (const ColumnSlice& c : column_slices_)
                if (c.t == t.get()) upload(*t, gather(c)), done = true;
            if (!done) upload(*t, t->data);
        }
        weight_buffers_.push_back(std::move(buf));
    }
    for (const auto& t : shard_store_) t->buffer = nullptr;
    tok_embd_->buffer = nullptr;
}

}  // namespace stowlm
