// Qwen3-Next (model_type "qwen3_next": Qwen3-Next-80B-A3B) and Qwen3.5-MoE (text model
// "qwen3_5_moe_text"; "qwen3_5_moe" multimodal checkpoints keep it in text_config with weights
// under model.language_model.: Qwen3.5-35B-A3B, -122B-A10B, -397B-A17B). Vision-tower and
// multi-token-prediction weights (model.visual.*, mtp.*) are left out of the pack.
//
// MLX checkpoints (mlx-community) come in mlx-lm's layout: experts stacked under mlp.switch_mlp,
// affine-quantized weights (<module>.weight U32 with .scales and .biases), conv1d weights
// [channels, kernel, 1], zero-centred norm weights stored as 1 + w. The multimodal Qwen3.5 ones
// (written by mlx-vlm, or mlx-lm's qwen3_5_moe) name the language model language_model.model.*
// and its head language_model.lm_head, and carry vision_tower.* and language_model.mtp.*,
// which are left out like the Hub's.
//
// A hybrid stack; each layer's kind comes from layer_types (or full_attention_interval):
//   linear_attention  Gated DeltaNet (deltanet.h), with a conv and a recurrent state per sequence.
//   full_attention    GQA whose q_proj also yields a per-head output gate (o *= sigmoid(gate)),
//                     per-head q/k RMSNorm, rotary on the first partial_rotary_factor of each head.
// Then a routed MoE (softmax top-k) plus a resident shared expert scaled by
// sigmoid(shared_expert_gate x) (MoeFeedForward); Qwen3-Next may make layers dense
// (mlp_only_layers, decoder_sparse_step). Every RMSNorm except DeltaNet's gated one is
// zero-centred: weight 1 + w.
//
// Qwen3-Next fuses in_proj_qkvz and in_proj_ba with rows grouped per key head ([q k v z] and
// [b a] of each group); Qwen3.5 stores in_proj_qkv, in_proj_z, in_proj_b, in_proj_a. Both q_proj
// layouts interleave [query, gate] per head. The loader regroups those rows once, so one forward
// pass serves both layouts.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <deque>
#include <optional>
#include <regex>

#include "core/error.h"
#include "io/pack.h"
#include "io/safetensors.h"
#include "models/deltanet.h"
#include "models/moe_decoder.h"
#include "models/registry.h"

namespace moestream {

namespace {

struct Qwen3NextConfig : DecoderConfig {
  bool split_projections;          // in_proj_qkv/z/b/a (Qwen3.5) instead of in_proj_qkvz/ba
  int64_t shared_expert_size;      // width of the shared expert
  std::vector<bool> linear_layer;  // [n_layers] true: linear_attention, false: full_attention
  int rot_dims;                    // rotated leading dims of each full-attention head
  DeltaNetParams delta;            // linear attention heads, dims, conv kernel
  SparseLayers sparse;             // Qwen3-Next's dense layers; Qwen3.5 has none

