// The CUDA backend (see cuda_backend.h). Everything runs in order on one compute stream; expert
// weights come up from pinned host memory on a second (copy) stream.
//
// Expert tiers, per MoE call of layer L:
//  - every expert of L resident in VRAM: route -> group -> expert kernels -> combine, all on the
//    GPU with no host round trip (the kernels find weights through the device table);
//  - otherwise the chosen ids come back to the host; resident experts (hits) are launched at once,
//    and the misses are requested from the ExpertSource (its pinned slots are the host tier; it
//    reads from disk what it lacks), copied into free VRAM slots on the copy stream, and launched
//    as one more batch once all have arrived. With a VRAM budget that holds every expert, the
//    rest of layer L is fetched along so that later calls take the first path.
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <list>
#include <unordered_map>
#include <unordered_set>

#include "backend/cuda/attention.h"
#include "backend/cuda/common.cuh"
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/deltanet.h"
#include "backend/cuda/elementwise.h"
#include "backend/cuda/linear.h"
#include "backend/cuda/moe.h"
#include "backend/expert_source.h"
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

// Pinned host memory in large chunks, handed out in fixed sizes and reused (cudaHostAlloc is slow,
// and the ExpertStore asks for thousands of equal slots).
class PinnedPool {
 public:
  ~PinnedPool() {
    for (void* c : chunks_) cudaFreeHost(c);
  }
  void* alloc(size_t bytes) {
    bytes = (bytes + 4095) / 4096 * 4096;
    auto& free_list = free_[bytes];
    if (!free_list.empty()) {
      void* p = free_list.back();
      free_list.pop_back();
      return p;
    }
    if (chunk_left_ < bytes) {
      const size_t chunk = std::max<size_t>(bytes, size_t(256) << 20);
      void* c = nullptr;
      MS_CUDA_CHECK(cudaHostAlloc(&c, chunk, cudaHostAllocPortable));
      chunks_.push_back(c);
      chunk_next_ = static_cast<char*>(c);
      chunk_left_ = chunk;
      total_ += chunk;
    }
    void* p = chunk_next_;
    chunk_next_ += bytes;
    chunk_left_ -= bytes;
    size_of_[p] = bytes;
    return p;
  }
  void free(void* p) {
    auto it = size_of_.find(p);
    if (it == size_of_.end()) fail("cuda: free_host of memory this backend did not hand out");
    free_[it->second].push_back(p);
  }
  uint64_t total() const { return total_; }

