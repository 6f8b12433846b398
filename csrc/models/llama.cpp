// llama family (Llama 2/3, SmolLM2): pre-norm, GQA, RoPE on adjacent pairs, SwiGLU FFN;
// the output head is tied to the embedding when the file has no output.weight. With
// llama.expert_count > 0 the FFN is a mixture of experts (Mixtral style).
#include "models/blocks.h"

namespace stowlm {

namespace {

void llama_hparams(const GGUFFile& f, HParams& hp) {
    load_common_hparams(f, hp);
    load_moe_hparams(f, hp, true);  // Mixtral-style experts: picked weights renormalised
    hp.rope_neox = false;
}

}  // namespace

// Shared with the other pre-norm decoders (qwen2, qwen3, the MoE families): the layer loop,
// with the attention block the architecture has.
Tensor* build_decoder(BuildContext& c, AttentionFn attention) {
    const HParams& hp = c.model.hp();
    Tensor* x = build_embedding(c);
    for (int il = 0; il < hp.n_layer; il++) {
        const LayerWeights& w = c.model.layers()[il];
        Tensor* h = rms_norm(c.g, x, w.attn_norm, hp.eps);
        h->name = layer_tensor(il, "attn_normed");
        x = add(c.g, x, attention(c, il, h));
        x->name = layer_tensor(il, "attn_residual");
        h = rms_norm(c.g, x, w.ffn_norm, hp.eps);
        h->name = layer_tensor(il, "ffn_normed");
        x = add(c.g, x, w.ffn_gate_inp ? build_moe_ffn(c, il, h) : build_ffn(c, il, h, FfnAct::SILU));
        x->name = layer_tensor(il, "ffn_residual");
    }
    return build_output(c, x);
}

Tensor* build_prenorm_decoder(BuildContext& c) { return build_decoder(c, build_attention); }

const ArchDef kArchLlama = {"llama", llama_hparams, load_standard_layer, build_prenorm_decoder};

}  // namespace stowlm
