// Qwen mixture-of-experts family: qwen3moe is qwen3 (per-head q/k RMS norms, NeoX RoPE) with
// every FFN a mixture of experts: softmax router, top-k, the picked weights renormalised
// (llama.cpp's convention for qwen3moe, Qwen3-MoE's norm_topk_prob). qwen2moe is qwen2 (q/k/v
// biases) with experts whose weights are not renormalised, plus a shared expert under a
// sigmoid gate (build_moe_ffn adds it when the layer has one).
#include "error.h"
#include "models/blocks.h"

namespace stowlm {

namespace {

void qwen3moe_hparams(const GGUFFile& f, HParams& hp) {
    load_common_hparams(f, hp);
    load_moe_hparams(f, hp, true);
    if (hp.n_expert == 0) throw InvalidInput(f.path() + ": qwen3moe.expert_count is missing or 0");
    hp.rope_neox = true;
}

void qwen2moe_hparams(const GGUFFile& f, HParams& hp) {
    load_common_hparams(f, hp);
    load_moe_hparams(f, hp, false);
    if (hp.n_expert == 0) throw InvalidInput(f.path() + ": qwen2moe.expert_count is missing or 0");
    hp.rope_neox = true;
}

}  // namespace

const ArchDef kArchQwen2Moe = {"qwen2moe", qwen2moe_hparams, load_standard_layer, build_prenorm_decoder};
const ArchDef kArchQwen3Moe = {"qwen3moe", qwen3moe_hparams, load_standard_layer, build_prenorm_decoder};

}  // namespace stowlm
