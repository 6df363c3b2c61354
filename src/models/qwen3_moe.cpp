// Qwen3-MoE (model_type "qwen3_moe"): Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder-30B-A3B/480B.
//
// Each layer: x += attn(rmsnorm(x)); x += ffn(rmsnorm(x)), where attn is grouped-query attention
// with a per-head RMSNorm on q and k before RoPE, and ffn is either a dense SwiGLU MLP or a
// routed MoE: softmax over all experts, top-k, optionally renormalized (norm_topk_prob).
#include "core/error.h"
#include "experts/expert_store.h"
#include "io/pack.h"
#include "io/safetensors.h"
#include "models/blocks.h"
#include "models/moe_decoder.h"
#include "models/registry.h"

namespace moestream {

namespace {

struct Qwen3MoeConfig {
  int64_t vocab_size;            // tokens
  int64_t hidden_size;           // model width
  int64_t intermediate_size;     // dense MLP width (mlp_only_layers / decoder_sparse_step layers)
  int64_t moe_intermediate_size; // width of one expert
  int n_layers;
  int n_heads, n_kv_heads, head_dim;  // attention heads; head_dim may differ from hidden/heads
  int n_experts, top_k;
  bool norm_topk_prob;           // renormalize the top-k routing weights
  int decoder_sparse_step;       // layer l is MoE when (l + 1) % step == 0 ...
  std::vector<int64_t> mlp_only_layers;  // ... and l is not listed here
  bool tie_word_embeddings;
  float rms_norm_eps;
  int64_t max_position;
  RopeParams rope;

  static Qwen3MoeConfig from(const HfConfig& c) {
    Qwen3MoeConfig q;
    q.vocab_size = c.get_int("vocab_size");
    q.hidden_size = c.get_int("hidden_size");
    q.intermediate_size = c.get_int("intermediate_size");
    q.moe_intermediate_size = c.get_int("moe_intermediate_size");
    q.n_layers = int(c.get_int("num_hidden_layers"));
    q.n_heads = int(c.get_int("num_attention_heads"));
    q.n_kv_heads = int(c.get_int("num_key_value_heads", q.n_heads));
    q.head_dim = int(c.get_int("head_dim", q.hidden_size / q.n_heads));
    q.n_experts = int(c.get_int("num_experts"));
    q.top_k = int(c.get_int("num_experts_per_tok"));
    q.norm_topk_prob = c.get_bool("norm_topk_prob", false);
    q.decoder_sparse_step = int(c.get_int("decoder_sparse_step", 1));
    q.mlp_only_layers = c.get_int_list("mlp_only_layers");
    q.tie_word_embeddings = c.get_bool("tie_word_embeddings", false);
    q.rms_norm_eps = float(c.get_double("rms_norm_eps", 1e-6));
    q.max_position = c.get_int("max_position_embeddings", 32768);
    q.rope = c.rope();
    check_silu(c);
    if (c.get_bool("use_sliding_window", false))
      fail(c.path(), ": use_sliding_window is not supported for qwen3_moe yet");
    check_gqa_heads(c, q.n_heads, q.n_kv_heads);
    check_head_dim(c, q.head_dim);
    check_top_k(c, q.top_k, q.n_experts, "num_experts");
    if (q.decoder_sparse_step <= 0) fail(c.path(), ": decoder_sparse_step must be positive");
    return q;
  }

  bool is_moe_layer(int l) const {
    for (int64_t m : mlp_only_layers)
      if (m == l) return false;
    return n_experts > 0 && (l + 1) % decoder_sparse_step == 0;
  }
};

std::string expert_tensor_name(int layer, int expert, const std::string& role) {
  return layer_prefix(layer) + "mlp.experts." + std::to_string(expert) + "." + role + "_proj.weight";
}

class Qwen3Moe final : public MoeDecoder {
 public:
  Qwen3Moe(const std::string& dir, const HfConfig& hf, const ModelOptions& options) {
    const Qwen3MoeConfig c = Qwen3MoeConfig::from(hf);
    open_pack(dir, hf, options, {"qwen3_moe", c.vocab_size, c.hidden_size, c.n_layers, c.max_position, c.rms_norm_eps});
    WeightLoader w(*weights_, *backend_, quantization_lookup(hf));
    const int64_t h = c.hidden_size;
    load_embeddings(w, c.tie_word_embeddings);
    const MoeParams routing{c.n_experts, c.top_k, RouterKind::SoftmaxTopK, c.norm_topk_prob};
    for (int l = 0; l < c.n_layers; ++l) {
      const std::string p = layer_prefix(l);
      MoeDecoderLayer layer = load_layer(w, l, {c.n_heads, c.n_kv_heads, c.head_dim});
      if (c.is_moe_layer(l)) {
        layer.ffn = routed_ffn(w.matrix(p + "mlp.gate.weight", c.n_experts, h), routing);
      } else {
        layer.ffn.dense = load_mlp(w, p + "mlp.", h, c.intermediate_size);
      }
      layers_.push_back(std::move(layer));
    }
    finish_load(hf, options, c.rope, {c.n_experts, c.top_k, c.moe_intermediate_size, expert_tensor_name});
  }
};

}  // namespace

std::unique_ptr<Model> load_qwen3_moe(const std::string& dir, const HfConfig& config,
                                      const ModelOptions& options) {
  return std::make_unique<Qwen3Moe>(dir, config, options);
}

}  // namespace moestream
