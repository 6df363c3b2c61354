// The config.json fields every decoder family reads, parsed and validated once.
//
// A family's config embeds DecoderConfig and adds only what differs (Mixtral's sliding_window,
// DeepSeek's latent-attention dims, ...). Names that changed across transformers versions
// (num_local_experts / n_routed_experts / num_experts, rope_theta / rope_parameters, text_config)
// are resolved by HfConfig. Every integer is read as 64-bit and range-checked before it is
// narrowed, so a bad value is an Error naming config.json, the field and the value, never a
// division by zero or a silent wrap-around.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "io/hf_config.h"

namespace moestream {

// Upper bounds far above any published model, low enough that products of them fit int64 and
// the counts fit the int fields below.
inline constexpr int64_t kMaxLayers = 4096;
inline constexpr int64_t kMaxHeads = 1 << 16;
inline constexpr int64_t kMaxWidth = 1 << 20;      // hidden_size, head_dim, MLP widths
inline constexpr int64_t kMaxVocab = 1 << 24;
inline constexpr int64_t kMaxExperts = 1 << 16;
inline constexpr int64_t kMaxPositions = int64_t(1) << 31;

// What differs between families in how the common fields are read.
struct DecoderDefaults {
  double rms_norm_eps = 1e-6;     // when config.json has none
  int64_t max_position = 32768;   // when config.json has none
  bool norm_topk_prob = false;    // when config.json has none
  // The field giving the width of one routed expert: Mixtral, OLMoE and gpt-oss name it
  // intermediate_size (their MLPs are all experts).
  const char* expert_size_field = "moe_intermediate_size";
  // num_key_value_heads and head_dim shape the attention; false for DeepSeek's latent attention,
  // which has its own per-head dims.
  bool gqa = true;
};

struct DecoderConfig {
  std::string model_type;
  int64_t vocab_size = 0;         // tokens
  int64_t hidden_size = 0;        // model width: floats per token
  int n_layers = 0;               // num_hidden_layers
  int n_heads = 0;                // query heads
  int n_kv_heads = 0;             // key/value heads, each shared by n_heads / n_kv_heads query heads
  int head_dim = 0;               // floats per attention head; default hidden_size / n_heads
  int64_t intermediate_size = 0;  // width of the dense SwiGLU MLP; 0 when config.json has none
  int64_t expert_size = 0;        // width of one routed expert (see DecoderDefaults)
  int n_experts = 0;              // routed experts per MoE layer
  int top_k = 0;                  // experts each token is routed to, in [1, n_experts]
  bool norm_topk_prob = false;    // renormalize the top-k routing weights to sum to 1
  bool tie_word_embeddings = false;  // lm_head is embed_tokens when the checkpoint has none
  float rms_norm_eps = 1e-6f;     // added to the mean square in every RMSNorm
  int64_t max_position = 0;       // positions the model was trained for (max_position_embeddings)
  RopeParams rope;                // base frequency, scaling, partial rotary factor
  std::string config_path;        // config.json, for the errors of later checks

  // Reads and validates the fields above; throws Error naming config.json and the field.
  static DecoderConfig parse(const HfConfig& c, const DecoderDefaults& defaults = {});

  int64_t q_dim() const { return int64_t(n_heads) * head_dim; }      // floats of all query heads
  int64_t kv_dim() const { return int64_t(n_kv_heads) * head_dim; }  // floats of all key heads
  // Rotated dims of each head: head_dim * partial_rotary_factor; an Error unless positive, even
  // and at most head_dim.
  int rot_dim() const;
  // Dense layers (where is_moe_layer(l) is false) need intermediate_size: an Error naming the
  // first one.
  void check_dense_width(const std::function<bool(int)>& is_moe_layer) const;
};

// Qwen's choice of dense layers (Qwen3-MoE, Qwen3-Next): layer l is MoE when
// (l + 1) % decoder_sparse_step == 0 and l is not in mlp_only_layers.
struct SparseLayers {
  int step = 1;                      // decoder_sparse_step, >= 1
  std::vector<int64_t> mlp_only;     // mlp_only_layers, each in [0, n_layers)

  static SparseLayers parse(const HfConfig& c, int n_layers);
  bool is_moe(int l) const;
};

// layer_types as one bool per layer, true where the entry is `marked`; an Error unless every
// entry is `marked` or `other` and the list has num_hidden_layers entries. Empty when absent.
std::vector<bool> parse_layer_types(const HfConfig& c, int n_layers, const std::string& marked,
                                    const std::string& other);

// Checks the MoE families share; each fails naming config.json and the field.
void check_silu(const HfConfig& c);  // hidden_act is silu (the default)
// n_group divides the expert count, topk_group in [1, n_group].
void check_expert_groups(const HfConfig& c, int n_experts, int n_group, int topk_group);

}  // namespace moestream
