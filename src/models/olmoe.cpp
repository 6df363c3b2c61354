// OLMoE (model_type "olmoe"): OLMoE-1B-7B.
//
// Each layer: x += attn(rmsnorm(x)); x += moe(rmsnorm(x)). Attention applies RMSNorm to the whole
// q and k projections (one norm over all heads, not per head), then clamps q, k and v to
// +-clip_qkv when configured. The MoE is softmax over all experts, top-k, weights renormalized only
// when norm_topk_prob (false for the published models).

#include "core/error.h"
#include "experts/expert_store.h"
#include "io/pack.h"
#include "io/safetensors.h"
#include "models/blocks.h"
#include "models/moe_decoder.h"
#include "models/registry.h"

namespace moestream {

namespace {

struct OlmoeConfig {
  int64_t vocab_size;         // tokens
  int64_t hidden_size;        // model width
  int64_t intermediate_size;  // width of one expert
  int n_layers;
  int n_heads, n_kv_heads, head_dim;
  int n_experts, top_k;
  bool norm_topk_prob;        // renormalize the top-k routing weights
  float clip_qkv;             // > 0: clamp of the q, k, v projections; 0 = none
  bool tie_word_embeddings;
  float rms_norm_eps;
  int64_t max_position;
  RopeParams rope;

  static OlmoeConfig from(const HfConfig& c) {
    OlmoeConfig m;
    m.vocab_size = c.get_int("vocab_size");
    m.hidden_size = c.get_int("hidden_size");
    m.intermediate_size = c.get_int("intermediate_size");
    m.n_layers = int(c.get_int("num_hidden_layers"));
    m.n_heads = int(c.get_int("num_attention_heads"));
    m.n_kv_heads = int(c.get_int("num_key_value_heads", m.n_heads));
    m.head_dim = int(c.get_int("head_dim", m.hidden_size / m.n_heads));
    m.n_experts = int(c.get_int("num_experts"));
    m.top_k = int(c.get_int("num_experts_per_tok"));
    m.norm_topk_prob = c.get_bool("norm_topk_prob", false);
    m.clip_qkv = float(c.get_double("clip_qkv", 0.0));
    m.tie_word_embeddings = c.get_bool("tie_word_embeddings", false);
    m.rms_norm_eps = float(c.get_double("rms_norm_eps", 1e-5));
    m.max_position = c.get_int("max_position_embeddings", 32768);
    m.rope = c.rope();
    check_silu(c);
    check_gqa_heads(c, m.n_heads, m.n_kv_heads);
    check_head_dim(c, m.head_dim);
    check_top_k(c, m.top_k, m.n_experts, "num_experts");
    if (m.clip_qkv < 0) fail(c.path(), ": clip_qkv must be positive, found ", m.clip_qkv);
    return m;
  }
};

std::string expert_tensor_name(int layer, int expert, const std::string& role) {
  return "model.layers." + std::to_string(layer) + ".mlp.experts." + std::to_string(expert) + "." + role +
         "_proj.weight";
}

class Olmoe final : public MoeDecoder {
 public:
  Olmoe(const std::string& dir, const HfConfig& hf, const ModelOptions& options) {
    const OlmoeConfig c = OlmoeConfig::from(hf);
    open_pack(dir, hf, options, {"olmoe", c.vocab_size, c.hidden_size, c.n_layers, c.max_position, c.rms_norm_eps});
    WeightLoader w(*weights_, *backend_, quantization_lookup(hf));
    load_embeddings(w, c.tie_word_embeddings);
    AttentionShape shape{c.n_heads, c.n_kv_heads, c.head_dim};
    shape.options.qk_norm_whole = true;
    shape.options.clip_qkv = c.clip_qkv;
    MoeParams routing{c.n_experts, c.top_k, RouterKind::SoftmaxTopK, c.norm_topk_prob};
    for (int l = 0; l < c.n_layers; ++l) {
      const std::string p = layer_prefix(l);
      MoeDecoderLayer layer = load_layer(w, l, shape);
      if (!w.has(p + "self_attn.q_norm.weight") || !w.has(p + "self_attn.k_norm.weight"))
        fail("tensor ", p, "self_attn.q_norm.weight / k_norm.weight: missing (OLMoE normalizes q and k)");
      layer.ffn = routed_ffn(w.matrix(p + "mlp.gate.weight", c.n_experts, c.hidden_size), routing);
      layers_.push_back(std::move(layer));
    }
    finish_load(hf, options, c.rope, {c.n_experts, c.top_k, c.intermediate_size, expert_tensor_name});
  }
};

}  // namespace

std::unique_ptr<Model> load_olmoe(const std::string& dir, const HfConfig& config, const ModelOptions& options) {
  return std::make_unique<Olmoe>(dir, config, options);
}

}  // namespace moestream
