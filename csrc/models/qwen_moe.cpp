// Qwen mixture-of-experts family: qwen3moe is qwen3 (per-head q/k RMS norms, NeoX RoPE) with
// every FFN a mixture of experts: softmax router, top-k, the picked weights renormalised
// (llama.cpp's convention for qwen3moe, Qwen3-MoE's norm_topk_prob).
#include "error.h"
#include "models/blocks.h"

namespace stowlm {

Tensor* build_prenorm_decoder(BuildContext& c);

namespace {

void qwen3moe_hparams(const GGUFFile& f, HParams& hp) {
    load_common_hparams(f, hp);
    load_moe_hparams(f, hp, true);
    if (hp.n_expert == 0) throw InvalidInput(f.path() + ": qwen3moe.expert_count is missing or 0");
    hp.rope_neox = true;
}

}  // namespace

const ArchDef kArchQwen3Moe = {"qwen3moe", qwen3moe_hparams, load_standard_layer, build_prenorm_decoder};

}  // namespace stowlm
