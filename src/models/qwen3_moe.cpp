// Qwen3-MoE (model_type "qwen3_moe"): Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder-30B-A3B/480B.
//
// Each layer: x += attn(rmsnorm(x)); x += ffn(rmsnorm(x)), where attn is grouped-query attention
// with a per-head RMSNorm on q and k before RoPE, and ffn is either a dense SwiGLU MLP or a
// routed MoE: softmax over all experts, top-k, optionally renormalized (norm_topk_prob).
#include "core/error.h"
#include "models/moe_decoder.h"
#include "models/registry.h"

namespace moestream {

namespace {

struct Qwen3MoeConfig : DecoderConfig {
  SparseLayers sparse;  // which layers are dense (mlp_only_layers, decoder_sparse_step)

  explicit Qwen3MoeConfig(const HfConfig& c) : DecoderConfig(parse(c)), sparse(SparseLayers::parse(c, n_layers)) {
    check_silu(c);
    if (c.get_bool("use_sliding_window", false))
      fail(c.path(), ": use_sliding_window is not supported for qwen3_moe yet");
    check_dense_width([&](int l) { return sparse.is_moe(l); });
  }
};

class Qwen3Moe final : public MoeDecoder {
 public:
  Qwen3Moe(const std::string& dir, const HfConfig& hf, const ModelOptions& options) {
    const Qwen3MoeConfig c(hf);
    open_pack(dir, hf, options, c);
    WeightLoader w(*weights_, *backend_, quantization_lookup(hf));
    const int64_t h = c.hidden_size;
    load_embeddings(w, c.tie_word_embeddings);
    const MoeParams routing{c.n_experts, c.top_k, RouterKind::SoftmaxTopK, c.norm_topk_prob};
    for (int l = 0; l < c.n_layers; ++l) {
      const std::string p = layer_prefix(l);
      MoeDecoderLayer layer = load_layer(w, l, {c.n_heads, c.n_kv_heads, c.head_dim});
      if (c.sparse.is_moe(l)) {
        layer.ffn = routed_ffn(w.matrix(p + "mlp.gate.weight", c.n_experts, h), routing);
      } else {
        layer.ffn.dense = load_mlp(w, p + "mlp.", h, c.intermediate_size);
      }
      layers_.push_back(std::move(layer));
    }
    finish_load(hf, options, c);
  }
};

}  // namespace

std::unique_ptr<Model> load_qwen3_moe(const std::string& dir, const HfConfig& config,
                                      const ModelOptions& options) {
  return std::make_unique<Qwen3Moe>(dir, config, options);
}

}  // namespace moestream
