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

const ArchDef kArchLlama = {"llama", llama_hparams, load_standard_layer, build_prenorm_decoder};

}  // namespace stowlm