 private:
  std::vector<void*> chunks_;
  char* chunk_next_ = nullptr;
  size_t chunk_left_ = 0;
  uint64_t total_ = 0;
  std::unordered_map<size_t, std::vector<void*>> free_;
  std::unordered_map<void*, size_t> size_of_;
};

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
    MS_CUDA_CHECK(cudaEventCreate(&copy_start_));
    MS_CUDA_CHECK(cudaEventCreate(&copy_done_));
    MS_CUDA_CHECK(cudaEventCreate(&copies_end_));
    MS_CUDA_CHECK(cudaEventCreateWithFlags(&staging_free_, cudaEventDisableTiming));
    // MOESTREAM_CUDA_SYNC=1: wait for the GPU after every operation, so that --timing's host-side
    // phase times are GPU times (a profile by phase; slower, for measurement only).
    const char* sync = std::getenv("MOESTREAM_CUDA_SYNC");
    sync_ops_ = sync && *sync && std::string(sync) != "0";
    const char* graphs = std::getenv("MOESTREAM_CUDA_GRAPHS");
    graphs_ = !(graphs && std::string(graphs) == "0");
  }

  ~CudaBackend() override {
    if (capturing_) {
      cudaGraph_t g = nullptr;
      cudaStreamEndCapture(compute_, &g);
      if (g) cudaGraphDestroy(g);
    }
    if (exec_) cudaGraphExecDestroy(exec_);
    cudaDeviceSynchronize();
    for (void* p : device_allocs_) cudaFree(p);
    if (slot_arena_) cudaFree(slot_arena_);
    if (table_dev_) cudaFree(table_dev_);
    if (table_host_) cudaFreeHost(table_host_);
    for (auto& [p, n] : staging_) cudaFreeHost(p);
    cudaEventDestroy(copy_start_);
    cudaEventDestroy(copy_done_);
    cudaEventDestroy(copies_end_);
    cudaEventDestroy(staging_free_);
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
    const size_t bytes = size_t(std::max<int64_t>(1, rows * cols)) * sizeof(float);
    void* p = nullptr;
    MS_CUDA_CHECK(cudaMalloc(&p, bytes));
    MS_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, compute_));
    device_allocs_.insert(p);
    return Buffer{static_cast<float*>(p), rows, cols};
  }

  void free(Buffer& b) override {
    if (b.data && device_allocs_.erase(b.data)) {
      MS_CUDA_CHECK(cudaStreamSynchronize(compute_));
      MS_CUDA_CHECK(cudaFree(b.data));
    }
    b = Buffer{};
  }

  void to_host(const Buffer& b, float* dst) override {
    if (capturing_) finish_capture();
    MS_CUDA_CHECK(cudaMemcpyAsync(dst, b.data, size_t(b.rows * b.cols) * sizeof(float), cudaMemcpyDeviceToHost, compute_));
    MS_CUDA_CHECK(cudaStreamSynchronize(compute_));
  }

  void copy_rows(const Buffer& src, Buffer& dst, int64_t rows) override {
    check_copy_rows(src, dst, rows);
    const size_t n = size_t(rows * src.cols);
    if (n == 0) return;
    MS_CUDA_CHECK(cudaMemcpyAsync(dst.data, src.data, n * sizeof(float), cudaMemcpyDeviceToDevice, compute_));
  }

  void* alloc_host(size_t bytes) override { return pinned_.alloc(bytes); }
  void free_host(void* p) override { pinned_.free(p); }

  // --- operations ----------------------------------------------------------------------------

  void embed(std::span<const int32_t> tokens, const Matrix& table, Buffer& out) override {
    check_embed_args(tokens, table, out);
    const int64_t T = int64_t(tokens.size());
    if (T == 0) return;
    int32_t* host = staging<int32_t>(0, size_t(T));
    MS_CUDA_CHECK(cudaEventSynchronize(staging_free_));
    std::memcpy(host, tokens.data(), size_t(T) * sizeof(int32_t));
    int32_t* dev = scratch_.get<int32_t>(kTokens, size_t(T));
    // From the third single-token step in a row on, with every expert resident, the whole step
    // (this embed up to the logits' to_host) is captured as a CUDA graph and replayed: one
    // launch instead of ~20 per layer. The graph reads the token from the pinned staging area.
    decode_streak_ = T == 1 ? decode_streak_ + 1 : 0;
    if (T == 1 && decode_streak_ >= 3 && graphs_ && !sync_ops_ && all_resident()) {
      MS_CUDA_CHECK(cudaStreamBeginCapture(compute_, cudaStreamCaptureModeRelaxed));
      capturing_ = true;
    }
    MS_CUDA_CHECK(cudaMemcpyAsync(dev, host, size_t(T) * sizeof(int32_t), cudaMemcpyHostToDevice, compute_));
    if (!capturing_) MS_CUDA_CHECK(cudaEventRecord(staging_free_, compute_));  // a graph step ends in to_host's sync
    cuda::embed(table, dev, T, out.data, compute_);
    op_done();
  }

  void rmsnorm(const Buffer& x, const Vector& w, float eps, int64_t group, Buffer& out) override {
    if (group <= 0 || (x.rows * x.cols) % group || w.size < group)
      fail("rmsnorm: groups of ", group, " over [", x.rows, ", ", x.cols, "] with a weight of ", w.size);
    cuda::rmsnorm(x.data, w.data, eps, x.rows * x.cols, group, out.data, compute_);
    op_done();
  }

  void linear(const Buffer& x, const Matrix& w, const Vector* bias, Buffer& out) override {
    if (x.cols != w.cols) fail("linear ", w.name, ": input has ", x.cols, " columns, weight expects ", w.cols);
    cuda::linear(w, x.data, x.cols, x.rows, bias ? bias->data : nullptr, out.data, w.rows, gemm_, compute_);
    op_done();
  }

  void rope(Buffer& x, int n_heads, int head_dim, const RopeTable& r, int64_t n_past) override {
    cuda::rope(x, n_heads, head_dim, r, inv_freq(r), n_past, compute_);
    op_done();
  }

  void attention(const Buffer& q, const Buffer& k, const Buffer& v, Buffer& k_cache, Buffer& v_cache,
                 const AttentionParams& p, Buffer& out) override {
    const int hd = p.head_dim, vd = p.v_head_dim ? p.v_head_dim : p.head_dim;
    const int64_t T = q.rows, kv_dim = int64_t(p.n_kv_heads) * hd, v_dim = int64_t(p.n_kv_heads) * vd;
    check_attention_args(q, k, v, k_cache, v_cache, p);
    MS_CUDA_CHECK(cudaMemcpyAsync(k_cache.data + p.n_past * kv_dim, k.data, size_t(T * kv_dim) * sizeof(float),
                                  cudaMemcpyDeviceToDevice, compute_));
    if (!p.values_in_keys)
      MS_CUDA_CHECK(cudaMemcpyAsync(v_cache.data + p.n_past * v_dim, v.data, size_t(T * v_dim) * sizeof(float),
                                    cudaMemcpyDeviceToDevice, compute_));
    cuda::attention(q, k_cache, v_cache, p, p.sinks ? p.sinks->data : nullptr, out, compute_);
    op_done();
  }

  void add(Buffer& x, const Buffer& y) override {
    cuda::add(x.data, y.data, x.rows * x.cols, compute_);
    op_done();
  }
  void clamp(Buffer& x, float limit) override {
    cuda::clamp(x.data, limit, x.rows * x.cols, compute_);
    op_done();
  }

  void copy_columns(const Buffer& src, ColumnBlocks from, Buffer& dst, ColumnBlocks to, int64_t width,
                    int64_t blocks) override {
    if (src.rows != dst.rows || from.offset + (blocks - 1) * from.stride + width > src.cols ||
        to.offset + (blocks - 1) * to.stride + width > dst.cols)
      fail("copy_columns: ", blocks, " blocks of ", width, " do not fit [", src.rows, ", ", src.cols, "] -> [",
           dst.rows, ", ", dst.cols, "]");
    cuda::copy_columns(src, from, dst, to, width, blocks, compute_);
    op_done();
  }

  void linear_per_head(const Buffer& x, std::span<const Matrix> w, Buffer& out) override {
    const int64_t H = int64_t(w.size()), in = H ? w[0].cols : 0, n_out = H ? w[0].rows : 0;
    if (x.cols != H * in || out.cols != H * n_out || x.rows != out.rows)
      fail("linear_per_head: ", H, " heads of [", n_out, ", ", in, "] do not fit input [", x.rows, ", ", x.cols,
           "] and output [", out.rows, ", ", out.cols, "]");
    for (int64_t h = 0; h < H; ++h)
      cuda::linear(w[size_t(h)], x.data + h * in, x.cols, x.rows, nullptr, out.data + h * n_out, out.cols, gemm_,
                   compute_);
    op_done();
  }

  void mlp(const Buffer& x, const MlpWeights& w, Buffer& out) override {
    const int64_t T = x.rows, inter = w.gate.rows;
    float* g = scratch_.get(kMlpGate, size_t(T * inter));
    float* u = scratch_.get(kMlpUp, size_t(T * inter));
    cuda::linear(w.gate, x.data, x.cols, T, w.gate_bias ? w.gate_bias.data : nullptr, g, inter, gemm_, compute_);
    cuda::linear(w.up, x.data, x.cols, T, w.up_bias ? w.up_bias.data : nullptr, u, inter, gemm_, compute_);
    cuda::expert_activation(g, u, T, inter, nullptr, nullptr, MoeParams{}, compute_);
    cuda::linear(w.down, g, inter, T, w.down_bias ? w.down_bias.data : nullptr, out.data, out.cols, gemm_, compute_);
    op_done();
  }

  void sigmoid_gate(Buffer& y, const Buffer& gate) override {
    if (gate.rows != y.rows || (gate.cols != 1 && gate.cols != y.cols))
      fail("sigmoid_gate: gate [", gate.rows, ", ", gate.cols, "] does not fit [", y.rows, ", ", y.cols, "]");
    cuda::sigmoid_gate(y.data, y.rows, y.cols, gate.data, gate.cols, compute_);
    op_done();
  }

  void gated_delta_net(const Buffer& qkv, const Buffer& z, const Buffer& b, const Buffer& a, const DeltaNetWeights& w,
                       const DeltaNetParams& p, DeltaNetState& state, Buffer& out) override {
    cuda::gated_delta_net(qkv, z, b, a, w, p, state, out, deltanet_scratch_, compute_);
    op_done();
  }

  void moe(const Buffer& x, const Matrix& router, ExpertSource& store, const MoeParams& p, Buffer& out) override;

  GpuLimits measure_limits() {
    MS_CUDA_CHECK(cudaStreamSynchronize(compute_));
    GpuLimits l;
    cudaEvent_t a, b;
    MS_CUDA_CHECK(cudaEventCreate(&a));
    MS_CUDA_CHECK(cudaEventCreate(&b));
    auto time_copy = [&](void* dst, const void* src, size_t bytes, cudaMemcpyKind kind, int reps) {
      double best = 1e30;
      for (int r = 0; r < reps; ++r) {
        MS_CUDA_CHECK(cudaEventRecord(a, compute_));
        MS_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, kind, compute_));
        MS_CUDA_CHECK(cudaEventRecord(b, compute_));
        MS_CUDA_CHECK(cudaEventSynchronize(b));
        float ms = 0;
        MS_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
        best = std::min(best, double(ms) / 1e3);
      }
      return best;
    };
    const size_t big = size_t(1) << 30, host_bytes = size_t(256) << 20;
    void *d0 = nullptr, *d1 = nullptr, *h = nullptr;
    MS_CUDA_CHECK(cudaMalloc(&d0, big));
    MS_CUDA_CHECK(cudaMalloc(&d1, big));
    MS_CUDA_CHECK(cudaMemset(d0, 1, big));
    l.d2d_gb_per_s = 2.0 * double(big) / time_copy(d1, d0, big, cudaMemcpyDeviceToDevice, 5) / 1e9;
    MS_CUDA_CHECK(cudaHostAlloc(&h, host_bytes, cudaHostAllocDefault));
    std::memset(h, 1, host_bytes);
    l.h2d_pinned_gb_per_s = double(host_bytes) / time_copy(d0, h, host_bytes, cudaMemcpyHostToDevice, 3) / 1e9;
    const size_t slot = std::min<size_t>(host_bytes, opt_.max_expert_bytes ? opt_.max_expert_bytes : (size_t(3) << 20));
    double t = 0;
    const int n = int(host_bytes / slot);
    for (int i = 0; i < n; ++i)
      t += time_copy(static_cast<char*>(d0) + size_t(i) * slot, static_cast<char*>(h) + size_t(i) * slot, slot,
                     cudaMemcpyHostToDevice, 1);
    l.h2d_slot_gb_per_s = double(slot) * n / t / 1e9;
    MS_CUDA_CHECK(cudaFreeHost(h));
    // The GEMV kernel on one token: bf16 [4096, 2048] (an attention projection), bf16
    // [151936, 2048] (an output head) and q4g64 [768 x 3, 2048] (one expert's gate/up/down
    // bytes), weights read per second; and the host cost of one kernel launch.
    auto gemv = [&](int64_t rows, int64_t cols, bool q4) {
      Matrix m{"probe", q4 ? DType::U32 : DType::BF16, d0, rows, cols};
      if (q4) {
        m.quant = QuantFormat{4, 64, DType::BF16};
        m.scales = static_cast<char*>(d0) + size_t(rows * cols / 2);
        m.biases = static_cast<const char*>(m.scales) + size_t(rows * cols / 64 * 2);
      }
      const size_t bytes = q4 ? size_t(rows * cols / 2 + rows * cols / 64 * 4) : size_t(rows * cols * 2);
      float* x = static_cast<float*>(d1);
      float* y = x + cols;
      MS_CUDA_CHECK(cudaMemset(d0, 0x3c, bytes));  // finite values in every format
      MS_CUDA_CHECK(cudaMemset(x, 0, size_t(cols) * 4));
      double best = 1e30;
      for (int r = 0; r < 5; ++r) {
        MS_CUDA_CHECK(cudaEventRecord(a, compute_));
        for (int i = 0; i < 10; ++i) cuda::linear(m, x, cols, 1, nullptr, y, rows, gemm_, compute_);
        MS_CUDA_CHECK(cudaEventRecord(b, compute_));
        MS_CUDA_CHECK(cudaEventSynchronize(b));
        float ms = 0;
        MS_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
        best = std::min(best, double(ms) / 1e3 / 10);
      }
      return double(bytes) / best / 1e9;
    };
    l.gemv_bf16_gb_per_s = gemv(4096, 2048, false);
    l.gemv_bf16_head_gb_per_s = gemv(151936, 2048, false);
    l.gemv_q4_gb_per_s = gemv(3 * 768, 2048, true);
    {
      const int n = 2000;
      float* x = static_cast<float*>(d1);
      auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < n; ++i) cuda::add(x, x + 64, 64, compute_);
      const double host = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      MS_CUDA_CHECK(cudaStreamSynchronize(compute_));
      const double all = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      l.launch_us = host / n * 1e6;
      l.launch_drain_us = all / n * 1e6;
      auto t1 = std::chrono::steady_clock::now();
      for (int i = 0; i < 200; ++i) {  // a round trip: one small launch, then wait for it
        cuda::add(x, x + 64, 64, compute_);
        MS_CUDA_CHECK(cudaStreamSynchronize(compute_));
      }
      l.round_trip_us = std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count() / 200 * 1e6;
    }
    MS_CUDA_CHECK(cudaFree(d0));
    MS_CUDA_CHECK(cudaFree(d1));
    MS_CUDA_CHECK(cudaEventDestroy(a));
    MS_CUDA_CHECK(cudaEventDestroy(b));
    return l;
  }

  GpuTierStats tier_stats() const {
    GpuTierStats s = stats_;
    s.slot_bytes = slot_bytes_;
    s.slots = n_slots_;
    s.pinned_bytes = pinned_.total();
    s.device = device_name_;
    return s;
  }

 private:
  enum ScratchSlot {
    kTokens, kMlpGate, kMlpUp, kLogits, kSelIds, kSelW, kNActive, kActive, kOffset, kRowToken, kRowOf, kHidden, kY,
  };

  void* upload(const void* src, size_t bytes) {
    void* p = nullptr;
    MS_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(bytes, 16)));
    MS_CUDA_CHECK(cudaMemcpy(p, src, bytes, cudaMemcpyHostToDevice));
    device_allocs_.insert(p);
    return p;
  }

  // Pinned host staging area `slot`, grown as needed (the caller orders its reuse).
  template <class T>
  T* staging(int slot, size_t count) {
    if (staging_.size() <= size_t(slot)) staging_.resize(size_t(slot) + 1, {nullptr, 0});
    auto& [p, n] = staging_[size_t(slot)];
    const size_t bytes = count * sizeof(T);
    if (n < bytes) {
      MS_CUDA_CHECK(cudaStreamSynchronize(compute_));
      if (p) MS_CUDA_CHECK(cudaFreeHost(p));
      p = nullptr;
      MS_CUDA_CHECK(cudaHostAlloc(&p, bytes, cudaHostAllocDefault));
      n = bytes;
    }
    return static_cast<T*>(p);
  }

  const float* inv_freq(const RopeTable& r) {
    auto it = rope_tables_.find(r.inv_freq.data());
    if (it == rope_tables_.end() || it->second.host != r.inv_freq) {
      RopeDevice d{r.inv_freq, static_cast<float*>(upload(r.inv_freq.data(), r.inv_freq.size() * sizeof(float)))};
      it = rope_tables_.insert_or_assign(r.inv_freq.data(), std::move(d)).first;
    }
    return it->second.dev;
  }

  // --- the VRAM expert tier -----------------------------------------------------------------
  void init_tier(const MoeParams& p, uint64_t first_expert_bytes);
  void ensure_table(int layer);
  void upload_table_row(int layer);
  void load_expert(int layer, int expert, const MlpWeights& w, int slot);
  void touch(int slot);

  // Every MoE layer has all its experts in VRAM: a step needs no host round trip.
  bool all_resident() const {
    return tier_ready_ && prefetch_layers_ && n_experts_ > 0 &&
           int64_t(full_layers_) * n_experts_ == opt_.total_experts;
  }

  void finish_capture() {
    capturing_ = false;
    cudaGraph_t g = nullptr;
    MS_CUDA_CHECK(cudaStreamEndCapture(compute_, &g));
    if (exec_) {
      cudaGraphExecUpdateResultInfo info{};
      if (cudaGraphExecUpdate(exec_, g, &info) != cudaSuccess) {
        cudaGetLastError();
        cudaGraphExecDestroy(exec_);
        exec_ = nullptr;
      }
    }
    if (!exec_) MS_CUDA_CHECK(cudaGraphInstantiate(&exec_, g, 0));
    MS_CUDA_CHECK(cudaGraphDestroy(g));
    MS_CUDA_CHECK(cudaGraphLaunch(exec_, compute_));
    ++stats_.graph_steps;
  }

  void op_done() {
    if (sync_ops_) MS_CUDA_CHECK(cudaStreamSynchronize(compute_));
  }

  CudaOptions opt_;
  bool sync_ops_ = false;
  bool graphs_ = true;          // MOESTREAM_CUDA_GRAPHS=0 turns decode-step graphs off
  bool capturing_ = false;
  int decode_streak_ = 0;
  cudaGraphExec_t exec_ = nullptr;
  int full_layers_ = 0;         // layers with every expert in VRAM
  std::string device_name_;
  cudaStream_t compute_ = nullptr, copy_ = nullptr;
  cudaEvent_t copy_start_ = nullptr, copy_done_ = nullptr, staging_free_ = nullptr;
  // A miss call's copies end at copies_end_. The host does not wait for it: the call's host slots
  // are released, and the copy time counted, by settle_copies() at the next miss call, before it
  // asks the store for anything (a store releases by its current layer).
  cudaEvent_t copies_end_ = nullptr;
  ExpertSource* unsettled_store_ = nullptr;
  std::vector<int> unsettled_;
  bool unsettled_timing_ = false;
  void settle_copies() {
    if (unsettled_.empty() && !unsettled_timing_) return;
    MS_CUDA_CHECK(cudaEventSynchronize(copies_end_));
    if (unsettled_timing_) {
      float ms = 0;
      MS_CUDA_CHECK(cudaEventElapsedTime(&ms, copy_start_, copies_end_));
      stats_.h2d_seconds += ms / 1e3;  // from the call's first copy's start to its last's end
      unsettled_timing_ = false;
    }
    for (int e : unsettled_) unsettled_store_->release(e);
    unsettled_.clear();
  }
  std::unordered_set<void*> device_allocs_;
  std::vector<std::pair<void*, size_t>> staging_;
  Scratch scratch_, deltanet_scratch_;
  GemmScratch gemm_;
  PinnedPool pinned_;
  struct RopeDevice {
    std::vector<float> host;
    float* dev;
  };
  std::unordered_map<const float*, RopeDevice> rope_tables_;

  // Slots: n_slots_ of slot_bytes_ in one arena; slot_owner_ (layer, expert) or (-1, -1).
  bool tier_ready_ = false;
  uint64_t slot_bytes_ = 0, n_slots_ = 0;
  char* slot_arena_ = nullptr;
  std::vector<std::pair<int, int>> slot_owner_;
  std::vector<uint64_t> slot_call_;       // the call that last used the slot
  std::list<int> lru_;                    // least recently used first
  std::vector<std::list<int>::iterator> lru_pos_;
  std::vector<std::vector<int>> where_;   // [layer][expert] -> slot or -1
  std::vector<int> resident_;             // experts of each layer in VRAM
  std::vector<FormatTag> gate_up_fmt_, down_fmt_;
  std::vector<char> fmt_known_;
  int n_experts_ = 0, layers_cap_ = 0;
  DevExpert* table_dev_ = nullptr;        // [layers_cap_][n_experts_]
  DevExpert* table_host_ = nullptr;       // pinned mirror
  bool prefetch_layers_ = false;          // the budget holds every expert: fill whole layers
  uint64_t call_ = 0;
  GpuTierStats stats_;
  std::vector<std::vector<int>> pairs_of_;  // expert -> its (token, slot) pair indices
  std::vector<int64_t> inter_;              // intermediate size of each layer's experts
  std::vector<int> hits_, request_, deferred_;
};

