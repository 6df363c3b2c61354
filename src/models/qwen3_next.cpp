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
//   linear_attention  Gated DeltaNet: qkv = in_proj_qkv x -> causal conv1d + SiLU (rolling conv
//                     state) -> L2-normalized q, k; the gated delta rule with a [k_head_dim,
//                     v_head_dim] state per value head (value heads share key heads, GQA-style);
//                     RMSNorm(o) * w * silu(in_proj_z x); out_proj.
//   full_attention    GQA whose q_proj also yields a per-head output gate (o *= sigmoid(gate)),
//                     per-head q/k RMSNorm, rotary on the first partial_rotary_factor of each head.
// Then a routed MoE (softmax top-k) plus a resident shared expert scaled by
// sigmoid(shared_expert_gate x); Qwen3-Next may make layers dense (mlp_only_layers,
// decoder_sparse_step). Every RMSNorm except the gated one is zero-centred: weight 1 + w.
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
#include "experts/expert_store.h"
#include "io/pack.h"
#include "io/safetensors.h"
#include "models/blocks.h"
#include "models/registry.h"

namespace moestream {

namespace {

struct Qwen3NextConfig {
  std::string model_type;
  bool split_projections;          // in_proj_qkv/z/b/a (Qwen3.5) instead of in_proj_qkvz/ba
  int64_t vocab_size;
  int64_t hidden_size;             // model width
  int64_t intermediate_size;       // dense MLP width (Qwen3-Next dense layers only)
  int64_t moe_intermediate_size;   // width of one routed expert
  int64_t shared_expert_size;      // width of the shared expert
  int n_layers;
  std::vector<bool> linear_layer;  // [n_layers] true: linear_attention, false: full_attention
  int n_heads, n_kv_heads, head_dim;  // full attention
  int rot_dim;                        // rotated leading dims of each head
  DeltaNetParams delta;               // linear attention heads, dims, conv kernel
  int n_experts, top_k;
  bool norm_topk_prob;
  int decoder_sparse_step;                // Qwen3-Next: layer l is MoE when (l + 1) % step == 0 ...
  std::vector<int64_t> mlp_only_layers;   // ... and l is not listed here
  bool tie_word_embeddings;
  float rms_norm_eps;
  int64_t max_position;
  RopeParams rope;

  int64_t q_dim() const { return int64_t(n_heads) * head_dim; }
  int64_t kv_dim() const { return int64_t(n_kv_heads) * head_dim; }
  int64_t key_dim() const { return int64_t(delta.n_k_heads) * delta.k_head_dim; }
  int64_t value_dim() const { return int64_t(delta.n_v_heads) * delta.v_head_dim; }
  int64_t conv_dim() const { return 2 * key_dim() + value_dim(); }

