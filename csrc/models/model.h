// A loaded model: the GGUF mapping, hyperparameters from its metadata, the devices, and every
// weight as a Tensor placed on a device (layers in contiguous ranges per device; the input
// embedding with the first layers unless it is tied to the output, which goes with the last).
// Weights stay zero copy in the mapping on CPU devices but count against that device's budget.
#pragma once
#include <cstdlib>
#include <map>
#include <memory>
#include <regex>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "gguf/gguf.h"
#include "graph/graph.h"

namespace stowlm {

struct HParams {
    std::string arch;
    int64_t n_vocab = 0, n_embd = 0, n_layer = 0, n_head = 0, n_head_kv = 0, n_ff = 0;
    int64_t head_dim_k = 0, head_dim_v = 0, n_rot = 0, n_ctx_train = 0;
    float eps = 1e-5f;
    float rope_base = 10000, rope_scale = 1;
    float rope_base_swa = 10000, rope_scale_swa = 1;
    bool rope_neox = false;
    // YaRN scaling (rope.scaling.type yarn), with llama.cpp's defaults and attention factor.
    float yarn_ext_factor = 0, yarn_attn_factor = 1, yarn_beta_fast = 32, yarn_beta_slow = 1;
    float yarn_log_mul = 0;  // rope.scaling.yarn_log_multiplier (deepseek2 reads it / 0.1)
    int32_t n_ctx_orig = 0;
    int32_t sliding_window = 0;
    std::vector<bool> swa_layer;  // per layer: sliding-window attention?
    float attn_scale = 0;         // 0: 1/sqrt(head_dim_k)
    float attn_softcap = 0, final_softcap = 0;
    float embed_scale = 1;        // gemma: sqrt(n_embd)
    bool ffn_gelu = false;        // gemma: GELU(tanh)-gated FFN (else SiLU)
    // Mixture of experts (0 experts: dense FFN).
    int64_t n_expert = 0, n_expert_used = 0;
    int32_t expert_gating = 0;        // cpu::Gating: 0 softmax, 1 sigmoid, 2 softmax over the picked
    bool expert_weights_norm = false; // renormalise the picked experts' weights to sum to 1
    float expert_weights_scale = 0;   // 0: none
    int64_t n_layer_dense_lead = 0;   // the first layers keep a dense FFN (deepseek2, glm4moe)
    int32_t n_expert_groups = 0, n_group_used = 0;  // grouped selection (DeepSeek-V3)
    bool expert_act_oai = false;      // gpt-oss's clamped SwiGLU on the experts
    // Multi-head latent attention (deepseek2): low-rank q and a compressed KV of kv_lora_rank
    // plus n_rot rope dims per token, one cache row that V reads the first kv_lora_rank of.
    int64_t q_lora_rank = 0, kv_lora_rank = 0, head_dim_qk_mla = 0, head_dim_v_mla = 0;
    bool kv_v_in_k = false;  // V is a view into the K cache (no V cache)
};

// The weights of one layer a builder may use (null where the file has none).
struct LayerWeights {
    Tensor *attn_norm = nullptr, *wq = nullptr, *wk = nullptr, *wv = nullptr, *wo = nullptr;
    Tensor *bq = nullptr, *bk = nullptr, *bv = nullptr, *bo = nullptr;
    Tensor *q_norm = nullptr, *k_norm = nullptr, *post_attn_norm = nullptr;
    Tensor* attn_sinks = nullptr;  // gpt-oss: per head
    // Multi-head latent attention: q = wq_b(norm(wq_a x)); [kv, k_rope] = wkv_a x; the
    // per-head wk_b takes q's no-rope part into the compressed space, wv_b takes it back out.
    Tensor *wq_a = nullptr, *q_a_norm = nullptr, *wq_b = nullptr, *wkv_a = nullptr, *kv_a_norm = nullptr;
    Tensor *wk_b = nullptr, *wv_b = nullptr;
    Tensor *ffn_norm = nullptr, *ffn_gate = nullptr, *ffn_up = nullptr, *ffn_down = nullptr, *post_ffn_norm = nullptr;
    // Mixture of experts: router [n_embd, n_expert] and the 3-d expert stacks [.., .., n_expert].
    Tensor *ffn_gate_inp = nullptr, *ffn_gate_exps = nullptr, *ffn_up_exps = nullptr, *ffn_down_exps = nullptr;
    // Optional: router bias (added to the logits), selection bias (DeepSeek-V3's exp_probs_b:
    // added to the gate scores to pick experts, not to their weights), per-expert biases.
    Tensor *ffn_gate_inp_b = nullptr, *ffn_exp_probs_b = nullptr;
    Tensor *ffn_gate_exps_b = nullptr, *ffn_up_exps_b = nullptr, *ffn_down_exps_b = nullptr;
    // Optional shared expert (qwen2moe): a dense SiLU FFN every token takes, scaled by the
    // sigmoid of its gate [n_embd] when there is one.
    Tensor *ffn_gate_inp_shexp = nullptr, *ffn_gate_shexp = nullptr, *ffn_up_shexp = nullptr,
           *ffn_down_shexp = nullptr;
};

// Tensor parallelism: the part of one layer a shard (one device) computes. Attention goes by
// whole KV heads with their query heads (MLA: by query heads, each shard keeping the one
// compressed KV row), dense FFNs, shared experts and routed experts by rows of gate/up and the
// matching columns of down (every expert cut alike, so a generated token's picked experts load
// every shard evenly; whole experts where an expert's rows are too few blocks to cut). Without
// tensor parallelism a layer is one shard.
struct ShardGeometry {
    int64_t q_head0 = 0, q_heads = 0;    // query heads [q_head0, q_head0 + q_heads)
    int64_t kv_head0 = 0, kv_heads = 0;  // KV heads (and KV cache) of this shard
    int64_t ff0 = 0, ff = 0;             // dense FFN rows
    int64_t expert0 = 0, experts = 0;    // routed experts [expert0, expert0 + experts)
    int64_t expert_ff0 = 0, expert_ff = 0; // and the rows of each of them (all of them: whole experts)
    int64_t shexp_ff0 = 0, shexp_ff = 0; // shared expert rows
    int64_t embd0 = 0, embd = 0;         // rows of n_embd the output projections give (gathers)
};

class Model;
class KVCache;

// What a model builder works with to emit the graph of one micro-batch.
struct BuildInputs {
    Tensor* tokens = nullptr;   // I32 [n_tok]
    Tensor* pos = nullptr;      // I32 [n_tok]
    Tensor* cells = nullptr;    // I32 [n_tok]: KV cells the tokens are written to
    Tensor* kv_pos = nullptr;   // I32 [n_kv]: position per visible cell (-1 empty)
    Tensor* out_ids = nullptr;  // I32 [n_out]: rows whose logits are wanted
    // I32 [h, n_tok]: 0..h-1 per token, for each number h of query heads a shard has (per-head
    // products; MLA only)
    std::vector<Tensor*> head_ids;
    // With several sequences in the cache: the sequence of each token and of each visible cell.
    Tensor* q_seq = nullptr;    // I32 [n_tok]
    Tensor* kv_seq = nullptr;   // I32 [n_kv]
    Tensor* seq_end = nullptr;  // I32 [n_seq]: the cell after each sequence's region
};

struct BuildContext {
    Graph& g;
    const Model& model;
    KVCache& kv;
    BuildInputs in;
    int64_t n_tok = 0, n_kv = 0, n_out = 0;
    int shard = 0;  // the shard the blocks build for (tensor parallelism; 0 otherwise)
    // A graph whose host-resident experts a GPU stages: the share of each such layer's experts
    // the host computes meanwhile (ContextParams::moe_cpu_share; 0: none).
    float host_expert_share = 0;
    bool embeddings = false;  // end at the output norm (the hidden states), no head
    // This shard's weights and part of layer il.
    const LayerWeights& w(int il) const;
    const ShardGeometry& geom(int il) const;
};

// One architecture family: reads its hyperparameters, names its tensors, builds its graph.
struct ArchDef {
    const char* name;
    void (*load_hparams)(const GGUFFile& f, HParams& hp);
    void (*load_layer)(Model& m, int il, LayerWeights& w);
    Tensor* (*build)(BuildContext& c);  // returns the logits [n_vocab, n_out] (hidden states [n_embd, n_out]: c.embeddings)
};
const ArchDef* find_arch(const std::string& name);  // nullptr if unknown
// Defined by the architecture files (listed explicitly: a static library drops unreferenced
// objects, so self-registration would be lost).
extern const ArchDef kArchLlama, kArchQwen2, kArchQwen3, kArchGemma3, kArchQwen3Moe, kArchQwen2Moe, kArchGptOss,
    kArchDeepseek2, kArchGlm4Moe;

// A tensor override: weights whose name matches `pattern` (ECMAScript regex, whole name) live
// on `device` instead of their layer's device; the first matching override wins. The scheduler
// then runs the nodes that read them there and copies activations across.
struct TensorOverride {
    std::string pattern;
    int device = 0;
    std::string label;  // how the user wrote it, for errors (the pattern itself when empty)
};

// Where a weight goes when no override names it: with its layer (anchor >= 0), or with the
// first / the last device that holds layers.
constexpr int kAnchorFirstDevice = -1, kAnchorLastDevice = -2;

struct WeightInfo {
    std::string name;
    int anchor = 0;           // layer index, kAnchorFirstDevice or kAnchorLastDevice
    size_t bytes = 0;         // on a device that reads the mapping in place (CPU)
    size_t packed_bytes = 0;  // on a device the weights are uploaded to (padded, see model.cpp)
    int override_index = -1;  // the first override that matches it, -1 for none
    int64_t n_elements = 0;
};

// The device of every layer when device d holds counts[d] layers in `interleave` chunks, the
// devices taking turns chunk by chunk: a pipeline's stages are then 1/interleave as long, and so
// are its fill and drain. interleave <= 0: 2 when two or more devices hold layers, each at least
// 2, and all of them are CPU devices (cpu_only: a hand-over between them is a memory copy; on a
// GPU each range costs a sync per generated token), else 1; larger than a holding device's
// count: clamped to it.
int effective_interleave(const std::vector<int>& counts, int interleave, bool cpu_only = true);
std::vector<int> layer_devices(const std::vector<int>& counts, int interleave);

class Model {
public:
    // layer_split: layers per device (sums to n_layer); empty: even split. interleave: each
    // device's layers in that many chunks, the devices taking turns (layer_devices()); 0: auto.
    // count_weights=false: build shapes and placement only (projections), nothing reserved.
    // An override that matches no weight the model uses is an error naming it.
    // tensor_split (one share per device, not all 0): tensor parallelism instead of a layer
    // split; every layer is cut over the devices with a share > 0, in proportion (layer_split
    // and overrides must then be empty).
    static std::unique_ptr<Model> load(const std::string& path, const std::vector<DeviceSpec>& devices,
                                       const std::vector<int>& layer_split, bool count_weights = true,
                                       const std::vector<TensorOverride>& overrides = {},
                                       const std::vector<double>& tensor_split = {}, int interleave = 0,
                                       bool tp_sum = false);
    // The same over a file opened once (fit projects many placements of one file).
    static std::unique_ptr<Model> load(std::shared_ptr<const GGUFFile> file, const std::vector<DeviceSpec>& devices,
                                       const std::vector<int>& layer_split, bool count_weights,
                                       const std::vector<TensorOverride>& overrides,
                                       const std::vector<double>& tensor_split = {}, int interleave = 0,
                                       bool tp_sum = false);

