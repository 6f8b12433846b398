// gemma3: embedding scaled by sqrt(n_embd), per-head q/k RMS norms, norms before and after
// both attention and FFN, GELU(tanh)-gated FFN, NeoX RoPE. Five of every six layers use a
// sliding window with their own RoPE base (10000); every sixth layer is global. Query scale
// 1/sqrt(head_dim) (the 27B variant, 62 layers, uses 1/sqrt(n_embd/n_head)).
#include <cmath>

#include "models/blocks.h"

namespace stowlm {

namespace {

void gemma3_hparams(const GGUFFile& f, HParams& hp) {
    load_common_hparams(f, hp);
    hp.rope_neox = true;
    hp.rope_base_swa = 10000.0f;
    hp.rope_scale_swa = 1.0f;
    hp.sliding_window = (int32_t)f.get_int("gemma3.attention.sliding_window");
    const int64_t pattern = f.get_int("gemma3.attention.sliding_window_pattern", 6);
    for (int64_t il = 0; il < hp.n_layer; il++) hp.swa_layer[il] = pattern > 0 && (il % pattern) < pattern - 1;
    hp.embed_scale = std::sqrt((float)hp.n_embd);
    hp.ffn_gelu = true;
    hp.attn_scale = hp.n_layer == 62 ? 1.0f / std::sqrt((float)(hp.n_embd / hp.n_head))
                                     : 1.0f / std::sqrt((float)hp.head_dim_k);
}

void gemma3_layer(Model& m, int il, LayerWeights& w) {
    load_standard_layer(m, il, w);
    w.q_norm = m.require(layer_tensor(il, "attn_q_norm.weight"));
    w.k_norm = m.require(layer_tensor(il, "attn_k_norm.weight"));
    w.post_attn_norm = m.require(layer_tensor(il, "post_attention_norm.weight"));
    w.post_ffn_norm = m.require(layer_tensor(il, "post_ffw_norm.weight"));
}

}  // namespace

const ArchDef kArchGemma3 = {"gemma3", gemma3_hparams, gemma3_layer, build_prenorm_decoder};

}  // namespace stowlm
