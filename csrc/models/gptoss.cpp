// gpt-oss: a pre-norm decoder whose FFN norm is post_attention_norm, with biases on q/k/v/o,
// per-head attention sinks, a sliding window on every other layer (the even ones, llama.cpp's
// pattern 2), NeoX RoPE with YaRN, and every FFN a mixture of experts: router with a bias, top-k
// on its logits, a softmax over the picked logits as their weights, per-expert biases and the
// clamped SwiGLU (alpha 1.702, limit 7).
#include "error.h"
#include "models/blocks.h"

namespace stowlm {

namespace {

void gptoss_hparams(const GGUFFile& f, HParams& hp) {
    load_common_hparams(f, hp);
    load_moe_hparams(f, hp, false, /*softmax over the picked*/ 2);
    if (hp.n_expert == 0) throw InvalidInput(f.path() + ": gpt-oss.expert_count is missing or 0");
    hp.rope_neox = true;
    hp.expert_act_oai = true;
    hp.sliding_window = (int32_t)f.get_int("gpt-oss.attention.sliding_window");
    const int64_t pattern = f.get_int("gpt-oss.attention.sliding_window_pattern", 2);
    for (int64_t il = 0; il < hp.n_layer; il++) hp.swa_layer[il] = pattern > 0 && il % pattern < pattern - 1;
    hp.rope_base_swa = (float)f.get_float("gpt-oss.rope.freq_base_swa", hp.rope_base);
    hp.rope_scale_swa = hp.rope_scale;
}

void gptoss_layer(Model& m, int il, LayerWeights& w) {
    load_layer_norm_named_post_attention(m, il, w);
    w.attn_sinks = m.require(layer_tensor(il, "attn_sinks.weight"));
}

}  // namespace

const ArchDef kArchGptOss = {"gpt-oss", gptoss_hparams, gptoss_layer, build_prenorm_decoder};

}  // namespace stowlm