    const GGUFFile& file() const { return *file_; }
    const HParams& hp() const { return hp_; }
    const ArchDef& arch() const { return *arch_; }
    const std::vector<LayerWeights>& layers() const { return layers_; }
    Tensor* tok_embd() const { return tok_embd_; }
    Tensor* output_norm() const { return output_norm_; }
    Tensor* output() const { return output_; }  // == tok_embd() when tied

    std::vector<Backend*> backends() const;
    // The token counts from which some device's products take batched kernels, ascending: a
    // token's logits are the same in any batch whose size lies between the same two bounds.
    std::vector<int64_t> batch_bounds() const;
    // Bytes of weights a generated token reads: every weight once, but of the input embedding
    // only a row (unless it is tied to the output) and of each expert stack its used experts.
    double weight_bytes_per_token() const;
    // Multiply-adds of one token's attention over n_kv visible cells, all layers (a sliding
    // window's layers see at most its cells).
    double attention_macs(int64_t n_kv) const;
    // Tensor parallelism: shards (1 without it), each on one device, and their parts of a layer.
    bool tensor_parallel() const { return !shard_device_.empty(); }
    // How the shards meet: by gathering rows (every product computed as on one device, so the
    // logits are one device's bit for bit; the default), or with tp_sum by summing partial
    // products (half the meetings and fewer bytes, results within float re-association).
    bool tp_gathers() const { return tensor_parallel() && !tp_sum_; }
    int n_shards() const { return tensor_parallel() ? (int)shard_device_.size() : 1; }
    int shard_device(int s, int il) const { return tensor_parallel() ? shard_device_.at(s) : layer_device_.at(il); }
    const ShardGeometry& shard_geometry(int s, int il) const;
    const LayerWeights& shard_layer(int s, int il) const;
    // The LM head rows [vocab0, vocab0 + n) a shard computes, its weights and final norm.
    Tensor* shard_output(int s) const { return tensor_parallel() ? shard_output_.at(s) : output_; }
    Tensor* shard_output_norm(int s) const { return tensor_parallel() ? shard_output_norm_.at(s) : output_norm_; }
    int layer_device(int il) const { return layer_device_[il]; }
    int interleave() const { return interleave_; }
    const std::vector<int>& layer_devices() const { return layer_device_; }
    const std::vector<size_t>& weight_bytes() const { return weight_bytes_; }  // per device
    // Names of the weights repacked into 16-row groups at load (cpu/repack.h).
    std::vector<std::string> repacked_weights() const;
    // Whether [p, p + bytes) lies in host memory that outlives the model's backends: the file's
    // mapping or the repacked weights (what a backend may page-lock).
    bool outlives_backends(const void* p, size_t bytes) const;
    int weight_device(const std::string& name) const;  // -1 when the model does not use it
    std::vector<WeightInfo> weight_infos() const;      // every weight the model uses, by name

