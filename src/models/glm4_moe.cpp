// GLM-4.5 MoE (model_type "glm4_moe"): GLM-4.5, GLM-4.5-Air, GLM-4.6.
//
// Each layer: x += attn(rmsnorm(x)); x += ffn(rmsnorm(x)). Attention is grouped-query with biases
// on q/k/v, an optional per-head RMSNorm of q and k (use_qk_norm), and rotary embedding on the
// first partial_rotary_factor of each head (halves rotated, not interleaved). The first
// first_k_dense_replace layers have a dense SwiGLU MLP; the others a routed MoE plus shared experts:
// sigmoid scores, experts chosen by score + e_score_correction_bias within the best topk_group of
// n_group groups, weights the chosen scores (renormalized when norm_topk_prob) times
// routed_scaling_factor.
#include "core/error.h"
#include "experts/expert_store.h"
#include "io/pack.h"
#include "io/safetensors.h"
#include "models/blocks.h"
#include "models/moe_decoder.h"
#include "models/registry.h"

namespace moestream {

namespace {

struct Glm4MoeConfig {
  int64_t vocab_size;             // tokens
  int64_t hidden_size;            // model width
  int64_t intermediate_size;      // dense MLP width (first_k_dense_replace layers)
  int64_t moe_intermediate_size;  // width of one routed expert
  int64_t shared_intermediate;    // moe_intermediate_size * n_shared_experts
  int n_layers;
  int n_heads, n_kv_heads, head_dim;
  int rot_dim;                    // rotated dims of each head: head_dim * partial_rotary_factor
  int n_experts, top_k;
  int n_group, topk_group;        // group-limited routing
  float routed_scaling_factor;
  bool norm_topk_prob;
  int first_k_dense_replace;      // layers [0, k) are dense
  bool use_qk_norm;
  bool tie_word_embeddings;
  float rms_norm_eps;
  int64_t max_position;
  RopeParams rope;

  static Glm4MoeConfig from(const HfConfig& c) {
    Glm4MoeConfig m;
    m.vocab_size = c.get_int("vocab_size");
    m.hidden_size = c.get_int("hidden_size");
    m.intermediate_size = c.get_int("intermediate_size");
    m.moe_intermediate_size = c.get_int("moe_intermediate_size");
    m.shared_intermediate = m.moe_intermediate_size * c.get_int("n_shared_experts", 1);
    m.n_layers = int(c.get_int("num_hidden_layers"));
    m.n_heads = int(c.get_int("num_attention_heads"));
    m.n_kv_heads = int(c.get_int("num_key_value_heads", m.n_heads));
    m.head_dim = int(c.get_int("head_dim", m.hidden_size / m.n_heads));
    m.rope = c.rope();
    m.rot_dim = int(m.head_dim * m.rope.partial_rotary_factor);
    m.n_experts = int(c.get_int("n_routed_experts"));
    m.top_k = int(c.get_int("num_experts_per_tok"));
    m.n_group = int(c.get_int("n_group", 1));
    m.topk_group = int(c.get_int("topk_group", 1));
    m.routed_scaling_factor = float(c.get_double("routed_scaling_factor", 1.0));
    m.norm_topk_prob = c.get_bool("norm_topk_prob", true);
    m.first_k_dense_replace = int(c.get_int("first_k_dense_replace", 0));
    m.use_qk_norm = c.get_bool("use_qk_norm", false);
    m.tie_word_embeddings = c.get_bool("tie_word_embeddings", false);
    m.rms_norm_eps = float(c.get_double("rms_norm_eps", 1e-5));
    m.max_position = c.get_int("max_position_embeddings", 131072);
    check_silu(c);
    check_gqa_heads(c, m.n_heads, m.n_kv_heads);
    if (m.rot_dim <= 0 || m.rot_dim % 2 != 0 || m.rot_dim > m.head_dim)
      fail(c.path(), ": head_dim (", m.head_dim, ") * partial_rotary_factor must be a positive even number of dims");
    check_top_k(c, m.top_k, m.n_experts, "n_routed_experts");
    check_expert_groups(c, m.n_experts, m.n_group, m.topk_group);
    return m;
  }

  bool is_moe_layer(int l) const { return l >= first_k_dense_replace; }
};

std::string expert_tensor_name(int layer, int expert, const std::string& role) {
  return "model.layers." + std::to_string(layer) + ".mlp.experts." + std::to_string(expert) + "." + role +
         "_proj.weight";
}

class Glm4Moe final : public MoeDecoder {
 public:
  Glm4Moe(const std::string& dir, const HfConfig& hf, const ModelOptions& options) {
    const Glm4MoeConfig c = Glm4MoeConfig::from(hf);
    open_pack(dir, hf, options, {"glm4_moe", c.vocab_size, c.hidden_size, c.n_layers, c.max_position, c.rms_norm_eps});
    WeightLoader w(*weights_, *backend_, quantization_lookup(hf));
    load_embeddings(w, c.tie_word_embeddings);
    const MoeParams routing = sigmoid_group_routing(c.n_experts, c.top_k, c.norm_topk_prob, c.n_group, c.topk_group,
                                                    c.routed_scaling_factor);
    for (int l = 0; l < c.n_layers; ++l) {
      const std::string p = layer_prefix(l);
      MoeDecoderLayer layer = load_layer(w, l, {c.n_heads, c.n_kv_heads, c.head_dim, c.rot_dim});
      if (bool(layer.attn.q_norm) != c.use_qk_norm || bool(layer.attn.k_norm) != c.use_qk_norm)
        fail("tensor ", p, "self_attn.q_norm.weight / k_norm.weight: ", c.use_qk_norm ? "missing" : "present",
             " but config.json has use_qk_norm = ", c.use_qk_norm ? "true" : "false");
      layer.ffn = load_shared_expert_ffn(w, p, c.is_moe_layer(l), c.hidden_size, c.intermediate_size,
                                         c.shared_intermediate, routing);
      layers_.push_back(std::move(layer));
    }
    finish_load(hf, options, c.rope, {c.n_experts, c.top_k, c.moe_intermediate_size, expert_tensor_name});
  }
};

}  // namespace

std::unique_ptr<Model> load_glm4_moe(const std::string& dir, const HfConfig& config, const ModelOptions& options) {
  return std::make_unique<Glm4Moe>(dir, config, options);
}

}  // namespace moestream
