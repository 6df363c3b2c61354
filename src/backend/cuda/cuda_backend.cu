// The CUDA backend (see cuda_backend.h): the Backend operations as launches on one compute
// stream, weights and activations in device memory, and decode steps replayed as CUDA graphs.
// Routed experts and the MoE layer are the expert tier's (cuda_expert_tier.cuh); the GPU-limits
// probe is in cuda_limits.cu.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <type_traits>
#include <unordered_map>
#include <unordered_set>

#include "backend/cuda/attention.h"
#include "backend/cuda/common.cuh"
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/cuda_expert_tier.cuh"
#include "backend/cuda/cuda_limits.h"
#include "backend/cuda/deltanet.h"
#include "backend/cuda/elementwise.h"
#include "backend/cuda/growable.h"
#include "backend/cuda/linear.h"
#include "backend/cuda/op_profile.h"
#include "core/quant.h"

namespace moestream {

namespace {

using namespace moestream::cuda;

float to_f32(const TensorView& t, int64_t i) {
  switch (t.dtype) {
    case DType::F32: return t.as<float>()[i];
    case DType::BF16: return bf16_to_f32(t.as<uint16_t>()[i]);
    case DType::F16: return f16_to_f32(t.as<uint16_t>()[i]);
    default: fail("tensor ", t.name, ": dtype ", dtype_name(t.dtype), " is not supported for vectors");
  }
}

// An integer setting from the environment in [lo, hi]; `fallback` when unset.
int env_int(const char* name, int fallback, int lo, int hi) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  char* end = nullptr;
  const long n = std::strtol(v, &end, 10);
  if (*end || n < lo || n > hi) fail(name, ": '", v, "' is not an integer from ", lo, " to ", hi);
  return int(n);
}

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(const CudaOptions& o) : opt_(o) {
    std::string why;
    if (!cuda_device_available(&why)) fail("--device cuda: ", why);
    MS_CUDA_CHECK(cudaSetDevice(0));
    cudaDeviceProp prop{};
    MS_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    device_name_ = prop.name;
    MS_CUDA_CHECK(cudaStreamCreateWithFlags(&compute_, cudaStreamNonBlocking));
    MS_CUDA_CHECK(cudaStreamCreateWithFlags(&copy_, cudaStreamNonBlocking));
    MS_CUDA_CHECK(cudaEventCreateWithFlags(&staging_free_, cudaEventDisableTiming));
    // MOESTREAM_CUDA_SYNC=1: wait for the GPU after every operation, so that --timing's host-side
    // phase times are GPU times (a profile by phase; slower, for measurement only).
    const char* sync = std::getenv("MOESTREAM_CUDA_SYNC");
    sync_ops_ = sync && *sync && std::string(sync) != "0";
    const char* graphs = std::getenv("MOESTREAM_CUDA_GRAPHS");
    graphs_ = !(graphs && std::string(graphs) == "0") && !prof_.on();
    graph_rows_ = env_int("MOESTREAM_CUDA_GRAPH_ROWS", kMaxGraphRows, 1, kMaxGraphRows);
    first_segment_ = env_int("MOESTREAM_CUDA_GRAPH_SEGMENT", 8, 0, 1 << 20);
    append_in_attention_ = env_int("MOESTREAM_CUDA_ATTN_APPEND", 1, 0, 1) == 1;
    shared_beside_ = env_int("MOESTREAM_CUDA_SHARED_BESIDE", 1, 0, 1) == 1;
    norm_split_ = env_int("MOESTREAM_CUDA_NORM_SPLIT", 1, 0, 1) == 1;
    MS_CUDA_CHECK(cudaStreamCreateWithFlags(&side_, cudaStreamNonBlocking));
    MS_CUDA_CHECK(cudaEventCreateWithFlags(&fork_, cudaEventDisableTiming));
    MS_CUDA_CHECK(cudaEventCreateWithFlags(&join_, cudaEventDisableTiming));
    tier_ = std::make_unique<ExpertTier>(opt_, compute_, copy_, gemm_, times_, sync_ops_, prof_);
    growable_ = std::make_unique<GrowableMemory>(0);
  }

  ~CudaBackend() override {
    try {
      prof_.report();
    } catch (...) {  // a failed CUDA call at exit loses the profile, not the run
    }
    host_wait_.report();
    if (capturing_) abort_capture();
    for (auto& [rows, g] : step_graphs_)
      for (cudaGraphExec_t e : g.execs)
        if (e) cudaGraphExecDestroy(e);
    cudaDeviceSynchronize();
    for (void* p : device_allocs_) cudaFree(p);
    tier_.reset();
    cudaEventDestroy(staging_free_);
    cudaEventDestroy(fork_);
    cudaEventDestroy(join_);
    cudaStreamDestroy(side_);
    cudaStreamDestroy(compute_);
    cudaStreamDestroy(copy_);
  }

  std::string name() const override { return "cuda(" + device_name_ + ")"; }

  // --- memory --------------------------------------------------------------------------------

  Matrix load_matrix(const TensorView& t) override {
    check_matrix_tensor(t);
    Matrix m{t.name, t.dtype, upload(t.data, size_t(t.numel()) * dtype_size(t.dtype)), t.shape[0], t.shape[1]};
    return m;
  }

  Matrix load_quantized(const TensorView& words, const TensorView& scales, const TensorView& biases,
                        const QuantFormat& f) override {
    Matrix m = quantized_matrix_view(words, scales, biases, f);
    if (f.scheme == QuantScheme::Fp8) {
      // FP8: one E4M3 byte per weight, a float32 scale per group of columns (the last partial).
      m.data = upload(words.data, size_t(words.numel()));
      m.scales = upload(scales.data, size_t(scales.numel()) * sizeof(float));
    } else {  // MLX affine: BF16/F16 scales and biases
      m.data = upload(words.data, size_t(words.numel()) * 4);
      m.scales = upload(scales.data, size_t(scales.numel()) * 2);
      m.biases = upload(biases.data, size_t(biases.numel()) * 2);
    }
    format_of(m);  // refuses what the kernels cannot read, naming the tensor
    return m;
  }

