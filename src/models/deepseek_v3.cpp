// DeepSeek-V3 (model_type "deepseek_v3"): DeepSeek-V3, DeepSeek-R1, Kimi-K2.
//
// Each layer: x += mla(rmsnorm(x)); x += ffn(rmsnorm(x)). The first first_k_dense_replace layers
// have a dense SwiGLU MLP, the others a routed MoE plus shared experts (sigmoid scores, choice by
// score + e_score_correction_bias within the best topk_group of n_group groups, weights the chosen
// scores renormalized, times routed_scaling_factor).
//
// Multi-head latent attention, in the absorbed form: the cache keeps per token the normalized
// latent c (kv_lora_rank) and the shared rotary key k_rope (qk_rope_head_dim), never per-head keys
// and values. kv_b_proj holds per head W_uk [nope, rank] and W_uv [v, rank], so that
//   q_h . k_h = (W_uk_h^T q_nope_h) . c + q_rope_h . k_rope      (scores against the latent)
//   v_h       = W_uv_h (sum_j p_j c_j)                            (values from the latent)
// and attention runs as one shared key head of width rank + rope whose first rank columns are
// also the values: the cache holds rank + rope floats per token and layer.
#include "core/dtype.h"
#include "core/error.h"
#include "io/pack.h"
#include "models/moe_decoder.h"
#include "models/registry.h"

#include <cmath>
#include <deque>

namespace moestream {

namespace {

struct DeepseekV3Config : DecoderConfig {
  int64_t shared_intermediate;    // width of the shared experts: expert_size * n_shared_experts
  int q_lora_rank;                // 0: q_proj directly (DeepSeek-V2-Lite style)
  int kv_lora_rank;               // latent width
  int nope_dim, rope_dim, v_dim;  // per head: qk_nope_head_dim, qk_rope_head_dim, v_head_dim
  bool rope_interleave;           // rotary pairs (2i, 2i+1)
  int n_group, topk_group;        // group-limited routing
  float routed_scaling_factor;    // multiplies the routing weights
  int first_k_dense_replace;      // layers [0, k) are dense

  explicit DeepseekV3Config(const HfConfig& c)
      : DecoderConfig(parse(c, {.max_position = 163840, .norm_topk_prob = true, .gqa = false})),
        shared_intermediate(expert_size * c.get_int_in("n_shared_experts", 1, kMaxExperts, 1)),
        q_lora_rank(int(c.get_int_in("q_lora_rank", 0, kMaxWidth, 0))),
        kv_lora_rank(int(c.get_int_in("kv_lora_rank", 1, kMaxWidth))),
        nope_dim(int(c.get_int_in("qk_nope_head_dim", 1, kMaxWidth))),
        rope_dim(int(c.get_int_in("qk_rope_head_dim", 1, kMaxWidth))),
        v_dim(int(c.get_int_in("v_head_dim", 1, kMaxWidth))),
        rope_interleave(c.get_bool("rope_interleave", true)),
        n_group(int(c.get_int_in("n_group", 1, kMaxExperts, 1))),
        topk_group(int(c.get_int_in("topk_group", 1, kMaxExperts, 1))),
        routed_scaling_factor(float(c.get_double("routed_scaling_factor", 1.0))),
        first_k_dense_replace(int(c.get_int_in("first_k_dense_replace", 0, kMaxLayers, 0))) {
    check_silu(c);
    if (c.get_bool("attention_bias", false)) fail(c.path(), ": attention_bias is not supported for deepseek_v3");
    if (rope_dim % 2 != 0) fail(c.path(), ": field 'qk_rope_head_dim' must be even, found ", rope_dim);
    if (rope.partial_rotary_factor != 1.0)
      fail(c.path(), ": partial_rotary_factor is not supported for deepseek_v3 (qk_rope_head_dim sets the rotated dims)");
    check_expert_groups(c, n_experts, n_group, topk_group);
    check_dense_width([&](int l) { return is_moe_layer(l); });
  }

