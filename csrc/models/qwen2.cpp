// Qwen family: qwen2 (q/k/v biases) and qwen3 (per-head q/k RMS norms, no biases). Both use
// NeoX-style RoPE and the plain pre-norm decoder of llama.cpp (models/llama.cpp here).
#include "models/blocks.h"

namespace stowlm {

namespace {

void qwen_hparams(const GGUFFile& f, HParams& hp) {
    load_common_hparams(f, hp);
    hp.rope_neox = true;
}

}  // namespace

const ArchDef kArchQwen2 = {"qwen2", qwen_hparams, load_standard_layer, build_prenorm_decoder};
const ArchDef kArchQwen3 = {"qwen3", qwen_hparams, load_standard_layer, build_prenorm_decoder};

}  // namespace stowlm
