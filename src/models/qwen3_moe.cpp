// Qwen3-MoE (model_type "qwen3_moe"): Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder-30B-A3B/480B.
//
// Each layer: x += attn(rmsnorm(x)); x += ffn(rmsnorm(x)), where attn is grouped-query attention
// with a per-head RMSNorm on q and k before RoPE, and ffn is either a dense SwiGLU MLP or a
// routed MoE: softmax over all experts, top-k, optionally renormalized (norm_topk_prob).
#include <algorithm>
#include <filesystem>

#include "core/error.h"
#include "experts/expert_store.h"
#include "io/pack.h"
#include "io/safetensors.h"
#include "models/blocks.h"
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
    const std::string act = c.get_string("hidden_act", "silu");
    if (act != "silu") fail(c.path(), ": hidden_act '", act, "' is not supported (expected silu)");
    if (c.get_bool("use_sliding_window", false))
      fail(c.path(), ": use_sliding_window is not supported for qwen3_moe yet");
    if (q.n_heads <= 0 || q.n_kv_heads <= 0 || q.n_heads % q.n_kv_heads != 0)
      fail(c.path(), ": num_attention_heads (", q.n_heads, ") must be a positive multiple of num_key_value_heads (", q.n_kv_heads, ")");
    if (q.head_dim <= 0 || q.head_dim % 2 != 0) fail(c.path(), ": head_dim must be positive and even, found ", q.head_dim);
    if (q.top_k <= 0 || q.top_k > q.n_experts)
      fail(c.path(), ": num_experts_per_tok (", q.top_k, ") must be in [1, num_experts = ", q.n_experts, "]");
    if (q.decoder_sparse_step <= 0) fail(c.path(), ": decoder_sparse_step must be positive");
    return q;
  }

  bool is_moe_layer(int l) const {
    for (int64_t m : mlp_only_layers)
      if (m == l) return false;
    return n_experts > 0 && (l + 1) % decoder_sparse_step == 0;
  }
};

struct Qwen3MoeLayer {
  Vector input_norm, post_attention_norm;
  GqaAttention attn;
  bool moe = false;
  Matrix router;     // [n_experts, hidden]   (moe layers)
  MlpWeights dense;  // (dense layers)
};

class Qwen3Moe final : public DecoderModel {
 public:
  Qwen3Moe(const std::string& dir, const HfConfig& hf, const ModelOptions& options)
      : cfg_(Qwen3MoeConfig::from(hf)) {
    open_pack(dir, hf, options, {"qwen3_moe", cfg_.vocab_size, cfg_.hidden_size, cfg_.n_layers,
                                  cfg_.max_position, cfg_.rms_norm_eps});

    WeightLoader w(*weights_, *backend_, quantization_lookup(hf));
    const int64_t h = cfg_.hidden_size;
    load_embeddings(w, cfg_.tie_word_embeddings);

    std::vector<bool> moe_layers;
    for (int l = 0; l < cfg_.n_layers; ++l) {
      const std::string p = "model.layers." + std::to_string(l) + ".";
      Qwen3MoeLayer layer;
      layer.input_norm = w.vector(p + "input_layernorm.weight", h);
      layer.post_attention_norm = w.vector(p + "post_attention_layernorm.weight", h);
      layer.attn = GqaAttention::load(w, p + "self_attn.", h, cfg_.n_heads, cfg_.n_kv_heads,
                                      cfg_.head_dim, cfg_.rms_norm_eps);
      layer.moe = cfg_.is_moe_layer(l);
      if (layer.moe) {
        layer.router = w.matrix(p + "mlp.gate.weight", cfg_.n_experts, h);
      } else {
        layer.dense.gate = w.matrix(p + "mlp.gate_proj.weight", cfg_.intermediate_size, h);
        layer.dense.up = w.matrix(p + "mlp.up_proj.weight", cfg_.intermediate_size, h);
        layer.dense.down = w.matrix(p + "mlp.down_proj.weight", h, cfg_.intermediate_size);
      }
      moe_layers.push_back(layer.moe);
      layers_.push_back(std::move(layer));
    }
    check_experts(moe_layers);
    experts_ = make_expert_store(pack_, *backend_, options.experts);
    rope_ = make_rope_table(cfg_.rope, cfg_.head_dim, hf.path());

    const int64_t q_dim = int64_t(cfg_.n_heads) * cfg_.head_dim;
    kv_dim_ = int64_t(cfg_.n_kv_heads) * cfg_.head_dim;
    init_workspace(kMaxBatch, q_dim, kv_dim_);

    int64_t dense_bytes = 0;
    for (const auto& name : weights_->names()) dense_bytes += int64_t(weights_->get(name).nbytes);
    const int64_t expert_bytes = int64_t(pack_.total_expert_bytes());
    const int64_t n_moe = std::count(moe_layers.begin(), moe_layers.end(), true);
    info_.weight_bytes = dense_bytes + expert_bytes;
    info_.active_bytes_per_token =
        dense_bytes + (n_moe ? expert_bytes / (n_moe * cfg_.n_experts) * n_moe * cfg_.top_k : 0);
  }