  static Qwen3NextConfig from(const HfConfig& c) {
    Qwen3NextConfig q;
    q.model_type = c.model_type();
    q.split_projections = q.model_type != "qwen3_next";
    q.vocab_size = c.get_int("vocab_size");
    q.hidden_size = c.get_int("hidden_size");
    q.moe_intermediate_size = c.get_int("moe_intermediate_size");
    q.shared_expert_size = c.get_int("shared_expert_intermediate_size");
    q.n_layers = int(c.get_int("num_hidden_layers"));
    q.n_heads = int(c.get_int("num_attention_heads"));
    q.n_kv_heads = int(c.get_int("num_key_value_heads", q.n_heads));
    q.head_dim = int(c.get_int("head_dim", q.hidden_size / q.n_heads));
    q.delta.n_k_heads = int(c.get_int("linear_num_key_heads"));
    q.delta.n_v_heads = int(c.get_int("linear_num_value_heads"));
    q.delta.k_head_dim = int(c.get_int("linear_key_head_dim"));
    q.delta.v_head_dim = int(c.get_int("linear_value_head_dim"));
    q.delta.conv_kernel = int(c.get_int("linear_conv_kernel_dim"));
    q.n_experts = int(c.get_int("num_experts"));
    q.top_k = int(c.get_int("num_experts_per_tok"));
    // Qwen3.5's router always renormalizes the top-k weights; Qwen3-Next follows the config.
    q.norm_topk_prob = q.split_projections || c.get_bool("norm_topk_prob", true);
    q.decoder_sparse_step = q.split_projections ? 1 : int(c.get_int("decoder_sparse_step", 1));
    if (!q.split_projections) q.mlp_only_layers = c.get_int_list("mlp_only_layers");
    q.intermediate_size = c.get_int("intermediate_size", 0);
    q.tie_word_embeddings = c.get_bool("tie_word_embeddings", false);
    q.rms_norm_eps = float(c.get_double("rms_norm_eps", 1e-6));
    q.delta.norm_eps = q.rms_norm_eps;
    q.max_position = c.get_int("max_position_embeddings", 32768);
    q.rope = c.rope();
    q.rot_dim = int(double(q.head_dim) * q.rope.partial_rotary_factor);

    const std::vector<std::string> types = c.get_string_list("layer_types");
    if (!types.empty()) {
      if (int(types.size()) != q.n_layers)
        fail(c.path(), ": layer_types has ", types.size(), " entries, num_hidden_layers is ", q.n_layers);
      for (const auto& t : types) {
        if (t != "linear_attention" && t != "full_attention")
          fail(c.path(), ": layer_types entry '", t, "' is not supported (expected linear_attention or full_attention)");
        q.linear_layer.push_back(t == "linear_attention");
      }
    } else {
      const int interval = int(c.get_int("full_attention_interval", 4));
      if (interval <= 0) fail(c.path(), ": full_attention_interval must be positive, found ", interval);
      for (int l = 0; l < q.n_layers; ++l) q.linear_layer.push_back((l + 1) % interval != 0);
    }

    const std::string act = c.get_string("hidden_act", "silu");
    if (act != "silu") fail(c.path(), ": hidden_act '", act, "' is not supported (expected silu)");
    if (c.get_bool("attention_bias", false))
      fail(c.path(), ": attention_bias true is not supported for ", q.model_type);
    if (q.n_heads <= 0 || q.n_kv_heads <= 0 || q.n_heads % q.n_kv_heads != 0)
      fail(c.path(), ": num_attention_heads (", q.n_heads, ") must be a positive multiple of num_key_value_heads (", q.n_kv_heads, ")");
    if (q.head_dim <= 0 || q.rot_dim <= 0 || q.rot_dim % 2 != 0)
      fail(c.path(), ": head_dim ", q.head_dim, " with partial_rotary_factor ", q.rope.partial_rotary_factor,
           " must rotate a positive even number of dims");
    const DeltaNetParams& d = q.delta;
    if (d.n_k_heads <= 0 || d.n_v_heads <= 0 || d.n_v_heads % d.n_k_heads != 0)
      fail(c.path(), ": linear_num_value_heads (", d.n_v_heads, ") must be a positive multiple of linear_num_key_heads (", d.n_k_heads, ")");
    if (d.k_head_dim <= 0 || d.v_head_dim <= 0 || d.conv_kernel <= 0)
      fail(c.path(), ": linear_key_head_dim, linear_value_head_dim and linear_conv_kernel_dim must be positive");
    if (q.top_k <= 0 || q.top_k > q.n_experts)
      fail(c.path(), ": num_experts_per_tok (", q.top_k, ") must be in [1, num_experts = ", q.n_experts, "]");
    if (q.decoder_sparse_step <= 0) fail(c.path(), ": decoder_sparse_step must be positive");
    for (int l = 0; l < q.n_layers; ++l)
      if (!q.is_moe_layer(l) && q.intermediate_size <= 0)
        fail(c.path(), ": layer ", l, " is dense but intermediate_size is missing");
    return q;
  }

