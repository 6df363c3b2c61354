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
    const std::string act = c.get_string("hidden_act", "silu");
    if (act != "silu") fail(c.path(), ": hidden_act '", act, "' is not supported (expected silu)");
    if (m.n_heads <= 0 || m.n_kv_heads <= 0 || m.n_heads % m.n_kv_heads != 0)
      fail(c.path(), ": num_attention_heads (", m.n_heads, ") must be a positive multiple of num_key_value_heads (", m.n_kv_heads, ")");
    if (m.rot_dim <= 0 || m.rot_dim % 2 != 0 || m.rot_dim > m.head_dim)
      fail(c.path(), ": head_dim (", m.head_dim, ") * partial_rotary_factor must be a positive even number of dims");
    if (m.top_k <= 0 || m.top_k > m.n_experts)
      fail(c.path(), ": num_experts_per_tok (", m.top_k, ") must be in [1, n_routed_experts = ", m.n_experts, "]");
    if (m.n_group <= 0 || m.n_experts % m.n_group != 0 || m.topk_group <= 0 || m.topk_group > m.n_group)
      fail(c.path(), ": n_group (", m.n_group, ") must divide n_routed_experts (", m.n_experts,
           ") and topk_group (", m.topk_group, ") must be in [1, n_group]");
    return m;
  }

  bool is_moe_layer(int l) const { return l >= first_k_dense_replace; }
};

std::string expert_tensor_name(int layer, int expert, const std::string& role) {
  return "model.layers." + std::to_string(layer) + ".mlp.experts." + std::to_string(expert) + "." + role +
         "_proj.weight";
}

struct Glm4MoeLayer {
  Vector input_norm, post_attention_norm;
  GqaAttention attn;
  bool moe = false;
  Matrix router;               // [n_experts, hidden]            (moe layers)
  Vector correction_bias;      // [n_experts] e_score_correction_bias
  MlpWeights shared, dense;    // shared experts (moe layers) / dense MLP
};

class Glm4Moe final : public DecoderModel {
 public:
  Glm4Moe(const std::string& dir, const HfConfig& hf, const ModelOptions& options)
      : cfg_(Glm4MoeConfig::from(hf)) {
    open_pack(dir, hf, options, {"glm4_moe", cfg_.vocab_size, cfg_.hidden_size, cfg_.n_layers,
                                  cfg_.max_position, cfg_.rms_norm_eps});

    WeightLoader w(*weights_, *backend_, quantization_lookup(hf));
    const int64_t h = cfg_.hidden_size;
    load_embeddings(w, cfg_.tie_word_embeddings);
    std::vector<bool> moe_layers;
    for (int l = 0; l < cfg_.n_layers; ++l) {
      const std::string p = "model.layers." + std::to_string(l) + ".";
      Glm4MoeLayer layer;
      layer.input_norm = w.vector(p + "input_layernorm.weight", h);
      layer.post_attention_norm = w.vector(p + "post_attention_layernorm.weight", h);
      layer.attn = GqaAttention::load(w, p + "self_attn.", h, cfg_.n_heads, cfg_.n_kv_heads,
                                      cfg_.head_dim, cfg_.rms_norm_eps);
      if (bool(layer.attn.q_norm) != cfg_.use_qk_norm || bool(layer.attn.k_norm) != cfg_.use_qk_norm)
        fail("tensor ", p, "self_attn.q_norm.weight / k_norm.weight: ", cfg_.use_qk_norm ? "missing" : "present",
             " but config.json has use_qk_norm = ", cfg_.use_qk_norm ? "true" : "false");
      layer.moe = cfg_.is_moe_layer(l);
      if (layer.moe) {
        layer.router = w.matrix(p + "mlp.gate.weight", cfg_.n_experts, h);
        layer.correction_bias = w.vector(p + "mlp.gate.e_score_correction_bias", cfg_.n_experts);
        layer.shared = load_mlp(w, p + "mlp.shared_experts.", h, cfg_.shared_intermediate);
      } else {
        layer.dense = load_mlp(w, p + "mlp.", h, cfg_.intermediate_size);
      }
      moe_layers.push_back(layer.moe);
      layers_.push_back(std::move(layer));
    }
    check_pack_experts(pack_, moe_layers, cfg_.n_experts, h, cfg_.moe_intermediate_size, expert_tensor_name);
    experts_ = make_expert_store(pack_, *backend_, options.experts);
    rope_ = make_rope_table(cfg_.rope, cfg_.rot_dim, hf.path());
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
    const Glm4MoeLayer& layer = layers_[size_t(l)];
    Backend& be = *backend_;
    Buffer x = ws_.x.rows_view(0, T), xn = ws_.xn.rows_view(0, T);
    Buffer out = ws_.ffn_out.rows_view(0, T);
    attention_residual(layer.input_norm, layer.attn, seq, l, rope_, T);
    be.rmsnorm(x, layer.post_attention_norm, norm_eps, x.cols, xn);
    if (!layer.moe) {
      ScopedTimer timer(be.times().dense_mlp);
      be.mlp(xn, layer.dense, out);
      be.add(x, out);
      return;
    }
    MoeParams p;
    p.n_experts = cfg_.n_experts;
    p.top_k = cfg_.top_k;
    p.router = RouterKind::SigmoidGroupTopK;
    p.norm_topk_prob = cfg_.norm_topk_prob;
    p.layer = l;
    p.router_bias = &layer.correction_bias;
    p.n_group = cfg_.n_group;
    p.topk_group = cfg_.topk_group;
    p.routed_scaling_factor = cfg_.routed_scaling_factor;
    be.moe(xn, layer.router, *experts_, p, out);
    be.add(x, out);
    Buffer shared{ws_.attn_out.data, T, x.cols};  // attention is done with attn_out
    {
      ScopedTimer timer(be.times().dense_mlp);
      be.mlp(xn, layer.shared, shared);
    }
    be.add(x, shared);
  }

 private:
  static constexpr int64_t kMaxBatch = 128;  // tokens per forward batch (prefill chunk)
  Glm4MoeConfig cfg_;
  std::vector<Glm4MoeLayer> layers_;
  std::unique_ptr<ExpertStore> experts_;
  RopeTable rope_;
  int64_t kv_dim_ = 0;
};

}  // namespace

std::unique_ptr<Model> load_glm4_moe(const std::string& dir, const HfConfig& config, const ModelOptions& options) {
  return std::make_unique<Glm4Moe>(dir, config, options);
}

}  // namespace moestream