bool all_resident_formats_known(const std::vector<char>& known, int layer) {
  return size_t(layer) < known.size() && known[size_t(layer)];
}

void CudaBackend::init_tier(const MoeParams& p, uint64_t first_expert_bytes) {
  n_experts_ = p.n_experts;
  slot_bytes_ = opt_.max_expert_bytes ? opt_.max_expert_bytes : first_expert_bytes;
  slot_bytes_ = (slot_bytes_ + 255) / 256 * 256;
  double budget;
  if (opt_.gpu_expert_mb >= 0) {
    budget = opt_.gpu_expert_mb * 1e6;
  } else {
    size_t free_b = 0, total_b = 0;
    MS_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    const double reserve = std::max(2.0e9, 0.06 * double(total_b));  // activations, scratch, later KV caches
    budget = std::max(0.0, double(free_b) - reserve);
  }
  n_slots_ = std::max<uint64_t>(1, uint64_t(budget / double(slot_bytes_)));
  if (opt_.total_experts > 0) n_slots_ = std::min<uint64_t>(n_slots_, uint64_t(opt_.total_experts));
  prefetch_layers_ = opt_.total_experts > 0 && n_slots_ >= uint64_t(opt_.total_experts);
  MS_CUDA_CHECK(cudaMalloc(&slot_arena_, n_slots_ * slot_bytes_));
  slot_owner_.assign(n_slots_, {-1, -1});
  slot_call_.assign(n_slots_, 0);
  lru_pos_.resize(n_slots_);
  for (uint64_t s = 0; s < n_slots_; ++s) lru_pos_[s] = lru_.insert(lru_.end(), int(s));
  tier_ready_ = true;
}

