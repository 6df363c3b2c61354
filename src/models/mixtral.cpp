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
    const std::string act = c.get_string("hidden_act", "silu");
    if (act != "silu") fail(c.path(), ": hidden_act '", act, "' is not supported (expected silu)");
    if (m.n_heads <= 0 || m.n_kv_heads <= 0 || m.n_heads % m.n_kv_heads != 0)
      fail(c.path(), ": num_attention_heads (", m.n_heads, ") must be a positive multiple of num_key_value_heads (", m.n_kv_heads, ")");
    if (m.head_dim <= 0 || m.head_dim % 2 != 0) fail(c.path(), ": head_dim must be positive and even, found ", m.head_dim);
    if (m.top_k <= 0 || m.top_k > m.n_experts)
      fail(c.path(), ": num_experts_per_tok (", m.top_k, ") must be in [1, num_local_experts = ", m.n_experts, "]");
    if (m.sliding_window < 0) fail(c.path(), ": sliding_window must be positive, found ", m.sliding_window);
    return m;
  }
};

std::string expert_tensor_name(int layer, int expert, const std::string& role) {
  const char* w = role == "gate" ? "w1" : role == "down" ? "w2" : "w3";
  return "model.layers." + std::to_string(layer) + ".block_sparse_moe.experts." + std::to_string(expert) +
         "." + w + ".weight";
}

struct MixtralLayer {
  Vector input_norm, post_attention_norm;
  GqaAttention attn;
  Matrix router;  // [n_experts, hidden]
};

class Mixtral final : public DecoderModel {
 public:
  Mixtral(const std::string& dir, const HfConfig& hf, const ModelOptions& options)
      : cfg_(MixtralConfig::from(hf)) {
    open_pack(dir, hf, options, {"mixtral", cfg_.vocab_size, cfg_.hidden_size, cfg_.n_layers,
                                  cfg_.max_position, cfg_.rms_norm_eps});

    WeightLoader w(*weights_, *backend_, quantization_lookup(hf));
    const int64_t h = cfg_.hidden_size;
    load_embeddings(w, cfg_.tie_word_embeddings);
    GqaOptions attn_options;
    attn_options.sliding_window = cfg_.sliding_window;
    for (int l = 0; l < cfg_.n_layers; ++l) {
      const std::string p = "model.layers." + std::to_string(l) + ".";
      MixtralLayer layer;
      layer.input_norm = w.vector(p + "input_layernorm.weight", h);
      layer.post_attention_norm = w.vector(p + "post_attention_layernorm.weight", h);
      layer.attn = GqaAttention::load(w, p + "self_attn.", h, cfg_.n_heads, cfg_.n_kv_heads,
                                      cfg_.head_dim, cfg_.rms_norm_eps, attn_options);
      layer.router = w.matrix(p + "block_sparse_moe.gate.weight", cfg_.n_experts, h);
      layers_.push_back(std::move(layer));
    }
    const std::vector<bool> moe_layers(size_t(cfg_.n_layers), true);
    check_pack_experts(pack_, moe_layers, cfg_.n_experts, h, cfg_.intermediate_size, expert_tensor_name);
    experts_ = make_expert_store(pack_, *backend_, options.experts);
    rope_ = make_rope_table(cfg_.rope, cfg_.head_dim, hf.path());
    kv_dim_ = int64_t(cfg_.n_kv_heads) * cfg_.head_dim;
    init_workspace(kMaxBatch, int64_t(cfg_.n_heads) * cfg_.head_dim, kv_dim_);
    set_weight_bytes(info_, *weights_, pack_, moe_layers, cfg_.n_experts, cfg_.top_k);
  }

  ExpertStats expert_stats() const override { return experts_->stats(); }

  std::unique_ptr<SequenceState> new_sequence(int64_t capacity) override {
    return std::make_unique<KvSequence>(*backend_, cfg_.n_layers, capacity, kv_dim_);
  }

 protected:
  void run_layer(int l, int64_t T, SequenceState& state) override {
    auto& seq = static_cast<KvSequence&>(state);
    const MixtralLayer& layer = layers_[size_t(l)];
    Backend& be = *backend_;
    Buffer x = ws_.x.rows_view(0, T), xn = ws_.xn.rows_view(0, T);
    Buffer out = ws_.ffn_out.rows_view(0, T);
    attention_residual(layer.input_norm, layer.attn, seq, l, rope_, T);
    be.rmsnorm(x, layer.post_attention_norm, norm_eps, x.cols, xn);
    MoeParams p;
    p.n_experts = cfg_.n_experts;
    p.top_k = cfg_.top_k;
    p.router = RouterKind::SoftmaxTopK;
    p.norm_topk_prob = true;
    p.layer = l;
    be.moe(xn, layer.router, *experts_, p, out);
    be.add(x, out);
  }

 private:
  static constexpr int64_t kMaxBatch = 128;  // tokens per forward batch (prefill chunk)
  MixtralConfig cfg_;
  std::vector<MixtralLayer> layers_;
  std::unique_ptr<ExpertStore> experts_;
  RopeTable rope_;
  int64_t kv_dim_ = 0;
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
