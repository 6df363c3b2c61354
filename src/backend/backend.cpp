// The argument checks every backend runs before it touches memory or launches work (see
// backend.h), written once so that the backends refuse the same things with the same words.
#include "backend/backend.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "core/error.h"
#include "core/quant.h"

namespace moestream {

namespace {

bool plain_dtype(DType d) { return d == DType::F32 || d == DType::BF16 || d == DType::F16; }

}  // namespace

void top_k_ids(std::span<const float> logits, int k, std::vector<int>& ids) {
  ids.resize(logits.size());
  std::iota(ids.begin(), ids.end(), 0);
  k = std::min(k, int(logits.size()));
  std::partial_sort(ids.begin(), ids.begin() + k, ids.end(), [&](int a, int b) {
    return logits[size_t(a)] > logits[size_t(b)] ||
           (logits[size_t(a)] == logits[size_t(b)] && a < b);
  });
  ids.resize(size_t(k));
}

void Backend::greedy_rows(const Buffer& x, std::span<int32_t> ids) {
  if (int64_t(ids.size()) != x.rows) fail("greedy_rows: ", ids.size(), " ids for ", x.rows, " rows");
  std::vector<float> host(size_t(x.rows * x.cols));
  to_host(x, host.data());
  for (int64_t r = 0; r < x.rows; ++r) {
    const float* row = host.data() + r * x.cols;
    int32_t best = -1;
    for (int64_t c = 0; c < x.cols; ++c) {
      if (std::isnan(row[c]) || row[c] == std::numeric_limits<float>::infinity()) {
        best = -1;
        break;
      }
      if (row[c] > -std::numeric_limits<float>::infinity() && (best < 0 || row[c] > row[best])) best = int32_t(c);
    }
    ids[size_t(r)] = best;
  }
}

void Backend::linear_shared_input(const Buffer& x, std::span<const Matrix* const> w,
                                  std::span<const Vector* const> bias, std::span<Buffer* const> out) {
  if (w.size() != bias.size() || w.size() != out.size())
    fail("linear_shared_input: ", w.size(), " matrices, ", bias.size(), " biases and ", out.size(), " outputs");
  for (size_t i = 0; i < w.size(); ++i) linear(x, *w[i], bias[i], *out[i]);
}

void Backend::add_rmsnorm(Buffer& x, const Buffer& y, const Vector& w, float eps, Buffer& out) {
  add(x, y);
  rmsnorm(x, w, eps, x.cols, out);
}

void Backend::expert_rows(const Buffer&, std::span<const ExpertRows>, const MoeParams&, Buffer&) {
  fail("expert_rows: the ", name(), " backend does not compute experts apart from a MoE call");
}

void Backend::gated_mlp_add(const Buffer& x, const MlpWeights& w, const Matrix& gate, Buffer& s, Buffer& g,
                            Buffer& out) {
  mlp(x, w, s);
  linear(x, gate, nullptr, g);
  sigmoid_gate(s, g);
  add(out, s);
}

void Backend::moe_gated_shared(const Buffer& x, const Matrix& router, ExpertProvider& experts, const MoeParams& p,
                               const MlpWeights& shared, const Matrix& gate, Buffer& s, Buffer& g, Buffer& out) {
  moe(x, router, experts, p, out);
  ScopedTimer timer(times().dense_mlp);
  gated_mlp_add(x, shared, gate, s, g, out);
}

void Backend::qk_norm_rope(Buffer& q, Buffer& k, const Vector& q_norm, const Vector& k_norm, float eps,
                           int n_heads, int n_kv_heads, int head_dim, const RopeTable& rope, int64_t n_past) {
  if (q_norm) rmsnorm(q, q_norm, eps, head_dim, q);
  if (k_norm) rmsnorm(k, k_norm, eps, head_dim, k);
  this->rope(q, n_heads, head_dim, rope, n_past);
  this->rope(k, n_kv_heads, head_dim, rope, n_past);
}

void Backend::attention_batch(Buffer& q, Buffer& k, const Buffer& v, const Vector& q_norm, const Vector& k_norm,
                              float eps, const RopeTable& rope, std::span<const AttentionSpan> spans,
                              const AttentionParams& p, Buffer& out) {
  for (const AttentionSpan& s : spans) {
    Buffer qs = q.rows_view(s.row0, s.rows), ks = k.rows_view(s.row0, s.rows), vs = v.rows_view(s.row0, s.rows);
    qk_norm_rope(qs, ks, q_norm, k_norm, eps, p.n_heads, p.n_kv_heads, p.head_dim, rope, s.n_past);
    AttentionParams ps = p;
    ps.n_past = s.n_past;
    Buffer os = out.rows_view(s.row0, s.rows);
    attention(qs, ks, vs, *s.k_cache, *s.v_cache, ps, os);
  }
}

void check_matrix_tensor(const TensorView& t) {
  if (t.shape.size() != 2) fail("tensor ", t.name, ": expected a matrix, found shape ", shape_str(t.shape));
  if (!plain_dtype(t.dtype)) fail("tensor ", t.name, ": dtype ", dtype_name(t.dtype), " is not supported for matrices");
}

void check_vector_tensor(const TensorView& t) {
  if (t.shape.size() != 1) fail("tensor ", t.name, ": expected a vector, found shape ", shape_str(t.shape));
  if (!plain_dtype(t.dtype)) fail("tensor ", t.name, ": dtype ", dtype_name(t.dtype), " is not supported for vectors");
}

Matrix quantized_matrix_view(const TensorView& words, const TensorView& scales, const TensorView& biases,
                             const QuantFormat& f) {
  if (f.scheme == QuantScheme::Fp8) {
    if (words.dtype != DType::F8_E4M3 || words.shape.size() != 2)
      fail("tensor ", words.name, ": FP8 weights must be an F8_E4M3 matrix, found ", dtype_name(words.dtype), " ",
           shape_str(words.shape));
    // The FP8 kernels read no biases: a bias tensor would be dropped, so it is an error.
    if (biases.data) fail("tensor ", words.name, ": FP8 weights have no biases, found ", biases.name);
    const int64_t rows = words.shape[0], cols = words.shape[1];
    check_quant_shape(f, cols, words.name);
    check_tensor(scales, DType::F32, {rows, quant_groups_per_row(f, cols)});
    Matrix m{words.name, DType::F8_E4M3, words.data, rows, cols};
    m.quant = f;
    m.scales = scales.data;
    return m;
  }
  // MXFP4 matrices reach a backend only as routed experts (ExpertProvider views), never through here.
  if (f.scheme != QuantScheme::Affine)
    fail("tensor ", words.name, ": load_quantized takes MLX affine or FP8 matrices, not ", quant_format_name(f));
  if (words.dtype != DType::U32 || words.shape.size() != 2)
    fail("tensor ", words.name, ": quantized weights must be a U32 matrix, found ", dtype_name(words.dtype), " ",
         shape_str(words.shape));
  const int64_t rows = words.shape[0], cols = words.shape[1] * 32 / f.bits;
  check_quant_shape(f, cols, words.name);
  const std::vector<int64_t> groups{rows, cols / f.group_size};
  check_tensor(scales, f.scale_dtype, groups);
  check_tensor(biases, f.scale_dtype, groups);
  Matrix m{words.name, DType::U32, words.data, rows, cols};
  m.quant = f;
  m.scales = scales.data;
  m.biases = biases.data;
  return m;
}

void check_copy_rows(const Buffer& src, const Buffer& dst, int64_t rows) {
  if (src.cols != dst.cols || rows < 0 || rows > src.rows || rows > dst.rows)
    fail("copy_rows: ", rows, " rows from a [", src.rows, ", ", src.cols, "] buffer into a [", dst.rows, ", ",
         dst.cols, "] one");
  const size_t n = size_t(rows * src.cols);
  if (n != 0 && src.data < dst.data + n && dst.data < src.data + n) fail("copy_rows: source and destination overlap");
}

void check_embed_args(std::span<const int32_t> tokens, const Matrix& table, const Buffer& out) {
  if (out.rows < int64_t(tokens.size()) || out.cols != table.cols)
    fail("embed: ", tokens.size(), " tokens of ", table.name, " [", table.rows, ", ", table.cols,
         "] do not fit an output of [", out.rows, ", ", out.cols, "]");
  for (int32_t t : tokens)
    if (t < 0 || t >= table.rows) fail("token id ", t, " out of range [0, ", table.rows, ")");
}

void check_attention_args(const Buffer& q, const Buffer& k, const Buffer& v, const Buffer& k_cache,
                          const Buffer& v_cache, const AttentionParams& p) {
  const int hd = p.head_dim, vd = p.v_head_dim ? p.v_head_dim : p.head_dim;
  const int64_t T = q.rows, kv_dim = int64_t(p.n_kv_heads) * hd, v_dim = int64_t(p.n_kv_heads) * vd;
  const KvCacheSpec& kv = p.kv;
  if (kv.window < 0 || kv.sinks < 0 || (kv.window == 0 && kv.sinks > 0))
    fail("attention: KV window ", kv.window, " with ", kv.sinks, " sinks (sinks need a window > 0)");
  const bool ring = kv.window > 0 && kv.ring && k_cache.rows == kv.sinks + kv.window;
  if (!ring && p.n_past + T > k_cache.rows)
    fail("context full: ", p.n_past + T, " positions needed, cache holds ", k_cache.rows);
  const int64_t k_words = kv_row_words(kv.type, kv_dim, p.n_kv_heads);
  const int64_t v_words = kv_row_words(kv.type, v_dim, p.n_kv_heads);
  if (k.cols != kv_dim || k_cache.cols != k_words ||
      (p.values_in_keys ? vd > hd : v.cols != v_dim || v_cache.cols != v_words || v_cache.rows != k_cache.rows))
    fail("attention: k/v widths ", k.cols, "/", v.cols, " (", kv_type_name(kv.type), " caches ", k_cache.cols, "/",
         v_cache.cols, " words) do not match ", p.n_kv_heads, " heads of ", hd, "/", vd);
}

}  // namespace moestream
