// GLM-4.5 (glm4moe): a pre-norm decoder whose FFN norm is post_attention_norm, with q/k/v
// biases, per-head q/k RMS norms, NeoX RoPE on the first rope.dimension_count dims of each head
// (partial rotary), leading dense layers, then mixtures of experts: sigmoid gates, experts picked
// by gate + exp_probs_b, their weights renormalised and scaled, plus a shared expert.
#include "error.h"
#include "models/blocks.h"

namespace stowlm {

namespace {

void glm4moe_hparams(const GGUFFile& f, HParams& hp) {
    load_common_hparams(f, hp);
    load_moe_hparams(f, hp, false, /*sigmoid*/ 1);
    if (hp.n_expert == 0) throw InvalidInput(f.path() + ": glm4moe.expert_count is missing or 0");
    hp.rope_neox = true;
}

void glm4moe_layer(Model& m, int il, LayerWeights& w) {
    load_attention_layer(m, il, w);
    // post_attention_norm is the norm in front of the FFN here, not one after attention.
    w.ffn_norm = w.post_attn_norm ? w.post_attn_norm : m.require(layer_tensor(il, "post_attention_norm.weight"));
    w.post_attn_norm = nullptr;
    load_ffn_layer(m, il, w);
}

}  // namespace

const ArchDef kArchGlm4Moe = {"glm4moe", glm4moe_hparams, glm4moe_layer, build_prenorm_decoder};

}  // namespace stowlm