  bool is_moe_layer(int l) const {
    for (int64_t m : mlp_only_layers)
      if (m == l) return false;
    return n_experts > 0 && (l + 1) % decoder_sparse_step == 0;
  }
};

// Full-attention layer: the checkpoint's q_proj rows, regrouped into the query and the gate.
struct GatedAttention {
  Matrix q_proj, gate_proj;  // [n_heads * head_dim, hidden] each
  Matrix k_proj, v_proj;     // [kv_dim, hidden]
  Matrix o_proj;             // [hidden, n_heads * head_dim]
  Vector q_norm, k_norm;     // [head_dim], stored as 1 + w
};

// Linear-attention layer (Gated DeltaNet).
struct LinearAttention {
  Matrix qkv_proj;  // [2 * key_dim + value_dim, hidden]: q | k | v
  Matrix z_proj;    // [value_dim, hidden]: gate of the output norm
  Matrix b_proj;    // [n_v_heads, hidden]: write strength, beta = sigmoid(b x)
  Matrix a_proj;    // [n_v_heads, hidden]: decay input
  Matrix out_proj;  // [hidden, value_dim]
  DeltaNetWeights weights;
};

struct Qwen3NextLayer {
  bool linear = false;
  Vector input_norm, post_attention_norm;  // stored as 1 + w
  GatedAttention attn;                     // full_attention layers
  LinearAttention delta;                   // linear_attention layers
  bool moe = false;
  Matrix router;            // [n_experts, hidden]
  MlpWeights shared;        // shared expert, resident like any non-expert weight
  Matrix shared_gate;       // [1, hidden]
  MlpWeights dense;         // dense layers
};

// The KV cache of the full-attention layers and the conv and recurrent states of the linear ones,
// one sequence state: snapshots copy n_past KV rows and the (small, fixed-size) conv and recurrent
// states whole. A recurrent state cannot be rewound, so truncation keeps everything or resets to
// a fresh sequence, copying the model's zero state into each linear layer.
class HybridSequence final : public SequenceState {
 public:
  // `zero`: a zero-filled DeltaNetState of one linear layer, owned by the model.
  HybridSequence(Backend& be, const Qwen3NextConfig& c, int64_t capacity, const DeltaNetState& zero)
      : be_(be), cfg_(c), zero_(zero), capacity_(capacity) {
    k.resize(size_t(c.n_layers));
    v.resize(size_t(c.n_layers));
    conv.resize(size_t(c.n_layers));
    recurrent.resize(size_t(c.n_layers));
    for (int l = 0; l < c.n_layers; ++l) {
      if (c.linear_layer[size_t(l)]) {
        conv[size_t(l)] = be.alloc(zero.conv.rows, zero.conv.cols);
        recurrent[size_t(l)] = be.alloc(zero.recurrent.rows, zero.recurrent.cols);
      } else {
        k[size_t(l)] = be.alloc(capacity, c.kv_dim());
        v[size_t(l)] = be.alloc(capacity, c.kv_dim());
      }
    }
  }
  ~HybridSequence() override {
    for (auto* list : {&k, &v, &conv, &recurrent})
      for (Buffer& b : *list)
        if (b.data) be_.free(b);
  }
  HybridSequence(const HybridSequence&) = delete;
  HybridSequence& operator=(const HybridSequence&) = delete;
  int64_t capacity() const override { return capacity_; }