void CudaBackend::ensure_table(int layer) {
  if (layer < layers_cap_) return;
  const int cap = std::max(layer + 1, layers_cap_ * 2);
  MS_CUDA_CHECK(cudaStreamSynchronize(compute_));
  DevExpert* dev = nullptr;
  DevExpert* host = nullptr;
  const size_t n = size_t(cap) * size_t(n_experts_);
  MS_CUDA_CHECK(cudaMalloc(&dev, n * sizeof(DevExpert)));
  MS_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&host), n * sizeof(DevExpert), cudaHostAllocDefault));
  for (size_t i = 0; i < n; ++i) host[i] = DevExpert{};
  if (table_host_) {
    std::copy(table_host_, table_host_ + size_t(layers_cap_) * n_experts_, host);
    MS_CUDA_CHECK(cudaFreeHost(table_host_));
    MS_CUDA_CHECK(cudaFree(table_dev_));
  }
  MS_CUDA_CHECK(cudaMemcpy(dev, host, n * sizeof(DevExpert), cudaMemcpyHostToDevice));
  table_dev_ = dev;
  table_host_ = host;
  layers_cap_ = cap;
  where_.resize(size_t(cap));
  resident_.resize(size_t(cap), 0);
  gate_up_fmt_.resize(size_t(cap));
  down_fmt_.resize(size_t(cap));
  fmt_known_.resize(size_t(cap), 0);
}

