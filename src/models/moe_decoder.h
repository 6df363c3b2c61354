// The layer shape most MoE families share, as blocks:
//
//   MoeFeedForward  the feed-forward half of a layer: routed experts (with optional shared
//                   experts added after them) or a dense SwiGLU MLP. DeepSeek-V3 uses it with its
//                   own latent attention.
//   MoeDecoder      a decoder whose every layer is x += attn(rmsnorm(x)); x += ffn(rmsnorm(x))
//                   with grouped-query attention (Mixtral, OLMoE, Qwen3-MoE, GLM-4.5, gpt-oss).
//                   A family parses its config, fills layers_ with the checkpoint's names, then
//                   calls finish_load; the forward pass is the same for all of them.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "experts/expert_store.h"
#include "models/blocks.h"

namespace moestream {

struct MoeFeedForward {
  bool moe = false;
  Matrix router;        // [n_experts, hidden]                                  (moe layers)
  Vector router_bias;   // gpt-oss logit bias / DeepSeek, GLM e_score_correction_bias, or empty
  MlpWeights shared;    // shared experts, or empty
  MoeParams routing;    // how tokens are routed (MoeParams::layer is set per call)
  MlpWeights dense;     //                                                      (dense layers)

  // x (T, hidden) += ffn(xn) for layer l; ws.ffn_out (and ws.attn_out for shared experts) are
  // scratch.
  void forward(Backend& be, ExpertStore& experts, Workspace& ws, int l, const Buffer& xn, Buffer& x) const;
};

// "model.layers.<l>."
inline std::string layer_prefix(int l) { return "model.layers." + std::to_string(l) + "."; }

// Routed experts alone (no shared experts): router [n_experts, hidden] and optional logit bias.
MoeFeedForward routed_ffn(Matrix router, const MoeParams& routing, Vector router_bias = {});

// DeepSeek-V3 / GLM-4.5 feed-forward of layer prefix p ("model.layers.L."): routed experts with
// p + "mlp.gate.weight", p + "mlp.gate.e_score_correction_bias" and shared experts
// p + "mlp.shared_experts.*" [shared_inter] when moe, else the dense MLP p + "mlp.*" [dense_inter].
MoeFeedForward load_shared_expert_ffn(WeightLoader& w, const std::string& p, bool moe, int64_t hidden,
                                      int64_t dense_inter, int64_t shared_inter, const MoeParams& routing);

// Routing of the sigmoid-scored families: SigmoidGroupTopK over n_group groups, keeping
// topk_group of them, weights optionally renormalized, then scaled.
MoeParams sigmoid_group_routing(int n_experts, int top_k, bool norm_topk_prob, int n_group, int topk_group,
                                float routed_scaling_factor);

// Config checks the MoE families share; each fails naming config.json and the field.
void check_silu(const HfConfig& c);  // hidden_act is silu (the default)
// num_attention_heads a positive multiple of num_key_value_heads.
void check_gqa_heads(const HfConfig& c, int n_heads, int n_kv_heads);
void check_head_dim(const HfConfig& c, int head_dim);  // positive and even
// num_experts_per_tok in [1, n_experts]; experts_field names the config's expert count.
void check_top_k(const HfConfig& c, int top_k, int n_experts, const char* experts_field);
// n_group divides n_routed_experts, topk_group in [1, n_group].
void check_expert_groups(const HfConfig& c, int n_experts, int n_group, int topk_group);

struct MoeDecoderLayer {
  Vector input_norm, post_attention_norm;
  GqaAttention attn;
  MoeFeedForward ffn;
};

class MoeDecoder : public DecoderModel {
 public:
  ExpertStats expert_stats() const override { return experts_->stats(); }
  std::unique_ptr<SequenceState> new_sequence(int64_t capacity) override;

 protected:
  static constexpr int64_t kMaxBatch = 128;  // tokens per forward batch (prefill chunk)

  // Norms and attention of layer l from "model.layers.<l>.{input,post_attention}_layernorm" and
  // "model.layers.<l>.self_attn."; the family adds ffn.
  struct AttentionShape {
    int n_heads = 0, n_kv_heads = 0, head_dim = 0;
    int rot_dim = 0;  // rotated dims of each head (partial rotary); 0: head_dim
    GqaOptions options;
  };
  MoeDecoderLayer load_layer(WeightLoader& w, int l, const AttentionShape& shape);

  // What finish_load checks the pack's experts against.
  struct ExpertShape {
    int n_experts = 0, top_k = 0;
    int64_t intermediate = 0;  // width of one routed expert
    // The checkpoint tensor of (layer, expert, role), for errors.
    std::function<std::string(int, int, const std::string&)> tensor_name;
  };
  // After layers_ is filled: the pack holds experts of that shape exactly for the MoE layers; the
  // expert store, rotary table, workspace and weight sizes.
  void finish_load(const HfConfig& hf, const ModelOptions& options, const RopeParams& rope,
                   const ExpertShape& experts);

  void run_layer(int l, int64_t T, SequenceState& state) override;

  std::vector<MoeDecoderLayer> layers_;
  std::unique_ptr<ExpertStore> experts_;
  RopeTable rope_;
  AttentionShape attention_shape_;  // of every layer (load_layer records it)
  int64_t kv_dim_ = 0;
};

}  // namespace moestream