  explicit Qwen3NextConfig(const HfConfig& c)
      : DecoderConfig(parse(c, {.norm_topk_prob = true})),
        split_projections(model_type != "qwen3_next"),
        shared_expert_size(c.get_int_in("shared_expert_intermediate_size", 1, kMaxWidth)),
        linear_layer(parse_layer_types(c, n_layers, "linear_attention", "full_attention")),
        rot_dims(rot_dim()) {
    if (linear_layer.empty()) {
      const int64_t interval = c.get_int_in("full_attention_interval", 1, kMaxLayers, 4);
      for (int l = 0; l < n_layers; ++l) linear_layer.push_back((l + 1) % interval != 0);
    }
    delta.n_k_heads = int(c.get_int_in("linear_num_key_heads", 1, kMaxHeads));
    delta.n_v_heads = int(c.get_int_in("linear_num_value_heads", 1, kMaxHeads));
    delta.k_head_dim = int(c.get_int_in("linear_key_head_dim", 1, kMaxWidth));
    delta.v_head_dim = int(c.get_int_in("linear_value_head_dim", 1, kMaxWidth));
    delta.conv_kernel = int(c.get_int_in("linear_conv_kernel_dim", 1, 1024));
    delta.norm_eps = rms_norm_eps;
    if (delta.n_v_heads % delta.n_k_heads != 0)
      fail(c.path(), ": linear_num_value_heads (", delta.n_v_heads, ") must be a multiple of linear_num_key_heads (",
           delta.n_k_heads, ")");
    // Qwen3.5's router always renormalizes the top-k weights and has no dense layers.
    if (split_projections) norm_topk_prob = true;
    if (!split_projections) sparse = SparseLayers::parse(c, n_layers);
    check_silu(c);
    if (c.get_bool("attention_bias", false))
      fail(c.path(), ": attention_bias true is not supported for ", model_type);
    check_dense_width([&](int l) { return sparse.is_moe(l); });
  }
};

// Full-attention layer: the checkpoint's q_proj rows, regrouped into the query and the gate.
struct GatedAttention {
  Matrix q_proj, gate_proj;  // [n_heads * head_dim, hidden] each
  Matrix k_proj, v_proj;     // [kv_dim, hidden]
  Matrix o_proj;             // [hidden, n_heads * head_dim]
  Vector q_norm, k_norm;     // [head_dim], stored as 1 + w
};

struct Qwen3NextLayer {
  bool linear = false;
  Vector input_norm, post_attention_norm;  // stored as 1 + w
  GatedAttention attn;                     // full_attention layers
  LinearAttention delta;                   // linear_attention layers
  MoeFeedForward ffn;  // routed experts + sigmoid-gated shared expert (resident), or dense
};

class Qwen3Next final : public DecoderModel {
 public:
  Qwen3Next(const std::string& dir, const HfConfig& hf, const ModelOptions& options)
      : cfg_(hf) {
    open_pack(dir, hf, options, cfg_);

    WeightLoader w(*weights_, *backend_, quantization_lookup(hf));
    // Multimodal Qwen3.5 checkpoints keep the language model under model.language_model. (Hub)
    // or language_model.model. (MLX), the head under lm_head or language_model.lm_head.
    prefix_ = w.has("model.language_model.embed_tokens.weight")   ? "model.language_model."
              : w.has("language_model.model.embed_tokens.weight") ? "language_model.model."
                                                                  : "model.";
    head_ = prefix_ == "language_model.model." ? "language_model.lm_head." : "lm_head.";
    const auto first_linear = std::find(cfg_.linear_layer.begin(), cfg_.linear_layer.end(), true);
    mlx_norms_ = is_mlx_layout(
        *weights_, hf,
        first_linear == cfg_.linear_layer.end()
            ? std::string()
            : layer_prefix(int(first_linear - cfg_.linear_layer.begin()), prefix_) + "linear_attn.conv1d.weight",
        cfg_.delta.conv_kernel);
    const int64_t h = cfg_.hidden_size;
    embed_tokens = w.matrix(prefix_ + "embed_tokens.weight", cfg_.vocab_size, h);
    final_norm = load_offset_norm(w, prefix_ + "norm.weight", h, mlx_norms_);
    if (cfg_.tie_word_embeddings && !w.has(head_ + "weight"))
      lm_head = embed_tokens;
    else
      lm_head = w.matrix(head_ + "weight", cfg_.vocab_size, h);

    const MoeParams routing{cfg_.n_experts, cfg_.top_k, RouterKind::SoftmaxTopK, cfg_.norm_topk_prob};
    std::vector<bool> moe_layers;
    for (int l = 0; l < cfg_.n_layers; ++l) {
      const std::string p = layer_prefix(l, prefix_);
      Qwen3NextLayer layer;
      layer.input_norm = load_offset_norm(w, p + "input_layernorm.weight", h, mlx_norms_);
      layer.post_attention_norm = load_offset_norm(w, p + "post_attention_layernorm.weight", h, mlx_norms_);
      layer.linear = cfg_.linear_layer[size_t(l)];
      if (layer.linear)
        layer.delta = LinearAttention::load(w, p + "linear_attn.", h, cfg_.delta, cfg_.split_projections, regrouped_);
      else
        layer.attn = load_gated_attention(w, p + "self_attn.");
      if (cfg_.sparse.is_moe(l)) {
        layer.ffn = routed_ffn(w.matrix(p + "mlp.gate.weight", cfg_.n_experts, h), routing);
        layer.ffn.shared = load_mlp(w, p + "mlp.shared_expert.", h, cfg_.shared_expert_size);
        layer.ffn.shared_gate = w.matrix(p + "mlp.shared_expert_gate.weight", 1, h);
      } else {
        layer.ffn.dense = load_mlp(w, p + "mlp.", h, cfg_.intermediate_size);
      }
      moe_layers.push_back(layer.ffn.moe);
      layers_.push_back(std::move(layer));
    }
    // The shared expert is a plain weight above, never in the pack's expert files.
    load_experts(options, moe_layers, cfg_.n_experts, cfg_.expert_size, ExpertNaming::Hub, prefix_);
    rope_ = make_rope_table(cfg_.rope, cfg_.rot_dims, hf.path());

    init_workspace(cfg_.q_dim(), cfg_.kv_dim());
    Backend& be = *backend_;
    gate_ = be.alloc(info_.max_batch, cfg_.q_dim());
    delta_buf_ = DeltaNetBuffers::alloc(be, info_.max_batch, cfg_.delta);
    // A fresh linear layer's state (alloc zero-fills): what truncate(0) copies back.
    zero_state_.conv = be.alloc(cfg_.delta.conv_kernel - 1, deltanet_conv_dim(cfg_.delta));
    zero_state_.recurrent = be.alloc(int64_t(cfg_.delta.n_v_heads) * cfg_.delta.k_head_dim, cfg_.delta.v_head_dim);

    // Bytes of what this model reads (a multimodal checkpoint's vision and mtp weights excluded).
    int64_t dense_bytes = 0;
    for (const auto& name : weights_->names())
      if (name.rfind(prefix_, 0) == 0 || name.rfind(head_, 0) == 0)
        dense_bytes += int64_t(weights_->get(name).nbytes);
    const int64_t expert_bytes = int64_t(pack_.total_expert_bytes());
    const int64_t n_moe = std::count(moe_layers.begin(), moe_layers.end(), true);
    info_.weight_bytes = dense_bytes + expert_bytes;
    info_.active_bytes_per_token = dense_bytes - unread_embedding_bytes(*weights_) +
                                   (n_moe ? expert_bytes / (n_moe * cfg_.n_experts) * n_moe * cfg_.top_k : 0);
  }

