#include "models/blocks.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "backend/backend_factory.h"
#include "core/error.h"
#include "core/quant.h"
#include "io/pack.h"
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
  if (t.dtype == DType::F8_E4M3) {
    // Block-scaled FP8 (DeepSeek-V3 / Kimi-K2), as a pack stores it: <module>.scales F32
    // [rows, ceil(cols / G)], G from config.json's quantization_config.weight_block_size.
    check_shape(t, {rows, cols});
    return backend_.load_quantized(t, weights_.get(module + ".scales"), TensorView{}, fp8_format(fp8_group(name, module)));
  }
  check_shape(t, {rows, cols});
  return backend_.load_matrix(t);
}

int WeightLoader::fp8_group(const std::string& name, const std::string& module) const {
  const int group = quantization_ ? quantization_(module).second : 0;
  if (!weights_.has(module + ".scales") || group <= 0)
    fail("tensor ", name, ": FP8 weights need ", module, ".scales and config.json's quantization_config "
         "{quant_method: fp8, weight_block_size} (pack the checkpoint with moestream)");
  return group;
}

std::vector<float> WeightLoader::dense_f32(const std::string& name, int64_t rows, int64_t cols) const {
  const TensorView& t = weights_.get(name);
  check_shape(t, {rows, cols});
  std::vector<float> out(size_t(rows * cols));
  switch (t.dtype) {
    case DType::F32: std::copy(t.as<float>(), t.as<float>() + rows * cols, out.begin()); break;
    case DType::BF16: for (int64_t i = 0; i < rows * cols; ++i) out[size_t(i)] = bf16_to_f32(t.as<uint16_t>()[i]); break;
    case DType::F16: for (int64_t i = 0; i < rows * cols; ++i) out[size_t(i)] = f16_to_f32(t.as<uint16_t>()[i]); break;
    case DType::F8_E4M3: {
      const std::string module = name.substr(0, name.size() - 7);
      const int group = fp8_group(name, module);
      const TensorView& scales = weights_.get(module + ".scales");
      const int64_t groups = quant_groups_per_row(fp8_format(group), cols);
      check_shape(scales, {rows, groups});
      for (int64_t r = 0; r < rows; ++r)
        dequantize_fp8_row(cols, group, t.as<uint8_t>() + r * cols, scales.as<float>() + r * groups,
                           out.data() + r * cols);
      break;
    }
    default: fail("tensor ", name, ": dtype ", dtype_name(t.dtype), " is not supported here (bf16, f16, f32 or fp8)");
  }
  return out;
}