  int qk_dim() const { return nope_dim + rope_dim; }
  bool is_moe_layer(int l) const { return l >= first_k_dense_replace; }
  // Softmax scale: qk_dim^-0.5, times mscale^2 under YaRN with mscale_all_dim.
  float attention_scale() const {
    float s = 1.0f / std::sqrt(float(qk_dim()));
    if (rope.type != "default" && rope.mscale_all_dim && *rope.mscale_all_dim != 0) {
      const float m = float(yarn_mscale(rope.factor, *rope.mscale_all_dim));
      s *= m * m;
    }
    return s;
  }
};

struct MlaWeights {
  Matrix q_a_proj, q_b_proj, q_proj;  // q_a/q_b with q_lora_rank, else q_proj
  Vector q_a_norm, kv_a_norm;
  Matrix kv_a_proj;                   // [rank + rope, hidden]
  std::vector<Matrix> uk_t;           // per head W_uk^T [rank, nope]
  std::vector<Matrix> uv;             // per head W_uv [v, rank] (rows of kv_b_proj)
  Matrix o_proj;                      // [hidden, heads * v]
};

struct DeepseekV3Layer {
  Vector input_norm, post_attention_norm;
  MlaWeights attn;
  MoeFeedForward ffn;  // routed + shared experts, or dense (first_k_dense_replace layers)
};

// Activations of the latent attention, [max_batch, width] each.
struct MlaBuffers {
  Buffer q_a, q, kv_a, latent, q_nope, q_absorbed, q_latent, o_latent, o_heads;
};

class DeepseekV3 final : public DecoderModel {
 public:
  DeepseekV3(const std::string& dir, const HfConfig& hf, const ModelOptions& options)
      : cfg_(hf) {
    open_pack(dir, hf, options, cfg_);  // model_type deepseek_v3 or kimi_k2

    WeightLoader w(*weights_, *backend_, quantization_lookup(hf));
    const int64_t h = cfg_.hidden_size;
    load_embeddings(w, cfg_.tie_word_embeddings);
    std::vector<bool> moe_layers;
    const MoeParams routing = sigmoid_group_routing(cfg_.n_experts, cfg_.top_k, cfg_.norm_topk_prob, cfg_.n_group,
                                                    cfg_.topk_group, cfg_.routed_scaling_factor);
    for (int l = 0; l < cfg_.n_layers; ++l) {
      const std::string p = layer_prefix(l);
      DeepseekV3Layer layer;
      layer.input_norm = w.vector(p + "input_layernorm.weight", h);
      layer.post_attention_norm = w.vector(p + "post_attention_layernorm.weight", h);
      layer.attn = load_mla(w, p + "self_attn.");
      layer.ffn = load_shared_expert_ffn(w, p, cfg_.is_moe_layer(l), h, cfg_.intermediate_size,
                                         cfg_.shared_intermediate, routing);
      moe_layers.push_back(layer.ffn.moe);
      layers_.push_back(std::move(layer));
    }
    load_experts(options, moe_layers, cfg_.n_experts, cfg_.expert_size, ExpertNaming::Hub);

    // Queries rotate their trailing rope dims of each head; the latent row [c, k_rope] its tail.
    q_rope_ = make_rope_table(cfg_.rope, cfg_.rope_dim, hf.path());
    q_rope_.interleaved = cfg_.rope_interleave;
    q_rope_.rot_offset = cfg_.nope_dim;
    k_rope_ = q_rope_;
    k_rope_.rot_offset = cfg_.kv_lora_rank;
    attn_params_.n_heads = cfg_.n_heads;
    attn_params_.n_kv_heads = 1;
    attn_params_.head_dim = cfg_.kv_lora_rank + cfg_.rope_dim;
    attn_params_.v_head_dim = cfg_.kv_lora_rank;
    attn_params_.values_in_keys = true;
    attn_params_.scale = cfg_.attention_scale();

    init_workspace(int64_t(cfg_.n_heads) * cfg_.v_dim, 1);
    const int64_t H = cfg_.n_heads, R = cfg_.kv_lora_rank, rope = cfg_.rope_dim;
    Backend& be = *backend_;
    buf_.q_a = be.alloc(info_.max_batch, std::max(cfg_.q_lora_rank, 1));
    buf_.q = be.alloc(info_.max_batch, H * cfg_.qk_dim());
    buf_.kv_a = be.alloc(info_.max_batch, R + rope);
    buf_.latent = be.alloc(info_.max_batch, R);
    buf_.q_nope = be.alloc(info_.max_batch, H * cfg_.nope_dim);
    buf_.q_absorbed = be.alloc(info_.max_batch, H * R);
    buf_.q_latent = be.alloc(info_.max_batch, H * (R + rope));
    buf_.o_latent = be.alloc(info_.max_batch, H * R);
    buf_.o_heads = be.alloc(info_.max_batch, H * cfg_.v_dim);
    set_weight_bytes(info_, *weights_, pack_, moe_layers, cfg_.n_experts, cfg_.top_k);
  }

