// DeepSeek-V2/V3, Kimi-K2 (deepseek2): multi-head latent attention in llama.cpp's absorbed form
// (the KV cache holds, per token, the kv_lora_rank-wide compressed KV and the n_rot rope dims of
// the one shared key; queries are taken into that space per head by attn_k_b, attention outputs
// back out by attn_v_b), RoPE on adjacent pairs with YaRN, leading dense layers, then mixtures of
// experts: sigmoid (V3) or softmax (V2) gates, selection by gate + exp_probs_b within the best
// expert groups, weights renormalised and scaled, plus shared experts.
#include <cmath>

#include "error.h"
#include "kv/kv_cache.h"
#include "models/blocks.h"

namespace stowlm {

namespace {

void deepseek2_hparams(const GGUFFile& f, HParams& hp) {
    load_common_hparams(f, hp);
    load_moe_hparams(f, hp, false, /*softmax (V2 files name no gating)*/ 0);
    const std::string a = "deepseek2.";
    hp.q_lora_rank = f.get_int(a + "attention.q_lora_rank", 0);
    hp.kv_lora_rank = f.get_int(a + "attention.kv_lora_rank");
    hp.head_dim_qk_mla = f.get_int(a + "attention.key_length_mla", hp.head_dim_k);
    hp.head_dim_v_mla = f.get_int(a + "attention.value_length_mla", hp.head_dim_v);
    // The cache row is the compressed KV plus the rope dims; V reads its first kv_lora_rank.
    if (hp.n_head_kv != 1 || hp.head_dim_k != hp.kv_lora_rank + hp.n_rot || hp.head_dim_v != hp.kv_lora_rank ||
        hp.head_dim_qk_mla <= hp.n_rot)
        throw InvalidInput(f.path() + ": deepseek2 attention.head_count_kv / key_length / value_length / " +
                           "rope.dimension_count do not describe multi-head latent attention (head_count_kv 1, " +
                           "key_length = kv_lora_rank + rope dims, value_length = kv_lora_rank)");
    hp.kv_v_in_k = true;
    hp.rope_neox = false;
    if (hp.yarn_log_mul != 0.0f) {
        hp.yarn_log_mul /= 0.1f;  // llama.cpp's convention: the converter stored 0.1 * it
        set_yarn_attn_factor(f, hp, true);
    }
    // The YaRN magnitude correction goes into the query scale (llama.cpp's deepseek2 graph).
    const float attn_factor_org = hp.yarn_attn_factor * (1.0f + 0.1f * logf(1.0f / hp.rope_scale));
    const float mscale = attn_factor_org * (1.0f + 0.1f * hp.yarn_log_mul * logf(1.0f / hp.rope_scale));
    hp.attn_scale = mscale * mscale / std::sqrt((float)hp.head_dim_qk_mla);
}

void deepseek2_layer(Model& m, int il, LayerWeights& w) {
    const HParams& hp = m.hp();
    auto req = [&](const char* n) { return m.require(layer_tensor(il, n)); };
    w.attn_norm = req("attn_norm.weight");
    if (hp.q_lora_rank > 0) {
        w.wq_a = req("attn_q_a.weight");
        w.q_a_norm = req("attn_q_a_norm.weight");
        w.wq_b = req("attn_q_b.weight");
    } else {
        w.wq = req("attn_q.weight");  // the lite variants project q directly
    }
    w.wkv_a = req("attn_kv_a_mqa.weight");
    w.kv_a_norm = req("attn_kv_a_norm.weight");
    w.wk_b = req("attn_k_b.weight");
    w.wv_b = req("attn_v_b.weight");
    w.wo = req("attn_output.weight");
    const int64_t nope = hp.head_dim_qk_mla - hp.n_rot, H = hp.n_head, L = hp.kv_lora_rank;
    auto want = [&](const Tensor* t, int64_t a, int64_t b, int64_t c) {
        if (t->ne[0] != a || t->ne[1] != b || t->ne[2] != c)
            throw InvalidInput(m.file().path() + ": " + t->name + " has shape [" + std::to_string(t->ne[0]) + ", " +
                               std::to_string(t->ne[1]) + ", " + std::to_string(t->ne[2]) + "], expected [" +
                               std::to_string(a) + ", " + std::to_string(b) + ", " + std::to_string(c) + "]");
    };
    want(w.wkv_a, hp.n_embd, L + hp.n_rot, 1);
    want(w.wk_b, nope, L, H);
    want(w.wv_b, L, hp.head_dim_v_mla, H);
    w.ffn_norm = req("ffn_norm.weight");
    load_ffn_layer(m, il, w);
}

// Multi-head latent attention, absorbed: one cache row per token, [kv (L), k_rope (R)].
Tensor* build_mla_attention(BuildContext& c, int il, Tensor* x) {
    const HParams& hp = c.model.hp();
    const LayerWeights& w = c.w(il);
    Graph& g = c.g;
    // this shard's query heads (tensor parallelism: each keeps the whole compressed row)
    const int64_t n = c.n_tok, H = c.geom(il).q_heads, R = hp.n_rot, L = hp.kv_lora_rank;
    Tensor* head_ids = nullptr;
    for (Tensor* t : c.in.head_ids)
        if (t->ne[0] == H) head_ids = t;
    const int64_t dq = hp.head_dim_qk_mla, nope = dq - R;
    auto nm = [&](Tensor* t, const char* what) {
        t->name = layer_tensor(il, what);
        return t;
    };
    const RopeSpec r = rope_spec(hp, false);

    Tensor* q = w.wq_a ? mul_mat(g, w.wq_b, nm(rms_norm(g, nm(mul_mat(g, w.wq_a, x), "q_a"), w.q_a_norm, hp.eps), "q_a_norm"))
                       : mul_mat(g, w.wq, x);
    q = reshape(g, nm(q, "q"), dq, H, n);
    Tensor* q_nope = nm(cont(g, view_cols(g, q, nope, 0)), "q_nope");
    Tensor* q_rope = nm(rope(g, nm(cont(g, view_cols(g, q, R, nope)), "q_pe"), c.in.pos, r), "q_rope");
    // Each head's no-rope query into the compressed space: [L, H, n].
    Tensor* q_abs = nm(mul_mat_id(g, w.wk_b, q_nope, head_ids), "q_absorbed");
    Tensor* Q = nm(concat(g, q_abs, q_rope), "q_mla");

    Tensor* kv = nm(mul_mat(g, w.wkv_a, x), "kv_a");
    Tensor* kv_c = nm(rms_norm(g, nm(cont(g, view_cols(g, kv, L, 0)), "kv_cmpr"), w.kv_a_norm, hp.eps), "kv_cmpr_norm");
    Tensor* k_rope = nm(rope(g, reshape(g, nm(cont(g, view_cols(g, kv, R, L)), "k_pe"), R, 1, n), c.in.pos, r), "k_rope");
    Tensor* K = nm(concat(g, reshape(g, kv_c, L, 1, n), k_rope), "k_mla");

    Tensor* stored = nm(store_kv(g, K, c.kv.k(il, c.shard), c.in.cells), "kv_store");
    Tensor* k_cells = view_rows(g, c.kv.k(il, c.shard), c.n_kv);
    Tensor* v_cells = view_cols(g, k_cells, L, 0);
    Tensor* a = nm(flash_attn(g, Q, k_cells, v_cells, attn_mask(c), stored, stored, hp.attn_scale, 0.0f, 0),
                   "attn");
    // Back out of the compressed space, per head: [dv, H, n].
    Tensor* o = nm(mul_mat_id(g, w.wv_b, reshape(g, a, L, H, n), head_ids), "attn_v");
    return reshape(g, o, hp.head_dim_v_mla * H, n);  // the decoder applies the output projection
}

Tensor* deepseek2_build(BuildContext& c) { return build_decoder(c, build_mla_attention); }

}  // namespace

const ArchDef kArchDeepseek2 = {"deepseek2", deepseek2_hparams, deepseek2_layer, deepseek2_build};

}  // namespace stowlm