Matrix WeightLoader::matrix_rows(const std::string& name, int64_t rows, int64_t cols, int64_t row0, int64_t n,
                                 const std::string& label) {
  const TensorView& t = weights_.get(name);
  check_shape(t, {rows, cols});
  if (row0 < 0 || n <= 0 || row0 + n > rows) fail("tensor ", name, ": rows [", row0, ", ", row0 + n, ") out of range");
  const size_t elem = dtype_size(t.dtype);
  const TensorView part{label, t.dtype, {n, cols}, static_cast<const char*>(t.data) + size_t(row0 * cols) * elem,
                        size_t(n * cols) * elem};
  if (t.dtype != DType::F8_E4M3) return backend_.load_matrix(part);
  const std::string module = name.substr(0, name.size() - 7);
  const QuantFormat f = fp8_format(fp8_group(name, module));
  const TensorView& scales = weights_.get(module + ".scales");
  const int64_t groups = quant_groups_per_row(f, cols);
  check_shape(scales, {rows, groups});
  const TensorView part_scales{label + " scales", DType::F32, {n, groups}, scales.as<float>() + row0 * groups,
                               size_t(n * groups) * sizeof(float)};
  return backend_.load_quantized(part, part_scales, TensorView{}, f);
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
  if (q.value("quant_method", "") == "fp8") {  // checked when the checkpoint was packed
    const int group = q.contains("weight_block_size") && q["weight_block_size"].is_array() &&
                              q["weight_block_size"].size() == 2 && q["weight_block_size"][1].is_number_integer()
                          ? q["weight_block_size"][1].get<int>() : 0;
    return [group](const std::string&) { return std::pair{8, group}; };
  }
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
  if (p.type == "yarn") {
    // YaRN: high-frequency pairs keep their frequency (extrapolation), low-frequency ones are
    // divided by factor (interpolation), with a linear ramp between the correction dims.
    if (p.original_max_position <= 0)
      fail(config_path, ": yarn rope needs original_max_position_embeddings");
    const double dim = rot_dim, base = p.theta, orig = p.original_max_position;
    const auto correction_dim = [&](double rotations) {
      return dim * std::log(orig / (rotations * 2 * M_PI)) / (2 * std::log(base));
    };
    double low = correction_dim(p.beta_fast), high = correction_dim(p.beta_slow);
    if (p.truncate) low = std::floor(low), high = std::ceil(high);
    low = std::max(low, 0.0), high = std::min(high, dim - 1);
    if (low == high) high += 0.001;
    for (int i = 0; i < rot_dim / 2; ++i) {
      const float pos_freq = std::pow(float(base), float(2 * i) / float(rot_dim));
      const float ramp = std::clamp((float(i) - float(low)) / float(high - low), 0.0f, 1.0f);
      const float extrapolation = 1.0f - ramp;
      r.inv_freq[size_t(i)] = 1.0f / (float(p.factor) * pos_freq) * (1.0f - extrapolation) +
                              1.0f / pos_freq * extrapolation;
    }
    if (p.attention_factor)
      r.attention_factor = float(*p.attention_factor);
    else if (p.mscale && p.mscale_all_dim && *p.mscale && *p.mscale_all_dim)
      r.attention_factor = float(yarn_mscale(p.factor, *p.mscale) / yarn_mscale(p.factor, *p.mscale_all_dim));
    else
      r.attention_factor = float(yarn_mscale(p.factor, 1.0));
    return r;
  }
  fail(config_path, ": rope type '", p.type, "' is not supported yet (supported: default, linear, yarn)");
}

double yarn_mscale(double factor, double mscale) {
  return factor <= 1 ? 1.0 : 0.1 * mscale * std::log(factor) + 1.0;
}

GqaAttention GqaAttention::load(WeightLoader& w, const std::string& prefix, int64_t hidden,
                                int n_heads, int n_kv_heads, int head_dim, float norm_eps,
                                const GqaOptions& options) {
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
  a.q_norm = w.optional_vector(prefix + "q_norm.weight", options.qk_norm_whole ? q_dim : head_dim);
  a.k_norm = w.optional_vector(prefix + "k_norm.weight", options.qk_norm_whole ? kv_dim : head_dim);
  a.sinks = w.optional_vector(prefix + "sinks", n_heads);
  a.options = options;
  a.params.sliding_window = options.sliding_window;
  a.params.n_heads = n_heads;
  a.params.n_kv_heads = n_kv_heads;
  a.params.head_dim = head_dim;
  a.params.scale = 1.0f / std::sqrt(float(head_dim));
  a.norm_eps = norm_eps;
  return a;
}

