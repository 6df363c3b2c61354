#include "models/decoder_config.h"

#include <cmath>

#include "core/error.h"

namespace moestream {

DecoderConfig DecoderConfig::parse(const HfConfig& c, const DecoderDefaults& d) {
  DecoderConfig m;
  m.config_path = c.path();
  m.model_type = c.model_type();
  m.vocab_size = c.get_int_in("vocab_size", 1, kMaxVocab);
  m.hidden_size = c.get_int_in("hidden_size", 1, kMaxWidth);
  m.n_layers = int(c.get_int_in("num_hidden_layers", 1, kMaxLayers));
  m.n_heads = int(c.get_int_in("num_attention_heads", 1, kMaxHeads));
  if (d.gqa) {
    m.n_kv_heads = int(c.get_int_in("num_key_value_heads", 1, m.n_heads, m.n_heads));
    if (m.n_heads % m.n_kv_heads != 0)
      fail(c.path(), ": field '", c.spelling("num_key_value_heads"), "' (", m.n_kv_heads,
           ") must divide num_attention_heads (", m.n_heads, ")");
    if (c.has("head_dim")) {
      m.head_dim = int(c.get_int_in("head_dim", 1, kMaxWidth));
    } else {
      // transformers' default; a remainder would leave part of the width in no head.
      if (m.hidden_size % m.n_heads != 0)
        fail(c.path(), ": hidden_size (", m.hidden_size, ") is not a multiple of num_attention_heads (",
             m.n_heads, ") and head_dim is not given");
      m.head_dim = int(m.hidden_size / m.n_heads);
    }
    if (m.head_dim % 2 != 0) fail(c.path(), ": field 'head_dim' must be even (rotary pairs), found ", m.head_dim);
  }
  m.intermediate_size = c.get_int_in("intermediate_size", 1, kMaxWidth, 0);
  m.expert_size = c.get_int_in(d.expert_size_field, 1, kMaxWidth);
  m.n_experts = int(c.get_int_in("num_experts", 1, kMaxExperts));
  const int64_t top_k = c.get_int("num_experts_per_tok");
  if (top_k < 1 || top_k > m.n_experts)
    fail(c.path(), ": field '", c.spelling("num_experts_per_tok"), "' must be in [1, ", c.spelling("num_experts"),
         " = ", m.n_experts, "], found ", top_k);
  m.top_k = int(top_k);
  m.norm_topk_prob = c.get_bool("norm_topk_prob", d.norm_topk_prob);
  m.tie_word_embeddings = c.get_bool("tie_word_embeddings", false);
  const double eps = c.get_double("rms_norm_eps", d.rms_norm_eps);
  if (!(eps >= 0 && eps < 1))
    fail(c.path(), ": field '", c.spelling("rms_norm_eps"), "' must be in [0, 1), found ", eps);
  m.rms_norm_eps = float(eps);
  m.max_position = c.get_int_in("max_position_embeddings", 1, kMaxPositions, d.max_position);
  m.rope = c.rope();
  return m;
}

int DecoderConfig::rot_dim() const {
  const int r = int(head_dim * rope.partial_rotary_factor);
  if (r <= 0 || r % 2 != 0 || r > head_dim)
    fail(config_path, ": head_dim (", head_dim, ") * partial_rotary_factor (", rope.partial_rotary_factor,
         ") must be a positive even number of dims");
  return r;
}

void DecoderConfig::check_dense_width(const std::function<bool(int)>& is_moe_layer) const {
  for (int l = 0; l < n_layers; ++l)
    if (!is_moe_layer(l) && intermediate_size <= 0)
      fail(config_path, ": layer ", l, " is dense but intermediate_size is missing");
}

SparseLayers SparseLayers::parse(const HfConfig& c, int n_layers) {
  SparseLayers s;
  s.step = int(c.get_int_in("decoder_sparse_step", 1, kMaxLayers, 1));
  s.mlp_only = c.get_int_list("mlp_only_layers");
  for (int64_t l : s.mlp_only)
    if (l < 0 || l >= n_layers)
      fail(c.path(), ": field 'mlp_only_layers' lists layer ", l, ", outside [0, num_hidden_layers = ", n_layers, ")");
  return s;
}

bool SparseLayers::is_moe(int l) const {
  for (int64_t m : mlp_only)
    if (m == l) return false;
  return (l + 1) % step == 0;
}

std::vector<bool> parse_layer_types(const HfConfig& c, int n_layers, const std::string& marked,
                                    const std::string& other) {
  const std::vector<std::string> types = c.get_string_list("layer_types");
  if (types.empty()) return {};
  if (int64_t(types.size()) != n_layers)
    fail(c.path(), ": layer_types has ", types.size(), " entries, num_hidden_layers is ", n_layers);
  std::vector<bool> out;
  for (const auto& t : types) {
    if (t != marked && t != other)
      fail(c.path(), ": layer_types entry '", t, "' is not supported (expected ", marked, " or ", other, ")");
    out.push_back(t == marked);
  }
  return out;
}

void check_silu(const HfConfig& c) {
  const std::string act = c.get_string("hidden_act", "silu");
  if (act != "silu") fail(c.path(), ": hidden_act '", act, "' is not supported (expected silu)");
}

void check_expert_groups(const HfConfig& c, int n_experts, int n_group, int topk_group) {
  if (n_experts % n_group != 0 || topk_group > n_group)
    fail(c.path(), ": n_group (", n_group, ") must divide n_routed_experts (", n_experts, ") and topk_group (",
         topk_group, ") must be in [1, n_group]");
}

}  // namespace moestream
