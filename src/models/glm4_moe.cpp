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
#include "models/moe_decoder.h"
#include "models/registry.h"

namespace moestream {

namespace {

struct Glm4MoeConfig : DecoderConfig {
  int64_t shared_intermediate;  // width of the shared experts: expert_size * n_shared_experts
  int rot_dims;                 // rotated dims of each head: head_dim * partial_rotary_factor
  int n_group, topk_group;      // group-limited routing
  float routed_scaling_factor;  // multiplies the routing weights
  int first_k_dense_replace;    // layers [0, k) are dense
  bool use_qk_norm;             // per-head RMSNorm of q and k

  explicit Glm4MoeConfig(const HfConfig& c)
      : DecoderConfig(parse(c, {.rms_norm_eps = 1e-5, .max_position = 131072, .norm_topk_prob = true})),
        shared_intermediate(expert_size * c.get_int_in("n_shared_experts", 1, kMaxExperts, 1)),
        rot_dims(rot_dim()),
        n_group(int(c.get_int_in("n_group", 1, kMaxExperts, 1))),
        topk_group(int(c.get_int_in("topk_group", 1, kMaxExperts, 1))),
        routed_scaling_factor(float(c.get_double("routed_scaling_factor", 1.0))),
        first_k_dense_replace(int(c.get_int_in("first_k_dense_replace", 0, kMaxLayers, 0))),
        use_qk_norm(c.get_bool("use_qk_norm", false)) {
    check_silu(c);
    check_expert_groups(c, n_experts, n_group, topk_group);
    check_dense_width([&](int l) { return is_moe_layer(l); });
  }

  bool is_moe_layer(int l) const { return l >= first_k_dense_replace; }
};

class Glm4Moe final : public MoeDecoder {
 public:
  Glm4Moe(const std::string& dir, const HfConfig& hf, const ModelOptions& options) {
    const Glm4MoeConfig c(hf);
    open_pack(dir, hf, options, c);
    WeightLoader w(*weights_, *backend_, quantization_lookup(hf));
    load_embeddings(w, c.tie_word_embeddings);
    const MoeParams routing = sigmoid_group_routing(c.n_experts, c.top_k, c.norm_topk_prob, c.n_group, c.topk_group,
                                                    c.routed_scaling_factor);
    for (int l = 0; l < c.n_layers; ++l) {
      const std::string p = layer_prefix(l);
      MoeDecoderLayer layer = load_layer(w, l, {c.n_heads, c.n_kv_heads, c.head_dim, c.rot_dims});
      if (bool(layer.attn.q_norm) != c.use_qk_norm || bool(layer.attn.k_norm) != c.use_qk_norm)
        fail("tensor ", p, "self_attn.q_norm.weight / k_norm.weight: ", c.use_qk_norm ? "missing" : "present",
             " but config.json has use_qk_norm = ", c.use_qk_norm ? "true" : "false");
      layer.ffn = load_shared_expert_ffn(w, p, c.is_moe_layer(l), c.hidden_size, c.intermediate_size,
                                         c.shared_intermediate, routing);
      layers_.push_back(std::move(layer));
    }
    finish_load(hf, options, c);
  }
};

}  // namespace

std::unique_ptr<Model> load_glm4_moe(const std::string& dir, const HfConfig& config, const ModelOptions& options) {
  return std::make_unique<Glm4Moe>(dir, config, options);
}

}  // namespace moestream