void GqaAttention::forward(Backend& be, Workspace& ws, const Buffer& x, std::span<const RowSpan> seqs, int l,
                           const RopeTable& rope, Buffer& out) const {
  const int64_t T = x.rows;
  Buffer q = ws.q.rows_view(0, T), k = ws.k.rows_view(0, T), v = ws.v.rows_view(0, T);
  const Matrix* w[3] = {&q_proj, &k_proj, &v_proj};
  const Vector* b[3] = {q_bias ? &q_bias : nullptr, k_bias ? &k_bias : nullptr, v_bias ? &v_bias : nullptr};
  Buffer* o[3] = {&q, &k, &v};
  be.linear_shared_input(x, w, b, o);
  // Per-head q/k norms go with RoPE in one step; a whole-vector norm or a clamp between them not.
  const bool fused = !options.qk_norm_whole && options.clip_qkv <= 0;
  if (!fused) {
    if (q_norm) be.rmsnorm(q, q_norm, norm_eps, options.qk_norm_whole ? q.cols : params.head_dim, q);
    if (k_norm) be.rmsnorm(k, k_norm, norm_eps, options.qk_norm_whole ? k.cols : params.head_dim, k);
    if (options.clip_qkv > 0) {
      be.clamp(q, options.clip_qkv);
      be.clamp(k, options.clip_qkv);
      be.clamp(v, options.clip_qkv);
    }
  }
  Buffer attn = ws.attn_out.rows_view(0, T);
  attn.cols = q.cols;
  AttentionParams p = params;
  p.sinks = sinks ? &sinks : nullptr;
  p.kv = ws.kv;
  if (fused) {
    ws.attention_spans.clear();
    for (const RowSpan& s : seqs) {
      auto& seq = static_cast<KvSequence&>(*s.state);
      ws.attention_spans.push_back({s.row0, s.rows, seq.n_past, &seq.k[size_t(l)], &seq.v[size_t(l)]});
    }
    be.attention_batch(q, k, v, q_norm, k_norm, norm_eps, rope, ws.attention_spans, p, attn);
  } else {
    for (const RowSpan& s : seqs) {
      auto& seq = static_cast<KvSequence&>(*s.state);
      Buffer qs = q.rows_view(s.row0, s.rows), ks = k.rows_view(s.row0, s.rows), vs = v.rows_view(s.row0, s.rows);
      be.rope(qs, params.n_heads, params.head_dim, rope, seq.n_past);
      be.rope(ks, params.n_kv_heads, params.head_dim, rope, seq.n_past);
      p.n_past = seq.n_past;
      Buffer as = attn.rows_view(s.row0, s.rows);
      be.attention(qs, ks, vs, seq.k[size_t(l)], seq.v[size_t(l)], p, as);
    }
  }
  be.linear(attn, o_proj, o_bias ? &o_bias : nullptr, out);
}

MlpWeights load_mlp(WeightLoader& w, const std::string& prefix, int64_t hidden, int64_t inter) {
  MlpWeights m;
  m.gate = w.matrix(prefix + "gate_proj.weight", inter, hidden);
  m.up = w.matrix(prefix + "up_proj.weight", inter, hidden);
  m.down = w.matrix(prefix + "down_proj.weight", hidden, inter);
  return m;
}

void check_pack_experts(const PackManifest& pack, const std::vector<bool>& moe_layers, int n_experts,
                        int64_t hidden, int64_t inter,
                        const std::function<std::string(int, int, const std::string&)>& tensor_name) {
  for (size_t l = 0; l < moe_layers.size(); ++l) {
    const bool packed = l < pack.layers.size() && !pack.layers[l].empty();
    if (packed != moe_layers[l])
      fail(pack.dir, ": layer ", l, moe_layers[l] ? " needs routed experts, the pack has none"
                                                  : " is dense in config.json but the pack has experts for it");
    if (!packed) continue;
    if (int(pack.layers[l].size()) != n_experts)
      fail(pack.dir, ": layer ", l, " has ", pack.layers[l].size(), " experts, config.json says ", n_experts);
    for (int e = 0; e < n_experts; ++e)
      for (const std::string role : {"gate", "up", "down"}) {
        const std::vector<int64_t> want = role == "down" ? std::vector<int64_t>{hidden, inter}
                                                          : std::vector<int64_t>{inter, hidden};
        const std::vector<int64_t> got = pack.expert(int(l), e).logical_shape(role);
        if (got != want)
          fail("tensor ", tensor_name(int(l), e, role), ": expected shape ", shape_str(want), ", found ",
               shape_str(got));
      }
  }
}

int64_t unread_embedding_bytes(const WeightSet& weights) {
  const auto& names = weights.names();
  const auto ends_with = [](const std::string& s, const std::string& tail) {
    return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
  };
  if (std::none_of(names.begin(), names.end(), [&](const std::string& n) { return ends_with(n, "lm_head.weight"); }))
    return 0;  // tied: the table is read whole as the output head
  int64_t unread = 0;
  for (const auto& name : names) {
    if (name.find("embed_tokens.") == std::string::npos || name.rfind("mtp", 0) == 0) continue;
    const TensorView& t = weights.get(name);  // the table, or its scales and biases: a row per token id
    if (!t.shape.empty() && t.shape[0] > 0) unread += int64_t(t.nbytes) - int64_t(t.nbytes) / t.shape[0];
  }
  return unread;
}