  std::unique_ptr<SequenceState> new_sequence(int64_t capacity) override {
    return std::make_unique<HybridSequence>(*backend_, cfg_.linear_layer, cfg_.kv_dim(), capacity, zero_state_, ws_.kv,
                                            cfg_.n_kv_heads);
  }

 protected:
  void run_layer(int l, int64_t T, std::span<const RowSpan> seqs) override {
    const Qwen3NextLayer& layer = layers_[size_t(l)];
    Backend& be = *backend_;
    Buffer x = ws_.x.rows_view(0, T), xn = ws_.xn.rows_view(0, T);
    Buffer out = ws_.ffn_out.rows_view(0, T);

    // Layers run in order, and the residual add that ends each layer but the last (whose rows the
    // final norm takes) also normalizes x for the next one (Backend::add_rmsnorm).
    {
      ScopedTimer timer(be.times().attention);
      if (l == 0) be.rmsnorm(x, layer.input_norm, norm_eps, x.cols, xn);
      if (layer.linear) {
        linear_attention(be, layer.delta, cfg_.delta, delta_buf_, xn, seqs, l, out);
      } else {
        gated_attention(layer.attn, xn, seqs, l, out);
      }
      be.add_rmsnorm(x, out, layer.post_attention_norm, norm_eps, xn);
    }
    layer.ffn.forward(be, *experts_, ws_, l, xn, x, upcoming_moe_layers(layers_, l, ws_),
                      next_input_norm(layers_, l), norm_eps);
  }

 private:
  // out (T, hidden) = gated attention of x (T, hidden), the rows of `seqs`; each span's k/v
  // appended to its layer-l caches.
  void gated_attention(const GatedAttention& a, const Buffer& x, std::span<const RowSpan> seqs, int l, Buffer& out) {
    Backend& be = *backend_;
    const int64_t T = x.rows;
    Buffer q = ws_.q.rows_view(0, T), k = ws_.k.rows_view(0, T), v = ws_.v.rows_view(0, T);
    Buffer gate = gate_.rows_view(0, T);
    {
      const Matrix* w[4] = {&a.q_proj, &a.gate_proj, &a.k_proj, &a.v_proj};
      const Vector* none[4] = {};
      Buffer* o[4] = {&q, &gate, &k, &v};
      be.linear_shared_input(x, w, none, o);
    }
    Buffer attn = ws_.attn_out.rows_view(0, T);
    attn.cols = q.cols;
    for (const RowSpan& s : seqs) {
      auto& seq = static_cast<HybridSequence&>(*s.state);
      const auto part = [&s](const Buffer& b) { return b.rows_view(s.row0, s.rows); };
      Buffer qs = part(q), ks = part(k), as = part(attn);
      be.qk_norm_rope(qs, ks, a.q_norm, a.k_norm, norm_eps, cfg_.n_heads, cfg_.n_kv_heads, cfg_.head_dim, rope_,
                      seq.n_past);
      AttentionParams p;
      p.n_heads = cfg_.n_heads;
      p.n_kv_heads = cfg_.n_kv_heads;
      p.head_dim = cfg_.head_dim;
      p.scale = 1.0f / std::sqrt(float(cfg_.head_dim));
      p.n_past = seq.n_past;
      p.kv = ws_.kv;
      be.attention(qs, ks, part(v), seq.k[size_t(l)], seq.v[size_t(l)], p, as);
    }
    be.sigmoid_gate(attn, gate);
    be.linear(attn, a.o_proj, nullptr, out);
  }

