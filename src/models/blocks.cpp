#include "models/blocks.h"

#include <cmath>

#include "core/error.h"
#include "io/safetensors.h"

namespace moestream {

Matrix WeightLoader::matrix(const std::string& name, int64_t rows, int64_t cols) {
  const TensorView& t = weights_.get(name);
  const std::string module = name.size() > 7 && name.compare(name.size() - 7, 7, ".weight") == 0
                                 ? name.substr(0, name.size() - 7) : name;
  if (t.dtype == DType::U32 && weights_.has(module + ".scales")) {
    // Affine-quantized (MLX layout): the format follows from the shapes, since rows and cols
    // are known: bits = 32 * words / cols, group = cols / groups.
    const TensorView& scales = weights_.get(module + ".scales");
    const TensorView& biases = weights_.get(module + ".biases");
    if (t.shape.size() != 2 || scales.shape.size() != 2 || t.shape[0] != rows ||
        (t.shape[1] * 32) % cols != 0 || scales.shape[1] == 0 || cols % scales.shape[1] != 0)
      fail("tensor ", name, ": quantized shape ", shape_str(t.shape), " with scales ",
           shape_str(scales.shape), " does not fit a [", rows, ", ", cols, "] matrix");
    const QuantFormat f{int(t.shape[1] * 32 / cols), int(cols / scales.shape[1]), scales.dtype};
    if (quantization_) {
      const auto [bits, group] = quantization_(module);
      if (bits && (bits != f.bits || group != f.group_size))
        fail("tensor ", name, ": stored as ", f.bits, "-bit groups of ", f.group_size,
             " but config.json's quantization says ", bits, "-bit groups of ", group);
    }
    return backend_.load_quantized(t, scales, biases, f);
  }
  check_shape(t, {rows, cols});
  return backend_.load_matrix(t);
}

Vector WeightLoader::vector(const std::string& name, int64_t size) {
  const TensorView& t = weights_.get(name);
  check_shape(t, {size});
  return backend_.load_vector(t);
}

Vector WeightLoader::optional_vector(const std::string& name, int64_t size) {
  return has(name) ? vector(name, size) : Vector{};
}

bool WeightLoader::has(const std::string& name) const { return weights_.has(name); }

WeightLoader::QuantLookup quantization_lookup(const HfConfig& config) {
  const nlohmann::json& j = config.json();
  const char* key = j.contains("quantization") ? "quantization"
                    : j.contains("quantization_config") ? "quantization_config" : nullptr;
  if (!key || !j[key].is_object()) return {};
  const nlohmann::json q = j[key];
  return [q](const std::string& module) -> std::pair<int, int> {
    const int bits = q.value("bits", 0), group = q.value("group_size", 0);
    if (q.contains(module) && q[module].is_object())
      return {q[module].value("bits", bits), q[module].value("group_size", group)};
    return {bits, group};
  };
}

RopeTable make_rope_table(const RopeParams& p, int rot_dim, const std::string& config_path) {
  RopeTable r;
  r.rot_dim = rot_dim;
  r.inv_freq.resize(size_t(rot_dim / 2));
  // As transformers: inv_freq = 1 / base^(2i/dim), in float32.
  for (int i = 0; i < rot_dim / 2; ++i)
    r.inv_freq[size_t(i)] = 1.0f / std::pow(float(p.theta), float(2 * i) / float(rot_dim));
  if (p.type == "default") return r;
  if (p.type == "linear") {
    for (float& f : r.inv_freq) f /= float(p.factor);
    return r;
  }
  fail(config_path, ": rope type '", p.type, "' is not supported yet (supported: default, linear)");
}

GqaAttention GqaAttention::load(WeightLoader& w, const std::string& prefix, int64_t hidden,
                                int n_heads, int n_kv_heads, int head_dim, float norm_eps) {
  GqaAttention a;
  const int64_t q_dim = int64_t(n_heads) * head_dim, kv_dim = int64_t(n_kv_heads) * head_dim;
  a.q_proj = w.matrix(prefix + "q_proj.weight", q_dim, hidden);
  a.k_proj = w.matrix(prefix + "k_proj.weight", kv_dim, hidden);
  a.v_proj = w.matrix(prefix + "v_proj.weight", kv_dim, hidden);
  a.o_proj = w.matrix(prefix + "o_proj.weight", hidden, q_dim);
  a.q_bias = w.optional_vector(prefix + "q_proj.bias", q_dim);
  a.k_bias = w.optional_vector(prefix + "k_proj.bias", kv_dim);
  a.v_bias = w.optional_vector(prefix + "v_proj.bias", kv_dim);
  a.o_bias = w.optional_vector(prefix + "o_proj.bias", hidden);
  a.q_norm = w.optional_vector(prefix + "q_norm.weight", head_dim);
  a.k_norm = w.optional_vector(prefix + "k_norm.weight", head_dim);
  a.params.n_heads = n_heads;
  a.params.n_kv_heads = n_kv_heads;
  a.params.head_dim = head_dim;
  a.params.scale = 1.0f / std::sqrt(float(head_dim));
  a.norm_eps = norm_eps;
  return a;
}

void GqaAttention::forward(Backend& be, Workspace& ws, const Buffer& x, Buffer& k_cache,
                           Buffer& v_cache, int64_t n_past, const RopeTable& rope,
                           Buffer& out) const {
  const int64_t T = x.rows;
  Buffer q = ws.q.rows_view(0, T), k = ws.k.rows_view(0, T), v = ws.v.rows_view(0, T);
  be.linear(x, q_proj, q_bias ? &q_bias : nullptr, q);
  be.linear(x, k_proj, k_bias ? &k_bias : nullptr, k);
  be.linear(x, v_proj, v_bias ? &v_bias : nullptr, v);
  if (q_norm) be.rmsnorm(q, q_norm, norm_eps, params.head_dim, q);
  if (k_norm) be.rmsnorm(k, k_norm, norm_eps, params.head_dim, k);
  be.rope(q, params.n_heads, params.head_dim, rope, n_past);
  be.rope(k, params.n_kv_heads, params.head_dim, rope, n_past);
  AttentionParams p = params;
  p.n_past = n_past;
  Buffer attn = ws.attn_out.rows_view(0, T);
  attn.cols = q.cols;
  be.attention(q, k, v, k_cache, v_cache, p, attn);
  be.linear(attn, o_proj, o_bias ? &o_bias : nullptr, out);
}

KvSequence::KvSequence(Backend& be, int n_layers, int64_t capacity, int64_t kv_dim)
    : be_(be), capacity_(capacity) {
  for (int l = 0; l < n_layers; ++l) {
    k.push_back(be.alloc(capacity, kv_dim));
    v.push_back(be.alloc(capacity, kv_dim));
  }
}

KvSequence::~KvSequence() {
  for (auto& b : k) be_.free(b);
  for (auto& b : v) be_.free(b);
}

void DecoderModel::init_workspace(int64_t max_batch, int64_t q_dim, int64_t kv_dim) {
  Backend& be = *backend_;
  const int64_t h = info_.hidden_size;
  ws_.max_batch = max_batch;
  ws_.x = be.alloc(max_batch, h);
  ws_.xn = be.alloc(max_batch, h);
  ws_.attn_out = be.alloc(max_batch, std::max(h, q_dim));
  ws_.ffn_out = be.alloc(max_batch, h);
  ws_.q = be.alloc(max_batch, q_dim);
  ws_.k = be.alloc(max_batch, kv_dim);
  ws_.v = be.alloc(max_batch, kv_dim);
  ws_.logits = be.alloc(max_batch, info_.vocab_size);
}

void DecoderModel::forward(std::span<const int32_t> tokens, SequenceState& state,
                           std::span<float> logits) {
  const int64_t n = int64_t(tokens.size()), vocab = info_.vocab_size;
  const bool all = int64_t(logits.size()) == n * vocab;
  if (!all && int64_t(logits.size()) != vocab)
    fail("forward: logits span holds ", logits.size(), " floats, expected ", vocab, " or ", n * vocab);
  if (state.n_past + n > state.capacity())
    fail("context full: ", state.n_past + n, " positions needed, the sequence holds ", state.capacity());
  for (int32_t t : tokens)
    if (t < 0 || t >= vocab) fail("token id ", t, " out of range [0, ", vocab, ")");
  Backend& be = *backend_;
  for (int64_t begin = 0; begin < n; begin += ws_.max_batch) {
    const int64_t T = std::min(ws_.max_batch, n - begin);
    Buffer x = ws_.x.rows_view(0, T);
    {
      ScopedTimer timer(be.times().embed);
      be.embed(tokens.subspan(size_t(begin), size_t(T)), embed_tokens, x);
    }
    for (int l = 0; l < info_.n_layers; ++l) run_layer(l, T, state);
    state.n_past += T;
    const bool last_batch = begin + T == n;
    if (!all && !last_batch) continue;
    // Only the rows whose logits are wanted go through the norm and the output head.
    ScopedTimer timer(be.times().output_head);
    const int64_t first = all ? 0 : T - 1, rows = all ? T : 1;
    Buffer xs = ws_.x.rows_view(first, rows), xn = ws_.xn.rows_view(0, rows);
    be.rmsnorm(xs, final_norm, norm_eps, xs.cols, xn);
    Buffer out = ws_.logits.rows_view(0, rows);
    be.linear(xn, lm_head, nullptr, out);
    be.to_host(out, logits.data() + (all ? begin * vocab : 0));
  }
}

}  // namespace moestream