void set_weight_bytes(ModelInfo& info, const WeightSet& weights, const PackManifest& pack,
                      const std::vector<bool>& moe_layers, int n_experts, int top_k) {
  int64_t dense_bytes = 0;
  for (const auto& name : weights.names()) dense_bytes += int64_t(weights.get(name).nbytes);
  const int64_t expert_bytes = int64_t(pack.total_expert_bytes());
  const int64_t n_moe = std::count(moe_layers.begin(), moe_layers.end(), true);
  info.weight_bytes = dense_bytes + expert_bytes;
  info.active_bytes_per_token = dense_bytes - unread_embedding_bytes(weights) +
                                (n_moe ? expert_bytes / (n_moe * n_experts) * n_moe * top_k : 0);
}

KvSequence::KvSequence(Backend& be, int n_layers, int64_t capacity, int64_t kv_dim, const KvCacheSpec& kv, int heads)
    : KvSequence(be, n_layers, capacity, kv_dim, kv_dim, kv, heads) {}

KvSequence::KvSequence(Backend& be, int n_layers, int64_t capacity, int64_t k_dim, int64_t v_dim,
                       const KvCacheSpec& kv, int heads)
    : be_(be), capacity_(capacity), k_dim_(k_dim), v_dim_(v_dim), kv_(kv), heads_(heads) {
  for (int l = 0; l < n_layers; ++l) {
    k.push_back(alloc_kv_cache(be, kv, capacity, k_dim, heads));
    v.push_back(alloc_kv_cache(be, kv, capacity, v_dim, heads));
  }
  reserve(capacity);  // a new sequence holds its capacity until trim() (the engine trims its slots)
}

KvSequence::~KvSequence() {
  for (auto& b : k) be_.free(b);
  for (auto& b : v) be_.free(b);
}

std::unique_ptr<SequenceState> KvSequence::clone(int64_t capacity) const {
  if (capacity < n_past) fail("clone: capacity ", capacity, " cannot hold the ", n_past, " positions computed");
  auto copy = std::make_unique<KvSequence>(be_, int(k.size()), capacity, k_dim_, v_dim_, kv_, heads_);
  copy->restore(*this);
  return copy;
}

void KvSequence::restore(const SequenceState& snapshot) { restore_prefix(snapshot, snapshot.n_past); }

void KvSequence::restore_prefix(const SequenceState& snapshot, int64_t n) {
  if (&snapshot == this) return truncate(n);
  const auto* s = dynamic_cast<const KvSequence*>(&snapshot);
  if (!s) fail("restore: the snapshot is not a KV-cache sequence state (it comes from another model)");
  if (n < s->n_past && !s->can_truncate(n)) fail_truncate(n, s->n_past);
  n = std::min(n, s->n_past);
  check_restore(be_, s->be_, capacity_, n);
  reserve(n);
  const int64_t rows = kv_rows_used(s->k, n);  // a ring's rows that position n reads are intact (can_truncate)
  copy_state_rows(be_, s->k, k, rows, "K cache");
  copy_state_rows(be_, s->v, v, rows, "V cache");
  n_past = n;
}

void KvSequence::seal() { KvReservation::seal(be_, k, v, n_past); }

bool KvSequence::can_truncate(int64_t n) const {
  return kv_can_truncate(kv_, k.empty() ? capacity_ : k[0].rows, n, n_past);
}

void KvSequence::truncate(int64_t n) {
  if (n >= 0 && n <= n_past && !can_truncate(n))
    fail("truncate: the KV window's ring has reused rows that position ", n, " reads (n_past ", n_past,
         "); restore a snapshot taken at that length instead");
  if (!can_truncate(n)) fail_truncate(n, n_past);
  n_past = n;
}