  ExpertStats expert_stats() const override { return experts_->stats(); }

  std::unique_ptr<SequenceState> new_sequence(int64_t capacity) override {
    return std::make_unique<KvSequence>(*backend_, cfg_.n_layers, capacity, kv_dim_);
  }

 protected:
  void run_layer(int l, int64_t T, SequenceState& state) override {
    auto& seq = static_cast<KvSequence&>(state);
    const Qwen3MoeLayer& layer = layers_[size_t(l)];
    Backend& be = *backend_;
    Buffer x = ws_.x.rows_view(0, T), xn = ws_.xn.rows_view(0, T);
    Buffer out = ws_.ffn_out.rows_view(0, T);

    attention_residual(layer.input_norm, layer.attn, seq, l, rope_, T);
    be.rmsnorm(x, layer.post_attention_norm, norm_eps, x.cols, xn);
    if (layer.moe) {
      MoeParams p{cfg_.n_experts, cfg_.top_k, RouterKind::SoftmaxTopK, cfg_.norm_topk_prob, l};
      be.moe(xn, layer.router, *experts_, p, out);
    } else {
      ScopedTimer timer(be.times().dense_mlp);
      be.mlp(xn, layer.dense, out);
    }
    be.add(x, out);
  }

 private:
  static constexpr int64_t kMaxBatch = 128;  // tokens per forward batch (prefill chunk)
  // Every MoE layer of the pack holds n_experts experts with gate/up/down of the config's shape.
  void check_experts(const std::vector<bool>& moe_layers) const {
    const int64_t h = cfg_.hidden_size, inter = cfg_.moe_intermediate_size;
    for (int l = 0; l < cfg_.n_layers; ++l) {
      const bool packed = size_t(l) < pack_.layers.size() && !pack_.layers[size_t(l)].empty();
      if (packed != moe_layers[size_t(l)])
        fail(pack_.dir, ": layer ", l, moe_layers[size_t(l)] ? " needs routed experts, the pack has none"
                                                             : " is dense in config.json but the pack has experts for it");
      if (!packed) continue;
      if (int(pack_.layers[size_t(l)].size()) != cfg_.n_experts)
        fail(pack_.dir, ": layer ", l, " has ", pack_.layers[size_t(l)].size(), " experts, config.json says ", cfg_.n_experts);
      for (int e = 0; e < cfg_.n_experts; ++e)
        for (const std::string role : {"gate", "up", "down"}) {
          const std::vector<int64_t> want = role == "down" ? std::vector<int64_t>{h, inter}
                                                            : std::vector<int64_t>{inter, h};
          const std::vector<int64_t> got = pack_.expert(l, e).logical_shape(role);
          if (got != want)
            fail("tensor model.layers.", l, ".mlp.experts.", e, ".", role, "_proj.weight: expected shape ",
                 shape_str(want), ", found ", shape_str(got));
        }
    }
  }

  Qwen3MoeConfig cfg_;
  std::vector<Qwen3MoeLayer> layers_;
  std::unique_ptr<ExpertStore> experts_;
  RopeTable rope_;
  int64_t kv_dim_ = 0;
};

}  // namespace

std::unique_ptr<Model> load_qwen3_moe(const std::string& dir, const HfConfig& config,
                                      const ModelOptions& options) {
  return std::make_unique<Qwen3Moe>(dir, config, options);
}

}  // namespace moestream