void CudaBackend::upload_table_row(int layer) {
  const size_t off = size_t(layer) * size_t(n_experts_);
  MS_CUDA_CHECK(cudaMemcpyAsync(table_dev_ + off, table_host_ + off, size_t(n_experts_) * sizeof(DevExpert),
                                cudaMemcpyHostToDevice, compute_));
}

void CudaBackend::touch(int slot) {
  lru_.splice(lru_.end(), lru_, lru_pos_[size_t(slot)]);
  slot_call_[size_t(slot)] = call_;
}

// The byte range [lo, hi) of host memory an expert's tensors occupy.
void expert_extent(const MlpWeights& w, const char*& lo, const char*& hi) {
  lo = nullptr;
  hi = nullptr;
  auto span = [&](const void* p, size_t n) {
    if (!p) return;
    const char* c = static_cast<const char*>(p);
    if (!lo || c < lo) lo = c;
    if (!hi || c + n > hi) hi = c + n;
  };
  for (const Matrix* m : {&w.gate, &w.up, &w.down}) {
    if (m->quant.bits) {  // affine, MXFP4 (no biases), FP8 (no biases; a row's last group may be partial)
      const int64_t g = m->quant.group_size;
      span(m->data, size_t(m->rows * m->cols * m->quant.bits / 8));
      const size_t groups = size_t(m->rows * ((m->cols + g - 1) / g));
      span(m->scales, groups * dtype_size(m->quant.scale_dtype));
      span(m->biases, groups * dtype_size(m->quant.scale_dtype));
    } else {
      span(m->data, size_t(m->rows * m->cols) * dtype_size(m->dtype));
    }
  }
  for (const Vector* v : {&w.gate_bias, &w.up_bias, &w.down_bias}) span(v->data, size_t(v->size) * sizeof(float));
}