Buffer alloc_kv_cache(Backend& be, const KvCacheSpec& kv, int64_t capacity, int64_t cols, int heads) {
  const int64_t rows = kv_cache_rows(kv, capacity), words = kv_row_words(kv.type, cols, heads);
  return kv.growable ? be.alloc_growable(rows, words) : be.alloc(rows, words);
}

void KvReservation::reserve(Backend& be, const KvCacheSpec& kv, std::vector<Buffer>& k, std::vector<Buffer>& v,
                            int64_t n) {
  if (n <= positions) return;
  for (auto* caches : {&k, &v})
    for (Buffer& b : *caches)
      if (b.data) be.commit_rows(b, std::min(b.rows, kv_cache_rows(kv, n)));
  positions = n;
}

void KvReservation::trim(Backend& be, const KvCacheSpec& kv, std::vector<Buffer>& k, std::vector<Buffer>& v,
                         int64_t n_past) {
  if (positions <= n_past) return;
  for (auto* caches : {&k, &v})
    for (Buffer& b : *caches)
      if (b.data) be.decommit_rows(b, std::min(b.rows, kv_cache_rows(kv, n_past)));
  positions = n_past;
}

int64_t KvReservation::bytes_at(const Backend& be, const KvCacheSpec& kv, const std::vector<Buffer>& k,
                                const std::vector<Buffer>& v, int64_t n) {
  int64_t bytes = 0;
  for (const auto* caches : {&k, &v})
    for (const Buffer& b : *caches)
      if (b.data)
        bytes += std::max<int64_t>(0, be.growable_bytes(std::min(b.rows, kv_cache_rows(kv, n)), b.cols) - be.lent_bytes(b));
  return bytes;
}

void KvReservation::seal(Backend& be, std::vector<Buffer>& k, std::vector<Buffer>& v, int64_t n) {
  const int64_t rows = kv_rows_used(k, n);
  for (auto* caches : {&k, &v})
    for (Buffer& b : *caches)
      if (b.data) be.seal_rows(b, rows);
}

void KvReservation::own(Backend& be, const KvCacheSpec& kv, std::vector<Buffer>& k, std::vector<Buffer>& v,
                        int64_t n_past) {
  const int64_t row = kv.window > 0 && kv.ring ? std::min(n_past, kv.sinks) : n_past;
  for (auto* caches : {&k, &v})
    for (Buffer& b : *caches)
      if (b.data) be.own_rows(b, row);
}

int64_t KvSequence::bytes() const { return state_bytes(k) + state_bytes(v); }
void KvSequence::reserve(int64_t positions) {
  reserved_.reserve(be_, kv_, k, v, std::min(positions, capacity_));
  KvReservation::own(be_, kv_, k, v, n_past);
}
void KvSequence::trim() { reserved_.trim(be_, kv_, k, v, n_past); }
int64_t KvSequence::held_bytes() const { return bytes_at(reserved_.positions); }
int64_t KvSequence::bytes_at(int64_t positions) const {
  return KvReservation::bytes_at(be_, kv_, k, v, std::min(positions, capacity_));
}

void copy_state_rows(Backend& be, const std::vector<Buffer>& src, std::vector<Buffer>& dst,
                     int64_t rows, const char* what) {
  if (src.size() != dst.size())
    fail("restore: the snapshot has ", src.size(), " ", what, " buffers, this state ", dst.size(),
         " (another model)");
  for (size_t l = 0; l < src.size(); ++l) {
    const Buffer& a = src[l];
    Buffer& b = dst[l];
    if ((a.data == nullptr) != (b.data == nullptr) || a.cols != b.cols)
      fail("restore: layer ", l, "'s ", what, " has ", a.data ? a.cols : 0, " columns in the snapshot, ",
           b.data ? b.cols : 0, " in this state (another model)");
    if (!a.data) continue;
    if (rows > a.rows || rows > b.rows)
      fail("restore: ", rows, " rows of layer ", l, "'s ", what, " do not fit (snapshot ", a.rows,
           " rows, this state ", b.rows, ")");
    be.copy_rows(a, b, rows);
  }
}

