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

}  // namespace

const ArchDef kArchGlm4Moe = {"glm4moe", glm4moe_hparams, load_layer_norm_named_post_attention, build_prenorm_decoder};

}  // namespace stowlm