  Vector load_vector(const TensorView& t) override {
    check_vector_tensor(t);
    std::vector<float> v(size_t(t.shape[0]));
    for (int64_t i = 0; i < t.shape[0]; ++i) v[size_t(i)] = to_f32(t, i);
    return Vector{t.name, static_cast<const float*>(upload(v.data(), v.size() * sizeof(float))), t.shape[0]};
  }

  Buffer alloc(int64_t rows, int64_t cols) override {
    drop_norm_split();
    const size_t bytes = size_t(std::max<int64_t>(1, rows * cols)) * sizeof(float);
    void* p = nullptr;
    MS_CUDA_CHECK(cudaMalloc(&p, bytes));
    MS_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, compute_));
    device_allocs_.insert(p);
    return Buffer{static_cast<float*>(p), rows, cols};
  }

  void free(Buffer& b) override {
    drop_norm_split();
    if (b.data && device_allocs_.erase(b.data)) {
      MS_CUDA_CHECK(cudaStreamSynchronize(compute_));
      MS_CUDA_CHECK(cudaFree(b.data));
    } else if (b.data && growable_->owns(b.data)) {
      MS_CUDA_CHECK(cudaStreamSynchronize(compute_));
      growable_->release(b.data);
    }
    b = Buffer{};
  }

  Buffer alloc_growable(int64_t rows, int64_t cols) override {
    void* p = growable_->reserve(size_t(std::max<int64_t>(1, rows * cols)) * sizeof(float));
    return Buffer{static_cast<float*>(p), rows, cols};
  }
  void commit_rows(Buffer& b, int64_t rows) override {
    drop_norm_split();
    if (b.data && growable_->owns(b.data))
      growable_->commit(b.data, size_t(std::min(rows, b.rows) * b.cols) * sizeof(float), compute_);
  }
  void decommit_rows(Buffer& b, int64_t rows) override {
    drop_norm_split();
    if (!b.data || !growable_->owns(b.data)) return;
    MS_CUDA_CHECK(cudaStreamSynchronize(compute_));  // no kernel still reads the rows
    growable_->decommit(
        b.data, size_t(std::max<int64_t>(0, std::min(rows, b.rows)) * b.cols) * sizeof(float));
  }
  int64_t growable_bytes(int64_t rows, int64_t cols) const override {
    const int64_t g = int64_t(growable_->granularity());
    return (rows * cols * int64_t(sizeof(float)) + g - 1) / g * g;
  }
  void reserve_growable_pool(int64_t bytes) override {
    growable_->reserve_pool(size_t(std::max<int64_t>(0, bytes)));
  }

  void to_host(const Buffer& b, float* dst) override {
    drop_norm_split();
    if (capturing_) finish_capture();
    MS_CUDA_CHECK(cudaMemcpyAsync(dst, b.data, size_t(b.rows * b.cols) * sizeof(float), cudaMemcpyDeviceToHost, compute_));
    MS_CUDA_CHECK(cudaStreamSynchronize(compute_));
  }

  void greedy_rows(const Buffer& x, std::span<int32_t> ids) override {
    if (int64_t(ids.size()) != x.rows) fail("greedy_rows: ", ids.size(), " ids for ", x.rows, " rows");
    if (x.rows == 0) return;
    prof_.begin(compute_);
    int32_t* dev = scratch_.get<int32_t>(kGreedyIds, ids.size() + size_t(cuda::greedy_work_ints(x.rows, x.cols)));
    cuda::greedy_rows(x.data, x.rows, x.cols, dev, dev + ids.size(), compute_);
    op_done([&] { return op_label("greedy token", x.rows); });
    if (capturing_) finish_capture();  // a graph step ends here, with the search in it
    int32_t* host = staging_.get<int32_t>(kGreedyIdsHost, ids.size(), compute_);
    MS_CUDA_CHECK(cudaMemcpyAsync(host, dev, ids.size() * sizeof(int32_t), cudaMemcpyDeviceToHost, compute_));
    host_wait_.begin();
    MS_CUDA_CHECK(cudaStreamSynchronize(compute_));
    host_wait_.end();
    std::copy_n(host, ids.size(), ids.data());
  }

  // From a sealed buffer into a growable one: its whole chunks are lent (mapped, not copied) and
  // the rest copied. What dst borrowed before and would be written now becomes its own first.
  void copy_rows(const Buffer& src, Buffer& dst, int64_t rows) override {
    drop_norm_split();
    check_copy_rows(src, dst, rows);
    const size_t n = size_t(rows * src.cols);
    if (n == 0) return;
    size_t lent = 0;
    if (dst.data && growable_->owns(dst.data)) {
      if (growable_->sealed(src.data)) {
        MS_CUDA_CHECK(cudaStreamSynchronize(compute_));  // no kernel still uses dst's chunks
        lent = std::min(n * sizeof(float), growable_->lend(src.data, dst.data, n * sizeof(float), compute_));
      } else {
        own_rows(dst, 0);  // nothing unless dst borrows
      }
    }
    MS_CUDA_CHECK(cudaMemcpyAsync(reinterpret_cast<char*>(dst.data) + lent, reinterpret_cast<const char*>(src.data) + lent,
                                  n * sizeof(float) - lent, cudaMemcpyDeviceToDevice, compute_));
  }

  // A sealed buffer's whole chunks may be lent by copy_rows (GrowableMemory::lend).
  void seal_rows(Buffer& b, int64_t rows) override {
    if (b.data && growable_->owns(b.data))
      growable_->seal(b.data, size_t(std::clamp<int64_t>(rows, 0, b.rows) * b.cols) * sizeof(float));
  }
  int64_t lent_bytes(const Buffer& b) const override {
    return b.data && growable_->owns(b.data) ? int64_t(growable_->lent_bytes(b.data)) : 0;
  }
  void own_rows(Buffer& b, int64_t row) override {
    if (!growable_->borrows_any() || !b.data || !growable_->owns(b.data)) return;
    const size_t from = size_t(std::clamp<int64_t>(row, 0, b.rows) * b.cols) * sizeof(float);
    if (!growable_->borrows_from(b.data, from)) return;
    if (capturing_) fail("KV cache: rows borrowed from a prefix cache entry written inside a captured step");
    drop_norm_split();
    MS_CUDA_CHECK(cudaStreamSynchronize(compute_));  // no kernel still reads the chunks replaced
    growable_->own(b.data, from, compute_);
  }

  void* alloc_host(size_t bytes) override { return pinned_.alloc(bytes); }
  void free_host(void* p) override { pinned_.free(p); }

  // --- operations ----------------------------------------------------------------------------

  void embed(std::span<const int32_t> tokens, const Matrix& table, Buffer& out) override {
    check_embed_args(tokens, table, out);
    const int64_t T = int64_t(tokens.size());
    if (T == 0) return;
    int32_t* host = staging_.get<int32_t>(kTokensHost, size_t(T), compute_);
    MS_CUDA_CHECK(cudaEventSynchronize(staging_free_));
    std::memcpy(host, tokens.data(), size_t(T) * sizeof(int32_t));
    int32_t* dev = scratch_.get<int32_t>(kTokens, size_t(T));
    // From the third step in a row of the same few tokens (decode: one sequence, or up to 8 in a
    // batch; a short prompt chunk too) on, with every expert resident or read in place (ExpertTier::graph_ready), the step
    // (this embed up to the logits' to_host or the greedy ids) is captured as CUDA graphs and
    // replayed: one launch a segment instead of ~20 per layer. The graph reads the tokens from
    // the pinned staging area. A step is captured in segments (the first of first_segment_
    // operations, each next one twice as long), each launched as soon as it is captured, so the
    // GPU runs one segment while the host captures the next instead of idling for the whole
    // capture.
    // Steps of the same row count whose graphs could not be updated in place three times in a
    // row (serve's steps mix decode rows and prompt chunks of that count) are launched op by op
    // for the next kGraphBackoff steps of that count, instead of instantiated anew each step.
    if (capturing_) abort_capture();  // the last step failed part way
    decode_streak_ = T <= graph_rows_ && T == streak_rows_ ? decode_streak_ + 1 : 1;
    streak_rows_ = T;
    tier_->step_begins();
    if (T <= graph_rows_ && decode_streak_ >= 3 && graphs_ && !sync_ops_ && tier_->graph_ready() &&
        !cuda::tensor_cores_for(T)) {
      StepGraphs& g = step_graphs_[T];
      if (g.skip > 0) {
        --g.skip;
      } else {
        segment_ = 0;
        segment_limit_ = first_segment_;
        g.updated_all = true;
        begin_segment();
      }
    }
    prof_.begin(compute_);
    MS_CUDA_CHECK(cudaMemcpyAsync(dev, host, size_t(T) * sizeof(int32_t), cudaMemcpyHostToDevice, compute_));
    if (!capturing_) MS_CUDA_CHECK(cudaEventRecord(staging_free_, compute_));  // a graph step ends in to_host's sync
    cuda::embed(table, dev, T, out.data, compute_);
    op_done([&] { return op_label("embed", T); });
  }

  void rmsnorm(const Buffer& x, const Vector& w, float eps, int64_t group, Buffer& out) override {
    prof_.begin(compute_);
    if (group <= 0 || (x.rows * x.cols) % group || w.size < group)
      fail("rmsnorm: groups of ", group, " over [", x.rows, ", ", x.cols, "] with a weight of ", w.size);
    cuda::rmsnorm(x.data, w.data, eps, x.rows * x.cols, group, out.data, compute_);
    op_done([&] { return op_label("rmsnorm", x.rows); });
  }

  void linear(const Buffer& x, const Matrix& w, const Vector* bias, Buffer& out) override {
    prof_.begin(compute_);
    if (x.cols != w.cols) fail("linear ", w.name, ": input has ", x.cols, " columns, weight expects ", w.cols);
    cuda::linear(w, x.data, x.cols, x.rows, bias ? bias->data : nullptr, out.data, w.rows, gemm_, compute_);
    op_done([&] { return weight_label("linear", w, x.rows); }, stored_bytes(w));
  }

  void linear_shared_input(const Buffer& x, std::span<const Matrix* const> w, std::span<const Vector* const> bias,
                           std::span<Buffer* const> out) override {
    if (w.size() == bias.size() && w.size() == out.size() && w.size() <= 4) {
      bool fits = true;
      const float* b[4] = {};
      float* o[4] = {};
      for (size_t i = 0; i < w.size(); ++i) {
        if (x.cols != w[i]->cols) fail("linear ", w[i]->name, ": input has ", x.cols, " columns, weight expects ", w[i]->cols);
        fits = fits && out[i]->cols == w[i]->rows;
        b[i] = bias[i] ? bias[i]->data : nullptr;
        o[i] = out[i]->data;
      }
      prof_.begin(compute_);
      if (fits && cuda::linear_shared_input(w, x.data, x.cols, x.rows, std::span<const float* const>(b, w.size()),
                                            std::span<float* const>(o, w.size()), gemm_, compute_)) {
        op_done([&] { return weight_label("linear, shared input", *w[0], x.rows) + " x" + std::to_string(w.size()); },
                [&] {
                  double bytes = 0;
                  for (const Matrix* m : w) bytes += stored_bytes(*m);
                  return bytes;
                }());
        return;
      }
    }  // else the fallback's own ops are profiled (a begin without an end is replaced by the next)
    Backend::linear_shared_input(x, w, bias, out);
  }

  void add_rmsnorm(Buffer& x, const Buffer& y, const Vector& w, float eps, Buffer& out) override {
    if (y.rows != x.rows || y.cols != x.cols || out.rows != x.rows || out.cols != x.cols || w.size != x.cols) {
      Backend::add_rmsnorm(x, y, w, eps, out);  // the unfused ops name what is wrong
      return;
    }
    prof_.begin(compute_);
    // A batched step's norm also splits its rows for the products after it (NormSplit), in the
    // order they last asked for here.
    const auto want = norm_split_ && x.rows >= 2 && x.rows <= cuda::kGemvMaxTokens && cuda::few_mma_enabled() &&
                              cuda::add_rmsnorm_splits(x.cols) && reinterpret_cast<uintptr_t>(out.data) % 16 == 0
                          ? split_orders_.try_emplace(w.data, SplitOrder::kInterleaved).first->second
                          : SplitOrder::kNone;
    cuda::SplitRows rows;
    if (want != SplitOrder::kNone) {
      auto get = [&](int slot, size_t bytes) { return gemm_.area(slot, bytes); };
      rows = cuda::split_buffers(get, cuda::kAreaNormHi, x.rows, x.cols);
    }
    const bool interleaved = want == SplitOrder::kInterleaved;
    cuda::add_rmsnorm(x.data, y.data, w.data, eps, x.rows, x.cols, out.data, compute_,
                      want != SplitOrder::kNone ? &rows : nullptr, interleaved);
    op_done([&] { return op_label(want != SplitOrder::kNone ? "add + rmsnorm + split" : "add + rmsnorm", x.rows); });
    if (want != SplitOrder::kNone) gemm_.norm_split = cuda::NormSplit{out.data, x.rows, interleaved, rows, w.data};
  }

  void qk_norm_rope(Buffer& q, Buffer& k, const Vector& q_norm, const Vector& k_norm, float eps, int n_heads,
                    int n_kv_heads, int head_dim, const RopeTable& r, int64_t n_past) override {
    const bool shapes = q.rows == k.rows && q.cols == int64_t(n_heads) * head_dim &&
                        k.cols == int64_t(n_kv_heads) * head_dim && (!q_norm || q_norm.size == head_dim) &&
                        (!k_norm || k_norm.size == head_dim) && r.rot_offset + r.rot_dim <= head_dim;
    if (!shapes) {
      Backend::qk_norm_rope(q, k, q_norm, k_norm, eps, n_heads, n_kv_heads, head_dim, r, n_past);
      return;
    }
    prof_.begin(compute_);
    cuda::qk_norm_rope(q, k, q_norm ? q_norm.data : nullptr, k_norm ? k_norm.data : nullptr, eps, n_heads, n_kv_heads,
                       head_dim, r, inv_freq(r), n_past, cuda::rmsnorm_threads(head_dim), compute_);
    op_done([&] { return op_label("q/k norm + rope", q.rows); });
  }

  // A batched decode step (every span one row, F32 caches without a window): rotary, cache
  // appends and attention of all its sequences in two launches, each row as the one-token calls
  // compute it. Anything else, span by span.
  void attention_batch(Buffer& q, Buffer& k, const Buffer& v, const Vector& q_norm, const Vector& k_norm, float eps,
                       const RopeTable& r, std::span<const AttentionSpan> spans, const AttentionParams& p,
                       Buffer& out) override {
    const int hd = p.head_dim, vd = p.v_head_dim ? p.v_head_dim : p.head_dim;
    const int64_t kv_dim = int64_t(p.n_kv_heads) * hd, v_dim = int64_t(p.n_kv_heads) * vd;
    bool rows = spans.size() > 1 && p.kv.type == KvType::F32 && p.kv.window == 0 && !p.values_in_keys &&
                q.rows == k.rows && q.rows == v.rows && q.cols == int64_t(p.n_heads) * hd && k.cols == kv_dim &&
                v.cols == v_dim && out.cols == int64_t(p.n_heads) * vd && (!q_norm || q_norm.size == hd) &&
                (!k_norm || k_norm.size == hd) && r.rot_offset + r.rot_dim <= hd;
    for (const AttentionSpan& s : spans)
      rows = rows && s.rows == 1 && s.row0 >= 0 && s.row0 < q.rows && s.k_cache->cols == kv_dim &&
             s.v_cache->cols == v_dim && s.n_past < s.k_cache->rows && s.n_past < s.v_cache->rows;
    if (!rows) {
      Backend::attention_batch(q, k, v, q_norm, k_norm, eps, r, spans, p, out);
      return;
    }
    for (size_t i0 = 0; i0 < spans.size(); i0 += cuda::kMaxDecodeRows) {
      cuda::DecodeRows d;
      d.n = int(std::min<size_t>(spans.size() - i0, cuda::kMaxDecodeRows));
      for (int i = 0; i < d.n; ++i) {
        const AttentionSpan& s = spans[i0 + size_t(i)];
        d.row[i] = s.row0;
        d.pos[i] = s.n_past;
        d.k_cache[i] = s.k_cache->data;
        d.v_cache[i] = s.v_cache->data;
      }
      prof_.begin(compute_);
      cuda::decode_attention(q, k, v, q_norm ? q_norm.data : nullptr, k_norm ? k_norm.data : nullptr, eps, r,
                             inv_freq(r), cuda::rmsnorm_threads(hd), d, p, p.sinks ? p.sinks->data : nullptr, out,
                             compute_);
      op_done([&] { return op_label("decode attention, batched (q/k norm + rope, cache append, attention)", d.n); });
    }
  }

  void rope(Buffer& x, int n_heads, int head_dim, const RopeTable& r, int64_t n_past) override {
    prof_.begin(compute_);
    cuda::rope(x, n_heads, head_dim, r, inv_freq(r), n_past, compute_);
    op_done([&] { return op_label("rope", x.rows); });
  }

  void attention(const Buffer& q, const Buffer& k, const Buffer& v, Buffer& k_cache, Buffer& v_cache,
                 const AttentionParams& p, Buffer& out) override {
    prof_.begin(compute_);
    const int hd = p.head_dim, vd = p.v_head_dim ? p.v_head_dim : p.head_dim;
    const int64_t T = q.rows, kv_dim = int64_t(p.n_kv_heads) * hd, v_dim = int64_t(p.n_kv_heads) * vd;
    check_attention_args(q, k, v, k_cache, v_cache, p);
    if (p.kv.type != KvType::F32 || p.kv.window > 0) {
      attention_kv(q, k, v, k_cache, v_cache, p, out);
      return;
    }
    const float* sinks = p.sinks ? p.sinks->data : nullptr;
    if (T == 1 && !p.values_in_keys && append_in_attention_) {  // a decode step: the kernel appends its key and value
      cuda::attention(q, k_cache, v_cache, p, sinks, out, compute_, k.data, v.data, k_cache.data + p.n_past * kv_dim,
                      v_cache.data + p.n_past * v_dim);
      op_done([&] { return op_label("attention (cache append in the kernel)", q.rows); });
      return;
    }
    MS_CUDA_CHECK(cudaMemcpyAsync(k_cache.data + p.n_past * kv_dim, k.data, size_t(T * kv_dim) * sizeof(float),
                                  cudaMemcpyDeviceToDevice, compute_));
    if (!p.values_in_keys)
      MS_CUDA_CHECK(cudaMemcpyAsync(v_cache.data + p.n_past * v_dim, v.data, size_t(T * v_dim) * sizeof(float),
                                    cudaMemcpyDeviceToDevice, compute_));
    cuda::attention(q, k_cache, v_cache, p, sinks, out, compute_, nullptr, nullptr, nullptr, nullptr,
                    attention_split(p, T));
    op_done([&] { return op_label("attention (cache append + attention)", q.rows); });
  }

  void add(Buffer& x, const Buffer& y) override {
    prof_.begin(compute_);
    cuda::add(x.data, y.data, x.rows * x.cols, compute_);
    op_done([&] { return op_label("add", x.rows); });
  }
  void clamp(Buffer& x, float limit) override {
    prof_.begin(compute_);
    cuda::clamp(x.data, limit, x.rows * x.cols, compute_);
    op_done([&] { return op_label("clamp", x.rows); });
  }

  void copy_columns(const Buffer& src, ColumnBlocks from, Buffer& dst, ColumnBlocks to, int64_t width,
                    int64_t blocks) override {
    prof_.begin(compute_);
    if (src.rows != dst.rows || from.offset + (blocks - 1) * from.stride + width > src.cols ||
        to.offset + (blocks - 1) * to.stride + width > dst.cols)
      fail("copy_columns: ", blocks, " blocks of ", width, " do not fit [", src.rows, ", ", src.cols, "] -> [",
           dst.rows, ", ", dst.cols, "]");
    cuda::copy_columns(src, from, dst, to, width, blocks, compute_);
    op_done([&] { return op_label("copy_columns", src.rows); });
  }

  void linear_per_head(const Buffer& x, std::span<const Matrix> w, Buffer& out) override {
    prof_.begin(compute_);
    const int64_t H = int64_t(w.size()), in = H ? w[0].cols : 0, n_out = H ? w[0].rows : 0;
    if (x.cols != H * in || out.cols != H * n_out || x.rows != out.rows)
      fail("linear_per_head: ", H, " heads of [", n_out, ", ", in, "] do not fit input [", x.rows, ", ", x.cols,
           "] and output [", out.rows, ", ", out.cols, "]");
    for (int64_t h = 0; h < H; ++h)
      cuda::linear(w[size_t(h)], x.data + h * in, x.cols, x.rows, nullptr, out.data + h * n_out, out.cols, gemm_,
                   compute_);
    op_done([&] { return weight_label("linear_per_head", w[0], x.rows) + " x" + std::to_string(w.size()); }, stored_bytes(w[0]) * double(w.size()));
  }

  void mlp(const Buffer& x, const MlpWeights& w, Buffer& out) override {
    prof_.begin(compute_);
    mlp_steps(x, w, nullptr, nullptr, out.data, out.cols, compute_, gemm_);
    op_done([&] { return weight_label("mlp gate/up/down", w.gate, x.rows); }, stored_bytes(w.gate) + stored_bytes(w.up) + stored_bytes(w.down));
  }

  // The shared expert's gate row joins the launch of its gate and up products, and its sigmoid the
  // residual add: four launches instead of seven for one token.
  void gated_mlp_add(const Buffer& x, const MlpWeights& w, const Matrix& gate, Buffer& s, Buffer& g,
                     Buffer& out) override {
    if (!gated_mlp_fits(x, w, gate, s, g, out)) {
      Backend::gated_mlp_add(x, w, gate, s, g, out);  // the unfused ops name what is wrong
      return;
    }
    prof_.begin(compute_);
    mlp_steps(x, w, &gate, g.data, s.data, s.cols, compute_, gemm_);
    cuda::sigmoid_gate_add(out.data, s.data, g.data, x.rows, out.cols, compute_);
    op_done([&] { return weight_label("shared expert, gated", w.gate, x.rows); },
            stored_bytes(w.gate) + stored_bytes(w.up) + stored_bytes(w.down) + stored_bytes(gate));
  }

  // One token's shared expert runs on a stream of its own beside the routed experts (the router
  // and the experts' kernels are one wave or less and leave SMs idle; ~20 us a layer of
  // Qwen3.5-397B-A17B's shape); then its sigmoid and add as gated_mlp_add's. The same kernels on
  // the same inputs as the two calls, so the same output bit for bit. In a graph step the second
  // stream's work is a branch of the graph. Not with the profile (its times are of one stream) or
  // MOESTREAM_CUDA_SHARED_BESIDE=0.
  void moe_gated_shared(const Buffer& x, const Matrix& router, ExpertProvider& experts, const MoeParams& p,
                        const MlpWeights& shared, const Matrix& gate, Buffer& s, Buffer& g, Buffer& out) override {
    if (x.rows != 1 || !shared_beside_ || prof_.on() || sync_ops_ || !gated_mlp_fits(x, shared, gate, s, g, out)) {
      Backend::moe_gated_shared(x, router, experts, p, shared, gate, s, g, out);
      return;
    }
    MS_CUDA_CHECK(cudaEventRecord(fork_, compute_));
    MS_CUDA_CHECK(cudaStreamWaitEvent(side_, fork_, 0));
    mlp_steps(x, shared, &gate, g.data, s.data, s.cols, side_, gemm_side_);
    MS_CUDA_CHECK(cudaEventRecord(join_, side_));
    try {
      tier_->moe(x, router, experts, p, out);
    } catch (...) {
      cudaStreamWaitEvent(compute_, join_, 0);  // the branch joins before the error leaves
      throw;
    }
    MS_CUDA_CHECK(cudaStreamWaitEvent(compute_, join_, 0));
    cuda::sigmoid_gate_add(out.data, s.data, g.data, x.rows, out.cols, compute_);
    op_done([&] { return weight_label("moe and shared expert, gated", shared.gate, x.rows); });
  }

  static bool gated_mlp_fits(const Buffer& x, const MlpWeights& w, const Matrix& gate, const Buffer& s,
                             const Buffer& g, const Buffer& out) {
    const int64_t T = x.rows;
    return gate.rows == 1 && gate.cols == x.cols && g.rows == T && g.cols == 1 && s.rows == T && out.rows == T &&
           s.cols == out.cols && w.down.rows == out.cols;
  }

  void sigmoid_gate(Buffer& y, const Buffer& gate) override {
    prof_.begin(compute_);
    if (gate.rows != y.rows || (gate.cols != 1 && gate.cols != y.cols))
      fail("sigmoid_gate: gate [", gate.rows, ", ", gate.cols, "] does not fit [", y.rows, ", ", y.cols, "]");
    cuda::sigmoid_gate(y.data, y.rows, y.cols, gate.data, gate.cols, compute_);
    op_done([&] { return op_label("sigmoid_gate", y.rows); });
  }

  void gated_delta_net(const Buffer& qkv, const Buffer& z, const Buffer& b, const Buffer& a, const DeltaNetWeights& w,
                       const DeltaNetParams& p, DeltaNetState& state, Buffer& out) override {
    prof_.begin(compute_);
    cuda::gated_delta_net(qkv, z, b, a, w, p, state, out, deltanet_scratch_, compute_);
    op_done([&] { return op_label("gated_delta_net", qkv.rows); });
  }

  void moe(const Buffer& x, const Matrix& router, ExpertProvider& experts, const MoeParams& p, Buffer& out) override {
    tier_->moe(x, router, experts, p, out);
    drop_norm_split();
  }

  // out (ldo) = down(act(gate x) * up x), gate and up (and `extra`, into extra_out, when given)
  // in one launch where the format allows; bit for bit the separate products.
  void mlp_steps(const Buffer& x, const MlpWeights& w, const Matrix* extra, float* extra_out, float* out,
                 int64_t ldo, cudaStream_t stream, GemmScratch& gemm) {
    const int64_t T = x.rows, inter = w.gate.rows;
    float* g = scratch_.get(kMlpGate, size_t(T * inter));
    float* u = scratch_.get(kMlpUp, size_t(T * inter));
    const Matrix* ms[3] = {&w.gate, &w.up, extra};
    const float* biases[3] = {w.gate_bias ? w.gate_bias.data : nullptr, w.up_bias ? w.up_bias.data : nullptr, nullptr};
    float* outs[3] = {g, u, extra_out};
    const size_t n = extra ? 3 : 2;
    if (!cuda::linear_shared_input(std::span<const Matrix* const>(ms, n), x.data, x.cols, T,
                                   std::span<const float* const>(biases, n), std::span<float* const>(outs, n), gemm,
                                   stream))
      for (size_t i = 0; i < n; ++i)
        cuda::linear(*ms[i], x.data, x.cols, T, biases[i], outs[i], ms[i]->rows, gemm, stream);
    cuda::expert_activation(g, u, T, inter, nullptr, nullptr, MoeParams{}, stream);
    cuda::linear(w.down, g, inter, T, w.down_bias ? w.down_bias.data : nullptr, out, ldo, gemm, stream);
  }

  GpuLimits measure_limits() { return probe_gpu_limits(compute_, gemm_, opt_.max_expert_bytes); }

  GpuTierStats tier_stats() const {
    GpuTierStats s = tier_->stats();
    s.graph_steps = graph_steps_;
    s.norm_splits = norm_splits_;
    s.pinned_bytes = pinned_.total();
    s.device = device_name_;
    return s;
  }

 private:
  enum ScratchSlot { kTokens, kMlpGate, kMlpUp, kKvStaged, kGreedyIds, kAttnSplit };
  static constexpr size_t kMaxAttentionSplitBytes = size_t(64) << 20;
  enum StagingSlot { kTokensHost, kGreedyIdsHost };

  // Scratch for prefill's keys and values split for the tensor cores once per call
  // (cuda::attention_split_bytes), or null. Not for steps that may become graphs (the scratch could
  // not grow under a capture, and a step must compute the same with and without one), and bounded:
  // otherwise each block splits the tiles it reads.
  void* attention_split(const AttentionParams& p, int64_t T) {
    const size_t bytes = cuda::attention_split_bytes(p, T);
    if (bytes == 0 || bytes > kMaxAttentionSplitBytes || T <= kMaxGraphRows || capturing_) return nullptr;
    return scratch_.get<unsigned char>(kAttnSplit, bytes);
  }

  // attention() for a compact or windowed cache (backend/kv_cache.h): new rows packed on the GPU,
  // into the cache, or for a ring into scratch first and into the ring after the attention.
  void attention_kv(const Buffer& q, const Buffer& k, const Buffer& v, Buffer& k_cache, Buffer& v_cache,
                    const AttentionParams& p, Buffer& out) {
    const int64_t T = q.rows, kw = k_cache.cols, vw = p.values_in_keys ? 0 : v_cache.cols;
    const bool ring = p.kv.window > 0 && p.kv.ring && k_cache.rows == p.kv.sinks + p.kv.window;
    float* k_dst = k_cache.data + p.n_past * kw;
    float* v_dst = p.values_in_keys ? nullptr : v_cache.data + p.n_past * vw;
    if (ring) {
      k_dst = scratch_.get(kKvStaged, size_t(std::max<int64_t>(1, T * (kw + vw))));
      v_dst = k_dst + T * kw;
    }
    cuda::kv_pack(k, p.n_kv_heads, p.kv.type, k_dst, kw, compute_);
    if (!p.values_in_keys) cuda::kv_pack(v, p.n_kv_heads, p.kv.type, v_dst, vw, compute_);
    cuda::attention(q, k_cache, v_cache, p, p.sinks ? p.sinks->data : nullptr, out, compute_, ring ? k_dst : nullptr,
                    ring && !p.values_in_keys ? v_dst : nullptr, nullptr, nullptr, ring ? nullptr : attention_split(p, T));
    if (ring) {
      cuda::kv_ring_store(k_dst, k_cache, T, p, compute_);
      if (!p.values_in_keys) cuda::kv_ring_store(v_dst, v_cache, T, p, compute_);
    }
    op_done([&] { return op_label("attention (compact or windowed cache)", q.rows); });
  }

  void* upload(const void* src, size_t bytes) {
    void* p = nullptr;
    MS_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(bytes, 16)));
    MS_CUDA_CHECK(cudaMemcpy(p, src, bytes, cudaMemcpyHostToDevice));
    device_allocs_.insert(p);
    return p;
  }

  const float* inv_freq(const RopeTable& r) {
    auto it = rope_tables_.find(r.inv_freq.data());
    if (it == rope_tables_.end() || it->second.host != r.inv_freq) {
      RopeDevice d{r.inv_freq, static_cast<float*>(upload(r.inv_freq.data(), r.inv_freq.size() * sizeof(float)))};
      it = rope_tables_.insert_or_assign(r.inv_freq.data(), std::move(d)).first;
    }
    return it->second.dev;
  }

  void begin_segment() {
    MS_CUDA_CHECK(cudaStreamBeginCapture(compute_, cudaStreamCaptureModeRelaxed));
    capturing_ = true;
    segment_ops_ = 0;
  }

  // The segment captured so far, as the graph of its place in a step of this many rows (updated
  // in place when the step's operations are those of the last such step), launched. A segment
  // with no operations (one ended just before the step's end) is dropped.
  void end_segment() {
    capturing_ = false;
    cudaGraph_t captured = nullptr;
    MS_CUDA_CHECK(cudaStreamEndCapture(compute_, &captured));
    std::unique_ptr<std::remove_pointer_t<cudaGraph_t>, decltype(&cudaGraphDestroy)> g(captured, cudaGraphDestroy);
    size_t nodes = 0;
    MS_CUDA_CHECK(cudaGraphGetNodes(g.get(), nullptr, &nodes));
    if (nodes == 0) return;
    StepGraphs& graphs = step_graphs_[streak_rows_];
    if (graphs.execs.size() <= size_t(segment_)) graphs.execs.resize(size_t(segment_) + 1, nullptr);
    cudaGraphExec_t& exec = graphs.execs[size_t(segment_)];
    if (exec) {
      cudaGraphExecUpdateResultInfo info{};
      if (cudaGraphExecUpdate(exec, g.get(), &info) != cudaSuccess) {
        cudaGetLastError();
        cudaGraphExecDestroy(exec);
        exec = nullptr;
        graphs.updated_all = false;
      }
    }
    if (!exec) MS_CUDA_CHECK(cudaGraphInstantiate(&exec, g.get(), 0));
    MS_CUDA_CHECK(cudaGraphLaunch(exec, compute_));
    ++segment_;
  }

  void finish_capture() {
    end_segment();
    ++graph_steps_;
    StepGraphs& g = step_graphs_[streak_rows_];
    g.failed_steps = g.updated_all ? 0 : g.failed_steps + 1;
    if (g.failed_steps >= 3) {
      g.failed_steps = 0;
      g.skip = kGraphBackoff;
    }
  }

  // A capture left open by a step that failed part way: ended and thrown away, so the next step
  // starts on a stream that is not capturing.
  void abort_capture() {
    capturing_ = false;
    cudaGraph_t g = nullptr;
    cudaStreamEndCapture(compute_, &g);
    if (g) cudaGraphDestroy(g);
    cudaGetLastError();
  }

  // The norm's split rows, once the operation after it has ended (or any that writes or frees
  // memory without op_done): what that one asked for decides what the norm makes next time.
  void drop_norm_split() {
    cuda::NormSplit& n = gemm_.norm_split;
    if (!n.x) return;
    split_orders_[n.norm] = !n.asked ? SplitOrder::kNone : n.asked_interleaved ? SplitOrder::kInterleaved : SplitOrder::kInOrder;
    if (n.asked && n.asked_interleaved == n.interleaved) ++norm_splits_;
    n = cuda::NormSplit{};
  }

  // Ends an operation: its profile entry (label() is called only when profiling) and, with
  // MOESTREAM_CUDA_SYNC, the wait for it.
  template <class Label>
  void op_done(Label&& label, double bytes = 0) {
    drop_norm_split();
    if (prof_.on()) prof_.end(compute_, label(), bytes);
    if (sync_ops_) MS_CUDA_CHECK(cudaStreamSynchronize(compute_));
    if (capturing_ && segment_limit_ > 0 && ++segment_ops_ >= segment_limit_) {
      end_segment();
      segment_limit_ *= 2;
      begin_segment();
    }
  }

  CudaOptions opt_;
  OpProfile prof_;  // MOESTREAM_CUDA_PROFILE: GPU time per operation, printed at exit
  bool sync_ops_ = false;
  bool graphs_ = true;          // MOESTREAM_CUDA_GRAPHS=0 turns decode-step graphs off
  bool capturing_ = false;
  static constexpr int kMaxGraphRows = 8;  // steps of up to this many tokens become graphs
  static_assert(kMaxGraphRows <= cuda::kGemvMaxTokens, "graph steps must be decode calls (no host round trip)");
  int graph_rows_ = kMaxGraphRows;         // MOESTREAM_CUDA_GRAPH_ROWS: 1 = single-token steps only
  int first_segment_ = 8;  // MOESTREAM_CUDA_GRAPH_SEGMENT: operations in a step's first graph; 0 = one graph a step
  int segment_limit_ = 0, segment_ops_ = 0, segment_ = 0;
  bool append_in_attention_ = true;  // MOESTREAM_CUDA_ATTN_APPEND=0: a decode step's cache append as copies
  // MOESTREAM_CUDA_HOST_WAIT=1: between the ends of consecutive greedy steps' final waits, how long
  // the host worked and how long it waited for the GPU (printed at exit): which of the two bounds
  // a decode step.
  struct HostWait {
    bool on = std::getenv("MOESTREAM_CUDA_HOST_WAIT") != nullptr;
    std::chrono::steady_clock::time_point last_end{}, wait_start;
    double work = 0, wait = 0;
    int64_t steps = 0;  // intervals between two waits' ends
    void begin() {
      if (on) wait_start = std::chrono::steady_clock::now();
    }
    void end() {
      if (!on) return;
      const auto now = std::chrono::steady_clock::now();
      if (last_end != std::chrono::steady_clock::time_point{}) {
        work += std::chrono::duration<double>(wait_start - last_end).count();
        wait += std::chrono::duration<double>(now - wait_start).count();
        ++steps;
      }
      last_end = now;
    }
    void report() const {
      if (on && steps > 0)
        std::fprintf(stderr, "host per step (MOESTREAM_CUDA_HOST_WAIT), %lld steps: %.1f us working, %.1f us waiting for the GPU\n",
                     static_cast<long long>(steps), 1e6 * work / double(steps), 1e6 * wait / double(steps));
    }
  } host_wait_;
  // What each RMSNorm (by its weights) of a batched step splits its rows for (NormSplit); learned
  // from the operation after it. MOESTREAM_CUDA_NORM_SPLIT=0: never, for comparison.
  enum class SplitOrder { kNone, kInOrder, kInterleaved };
  std::unordered_map<const void*, SplitOrder> split_orders_;
  bool norm_split_ = true;
  int decode_streak_ = 0;   // steps in a row of streak_rows_ tokens
  int64_t streak_rows_ = 0;
  // The graphs of steps of one row count: one per segment, and how their updates went.
  struct StepGraphs {
    std::vector<cudaGraphExec_t> execs;
    bool updated_all = true;  // this step's segments all updated in place (or were new)
    int failed_steps = 0;     // steps in a row with a segment instantiated anew
    int skip = 0;             // steps still to launch op by op
  };
  static constexpr int kGraphBackoff = 32;
  std::map<int64_t, StepGraphs> step_graphs_;  // by a step's row count
  std::string device_name_;
  cudaStream_t compute_ = nullptr, copy_ = nullptr;
  cudaEvent_t staging_free_ = nullptr;  // embed's staging area may be overwritten
  std::unordered_set<void*> device_allocs_;
  HostStaging staging_;
  Scratch scratch_, deltanet_scratch_;
  GemmScratch gemm_;
  // One token's shared expert beside the routed experts (moe_gated_shared): its stream, the events
  // that fork it from the compute stream and join it back, and its own GEMM scratch.
  bool shared_beside_ = true;  // MOESTREAM_CUDA_SHARED_BESIDE=0: one stream, for comparison
  cudaStream_t side_ = nullptr;
  cudaEvent_t fork_ = nullptr, join_ = nullptr;
  GemmScratch gemm_side_;
  PinnedPool pinned_;
  struct RopeDevice {
    std::vector<float> host;
    float* dev;
  };
  std::unordered_map<const float*, RopeDevice> rope_tables_;

  std::unique_ptr<ExpertTier> tier_;  // routed experts and moe(); made once the streams exist
  std::unique_ptr<GrowableMemory> growable_;  // the KV caches' memory (alloc_growable)
  uint64_t graph_steps_ = 0;           // steps replayed as CUDA graphs
  uint64_t norm_splits_ = 0;           // GpuTierStats::norm_splits
};

}  // namespace

bool cuda_device_available(std::string* why) {
  int n = 0;
  const cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess || n == 0) {
    if (why) *why = err != cudaSuccess ? std::string("no usable CUDA device (") + cudaGetErrorString(err) + ")"
                                       : std::string("no CUDA device found");
    cudaGetLastError();  // clear the sticky error of a failed probe
    return false;
  }
  return true;
}

std::unique_ptr<Backend> make_cuda_backend(const CudaOptions& options) {
  return std::make_unique<CudaBackend>(options);
}

std::optional<GpuLimits> measure_gpu_limits(Backend& backend) {
  if (auto* c = dynamic_cast<CudaBackend*>(&backend)) return c->measure_limits();
  return std::nullopt;
}

std::optional<GpuTierStats> gpu_tier_stats(Backend& backend) {
  if (auto* c = dynamic_cast<CudaBackend*>(&backend)) return c->tier_stats();
  return std::nullopt;
}

}  // namespace moestream