  std::unique_ptr<SequenceState> new_sequence(int64_t capacity) override {
    // Keys [c, k_rope]; values are c, read from the key rows (no V cache).
    // Compact types scale each latent row as one head.
    return std::make_unique<KvSequence>(*backend_, cfg_.n_layers, capacity, cfg_.kv_lora_rank + cfg_.rope_dim, 0,
                                        ws_.kv, 1);
  }

 protected:
  void run_layer(int l, int64_t T, std::span<const RowSpan> seqs) override {
    const DeepseekV3Layer& layer = layers_[size_t(l)];
    Backend& be = *backend_;
    Buffer x = ws_.x.rows_view(0, T), xn = ws_.xn.rows_view(0, T);
    Buffer out = ws_.ffn_out.rows_view(0, T);
    {
      ScopedTimer timer(be.times().attention);
      be.rmsnorm(x, layer.input_norm, norm_eps, x.cols, xn);
      attention(layer.attn, xn, seqs, l, out);
      be.add(x, out);
    }
    be.rmsnorm(x, layer.post_attention_norm, norm_eps, x.cols, xn);
    layer.ffn.forward(be, *experts_, ws_, l, xn, x, upcoming_moe_layers(layers_, l, ws_));
  }

 private:
  MlaWeights load_mla(WeightLoader& w, const std::string& p) {
    const int64_t h = cfg_.hidden_size, H = cfg_.n_heads, R = cfg_.kv_lora_rank;
    const int64_t nope = cfg_.nope_dim, vd = cfg_.v_dim;
    MlaWeights a;
    if (cfg_.q_lora_rank > 0) {
      a.q_a_proj = w.matrix(p + "q_a_proj.weight", cfg_.q_lora_rank, h);
      a.q_a_norm = w.vector(p + "q_a_layernorm.weight", cfg_.q_lora_rank);
      a.q_b_proj = w.matrix(p + "q_b_proj.weight", H * cfg_.qk_dim(), cfg_.q_lora_rank);
    } else {
      a.q_proj = w.matrix(p + "q_proj.weight", H * cfg_.qk_dim(), h);
    }
    a.kv_a_proj = w.matrix(p + "kv_a_proj_with_mqa.weight", R + cfg_.rope_dim, h);
    a.kv_a_norm = w.vector(p + "kv_a_layernorm.weight", R);
    a.o_proj = w.matrix(p + "o_proj.weight", h, H * vd);

    // kv_b_proj [H * (nope + v), R]: per head nope rows of W_uk, then v rows of W_uv. W_uk is
    // kept transposed in float32; W_uv rows as they are stored (bf16, f16, f32 or FP8).
    const std::string name = p + "kv_b_proj.weight";
    const std::vector<float> kv_b = w.dense_f32(name, H * (nope + vd), R);
    for (int64_t hd = 0; hd < H; ++hd) {
      const int64_t row0 = hd * (nope + vd);
      std::vector<float>& t = owned_.emplace_back(size_t(R * nope));  // W_uk^T: [R, nope]
      for (int64_t i = 0; i < nope; ++i)
        for (int64_t r = 0; r < R; ++r) t[size_t(r * nope + i)] = kv_b[size_t((row0 + i) * R + r)];
      const std::string head = name + "[head " + std::to_string(hd) + "]";
      a.uk_t.push_back(w.backend().load_matrix(
          TensorView{head + " W_uk^T", DType::F32, {R, nope}, t.data(), t.size() * sizeof(float)}));
      a.uv.push_back(w.matrix_rows(name, H * (nope + vd), R, row0 + nope, vd, head + " W_uv"));
    }
    return a;
  }