  using SequenceState::clone;
  std::unique_ptr<SequenceState> clone(int64_t capacity) const override {
    if (capacity < n_past) fail("clone: capacity ", capacity, " cannot hold the ", n_past, " positions computed");
    auto copy = std::make_unique<HybridSequence>(be_, cfg_, capacity, zero_);
    copy->restore(*this);
    return copy;
  }
  void restore(const SequenceState& snapshot) override {
    if (&snapshot == this) return;
    const auto* s = dynamic_cast<const HybridSequence*>(&snapshot);
    if (!s) fail("restore: the snapshot is not a Qwen3-Next sequence state (it comes from another model)");
    check_restore(be_, s->be_, capacity_, s->n_past);
    copy_state_rows(be_, s->k, k, s->n_past, "K cache");
    copy_state_rows(be_, s->v, v, s->n_past, "V cache");
    copy_state_rows(be_, s->conv, conv, zero_.conv.rows, "conv state");
    copy_state_rows(be_, s->recurrent, recurrent, zero_.recurrent.rows, "recurrent state");
    n_past = s->n_past;
  }
  bool can_truncate(int64_t n) const override { return n == n_past || n == 0; }
  void truncate(int64_t n) override {
    if (!can_truncate(n)) fail_truncate(n, n_past);
    if (n == n_past) return;
    for (size_t l = 0; l < conv.size(); ++l) {
      if (!conv[l].data) continue;
      be_.copy_rows(zero_.conv, conv[l], zero_.conv.rows);
      be_.copy_rows(zero_.recurrent, recurrent[l], zero_.recurrent.rows);
    }
    n_past = 0;
  }
  int64_t bytes() const override {
    return state_bytes(k) + state_bytes(v) + state_bytes(conv) + state_bytes(recurrent);
  }

  DeltaNetState delta(int l) { return DeltaNetState{conv[size_t(l)], recurrent[size_t(l)]}; }

  // Per layer; empty buffers where the layer has no state of that kind.
  std::vector<Buffer> k, v;                // [capacity, kv_dim] for full-attention layers
  std::vector<Buffer> conv, recurrent;     // DeltaNetState of linear-attention layers

