#include "models/moe_decoder.h"

#include "core/error.h"
#include "io/hf_config.h"
#include "io/pack.h"
#include "io/safetensors.h"

namespace moestream {

void MoeFeedForward::forward(Backend& be, ExpertStore& experts, Workspace& ws, int l, const Buffer& xn,
                             Buffer& x) const {
  const int64_t T = x.rows;
  Buffer out = ws.ffn_out.rows_view(0, T);
  if (!moe) {
    ScopedTimer timer(be.times().dense_mlp);
    be.mlp(xn, dense, out);
    be.add(x, out);
    return;
  }
  MoeParams p = routing;
  p.layer = l;
  p.router_bias = router_bias ? &router_bias : nullptr;
  be.moe(xn, router, experts, p, out);
  be.add(x, out);
  if (!shared.gate) return;
  Buffer s{ws.attn_out.data, T, x.cols};  // attention is done with attn_out
  {
    ScopedTimer timer(be.times().dense_mlp);
    be.mlp(xn, shared, s);
  }
  be.add(x, s);
}

MoeFeedForward routed_ffn(Matrix router, const MoeParams& routing, Vector router_bias) {
  MoeFeedForward f;
  f.moe = true;
  f.router = std::move(router);
  f.router_bias = std::move(router_bias);
  f.routing = routing;
  return f;
}

MoeFeedForward load_shared_expert_ffn(WeightLoader& w, const std::string& p, bool moe, int64_t hidden,
                                      int64_t dense_inter, int64_t shared_inter, const MoeParams& routing) {
  MoeFeedForward f;
  f.moe = moe;
  if (!moe) {
    f.dense = load_mlp(w, p + "mlp.", hidden, dense_inter);
    return f;
  }
  f.router = w.matrix(p + "mlp.gate.weight", routing.n_experts, hidden);
  f.router_bias = w.vector(p + "mlp.gate.e_score_correction_bias", routing.n_experts);
  f.shared = load_mlp(w, p + "mlp.shared_experts.", hidden, shared_inter);
  f.routing = routing;
  return f;
}

MoeParams sigmoid_group_routing(int n_experts, int top_k, bool norm_topk_prob, int n_group, int topk_group,
                                float routed_scaling_factor) {
  MoeParams p;
  p.n_experts = n_experts;
  p.top_k = top_k;
  p.router = RouterKind::SigmoidGroupTopK;
  p.norm_topk_prob = norm_topk_prob;
  p.n_group = n_group;
  p.topk_group = topk_group;
  p.routed_scaling_factor = routed_scaling_factor;
  return p;
}

void check_silu(const HfConfig& c) {
  const std::string act = c.get_string("hidden_act", "silu");
  if (act != "silu") fail(c.path(), ": hidden_act '", act, "' is not supported (expected silu)");
}

void check_gqa_heads(const HfConfig& c, int n_heads, int n_kv_heads) {
  if (n_heads <= 0 || n_kv_heads <= 0 || n_heads % n_kv_heads != 0)
    fail(c.path(), ": num_attention_heads (", n_heads, ") must be a positive multiple of num_key_value_heads (",
         n_kv_heads, ")");
}

void check_head_dim(const HfConfig& c, int head_dim) {
  if (head_dim <= 0 || head_dim % 2 != 0) fail(c.path(), ": head_dim must be positive and even, found ", head_dim);
}

void check_top_k(const HfConfig& c, int top_k, int n_experts, const char* experts_field) {
  if (top_k <= 0 || top_k > n_experts)
    fail(c.path(), ": num_experts_per_tok (", top_k, ") must be in [1, ", experts_field, " = ", n_experts, "]");
}

void check_expert_groups(const HfConfig& c, int n_experts, int n_group, int topk_group) {
  if (n_group <= 0 || n_experts % n_group != 0 || topk_group <= 0 || topk_group > n_group)
    fail(c.path(), ": n_group (", n_group, ") must divide n_routed_experts (", n_experts, ") and topk_group (",
         topk_group, ") must be in [1, n_group]");
}

std::unique_ptr<SequenceState> MoeDecoder::new_sequence(int64_t capacity) {
  return std::make_unique<KvSequence>(*backend_, int(layers_.size()), capacity, kv_dim_);
}

MoeDecoderLayer MoeDecoder::load_layer(WeightLoader& w, int l, const AttentionShape& shape) {
  attention_shape_ = shape;
  const std::string p = layer_prefix(l);
  const int64_t h = info_.hidden_size;
  MoeDecoderLayer layer;
  layer.input_norm = w.vector(p + "input_layernorm.weight", h);
  layer.post_attention_norm = w.vector(p + "post_attention_layernorm.weight", h);
  layer.attn = GqaAttention::load(w, p + "self_attn.", h, shape.n_heads, shape.n_kv_heads, shape.head_dim,
                                  norm_eps, shape.options);
  return layer;
}

void MoeDecoder::finish_load(const HfConfig& hf, const ModelOptions& options, const RopeParams& rope,
                             const ExpertShape& e) {
  const AttentionShape& a = attention_shape_;
  std::vector<bool> moe_layers;
  for (const MoeDecoderLayer& layer : layers_) moe_layers.push_back(layer.ffn.moe);
  check_pack_experts(pack_, moe_layers, e.n_experts, info_.hidden_size, e.intermediate, e.tensor_name);
  experts_ = make_expert_store(pack_, *backend_, options.experts);
  rope_ = make_rope_table(rope, a.rot_dim > 0 ? a.rot_dim : a.head_dim, hf.path());
  kv_dim_ = int64_t(a.n_kv_heads) * a.head_dim;
  init_workspace(kMaxBatch, int64_t(a.n_heads) * a.head_dim, kv_dim_);
  set_weight_bytes(info_, *weights_, pack_, moe_layers, e.n_experts, e.top_k);
}

void MoeDecoder::run_layer(int l, int64_t T, SequenceState& state) {
  auto& seq = static_cast<KvSequence&>(state);
  const MoeDecoderLayer& layer = layers_[size_t(l)];
  Buffer x = ws_.x.rows_view(0, T), xn = ws_.xn.rows_view(0, T);
  attention_residual(layer.input_norm, layer.attn, seq, l, rope_, T);
  backend_->rmsnorm(x, layer.post_attention_norm, norm_eps, x.cols, xn);
  layer.ffn.forward(*backend_, *experts_, ws_, l, xn, x);
}

}  // namespace moestream
