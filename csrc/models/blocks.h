// Transformer pieces shared by the architecture files: embedding lookup, the attention block
// (projections, optional biases and per-head q/k norms, RoPE, KV store, flash attention,
// output projection), the gated FFN, and the output head.
#pragma once
#include <functional>

#include "models/model.h"

namespace stowlm {

Tensor* build_embedding(BuildContext& c);
// How this model rotates (its RoPE base/scale, the sliding-window layers' own, YaRN).
RopeSpec rope_spec(const HParams& hp, bool swa);
// Which cached cells the micro-batch's tokens see (positions; sequences when there are several).
AttnMask attn_mask(const BuildContext& c);
// x: the normed hidden state [n_embd, n_tok]. Returns this shard's heads' output [head_dim_v *
// q_heads, n_tok], before the output projection (the decoder applies it).
Tensor* build_attention(BuildContext& c, int il, Tensor* x);
// A sub-block cut around tensor parallelism's meeting: `mid` is what this shard computes of
// what the sub-block's last projections read (null where it has no part), `out` those
// projections on what it is given (this shard's own mids when the shards' products are summed,
// the gathered wholes when their rows are gathered). One device: out(mid).
struct SubBlock {
    std::vector<Tensor*> mid;
    std::function<Tensor*(const std::vector<Tensor*>&)> out;
};
// mid, and out(v) = proj . v[0] (named `name`; null where there is no part or no projection).
SubBlock projected(BuildContext& c, int il, Tensor* mid, Tensor* proj, const char* name);
enum class FfnAct { SILU, GELU };
SubBlock build_ffn(BuildContext& c, int il, Tensor* x, FfnAct act);
// Mixture-of-experts FFN: router logits (+ bias), top-k experts (by the gated scores + the
// selection bias, within the best groups where there are groups), their routing weights
// (gating, renormalisation and scale from HParams), the expert products (+ per-expert biases,
// SwiGLU or gpt-oss's clamped SwiGLU), weighted sum, plus a shared expert when the layer has one.
SubBlock build_moe_ffn(BuildContext& c, int il, Tensor* x);
// Per shard: picks the wanted rows, final norm, its rows of the LM head, optional softcap; the
// shards' rows gathered in order: logits [n_vocab, n_out].
Tensor* build_output(BuildContext& c, const std::vector<Tensor*>& xs);

// The pre-norm decoder: x += post_norm(attention(norm(x)) + bias); x += post_norm(ffn(ffn_norm(x)))
// per layer (an MoE FFN where the layer has experts; post-norms where the layer has them, as
// gemma3), then the output head. With tensor parallelism every shard runs each sub-block on
// its part and the parts are summed (all-reduce) before the bias.
using AttentionFn = Tensor* (*)(BuildContext&, int, Tensor*);
Tensor* build_decoder(BuildContext& c, AttentionFn attention);
Tensor* build_prenorm_decoder(BuildContext& c);  // with build_attention

// Layer tensor names as GGUF spells them.
std::string layer_tensor(int il, const char* what);
// The tensors a plain pre-norm transformer layer has (llama, qwen2, qwen3, gemma3 all share them):
// the attention part and the FFN part. When hp.n_expert > 0 the FFN of the layers after
// hp.n_layer_dense_lead is the router and expert stacks instead (load_moe_layer).
void load_standard_layer(Model& m, int il, LayerWeights& w);
void load_attention_layer(Model& m, int il, LayerWeights& w);
void load_ffn_layer(Model& m, int il, LayerWeights& w);
void load_moe_layer(Model& m, int il, LayerWeights& w);
// A layer whose FFN norm is stored as post_attention_norm (gpt-oss, glm4moe): not a norm after
// the attention, the one in front of the FFN.
void load_layer_norm_named_post_attention(Model& m, int il, LayerWeights& w);

}  // namespace stowlm