 private:
  Backend& be_;
  const Qwen3NextConfig& cfg_;
  const DeltaNetState& zero_;
  int64_t capacity_;
};

// A zero-centred RMSNorm weight w as the vector 1 + w (added in float32, as transformers does).
// mlx-lm's checkpoints already store 1 + w (`stored_with_offset`), read as they are.
Vector load_offset_norm(WeightLoader& w, const std::string& name, int64_t size, bool stored_with_offset) {
  const TensorView& t = w.weights().get(name);
  check_shape(t, {size});
  if (stored_with_offset) return w.backend().load_vector(t);
  std::vector<float> values(static_cast<size_t>(size));
  for (int64_t i = 0; i < size; ++i) {
    float x;
    switch (t.dtype) {
      case DType::F32: x = t.as<float>()[i]; break;
      case DType::BF16: x = bf16_to_f32(t.as<uint16_t>()[i]); break;
      case DType::F16: x = f16_to_f32(t.as<uint16_t>()[i]); break;
      default: fail("tensor ", name, ": dtype ", dtype_name(t.dtype), " is not supported for norm weights");
    }
    values[size_t(i)] = 1.0f + x;
  }
  return w.backend().load_vector(TensorView{name, DType::F32, {size}, values.data(), values.size() * sizeof(float)});
}

// The depthwise conv1d weight as one vector, channel-major: transformers stores it [channels, 1,
// kernel], mlx-lm [channels, kernel, 1]; both hold tap j of channel c at c * kernel + j.
Vector load_conv(WeightLoader& w, const std::string& name, int64_t channels, int kernel) {
  TensorView t = w.weights().get(name);
  if (t.shape != std::vector<int64_t>{channels, kernel, 1}) check_shape(t, {channels, 1, kernel});
  t.shape = {channels * kernel};
  return w.backend().load_vector(t);
}

// Whether the checkpoint is in mlx-lm's layout, whose sanitize step stores the zero-centred norm
// weights as 1 + w: told by the conv1d weights ([channels, kernel, 1]); where the two layouts
// coincide (a kernel of 1, or no linear-attention layer) by config.json's MLX quantization entry.
bool is_mlx_layout(const WeightSet& weights, const HfConfig& hf, const std::string& first_conv, int kernel) {
  if (kernel > 1 && !first_conv.empty() && weights.has(first_conv)) {
    const std::vector<int64_t>& shape = weights.get(first_conv).shape;
    return shape.size() == 3 && shape[1] == kernel && shape[2] == 1;
  }
  return hf.json().contains("quantization");
}

// Row ranges [begin, begin + count) of a fused weight, taken in order.
struct RowRange {
  int64_t begin, count;
};

// Rows of the fused weight `name` [rows, cols], regrouped into one matrix; plain or MLX-quantized
// (the words, scales and biases of each row move together). The copy lives in `storage`.
Matrix regrouped_rows(WeightLoader& w, const std::string& name, int64_t rows, int64_t cols,
                      const std::vector<RowRange>& ranges, std::deque<std::vector<char>>& storage) {
  const TensorView& t = w.weights().get(name);
  const std::string module = name.substr(0, name.size() - std::string(".weight").size());
  auto gather = [&](const TensorView& src) {
    if (src.shape.size() != 2 || src.shape[0] != rows)
      fail("tensor ", src.name, ": expected ", rows, " rows, found shape ", shape_str(src.shape));
    const size_t row_bytes = src.nbytes / size_t(rows);
    int64_t n = 0;
    for (const RowRange& r : ranges) {
      if (r.begin < 0 || r.begin + r.count > rows) fail("tensor ", src.name, ": row range out of bounds");
      n += r.count;
    }
    std::vector<char>& bytes = storage.emplace_back(size_t(n) * row_bytes);
    char* dst = bytes.data();
    for (const RowRange& r : ranges) {
      std::memcpy(dst, src.as<char>() + size_t(r.begin) * row_bytes, size_t(r.count) * row_bytes);
      dst += size_t(r.count) * row_bytes;
    }
    return TensorView{src.name, src.dtype, {n, src.shape[1]}, bytes.data(), bytes.size()};
  };
  if (t.dtype == DType::U32 && w.has(module + ".scales")) {
    const TensorView& scales = w.weights().get(module + ".scales");
    const TensorView& biases = w.weights().get(module + ".biases");
    if (t.shape.size() != 2 || scales.shape.size() != 2 || (t.shape[1] * 32) % cols != 0 ||
        scales.shape[1] == 0 || cols % scales.shape[1] != 0)
      fail("tensor ", name, ": quantized shape ", shape_str(t.shape), " with scales ",
           shape_str(scales.shape), " does not fit a [", rows, ", ", cols, "] matrix");
    const QuantFormat f{int(t.shape[1] * 32 / cols), int(cols / scales.shape[1]), scales.dtype};
    return w.backend().load_quantized(gather(t), gather(scales), gather(biases), f);
  }
  check_shape(t, {rows, cols});
  return w.backend().load_matrix(gather(t));
}

// Rows [offset, offset + width) of each of `groups` consecutive groups of `stride` rows.
std::vector<RowRange> strided(int64_t groups, int64_t stride, int64_t offset, int64_t width) {
  std::vector<RowRange> r;
  for (int64_t g = 0; g < groups; ++g) r.push_back({g * stride + offset, width});
  return r;
}

class Qwen3Next final : public DecoderModel {
 public:
  Qwen3Next(const std::string& dir, const HfConfig& hf, const ModelOptions& options)
      : cfg_(Qwen3NextConfig::from(hf)) {
    open_pack(dir, hf, options, {cfg_.model_type, cfg_.vocab_size, cfg_.hidden_size, cfg_.n_layers,
                                  cfg_.max_position, cfg_.rms_norm_eps});

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
            : prefix_ + "layers." + std::to_string(first_linear - cfg_.linear_layer.begin()) + ".linear_attn.conv1d.weight",
        cfg_.delta.conv_kernel);
    const int64_t h = cfg_.hidden_size;
    embed_tokens = w.matrix(prefix_ + "embed_tokens.weight", cfg_.vocab_size, h);
    final_norm = load_offset_norm(w, prefix_ + "norm.weight", h, mlx_norms_);
    if (cfg_.tie_word_embeddings && !w.has(head_ + "weight"))
      lm_head = embed_tokens;
    else
      lm_head = w.matrix(head_ + "weight", cfg_.vocab_size, h);

