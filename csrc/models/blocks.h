// Transformer pieces shared by the architecture files: embedding lookup, the attention block
// (projections, optional biases and per-head q/k norms, RoPE, KV store, flash attention,
// output projection), the gated FFN, and the output head.
#pragma once
#include "models/model.h"

namespace stowlm {

Tensor* build_embedding(BuildContext& c);
// x: the normed hidden state [n_embd, n_tok]. Returns the attention output [n_embd, n_tok].
Tensor* build_attention(BuildContext& c, int il, Tensor* x);
enum class FfnAct { SILU, GELU };
Tensor* build_ffn(BuildContext& c, int il, Tensor* x, FfnAct act);
// Mixture-of-experts FFN (SiLU-gated experts): router logits, top-k experts, their routing
// weights (gating, renormalisation and scale from HParams), the expert products, weighted sum.
Tensor* build_moe_ffn(BuildContext& c, int il, Tensor* x);
// Picks the wanted rows, final norm, LM head, optional softcap: logits [n_vocab, n_out].
Tensor* build_output(BuildContext& c, Tensor* x);

// Layer tensor names as GGUF spells them.
std::string layer_tensor(int il, const char* what);
// The tensors a plain pre-norm transformer layer has (llama, qwen2, qwen3, gemma3 all share them).
// When hp.n_expert > 0 the FFN is the router and expert stacks instead (load_moe_layer).
void load_standard_layer(Model& m, int il, LayerWeights& w);
void load_moe_layer(Model& m, int il, LayerWeights& w);

}  // namespace stowlm