  // out (T, hidden) = latent attention of x (T, hidden), the rows of `seqs`; each span's [c, k_rope]
  // appended to its layer-l key cache.
  void attention(const MlaWeights& a, const Buffer& x, std::span<const RowSpan> seqs, int l, Buffer& out) {
    Backend& be = *backend_;
    const int64_t T = x.rows, H = cfg_.n_heads, R = cfg_.kv_lora_rank;
    const int64_t nope = cfg_.nope_dim, rope = cfg_.rope_dim, qk = cfg_.qk_dim();
    const auto rows = [T](const Buffer& b) { return b.rows_view(0, T); };
    Buffer q = rows(buf_.q), kv_a = rows(buf_.kv_a), latent = rows(buf_.latent);
    if (cfg_.q_lora_rank > 0) {
      Buffer q_a = rows(buf_.q_a);
      be.linear(x, a.q_a_proj, nullptr, q_a);                 // (T, q_lora)
      be.rmsnorm(q_a, a.q_a_norm, norm_eps, q_a.cols, q_a);
      be.linear(q_a, a.q_b_proj, nullptr, q);                 // (T, H * (nope + rope))
    } else {
      be.linear(x, a.q_proj, nullptr, q);
    }
    be.linear(x, a.kv_a_proj, nullptr, kv_a);                // (T, R + rope): [c, k_rope]
    for (const RowSpan& s : seqs) {
      Buffer qs = q.rows_view(s.row0, s.rows), ks = kv_a.rows_view(s.row0, s.rows);
      be.rope(qs, int(H), int(qk), q_rope_, s.state->n_past);
      be.rope(ks, 1, int(R + rope), k_rope_, s.state->n_past);
    }
    be.copy_columns(kv_a, {0, 0}, latent, {0, 0}, R, 1);
    be.rmsnorm(latent, a.kv_a_norm, norm_eps, R, latent);    // c (T, R)
    be.copy_columns(latent, {0, 0}, kv_a, {0, 0}, R, 1);     // key row [c, k_rope]

    // Queries in latent space: [W_uk_h^T q_nope_h, q_rope_h] per head.
    Buffer q_nope = rows(buf_.q_nope), q_abs = rows(buf_.q_absorbed), q_lat = rows(buf_.q_latent);
    be.copy_columns(q, {0, qk}, q_nope, {0, nope}, nope, H);
    be.linear_per_head(q_nope, a.uk_t, q_abs);                // (T, H * R)
    be.copy_columns(q_abs, {0, R}, q_lat, {0, R + rope}, R, H);
    be.copy_columns(q, {nope, qk}, q_lat, {R, R + rope}, rope, H);

    Buffer o_lat = rows(buf_.o_latent), o_heads = rows(buf_.o_heads);
    for (const RowSpan& s : seqs) {
      auto& seq = static_cast<KvSequence&>(*s.state);
      AttentionParams p = attn_params_;
      p.n_past = seq.n_past;
      p.kv = ws_.kv;
      const auto part = [&s](const Buffer& b) { return b.rows_view(s.row0, s.rows); };
      Buffer o = part(o_lat);
      be.attention(part(q_lat), part(kv_a), part(latent), seq.k[size_t(l)], seq.v[size_t(l)], p, o);  // (T, H * R)
    }
    be.linear_per_head(o_lat, a.uv, o_heads);                      // (T, H * v)
    be.linear(o_heads, a.o_proj, nullptr, out);
  }

  DeepseekV3Config cfg_;
  std::vector<DeepseekV3Layer> layers_;
  std::deque<std::vector<float>> owned_;  // W_uk^T copies behind the uk_t matrices
  RopeTable q_rope_, k_rope_;
  AttentionParams attn_params_;
  MlaBuffers buf_;
};

}  // namespace

std::unique_ptr<Model> load_deepseek_v3(const std::string& dir, const HfConfig& config, const ModelOptions& options) {
  return std::make_unique<DeepseekV3>(dir, config, options);
}

}  // namespace moestream
