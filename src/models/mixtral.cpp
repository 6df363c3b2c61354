// Mixtral (model_type "mixtral"): Mixtral-8x7B, Mixtral-8x22B.
//
// Each layer: x += attn(rmsnorm(x)); x += moe(rmsnorm(x)), where attn is grouped-query attention
// (optionally over a sliding window of the last `sliding_window` positions) and moe routes each
// token to its top-k experts by softmax, the k weights renormalized to sum to 1. An expert is
// SwiGLU with w1 = gate, w3 = up, w2 = down ("block_sparse_moe.experts.E.w{1,2,3}").
#include <regex>

#include "core/error.h"
#include "experts/expert_store.h"
#include "io/pack.h"
#include "io/safetensors.h"
#include "models/blocks.h"
#include "models/moe_decoder.h"
#include "models/registry.h"

namespace moestream {

namespace {

struct MixtralConfig {
  int64_t vocab_size;         // tokens
  int64_t hidden_size;        // model width
  int64_t intermediate_size;  // width of one expert
  int n_layers;
  int n_heads, n_kv_heads, head_dim;
  int n_experts, top_k;
  int64_t sliding_window;     // positions a query sees; 0 = all
  bool tie_word_embeddings;
  float rms_norm_eps;
  int64_t max_position;
  RopeParams rope;

  static MixtralConfig from(const HfConfig& c) {
    MixtralConfig m;
    m.vocab_size = c.get_int("vocab_size");
    m.hidden_size = c.get_int("hidden_size");
    m.intermediate_size = c.get_int("intermediate_size");
    m.n_layers = int(c.get_int("num_hidden_layers"));
    m.n_heads = int(c.get_int("num_attention_heads"));
    m.n_kv_heads = int(c.get_int("num_key_value_heads", m.n_heads));
    m.head_dim = int(c.get_int("head_dim", m.hidden_size / m.n_heads));
    m.n_experts = int(c.get_int("num_local_experts"));
    m.top_k = int(c.get_int("num_experts_per_tok"));
    m.sliding_window = c.get_int("sliding_window", 0);
    m.tie_word_embeddings = c.get_bool("tie_word_embeddings", false);
    m.rms_norm_eps = float(c.get_double("rms_norm_eps", 1e-5));
    m.max_position = c.get_int("max_position_embeddings", 32768);
    m.rope = c.rope();
    check_silu(c);
    check_gqa_heads(c, m.n_heads, m.n_kv_heads);
    check_head_dim(c, m.head_dim);
    check_top_k(c, m.top_k, m.n_experts, "num_local_experts");
    if (m.sliding_window < 0) fail(c.path(), ": sliding_window must be positive, found ", m.sliding_window);
    return m;
  }
};

std::string expert_tensor_name(int layer, int expert, const std::string& role) {
  const char* w = role == "gate" ? "w1" : role == "down" ? "w2" : "w3";
  return "model.layers." + std::to_string(layer) + ".block_sparse_moe.experts." + std::to_string(expert) +
         "." + w + ".weight";
}

class Mixtral final : public MoeDecoder {
 public:
  Mixtral(const std::string& dir, const HfConfig& hf, const ModelOptions& options) {
    const MixtralConfig c = MixtralConfig::from(hf);
    open_pack(dir, hf, options, {"mixtral", c.vocab_size, c.hidden_size, c.n_layers, c.max_position, c.rms_norm_eps});
    WeightLoader w(*weights_, *backend_, quantization_lookup(hf));
    load_embeddings(w, c.tie_word_embeddings);
    AttentionShape shape{c.n_heads, c.n_kv_heads, c.head_dim};
    shape.options.sliding_window = c.sliding_window;
    MoeParams routing{c.n_experts, c.top_k, RouterKind::SoftmaxTopK, /*norm_topk_prob=*/true};
    for (int l = 0; l < c.n_layers; ++l) {
      MoeDecoderLayer layer = load_layer(w, l, shape);
      layer.ffn = routed_ffn(w.matrix(layer_prefix(l) + "block_sparse_moe.gate.weight", c.n_experts, c.hidden_size), routing);
      layers_.push_back(std::move(layer));
    }
    finish_load(hf, options, c.rope, {c.n_experts, c.top_k, c.intermediate_size, expert_tensor_name});
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