void CudaBackend::load_expert(int layer, int expert, const MlpWeights& w, int slot) {
  const char* lo;
  const char* hi;
  expert_extent(w, lo, hi);
  const uint64_t bytes = uint64_t(hi - lo);
  if (bytes > slot_bytes_)
    fail("cuda: expert ", expert, " of layer ", layer, " takes ", bytes, " bytes, more than a slot (", slot_bytes_, ")");
  const FormatTag gu = format_of(w.gate), dn = format_of(w.down);
  if (!(format_of(w.up) == gu)) fail("cuda: expert ", expert, " of layer ", layer, ": gate and up differ in format");
  if (!fmt_known_[size_t(layer)]) {
    gate_up_fmt_[size_t(layer)] = gu;
    down_fmt_[size_t(layer)] = dn;
    fmt_known_[size_t(layer)] = 1;
  } else if (!(gate_up_fmt_[size_t(layer)] == gu) || !(down_fmt_[size_t(layer)] == dn)) {
    fail("cuda: expert ", expert, " of layer ", layer,
         " is stored in another format than the layer's other experts (mixed formats in one layer are not supported on CUDA)");
  }
  char* dst = slot_arena_ + uint64_t(slot) * slot_bytes_;
  // Evict the previous owner.
  auto [old_layer, old_expert] = slot_owner_[size_t(slot)];
  if (old_layer >= 0) {
    where_[size_t(old_layer)][size_t(old_expert)] = -1;
    if (resident_[size_t(old_layer)]-- == n_experts_) --full_layers_;
    table_host_[size_t(old_layer) * n_experts_ + size_t(old_expert)] = DevExpert{};
  }
  MS_CUDA_CHECK(cudaMemcpyAsync(dst, lo, bytes, cudaMemcpyHostToDevice, copy_));
  auto rebase = [&](const void* p) -> const void* { return p ? dst + (static_cast<const char*>(p) - lo) : nullptr; };
  auto ref = [&](const Matrix& m) {
    WeightRef r = weight_ref(m);
    r.data = rebase(m.data);
    r.scales = rebase(m.scales);
    r.biases = static_cast<const uint16_t*>(rebase(m.biases));
    return r;
  };
  DevExpert d;
  d.gate = ref(w.gate);
  d.up = ref(w.up);
  d.down = ref(w.down);
  d.gate_bias = static_cast<const float*>(rebase(w.gate_bias.data));
  d.up_bias = static_cast<const float*>(rebase(w.up_bias.data));
  d.down_bias = static_cast<const float*>(rebase(w.down_bias.data));
  table_host_[size_t(layer) * n_experts_ + size_t(expert)] = d;
  slot_owner_[size_t(slot)] = {layer, expert};
  where_[size_t(layer)][size_t(expert)] = slot;
  if (++resident_[size_t(layer)] == n_experts_) ++full_layers_;
  touch(slot);
  stats_.bytes_h2d += bytes;
}