int64_t state_bytes(const std::vector<Buffer>& buffers) {
  int64_t n = 0;
  for (const Buffer& b : buffers) n += b.rows * b.cols * int64_t(sizeof(float));
  return n;
}

void check_restore(const Backend& mine, const Backend& theirs, int64_t capacity, int64_t snapshot_n_past) {
  if (&mine != &theirs) fail("restore: the snapshot belongs to another model instance");
  if (snapshot_n_past > capacity)
    fail("restore: the snapshot holds ", snapshot_n_past, " positions, this sequence has room for ", capacity);
}

void fail_truncate(int64_t n, int64_t n_past) {
  if (n < 0 || n > n_past) fail("truncate: cannot keep ", n, " positions of a sequence at n_past ", n_past);
  fail("truncate: this model's linear-attention layers fold every position into a recurrent state, so a "
       "sequence at n_past ", n_past, " can only be kept whole or reset to 0, not cut to ", n,
       " (restore a snapshot taken at that length instead)");
}

void MoeFeedForward::forward(Backend& be, ExpertStore& experts, Workspace& ws, int l, const Buffer& xn,
                             Buffer& x, std::span<const LookaheadGuess> ahead, const Vector* next_norm,
                             float eps) const {
  const int64_t T = x.rows;
  Buffer out = ws.ffn_out.rows_view(0, T);
  // x += y, the last step of every branch; with next_norm also the next layer's normalized input.
  auto residual = [&](const Buffer& y) {
    if (!next_norm) return be.add(x, y);
    Buffer next_xn = ws.xn.rows_view(0, T);
    be.add_rmsnorm(x, y, *next_norm, eps, next_xn);
  };
  if (!moe) {
    ScopedTimer timer(be.times().dense_mlp);
    be.mlp(xn, dense, out);
    return residual(out);
  }
  MoeParams p = routing;
  p.layer = l;
  p.router_bias = router_bias ? &router_bias : nullptr;
  if (ws.moe_top_k > 0 && ws.moe_top_k < p.top_k) {  // --moe-top-k: fewer experts, renormalized
    p.top_k = ws.moe_top_k;
    p.norm_topk_prob = true;
  }
  if (T == 1 && (ws.miss_fallback || ws.cache_bias != 0.0f) && experts.bounded()) {
    p.miss_fallback = ws.miss_fallback;
    p.cache_bias = ws.cache_bias;
  }
  if (T == 1 && experts.wants_prefetch()) p.ahead = ahead;
  Buffer s{ws.attn_out.data, T, x.cols};  // attention is done with attn_out
  if (shared.gate && shared_gate) {
    // Qwen3-Next: out = moe(xn) + sigmoid(shared_gate xn) * shared(xn), then x += out.
    Buffer gate = ws.shared_gate.rows_view(0, T);
    be.moe_gated_shared(xn, router, experts, p, shared, shared_gate, s, gate, out);
    return residual(out);
  }
  be.moe(xn, router, experts, p, out);
  if (!shared.gate) return residual(out);
  be.add(x, out);
  {
    ScopedTimer timer(be.times().dense_mlp);
    be.mlp(xn, shared, s);
  }
  return residual(s);
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

std::string expert_tensor_name(ExpertNaming naming, int l, int e, const std::string& role,
                               const std::string& model) {
  const std::string p = layer_prefix(l, model), expert = std::to_string(e);
  switch (naming) {
    case ExpertNaming::Hub: return p + "mlp.experts." + expert + "." + role + "_proj.weight";
    case ExpertNaming::Mixtral:
      return p + "block_sparse_moe.experts." + expert + "." + (role == "gate" ? "w1" : role == "down" ? "w2" : "w3") +
             ".weight";
    case ExpertNaming::Stacked:
      return p + "mlp.experts." + (role == "down" ? "down_proj" : "gate_up_proj") + "[" + expert + "] (" + role + ")";
  }
  return p + "mlp.experts." + expert;
}

}  // namespace moestream
