// OLMoE (model_type "olmoe"): OLMoE-1B-7B.
//
// Each layer: x += attn(rmsnorm(x)); x += moe(rmsnorm(x)). Attention applies RMSNorm to the whole
// q and k projections (one norm over all heads, not per head), then clamps q, k and v to
// +-clip_qkv when configured. The MoE is softmax over all experts, top-k, weights renormalized only
// when norm_topk_prob (false for the published models).
#include "core/error.h"
#include "models/moe_decoder.h"
#include "models/registry.h"

namespace moestream {

namespace {

struct OlmoeConfig : DecoderConfig {
  float clip_qkv;  // > 0: clamp of the q, k, v projections; 0 = none

  explicit OlmoeConfig(const HfConfig& c)
      : DecoderConfig(parse(c, {.rms_norm_eps = 1e-5, .expert_size_field = "intermediate_size"})),
        clip_qkv(float(c.get_double("clip_qkv", 0.0))) {
    check_silu(c);
    if (!(clip_qkv >= 0)) fail(c.path(), ": field 'clip_qkv' must be positive, found ", clip_qkv);
  }
};

class Olmoe final : public MoeDecoder {
 public:
  Olmoe(const std::string& dir, const HfConfig& hf, const ModelOptions& options) {
    const OlmoeConfig c(hf);
    open_pack(dir, hf, options, c);
    WeightLoader w(*weights_, *backend_, quantization_lookup(hf));
    load_embeddings(w, c.tie_word_embeddings);
    AttentionShape shape{c.n_heads, c.n_kv_heads, c.head_dim};
    shape.options.qk_norm_whole = true;
    shape.options.clip_qkv = c.clip_qkv;
    const MoeParams routing{c.n_experts, c.top_k, RouterKind::SoftmaxTopK, c.norm_topk_prob};
    for (int l = 0; l < c.n_layers; ++l) {
      const std::string p = layer_prefix(l);
      MoeDecoderLayer layer = load_layer(w, l, shape);
      if (!layer.attn.q_norm || !layer.attn.k_norm)
        fail("tensor ", p, "self_attn.q_norm.weight / k_norm.weight: missing (OLMoE normalizes q and k)");
      layer.ffn = routed_ffn(w.matrix(p + "mlp.gate.weight", c.n_experts, c.hidden_size), routing);
      layers_.push_back(std::move(layer));
    }
    finish_load(hf, options, c);
  }
};

}  // namespace

std::unique_ptr<Model> load_olmoe(const std::string& dir, const HfConfig& config, const ModelOptions& options) {
  return std::make_unique<Olmoe>(dir, config, options);
}

}  // namespace moestream
