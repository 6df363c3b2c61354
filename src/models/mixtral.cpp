// Mixtral (model_type "mixtral"): Mixtral-8x7B, Mixtral-8x22B.
//
// Each layer: x += attn(rmsnorm(x)); x += moe(rmsnorm(x)), where attn is grouped-query attention
// (optionally over a sliding window of the last `sliding_window` positions) and moe routes each
// token to its top-k experts by softmax, the k weights renormalized to sum to 1. An expert is
// SwiGLU with w1 = gate, w3 = up, w2 = down ("block_sparse_moe.experts.E.w{1,2,3}").
#include <regex>

#include "core/error.h"
#include "models/moe_decoder.h"
#include "models/registry.h"

namespace moestream {

namespace {

struct MixtralConfig : DecoderConfig {
  int64_t sliding_window;  // positions a query sees; 0 = all

  explicit MixtralConfig(const HfConfig& c)
      : DecoderConfig(parse(c, {.rms_norm_eps = 1e-5, .expert_size_field = "intermediate_size"})),
        sliding_window(c.get_int_in("sliding_window", 0, kMaxPositions, 0)) {
    check_silu(c);
  }
};

class Mixtral final : public MoeDecoder {
 public:
  Mixtral(const std::string& dir, const HfConfig& hf, const ModelOptions& options) {
    const MixtralConfig c(hf);
    open_pack(dir, hf, options, c);
    WeightLoader w(*weights_, *backend_, quantization_lookup(hf));
    load_embeddings(w, c.tie_word_embeddings);
    AttentionShape shape{c.n_heads, c.n_kv_heads, c.head_dim};
    shape.options.sliding_window = c.sliding_window;
    // Mixtral always renormalizes the top-k weights (config.json has no norm_topk_prob).
    const MoeParams routing{c.n_experts, c.top_k, RouterKind::SoftmaxTopK, /*norm_topk_prob=*/true};
    for (int l = 0; l < c.n_layers; ++l) {
      MoeDecoderLayer layer = load_layer(w, l, shape);
      layer.ffn = routed_ffn(w.matrix(layer_prefix(l) + "block_sparse_moe.gate.weight", c.n_experts, c.hidden_size), routing);
      layers_.push_back(std::move(layer));
    }
    finish_load(hf, options, c, ExpertNaming::Mixtral);
  }
};

}  // namespace

std::optional<ExpertTensorRef> parse_mixtral_expert_tensor(const std::string& name) {
  static const std::regex re(R"(model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w1|w2|w3)\.weight)");
  std::smatch m;
  if (!std::regex_match(name, m, re)) return std::nullopt;
  const std::string w = m[3];
  return ExpertTensorRef{std::stoi(m[1]), std::stoi(m[2]), w == "w1" ? "gate" : w == "w2" ? "down" : "up", false};
}

std::unique_ptr<Model> load_mixtral(const std::string& dir, const HfConfig& config, const ModelOptions& options) {
  return std::make_unique<Mixtral>(dir, config, options);
}

}  // namespace moestream