  GatedAttention load_gated_attention(WeightLoader& w, const std::string& p) {
    const int64_t h = cfg_.hidden_size, hd = cfg_.head_dim, q_dim = cfg_.q_dim(), kv_dim = cfg_.kv_dim();
    GatedAttention a;
    // q_proj [n_heads * 2 * head_dim, hidden]: per head, head_dim query rows then head_dim gate rows.
    const std::string q_name = p + "q_proj.weight";
    a.q_proj = regrouped_rows(w, q_name, 2 * q_dim, h, strided(cfg_.n_heads, 2 * hd, 0, hd), regrouped_);
    a.gate_proj = regrouped_rows(w, q_name, 2 * q_dim, h, strided(cfg_.n_heads, 2 * hd, hd, hd), regrouped_);
    a.k_proj = w.matrix(p + "k_proj.weight", kv_dim, h);
    a.v_proj = w.matrix(p + "v_proj.weight", kv_dim, h);
    a.o_proj = w.matrix(p + "o_proj.weight", h, q_dim);
    a.q_norm = load_offset_norm(w, p + "q_norm.weight", hd, mlx_norms_);
    a.k_norm = load_offset_norm(w, p + "k_norm.weight", hd, mlx_norms_);
    return a;
  }

  Qwen3NextConfig cfg_;
  std::string prefix_;  // "model.", "model.language_model." or "language_model.model."
  std::string head_;    // "lm_head." or "language_model.lm_head."
  bool mlx_norms_ = false;  // zero-centred norm weights stored as 1 + w (mlx-lm's layout)
  std::vector<Qwen3NextLayer> layers_;
  std::deque<std::vector<char>> regrouped_;  // storage of the regrouped fused weights
  RopeTable rope_;
  Buffer gate_;                // [info_.max_batch, q_dim]: output gate of the full-attention layers
  DeltaNetBuffers delta_buf_;  // activations of the linear-attention layers
  DeltaNetState zero_state_;  // all zeros; sequences reset their linear layers from it
};

}  // namespace

std::unique_ptr<Model> load_qwen3_next(const std::string& dir, const HfConfig& config,
                                       const ModelOptions& options) {
  return std::make_unique<Qwen3Next>(dir, config, options);
}

bool is_qwen3_next_unused_tensor(const std::string& name) {
  for (const char* prefix : {"model.visual.", "mtp.", "vision_tower.", "language_model.mtp."})
    if (name.rfind(prefix, 0) == 0) return true;
  return false;
}

std::optional<ExpertTensorRef> parse_qwen3_5_expert_tensor(const std::string& name) {
  // The text-only layout (model.layers.) and the multimodal one (model.language_model.layers.).
  static const std::regex hub(
      R"(model\.(?:language_model\.)?layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight)");
  // transformers' fused form (as it holds experts in memory): gate_up_proj [E, 2 * inter, hidden],
  // gate rows then up rows; down_proj [E, hidden, inter].
  static const std::regex fused(R"(model\.(?:language_model\.)?layers\.(\d+)\.mlp\.experts\.(gate_up|down)_proj)");
  std::smatch m;
  if (std::regex_match(name, m, hub)) return ExpertTensorRef{std::stoi(m[1]), std::stoi(m[2]), m[3], false};
  if (std::regex_match(name, m, fused))
    return m[2] == "down" ? ExpertTensorRef{std::stoi(m[1]), -1, "down", true}
                          : ExpertTensorRef{std::stoi(m[1]), -1, "gate_up", true, ExpertLayout::GateUpRows};
  // Stacked experts (mlp.switch_mlp) under model.language_model. or, as MLX names them,
  // language_model.model.
  for (const char* prefix : {"model.language_model.", "language_model.model."})
    if (name.rfind(prefix, 0) == 0) return parse_qwen_expert_tensor("model." + name.substr(std::strlen(prefix)));
  return parse_qwen_expert_tensor(name);
}

}  // namespace moestream
