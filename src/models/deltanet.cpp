#include "models/deltanet.h"

#include <algorithm>
#include <cstring>

#include "core/dtype.h"
#include "core/error.h"
#include "io/safetensors.h"

namespace moestream {

HybridSequence::HybridSequence(Backend& be, const std::vector<bool>& linear_layer, int64_t kv_dim,
                               int64_t capacity, const DeltaNetState& zero, const KvCacheSpec& kv, int kv_heads)
    : be_(be), linear_layer_(linear_layer), kv_dim_(kv_dim), zero_(zero), capacity_(capacity), kv_(kv),
      kv_heads_(kv_heads) {
  const size_t n = linear_layer.size();
  k.resize(n);
  v.resize(n);
  conv.resize(n);
  recurrent.resize(n);
  for (size_t l = 0; l < n; ++l) {
    if (linear_layer[l]) {
      conv[l] = be.alloc(zero.conv.rows, zero.conv.cols);
      recurrent[l] = be.alloc(zero.recurrent.rows, zero.recurrent.cols);
    } else {
      k[l] = alloc_kv_cache(be, kv, capacity, kv_dim, kv_heads);
      v[l] = alloc_kv_cache(be, kv, capacity, kv_dim, kv_heads);
    }
  }
  reserve(capacity);  // held until trim(), as KvSequence's
}

HybridSequence::~HybridSequence() {
  for (auto* list : {&k, &v, &conv, &recurrent})
    for (Buffer& b : *list)
      if (b.data) be_.free(b);
}

std::unique_ptr<SequenceState> HybridSequence::clone(int64_t capacity) const {
  if (capacity < n_past) fail("clone: capacity ", capacity, " cannot hold the ", n_past, " positions computed");
  auto copy = std::make_unique<HybridSequence>(be_, linear_layer_, kv_dim_, capacity, zero_, kv_, kv_heads_);
  copy->restore(*this);
  return copy;
}

void HybridSequence::restore(const SequenceState& snapshot) {
  if (&snapshot == this) return;
  const auto* s = dynamic_cast<const HybridSequence*>(&snapshot);
  if (!s) fail("restore: the snapshot is not a Qwen3-Next sequence state (it comes from another model)");
  check_restore(be_, s->be_, capacity_, s->n_past);
  reserve(s->n_past);
  copy_state_rows(be_, s->k, k, kv_rows_used(s->k, s->n_past), "K cache");
  copy_state_rows(be_, s->v, v, kv_rows_used(s->v, s->n_past), "V cache");
  copy_state_rows(be_, s->conv, conv, zero_.conv.rows, "conv state");
  copy_state_rows(be_, s->recurrent, recurrent, zero_.recurrent.rows, "recurrent state");
  n_past = s->n_past;
}

void HybridSequence::seal() { KvReservation::seal(be_, k, v, n_past); }

void HybridSequence::truncate(int64_t n) {
  if (!can_truncate(n)) fail_truncate(n, n_past);
  if (n == n_past) return;
  for (size_t l = 0; l < conv.size(); ++l) {
    if (!conv[l].data) continue;
    be_.copy_rows(zero_.conv, conv[l], zero_.conv.rows);
    be_.copy_rows(zero_.recurrent, recurrent[l], zero_.recurrent.rows);
  }
  n_past = 0;
}

int64_t HybridSequence::bytes() const {
  return state_bytes(k) + state_bytes(v) + state_bytes(conv) + state_bytes(recurrent);
}

void HybridSequence::reserve(int64_t positions) {
  reserved_.reserve(be_, kv_, k, v, std::min(positions, capacity_));
  KvReservation::own(be_, kv_, k, v, n_past);
}
void HybridSequence::trim() { reserved_.trim(be_, kv_, k, v, n_past); }
int64_t HybridSequence::held_bytes() const { return bytes_at(reserved_.positions); }
int64_t HybridSequence::bytes_at(int64_t positions) const {
  return KvReservation::bytes_at(be_, kv_, k, v, std::min(positions, capacity_)) + state_bytes(conv) +
         state_bytes(recurrent);
}

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
static Vector load_conv(WeightLoader& w, const std::string& name, int64_t channels, int kernel) {
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

LinearAttention LinearAttention::load(WeightLoader& w, const std::string& p, int64_t h, const DeltaNetParams& dp,
                                    bool split, std::deque<std::vector<char>>& storage) {
  const int64_t nv = dp.n_v_heads, nk = dp.n_k_heads;
  const int64_t dk = dp.k_head_dim, value_dim = deltanet_value_dim(dp), conv_dim = deltanet_conv_dim(dp);
  LinearAttention d;
  if (split) {
    d.qkv_proj = w.matrix(p + "in_proj_qkv.weight", conv_dim, h);
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
    d.qkv_proj = regrouped_rows(w, qkvz, nk * stride, h, qkv, storage);
    d.z_proj = regrouped_rows(w, qkvz, nk * stride, h, strided(nk, stride, 2 * dk + vg, vg), storage);
    d.b_proj = regrouped_rows(w, ba, 2 * nv, h, strided(nk, 2 * group, 0, group), storage);
    d.a_proj = regrouped_rows(w, ba, 2 * nv, h, strided(nk, 2 * group, group, group), storage);
  }
  d.out_proj = w.matrix(p + "out_proj.weight", h, value_dim);
  d.weights.conv = load_conv(w, p + "conv1d.weight", conv_dim, dp.conv_kernel);
  d.weights.A_log = w.vector(p + "A_log", nv);
  d.weights.dt_bias = w.vector(p + "dt_bias", nv);
  d.weights.norm = w.vector(p + "norm.weight", dp.v_head_dim);
  return d;
}

DeltaNetBuffers DeltaNetBuffers::alloc(Backend& be, int64_t max_batch, const DeltaNetParams& dp) {
  DeltaNetBuffers b;
  b.qkv = be.alloc(max_batch, deltanet_conv_dim(dp));
  b.z = be.alloc(max_batch, deltanet_value_dim(dp));
  b.core = be.alloc(max_batch, deltanet_value_dim(dp));
  b.b = be.alloc(max_batch, dp.n_v_heads);
  b.a = be.alloc(max_batch, dp.n_v_heads);
  return b;
}

void linear_attention(Backend& be, const LinearAttention& d, const DeltaNetParams& dp, DeltaNetBuffers& buf,
                      const Buffer& x, std::span<const RowSpan> seqs, int l, Buffer& out) {
  const int64_t T = x.rows;
  Buffer qkv = buf.qkv.rows_view(0, T), z = buf.z.rows_view(0, T), core = buf.core.rows_view(0, T);
  Buffer b = buf.b.rows_view(0, T), a = buf.a.rows_view(0, T);
  {  // one launch on CUDA where the four share a format (Backend::linear_shared_input)
    const Matrix* w[4] = {&d.qkv_proj, &d.z_proj, &d.b_proj, &d.a_proj};
    const Vector* none[4] = {};
    Buffer* o[4] = {&qkv, &z, &b, &a};
    be.linear_shared_input(x, w, none, o);
  }
  for (const RowSpan& s : seqs) {
    DeltaNetState state = static_cast<HybridSequence&>(*s.state).delta(l);
    const auto part = [&s](const Buffer& buffer) { return buffer.rows_view(s.row0, s.rows); };
    Buffer cs = part(core);
    be.gated_delta_net(part(qkv), part(z), part(b), part(a), d.weights, dp, state, cs);
  }
  be.linear(core, d.out_proj, nullptr, out);
}

}  // namespace moestream