    std::vector<bool> moe_layers;
    for (int l = 0; l < cfg_.n_layers; ++l) {
      const std::string p = prefix_ + "layers." + std::to_string(l) + ".";
      Qwen3NextLayer layer;
      layer.input_norm = load_offset_norm(w, p + "input_layernorm.weight", h, mlx_norms_);
      layer.post_attention_norm = load_offset_norm(w, p + "post_attention_layernorm.weight", h, mlx_norms_);
      layer.linear = cfg_.linear_layer[size_t(l)];
      if (layer.linear)
        layer.delta = load_linear_attention(w, p + "linear_attn.");
      else
        layer.attn = load_gated_attention(w, p + "self_attn.");
      layer.moe = cfg_.is_moe_layer(l);
      if (layer.moe) {
        layer.router = w.matrix(p + "mlp.gate.weight", cfg_.n_experts, h);
        layer.shared = load_mlp(w, p + "mlp.shared_expert.", h, cfg_.shared_expert_size);
        layer.shared_gate = w.matrix(p + "mlp.shared_expert_gate.weight", 1, h);
      } else {
        layer.dense = load_mlp(w, p + "mlp.", h, cfg_.intermediate_size);
      }
      moe_layers.push_back(layer.moe);
      layers_.push_back(std::move(layer));
    }
    // The shared expert is a plain weight above, never in the pack's expert files.
    check_pack_experts(pack_, moe_layers, cfg_.n_experts, h, cfg_.moe_intermediate_size,
                       [&](int l, int e, const std::string& role) {
                         return prefix_ + "layers." + std::to_string(l) + ".mlp.experts." + std::to_string(e) +
                                "." + role + "_proj.weight";
                       });
    experts_ = make_expert_store(pack_, *backend_, options.experts);
    rope_ = make_rope_table(cfg_.rope, cfg_.rot_dim, hf.path());

    init_workspace(kMaxBatch, cfg_.q_dim(), cfg_.kv_dim());
    Backend& be = *backend_;
    gate_ = be.alloc(kMaxBatch, cfg_.q_dim());
    qkv_ = be.alloc(kMaxBatch, cfg_.conv_dim());
    z_ = be.alloc(kMaxBatch, cfg_.value_dim());
    core_ = be.alloc(kMaxBatch, cfg_.value_dim());
    b_ = be.alloc(kMaxBatch, cfg_.delta.n_v_heads);
    a_ = be.alloc(kMaxBatch, cfg_.delta.n_v_heads);
    shared_out_ = be.alloc(kMaxBatch, h);
    shared_gate_ = be.alloc(kMaxBatch, 1);
    // A fresh linear layer's state (alloc zero-fills): what truncate(0) copies back.
    zero_state_.conv = be.alloc(cfg_.delta.conv_kernel - 1, cfg_.conv_dim());
    zero_state_.recurrent = be.alloc(int64_t(cfg_.delta.n_v_heads) * cfg_.delta.k_head_dim, cfg_.delta.v_head_dim);

    // Bytes of what this model reads (a multimodal checkpoint's vision and mtp weights excluded).
    int64_t dense_bytes = 0;
    for (const auto& name : weights_->names())
      if (name.rfind(prefix_, 0) == 0 || name.rfind(head_, 0) == 0)
        dense_bytes += int64_t(weights_->get(name).nbytes);
    const int64_t expert_bytes = int64_t(pack_.total_expert_bytes());
    const int64_t n_moe = std::count(moe_layers.begin(), moe_layers.end(), true);
    info_.weight_bytes = dense_bytes + expert_bytes;
    info_.active_bytes_per_token =
        dense_bytes + (n_moe ? expert_bytes / (n_moe * cfg_.n_experts) * n_moe * cfg_.top_k : 0);
  }

  ExpertStats expert_stats() const override { return experts_->stats(); }