    // Used by the arch files while loading.
    Tensor* require(const std::string& name);  // InvalidInput naming the tensor and file if absent
    Tensor* optional(const std::string& name);

private:
    Model() = default;
    std::shared_ptr<const GGUFFile> file_;
    HParams hp_;
    const ArchDef* arch_ = nullptr;
    // CPU weights repacked at load (cpu/repack.h); their share of the budget is still counted
    // through weight_buffers_, the mapped bytes they replace are given back to the page cache.
    // Before backends_: a backend that page-locked some (staged experts) lets go of them first.
    struct FreeDeleter { void operator()(void* p) const { std::free(p); } };
    std::unique_ptr<uint8_t, FreeDeleter> repacked_;
    size_t repacked_bytes_ = 0;
    std::vector<std::unique_ptr<Backend>> backends_;
    std::map<std::string, Tensor> weights_;
    std::vector<LayerWeights> layers_;
    Tensor *tok_embd_ = nullptr, *output_norm_ = nullptr, *output_ = nullptr;
    std::vector<int> layer_device_;
    int interleave_ = 1;
    std::vector<size_t> weight_bytes_;
    std::vector<BufferPtr> weight_buffers_;
    void repack_cpu_weights(const std::vector<DeviceSpec>& devices, const std::vector<Tensor*>& candidates);
    int loading_device_ = 0;  // device for tensors named while loading a layer
    int loading_anchor_ = 0;  // and what that device follows (WeightInfo::anchor)
    std::map<std::string, std::pair<int, int>> anchors_;  // weight -> (anchor, override index)
    std::vector<std::pair<std::regex, int>> overrides_;
    // Tensor parallelism (model_tp.cpp).
    void build_shards(const std::vector<double>& shares);
    void place_shard_weights(bool count_weights);
    std::vector<int> shard_device_;                        // per shard
    bool tp_sum_ = false;
    std::vector<std::vector<ShardGeometry>> shard_geom_;   // [shard][layer]
    std::vector<std::vector<LayerWeights>> shard_layers_;  // [shard][layer]
    std::vector<Tensor*> shard_output_, shard_output_norm_;
    std::vector<std::unique_ptr<Tensor>> shard_store_;     // the shards' weight tensors
    // Shard weights that are column ranges of a file tensor (not contiguous in it): copied
    // into their device's buffer at load. (tensor, source, first column, columns)
    struct ColumnSlice {
        Tensor* t;
        const Tensor* src;
        int64_t col0, cols;
        bool rows = false;  // rows [col0, col0 + cols) of each matrix of a stack instead of columns
    };
    std::vector<ColumnSlice> column_slices_;
    bool is_column_slice(const Tensor* t) const;  // a -sm tensor-sum slice, in a buffer of its own
    bool cuts_columns(const Tensor* t) const;      // one of those cutting columns (not an expert's rows)
};

// Hyperparameter helpers for the arch files.
void load_common_hparams(const GGUFFile& f, HParams& hp);
// The {arch}.expert_* keys; `norm_default` is the architecture's convention when the file does
// not say whether the picked experts' weights are renormalised, `gating_default` (cpu::Gating)
// when it does not name the gating function.
void load_moe_hparams(const GGUFFile& f, HParams& hp, bool norm_default, int32_t gating_default = 0);
// llama.cpp's YaRN attention factor from the scaling factor and yarn_log_mul (deepseek2 scales
// by the log multiplier itself when it is not 1).
void set_yarn_attn_factor(const GGUFFile& f, HParams& hp, bool deepseek2);

}  // namespace stowlm