void CudaBackend::moe(const Buffer& x, const Matrix& router, ExpertSource& store, const MoeParams& p, Buffer& out) {
  const int64_t T = x.rows, dim = x.cols;
  const int K = p.top_k, E = p.n_experts, layer = p.layer;
  if (T == 0) return;
  if (router.rows != E || router.cols != dim)
    fail("moe: router ", router.name, " is [", router.rows, ", ", router.cols, "], expected [", E, ", ", dim, "]");
  auto t_start = std::chrono::steady_clock::now();
  const int64_t pairs = T * K;
  float* logits = scratch_.get(kLogits, size_t(T * E));
  int* sel_ids = scratch_.get<int>(kSelIds, size_t(pairs));
  float* sel_w = scratch_.get(kSelW, size_t(pairs));
  MoeGroups g;
  g.n_active = scratch_.get<int>(kNActive, 1);
  g.active = scratch_.get<int>(kActive, size_t(std::min<int64_t>(E, pairs)));
  g.offset = scratch_.get<int>(kOffset, size_t(std::min<int64_t>(E, pairs) + 1));
  g.row_token = scratch_.get<int>(kRowToken, size_t(pairs));
  g.row_of = scratch_.get<int>(kRowOf, size_t(pairs));
  // Routing compares logits: float32 activations, like the CPU.
  cuda::linear(router, x.data, dim, T, nullptr, logits, E, gemm_, compute_);
  if (tier_ready_ && n_experts_ != E) fail("moe: layer ", layer, " has ", E, " experts, an earlier one ", n_experts_);
  const bool resident = tier_ready_ && layer < layers_cap_ && resident_[size_t(layer)] == E &&
                        all_resident_formats_known(fmt_known_, layer);
  cuda::route(logits, T, p, p.router_bias ? p.router_bias->data : nullptr, sel_ids, sel_w,
              resident && T == 1 ? &g : nullptr, compute_);

  ExpertBatch b;
  b.dim = dim;
  b.x = x.data;
  b.params = &p;
  b.one_token = T == 1;
  b.groups = g;
  b.hidden = nullptr;
  b.y = nullptr;
  auto t_routed = std::chrono::steady_clock::now();
  times_.routing += std::chrono::duration<double>(t_routed - t_start).count();
  ScopedTimer compute(times_.expert_compute);

  // The layer's expert table, formats and buffers, once its tier state is known.
  auto bind_layer = [&]() {
    b.table = table_dev_ + size_t(layer) * E;
    b.gate_up = gate_up_fmt_[size_t(layer)];
    b.down = down_fmt_[size_t(layer)];
    b.inter = inter_[size_t(layer)];
    b.hidden = scratch_.get(kHidden, size_t(pairs * b.inter));
    b.y = scratch_.get(kY, size_t(pairs * dim));
  };

  if (resident) {
    ++stats_.resident_calls;
    bind_layer();
    if (T > 1) cuda::group_by_expert(sel_ids, T, K, E, g, compute_);
    b.count_on_device = true;
    b.a_begin = 0;
    b.a_end = int(std::min<int64_t>(E, pairs));
    cuda::run_experts(b, compute_);
    cuda::combine(b.y, sel_w, g.row_of, T, K, dim, out.data, compute_);
    op_done();
    return;
  }

  // The chosen experts come back to the host.
  int* ids_host = staging<int>(1, size_t(pairs));
  MS_CUDA_CHECK(cudaMemcpyAsync(ids_host, sel_ids, size_t(pairs) * sizeof(int), cudaMemcpyDeviceToHost, compute_));
  MS_CUDA_CHECK(cudaStreamSynchronize(compute_));
  ++call_;
  pairs_of_.resize(size_t(E));
  for (auto& v : pairs_of_) v.clear();
  for (int64_t i = 0; i < pairs; ++i) {
    const int e = ids_host[i];
    if (e < 0 || e >= E) fail("moe: routing produced expert ", e, " for layer ", layer);
    pairs_of_[size_t(e)].push_back(int(i));
  }

  // Host-built groups, uploaded range by range as batches launch.
  const int64_t max_active = std::min<int64_t>(E, pairs);
  int* act_h = staging<int>(2, size_t(max_active));
  int* off_h = staging<int>(3, size_t(max_active + 1));
  int* row_token_h = staging<int>(4, size_t(pairs));
  int* row_of_h = staging<int>(5, size_t(pairs));
  int n_active = 0, row = 0;
  off_h[0] = 0;
  auto append = [&](int e) {
    act_h[n_active] = e;
    for (int i : pairs_of_[size_t(e)]) {
      row_token_h[row] = i;
      row_of_h[i] = row;
      ++row;
    }
    ++n_active;
    off_h[n_active] = row;
  };
  int launched = 0;
  bool copies = false;  // expert copies issued on the copy stream in this call
  auto launch = [&]() {  // the appended experts not launched yet, as one batch
    if (launched == n_active) return;
    const int a0 = launched, a1 = n_active;
    if (copies) {  // the batch reads slots the copy stream fills
      MS_CUDA_CHECK(cudaEventRecord(copy_done_, copy_));
      MS_CUDA_CHECK(cudaStreamWaitEvent(compute_, copy_done_, 0));
    }
    MS_CUDA_CHECK(cudaMemcpyAsync(g.active + a0, act_h + a0, size_t(a1 - a0) * sizeof(int), cudaMemcpyHostToDevice, compute_));
    MS_CUDA_CHECK(cudaMemcpyAsync(g.offset + a0, off_h + a0, size_t(a1 - a0 + 1) * sizeof(int), cudaMemcpyHostToDevice, compute_));
    MS_CUDA_CHECK(cudaMemcpyAsync(g.row_token + off_h[a0], row_token_h + off_h[a0], size_t(off_h[a1] - off_h[a0]) * sizeof(int),
                                  cudaMemcpyHostToDevice, compute_));
    upload_table_row(layer);
    bind_layer();
    b.count_on_device = false;
    b.a_begin = a0;
    b.a_end = a1;
    cuda::run_experts(b, compute_);
    launched = a1;
  };

  std::vector<int>& hits = hits_;
  std::vector<int>& request = request_;
  hits.clear();
  request.clear();
  if (tier_ready_) ensure_table(layer);
  for (int e = 0; e < E; ++e) {
    if (pairs_of_[size_t(e)].empty()) continue;
    const bool in_vram = tier_ready_ && !where_[size_t(layer)].empty() && where_[size_t(layer)][size_t(e)] >= 0;
    if (in_vram) hits.push_back(e);
    else request.push_back(e);
  }
  stats_.hits += hits.size();
  stats_.misses += request.size();
  const size_t n_selected_misses = request.size();
  if (tier_ready_ && !hits.empty()) {
    for (int e : hits) {
      touch(where_[size_t(layer)][size_t(e)]);
      append(e);
    }
    launch();
  }
  const bool fill_layer = prefetch_layers_ && tier_ready_ && resident_[size_t(layer)] < E;
  if (!request.empty() || fill_layer) {
    if (fill_layer) {
      for (int e = 0; e < E; ++e)
        if (pairs_of_[size_t(e)].empty() && (where_[size_t(layer)].empty() || where_[size_t(layer)][size_t(e)] < 0))
          request.push_back(e);
    }
    settle_copies();
    store.request(layer, request);
    // The store may reuse a host slot once it is released, so a copy must finish first. Releases
    // are batched: up to a quarter of the store's slots (all, when it is unbounded) wait for one
    // synchronization of the copy stream.
    const double host_slot = double(opt_.max_expert_bytes ? opt_.max_expert_bytes : slot_bytes_);
    const size_t max_deferred =
        opt_.host_expert_mb < 0 ? SIZE_MAX : size_t(std::max(1.0, opt_.host_expert_mb * 1e6 / host_slot) / 4);
    std::vector<int>& deferred = deferred_;
    deferred.clear();
    auto release_deferred = [&]() {
      if (deferred.empty()) return;
      MS_CUDA_CHECK(cudaStreamSynchronize(copy_));
      for (int d : deferred) store.release(d);
      deferred.clear();
    };
    size_t selected_loaded = 0;
    int e;
    MlpWeights w;
    while (store.next(e, w)) {
      if (!tier_ready_) {
        const char* lo;
        const char* hi;
        expert_extent(w, lo, hi);
        init_tier(p, uint64_t(hi - lo));
        ensure_table(layer);
      }
      if (where_[size_t(layer)].empty()) where_[size_t(layer)].assign(size_t(E), -1);
      if (int64_t(inter_.size()) <= layer) inter_.resize(size_t(layer) + 1, 0);
      inter_[size_t(layer)] = w.gate.rows;
      const bool selected = !pairs_of_[size_t(e)].empty();
      int slot = -1;
      for (;;) {  // the least recently used slot that this call does not hold
        for (int s : lru_)
          if (slot_call_[size_t(s)] != call_) {
            slot = s;
            break;
          }
        if (slot >= 0) break;
        // Every slot holds an expert of this call: compute those, then reuse their slots.
        launch();
        MS_CUDA_CHECK(cudaStreamSynchronize(compute_));
        for (uint64_t s = 0; s < n_slots_; ++s) slot_call_[s] = 0;
      }
      if (!selected) ++stats_.prefetched;
      if (!copies) MS_CUDA_CHECK(cudaEventRecord(copy_start_, copy_));
      copies = true;
      load_expert(layer, e, w, slot);
      deferred.push_back(e);
      if (deferred.size() >= max_deferred) release_deferred();
      if (selected) {
        append(e);
        if (++selected_loaded == n_selected_misses) launch();
      }
    }
    launch();
    if (copies) {  // settled by the next miss call (settle_copies), not waited for here
      MS_CUDA_CHECK(cudaEventRecord(copies_end_, copy_));
      unsettled_timing_ = true;
    }
    unsettled_store_ = &store;
    unsettled_.insert(unsettled_.end(), deferred.begin(), deferred.end());
    deferred.clear();
  }
  upload_table_row(layer);
  MS_CUDA_CHECK(cudaMemcpyAsync(g.row_of, row_of_h, size_t(pairs) * sizeof(int), cudaMemcpyHostToDevice, compute_));
  cuda::combine(b.y, sel_w, g.row_of, T, K, dim, out.data, compute_);
  op_done();
}

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