  std::unique_ptr<SequenceState> new_sequence(int64_t capacity) override {
    return std::make_unique<HybridSequence>(*backend_, cfg_, capacity, zero_state_);
  }

 protected:
  void run_layer(int l, int64_t T, SequenceState& state) override {
    auto& seq = static_cast<HybridSequence&>(state);
    const Qwen3NextLayer& layer = layers_[size_t(l)];
    Backend& be = *backend_;
    Buffer x = ws_.x.rows_view(0, T), xn = ws_.xn.rows_view(0, T);
    Buffer out = ws_.ffn_out.rows_view(0, T);

    {
      ScopedTimer timer(be.times().attention);
      be.rmsnorm(x, layer.input_norm, norm_eps, x.cols, xn);
      if (layer.linear) {
        DeltaNetState state = seq.delta(l);
        linear_attention(layer.delta, xn, state, out);
      } else {
        gated_attention(layer.attn, xn, seq.k[size_t(l)], seq.v[size_t(l)], seq.n_past, out);
      }
      be.add(x, out);
    }
    be.rmsnorm(x, layer.post_attention_norm, norm_eps, x.cols, xn);
    if (layer.moe) {
      MoeParams p;
      p.n_experts = cfg_.n_experts;
      p.top_k = cfg_.top_k;
      p.router = RouterKind::SoftmaxTopK;
      p.norm_topk_prob = cfg_.norm_topk_prob;
      p.layer = l;
      be.moe(xn, layer.router, *experts_, p, out);
      ScopedTimer timer(be.times().dense_mlp);
      Buffer shared = shared_out_.rows_view(0, T), gate = shared_gate_.rows_view(0, T);
      be.mlp(xn, layer.shared, shared);
      be.linear(xn, layer.shared_gate, nullptr, gate);
      be.sigmoid_gate(shared, gate);
      be.add(out, shared);
    } else {
      ScopedTimer timer(be.times().dense_mlp);
      be.mlp(xn, layer.dense, out);
    }
    be.add(x, out);
  }

 private:
  static constexpr int64_t kMaxBatch = 128;  // tokens per forward batch (prefill chunk)

  // out (T, hidden) = Gated DeltaNet of x (T, hidden), continuing the layer's state.
  void linear_attention(const LinearAttention& d, const Buffer& x, DeltaNetState& state, Buffer& out) {
    Backend& be = *backend_;
    const int64_t T = x.rows;
    Buffer qkv = qkv_.rows_view(0, T), z = z_.rows_view(0, T), core = core_.rows_view(0, T);
    Buffer b = b_.rows_view(0, T), a = a_.rows_view(0, T);
    be.linear(x, d.qkv_proj, nullptr, qkv);
    be.linear(x, d.z_proj, nullptr, z);
    be.linear(x, d.b_proj, nullptr, b);
    be.linear(x, d.a_proj, nullptr, a);
    be.gated_delta_net(qkv, z, b, a, d.weights, cfg_.delta, state, core);
    be.linear(core, d.out_proj, nullptr, out);
  }

  // out (T, hidden) = gated attention of x (T, hidden); k/v appended to the caches at n_past.
  void gated_attention(const GatedAttention& a, const Buffer& x, Buffer& k_cache, Buffer& v_cache,
                       int64_t n_past, Buffer& out) {
    Backend& be = *backend_;
    const int64_t T = x.rows;
    Buffer q = ws_.q.rows_view(0, T), k = ws_.k.rows_view(0, T), v = ws_.v.rows_view(0, T);
    Buffer gate = gate_.rows_view(0, T);
    be.linear(x, a.q_proj, nullptr, q);
    be.linear(x, a.gate_proj, nullptr, gate);
    be.linear(x, a.k_proj, nullptr, k);
    be.linear(x, a.v_proj, nullptr, v);
    be.rmsnorm(q, a.q_norm, norm_eps, cfg_.head_dim, q);
    be.rmsnorm(k, a.k_norm, norm_eps, cfg_.head_dim, k);
    be.rope(q, cfg_.n_heads, cfg_.head_dim, rope_, n_past);
    be.rope(k, cfg_.n_kv_heads, cfg_.head_dim, rope_, n_past);
    AttentionParams p;
    p.n_heads = cfg_.n_heads;
    p.n_kv_heads = cfg_.n_kv_heads;
    p.head_dim = cfg_.head_dim;
    p.scale = 1.0f / std::sqrt(float(cfg_.head_dim));
    p.n_past = n_past;
    Buffer attn = ws_.attn_out.rows_view(0, T);
    attn.cols = q.cols;
    be.attention(q, k, v, k_cache, v_cache, p, attn);
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

  LinearAttention load_linear_attention(WeightLoader& w, const std::string& p) {
    const DeltaNetParams& dp = cfg_.delta;
    const int64_t h = cfg_.hidden_size, nv = dp.n_v_heads, nk = dp.n_k_heads;
    const int64_t dk = dp.k_head_dim, value_dim = cfg_.value_dim();
    LinearAttention d;
    if (cfg_.split_projections) {
      d.qkv_proj = w.matrix(p + "in_proj_qkv.weight", cfg_.conv_dim(), h);
      d.z_proj = w.matrix(p + "in_proj_z.weight", value_dim, h);
      d.b_proj = w.matrix(p + "in_proj_b.weight", nv, h);
      d.a_proj = w.matrix(p + "in_proj_a.weight", nv, h);
    } else {
      // in_proj_qkvz: per key head, [q (dk), k (dk), v (group * dv), z (group * dv)] rows;
      // in_proj_ba: per key head, [b (group), a (group)] rows. Value head g * group + j is the
      // j-th of key head g's group in both.
      const int64_t vg = value_dim / nk, stride = 2 * dk + 2 * vg, group = nv / nk;
      const std::string qkvz = p + "in_proj_qkvz.weight", ba = p + "in_proj_ba.weight";
      std::vector<RowRange> qkv = strided(nk, stride, 0, dk);
      for (const RowRange& r : strided(nk, stride, dk, dk)) qkv.push_back(r);
      for (const RowRange& r : strided(nk, stride, 2 * dk, vg)) qkv.push_back(r);
      d.qkv_proj = regrouped_rows(w, qkvz, nk * stride, h, qkv, regrouped_);
      d.z_proj = regrouped_rows(w, qkvz, nk * stride, h, strided(nk, stride, 2 * dk + vg, vg), regrouped_);
      d.b_proj = regrouped_rows(w, ba, 2 * nv, h, strided(nk, 2 * group, 0, group), regrouped_);
      d.a_proj = regrouped_rows(w, ba, 2 * nv, h, strided(nk, 2 * group, group, group), regrouped_);
    }
    d.out_proj = w.matrix(p + "out_proj.weight", h, value_dim);
    d.weights.conv = load_conv(w, p + "conv1d.weight", cfg_.conv_dim(), dp.conv_kernel);
    d.weights.A_log = w.vector(p + "A_log", nv);
    d.weights.dt_bias = w.vector(p + "dt_bias", nv);
    d.weights.norm = w.vector(p + "norm.weight", dp.v_head_dim);
    return d;
  }

  Qwen3NextConfig cfg_;
  std::string prefix_;  // "model.", "model.language_model." or "language_model.model."
  std::string head_;    // "lm_head." or "language_model.lm_head."
  bool mlx_norms_ = false;  // zero-centred norm weights stored as 1 + w (mlx-lm's layout)
  std::vector<Qwen3NextLayer> layers_;
  std::deque<std::vector<char>> regrouped_;  // storage of the regrouped fused weights
  std::unique_ptr<ExpertStore> experts_;
  RopeTable rope_;
  Buffer gate_, qkv_, z_, core_, b_, a_, shared_out_, shared_gate_;  // [kMaxBatch, ...] activations
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
