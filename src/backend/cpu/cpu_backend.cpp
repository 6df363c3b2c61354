// The CPU backend: float32 activations in host memory, weights read in place from the mapping,
// work split across a thread pool by output rows (linear) or by (token, head) (attention).
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <numeric>
#include <unordered_map>

#include "backend/backend.h"
#include "backend/cpu/attention_blocks.h"
#include "backend/cpu/deltanet.h"
#include "backend/cpu/kernels.h"
#include "backend/cpu/kv_attention.h"
#include "backend/expert_provider.h"
#include "core/error.h"
#include "core/quant.h"
#include "core/thread_pool.h"

namespace moestream {

namespace {

// Rows per task: enough work per chunk to amortize the hand-off.
size_t rows_per_chunk(int64_t cols, int64_t tokens) {
  return size_t(std::max<int64_t>(1, 16384 / std::max<int64_t>(1, cols * tokens)));
}

// The same for a loop over n rows of products that go through the panel GEMM (several tokens:
// gemm.h): whole panels of kPanelAlign rows per chunk (a chunk cut inside a panel leaves the
// micro-kernel's lanes idle and dequantizes the panel twice), and no more chunks than the pool
// would cut (ThreadPool::kChunksPerThread a thread). One token (the GEMV) keeps rows_per_chunk. The
// chunks change no row's value.
constexpr size_t kPanelAlign = 32;  // the AVX-512 panel (AVX2's 16 divides it)
size_t gemm_rows_per_chunk(int64_t cols, int64_t tokens, size_t n, size_t threads) {
  const size_t base = rows_per_chunk(cols, tokens);
  if (tokens <= 1) return base;
  const size_t per_thread =
      (n + threads * ThreadPool::kChunksPerThread - 1) / (threads * ThreadPool::kChunksPerThread);
  return (std::max(base, per_thread) + kPanelAlign - 1) / kPanelAlign * kPanelAlign;
}

class CpuBackend final : public Backend {
 public:
  CpuBackend(int n_threads, bool precise, int spin_micros)
      : pool_(n_threads, spin_micros), precise_(precise) {}
  ~CpuBackend() override {
    for (auto& [p, bytes] : growable_) munmap(p, bytes);
    lent_.clear();  // before the arena's bookkeeping goes: the last references hand ranges back
    sealed_.clear();
    if (arena_fd_ >= 0) close(arena_fd_);
  }
  CpuBackend(const CpuBackend&) = delete;
  CpuBackend& operator=(const CpuBackend&) = delete;

  std::string name() const override { return "cpu(" + std::to_string(pool_.size()) + " threads)"; }

  Matrix load_matrix(const TensorView& t) override {
    check_matrix_tensor(t);
    return Matrix{t.name, t.dtype, t.data, t.shape[0], t.shape[1]};
  }

  Matrix load_quantized(const TensorView& words, const TensorView& scales, const TensorView& biases,
                        const QuantFormat& f) override {
    return quantized_matrix_view(words, scales, biases, f);  // read in place from the mapping
  }

  Vector load_vector(const TensorView& t) override {
    check_vector_tensor(t);
    std::vector<float>& v = vectors_.emplace_back(size_t(t.shape[0]));
    Matrix as_row{t.name, t.dtype, t.data, 1, t.shape[0]};
    cpu::row_to_f32(as_row, 0, v.data());
    return Vector{t.name, v.data(), t.shape[0]};
  }

  Buffer alloc(int64_t rows, int64_t cols) override {
    auto mem = std::make_unique<float[]>(size_t(rows * cols));
    float* p = mem.get();
    allocations_.emplace(p, std::move(mem));
    return Buffer{p, rows, cols};
  }
  void free(Buffer& b) override {
    if (auto g = growable_.find(b.data); g != growable_.end()) {
      munmap(b.data, g->second);
      growable_.erase(g);
      if (auto s = sealed_.find(b.data); s != sealed_.end()) {
        s->second->lender_alive = false;
        sealed_.erase(s);
      }
      lent_.erase(b.data);
    }
    allocations_.erase(b.data);
    b = Buffer{};
  }

  // Growable buffers are anonymous mappings that reserve no swap: the kernel gives a page memory
  // when it is first written, so committing is only bookkeeping and decommitting hands pages back.
  Buffer alloc_growable(int64_t rows, int64_t cols) override {
    const size_t bytes = size_t(std::max<int64_t>(1, growable_bytes(rows, cols)));
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) fail("KV cache: cannot reserve ", bytes, " bytes of address space");
    growable_.emplace(static_cast<float*>(p), bytes);
    return Buffer{static_cast<float*>(p), rows, cols};
  }
  void decommit_rows(Buffer& b, int64_t rows) override {
    auto g = growable_.find(b.data);
    if (g == growable_.end()) return;
    const size_t keep = size_t(growable_bytes(std::min(rows, b.rows), b.cols));
    if (auto l = lent_.find(b.data); l != lent_.end() && keep < l->second.bytes) {
      // Borrowed pages past `keep` go back to the lender; the rows read as zeros again.
      map_anonymous(b.data, keep, l->second.bytes);
      if (keep == 0) lent_.erase(l);
      else l->second.bytes = keep;
    }
    if (keep < g->second)
      madvise(reinterpret_cast<char*>(b.data) + keep, g->second - keep, MADV_DONTNEED);
  }
  // A sealed buffer's whole pages move into a memory file (one for the backend, pages placed at
  // page-aligned offsets), mapped back privately at the same address; copy_rows from it maps
  // the same pages privately into the destination, so that either side's writes copy the page
  // they touch (the kernel's copy-on-write) and the other keeps reading the sealed rows. A range
  // of the file is handed back only once neither its buffer nor any borrower maps it.
  void seal_rows(Buffer& b, int64_t rows) override {
    if (!growable_.count(b.data) || sealed_.count(b.data) || lent_.count(b.data)) return;
    const size_t bytes = size_t(std::min(rows, b.rows) * b.cols) * sizeof(float) / kPage * kPage;
    if (bytes == 0 || !open_arena()) return;
    // Whatever fails here (no memory for the file, no mapping left) leaves the buffer as it was,
    // unsealed: copies from it then copy.
    const int64_t offset = arena_take(bytes);
    if (offset < 0) return;
    char* data = reinterpret_cast<char*>(b.data);
    if (!arena_io(pwrite, data, bytes, offset)) return arena_give(offset, bytes);
    if (!map_arena(b.data, bytes, offset)) {  // fresh zero pages there now: read the rows back
      if (!arena_io(pread, data, bytes, offset)) fail("KV cache: cannot read back ", bytes, " bytes of a snapshot");
      return arena_give(offset, bytes);
    }
    sealed_[b.data] = std::shared_ptr<SealedPages>(new SealedPages{offset, bytes, true}, [this](SealedPages* r) {
      arena_give(r->offset, r->bytes);
      delete r;
    });
  }
  int64_t lent_bytes(const Buffer& b) const override {
    const auto l = lent_.find(b.data);
    // Once the lender is gone the pages are the borrowers' to count (each counts them: never less
    // than the memory held).
    return l == lent_.end() || !l->second.pages->lender_alive ? 0 : int64_t(l->second.bytes);
  }
  int64_t growable_bytes(int64_t rows, int64_t cols) const override {
    return (rows * cols * int64_t(sizeof(float)) + kPage - 1) / kPage * kPage;
  }
  void to_host(const Buffer& b, float* dst) override {
    std::memcpy(dst, b.data, size_t(b.rows * b.cols) * sizeof(float));
  }
  void copy_rows(const Buffer& src, Buffer& dst, int64_t rows) override {
    check_copy_rows(src, dst, rows);
    const size_t n = size_t(rows * src.cols);
    if (n == 0) return;
    size_t shared = 0;
    if (growable_.count(dst.data) && !sealed_.count(dst.data)) {
      if (auto l = lent_.find(dst.data); l != lent_.end()) {  // drop what it borrowed before
        map_anonymous(dst.data, 0, l->second.bytes);
        lent_.erase(l);
      }
      if (auto s = sealed_.find(src.data); s != sealed_.end()) {
        shared = std::min(n * sizeof(float) / kPage * kPage, s->second->bytes);
        if (shared > 0 && map_arena(dst.data, shared, s->second->offset)) lent_[dst.data] = Lent{s->second, shared};
        else shared = 0;  // nothing to lend, or no mapping left: copy after all
      }
    }
    std::memcpy(reinterpret_cast<char*>(dst.data) + shared, reinterpret_cast<const char*>(src.data) + shared,
                n * sizeof(float) - shared);
  }

  void embed(std::span<const int32_t> tokens, const Matrix& table, Buffer& out) override {
    check_embed_args(tokens, table, out);
    for (size_t t = 0; t < tokens.size(); ++t) cpu::row_to_f32(table, tokens[t], out.data + t * out.cols);
  }

  void rmsnorm(const Buffer& x, const Vector& w, float eps, int64_t group, Buffer& out) override {
    const int64_t groups = x.rows * x.cols / group;
    pool_.parallel_for(size_t(groups), [&](size_t g0, size_t g1) {
      for (int64_t g = int64_t(g0); g < int64_t(g1); ++g) {
        const float* src = x.data + g * group;
        float* dst = out.data + g * group;
        float ss = 0;
        for (int64_t i = 0; i < group; ++i) ss += src[i] * src[i];
        const float inv = 1.0f / std::sqrt(ss / float(group) + eps);
        for (int64_t i = 0; i < group; ++i) dst[i] = w.data[i] * (src[i] * inv);
      }
    }, ThreadPool::elementwise_chunk(group));
  }

  void linear(const Buffer& x, const Matrix& w, const Vector* bias, Buffer& out) override {
    linear(x, w, bias, out, precise_);
  }

  void linear(const Buffer& x, const Matrix& w, const Vector* bias, Buffer& out, bool precise) {
    if (x.cols != w.cols)
      fail("linear ", w.name, ": input has ", x.cols, " columns, weight expects ", w.cols);
    const int64_t T = x.rows, n_out = w.rows;
    cpu::prepare_input(w, x.data, T, precise, input_);
    pool_.parallel_for(size_t(n_out), [&](size_t r0, size_t r1) {
      cpu::matmul_rows(w, input_, out.data, n_out, int64_t(r0), int64_t(r1));
    }, gemm_rows_per_chunk(w.cols, T, size_t(n_out), size_t(pool_.size())));
    if (bias) add_bias(Buffer{out.data, T, n_out}, *bias);
  }

  // Matrices of one format and width over the same x (q, k and v): x prepared once and all their
  // rows in one parallel loop, each row computed as linear() computes it.
  void linear_shared_input(const Buffer& x, std::span<const Matrix* const> w, std::span<const Vector* const> bias,
                           std::span<Buffer* const> out) override {
    bool same = w.size() > 1 && w.size() == bias.size() && w.size() == out.size();
    for (size_t i = 0; same && i < w.size(); ++i)
      same = w[i]->cols == x.cols && w[i]->dtype == w[0]->dtype && w[i]->quant == w[0]->quant &&
             out[i]->rows == x.rows && out[i]->cols == w[i]->rows;
    if (!same) return Backend::linear_shared_input(x, w, bias, out);  // one by one (and their errors)
    const int64_t T = x.rows;
    cpu::prepare_input(*w[0], x.data, T, precise_, input_);
    shared_first_.assign(1, 0);
    for (const Matrix* m : w) shared_first_.push_back(shared_first_.back() + m->rows);
    pool_.parallel_for(size_t(shared_first_.back()), [&](size_t a, size_t b) {
      while (a < b) {  // a chunk is cut where a matrix ends
        size_t i = 0;
        while (int64_t(a) >= shared_first_[i + 1]) ++i;
        const size_t end = std::min(b, size_t(shared_first_[i + 1]));
        cpu::matmul_rows(*w[i], input_, out[i]->data, w[i]->rows, int64_t(a) - shared_first_[i],
                         int64_t(end) - shared_first_[i]);
        a = end;
      }
    }, gemm_rows_per_chunk(x.cols, T, size_t(shared_first_.back()), size_t(pool_.size())));
    for (size_t i = 0; i < w.size(); ++i)
      if (bias[i]) add_bias(Buffer{out[i]->data, T, w[i]->rows}, *bias[i]);
  }

  void rope(Buffer& x, int n_heads, int head_dim, const RopeTable& rope, int64_t n_past) override {
    const int half = rope.rot_dim / 2;
    // Tokens split over the pool in prompt batches; each thread its own cos/sin table.
    pool_.parallel_for(size_t(x.rows), [&](size_t t0, size_t t1) {
      thread_local std::vector<float> cs;
      cs.resize(size_t(2 * half));
      for (int64_t t = int64_t(t0); t < int64_t(t1); ++t) {
        // Angles in float32, as transformers computes them.
        const float pos = float(n_past + t);
        for (int i = 0; i < half; ++i) {
          float angle = pos * rope.inv_freq[i];
          cs[i] = std::cos(angle) * rope.attention_factor;
          cs[half + i] = std::sin(angle) * rope.attention_factor;
        }
        for (int h = 0; h < n_heads; ++h) {
          float* v = x.data + t * x.cols + int64_t(h) * head_dim + rope.rot_offset;
          for (int i = 0; i < half; ++i) {
            const int a = rope.interleaved ? 2 * i : i;
            const int b = rope.interleaved ? 2 * i + 1 : i + half;
            const float x0 = v[a], x1 = v[b];
            v[a] = x0 * cs[i] - x1 * cs[half + i];
            v[b] = x1 * cs[i] + x0 * cs[half + i];
          }
        }
      }
    }, ThreadPool::elementwise_chunk(int64_t(n_heads) * rope.rot_dim));
  }

  void attention(const Buffer& q, const Buffer& k, const Buffer& v, Buffer& k_cache,
                 Buffer& v_cache, const AttentionParams& p, Buffer& out) override {
    const int hd = p.head_dim, vd = p.v_head_dim ? p.v_head_dim : p.head_dim;
    const int64_t T = q.rows, kv_dim = int64_t(p.n_kv_heads) * hd, v_dim = int64_t(p.n_kv_heads) * vd;
    check_attention_args(q, k, v, k_cache, v_cache, p);
    if (p.kv.type != KvType::F32 || p.kv.window > 0) {
      cpu::attention_kv(pool_, q, k, v, k_cache, v_cache, p, out, kv_staged_);
      return;
    }
    std::memcpy(k_cache.data + p.n_past * kv_dim, k.data, size_t(T * kv_dim) * sizeof(float));
    if (!p.values_in_keys)
      std::memcpy(v_cache.data + p.n_past * v_dim, v.data, size_t(T * v_dim) * sizeof(float));
    // Value j of kv head h: v_base + j * v_stride + h * v_head.
    const float* v_base = p.values_in_keys ? k_cache.data : v_cache.data;
    const int64_t v_stride = p.values_in_keys ? kv_dim : v_dim, v_head = p.values_in_keys ? hd : vd;
    if (T > 1) {  // a prompt chunk: by blocks of queries (attention_blocks.h)
      cpu::KeyRows rows;
      rows.key = [&](int64_t j, int h, float* dst) {
        std::memcpy(dst, k_cache.data + j * kv_dim + int64_t(h) * hd, size_t(hd) * sizeof(float));
      };
      rows.value = [&](int64_t j, int h, float* dst) {
        std::memcpy(dst, v_base + j * v_stride + int64_t(h) * v_head, size_t(vd) * sizeof(float));
      };
      cpu::attention_by_blocks(pool_, q, p, rows, out);
      return;
    }
    const int group = p.n_heads / p.n_kv_heads;
    pool_.parallel_for(size_t(T * p.n_heads), [&](size_t i0, size_t i1) {
      thread_local std::vector<float> scores;
      for (size_t i = i0; i < i1; ++i) {
        const int64_t t = int64_t(i) / p.n_heads;
        const int h = int(int64_t(i) % p.n_heads), kvh = h / group;
        const int64_t n_keys = p.n_past + t + 1;
        const int64_t first = p.sliding_window > 0 ? std::max<int64_t>(0, n_keys - p.sliding_window) : 0;
        scores.resize(size_t(n_keys));
        const float* qv = q.data + t * q.cols + int64_t(h) * hd;
        const float sink = p.sinks ? p.sinks->data[h] : -INFINITY;
        float mx = sink;
        for (int64_t j = first; j < n_keys; ++j) {
          scores[j] = cpu::dot_f32(qv, k_cache.data + j * kv_dim + int64_t(kvh) * hd, hd) * p.scale;
          mx = std::max(mx, scores[j]);
        }
        float sum = p.sinks ? std::exp(sink - mx) : 0.0f;
        for (int64_t j = first; j < n_keys; ++j) sum += (scores[j] = std::exp(scores[j] - mx));
        float* o = out.data + t * out.cols + int64_t(h) * vd;
        std::fill(o, o + vd, 0.0f);
        for (int64_t j = first; j < n_keys; ++j)
          cpu::axpy(scores[j] / sum, v_base + j * v_stride + int64_t(kvh) * v_head, o, vd);
      }
    });
  }

  void add(Buffer& x, const Buffer& y) override {
    pool_.parallel_for(size_t(x.rows * x.cols), [&](size_t i0, size_t i1) {
      for (size_t i = i0; i < i1; ++i) x.data[i] += y.data[i];
    }, ThreadPool::elementwise_chunk(1));
  }

  void clamp(Buffer& x, float limit) override {
    const int64_t n = x.rows * x.cols;
    for (int64_t i = 0; i < n; ++i) x.data[i] = std::min(std::max(x.data[i], -limit), limit);
  }

  void copy_columns(const Buffer& src, ColumnBlocks from, Buffer& dst, ColumnBlocks to, int64_t width,
                    int64_t blocks) override {
    if (src.rows != dst.rows || from.offset + (blocks - 1) * from.stride + width > src.cols ||
        to.offset + (blocks - 1) * to.stride + width > dst.cols)
      fail("copy_columns: ", blocks, " blocks of ", width, " do not fit [", src.rows, ", ", src.cols,
           "] -> [", dst.rows, ", ", dst.cols, "]");
    for (int64_t t = 0; t < src.rows; ++t)
      for (int64_t g = 0; g < blocks; ++g)
        std::memcpy(dst.data + t * dst.cols + to.offset + g * to.stride,
                    src.data + t * src.cols + from.offset + g * from.stride, size_t(width) * sizeof(float));
  }

  void linear_per_head(const Buffer& x, std::span<const Matrix> w, Buffer& out) override {
    const int64_t H = int64_t(w.size()), in = H ? w[0].cols : 0, n_out = H ? w[0].rows : 0;
    if (x.cols != H * in || out.cols != H * n_out || x.rows != out.rows)
      fail("linear_per_head: ", H, " heads of [", n_out, ", ", in, "] do not fit input [", x.rows, ", ",
           x.cols, "] and output [", out.rows, ", ", out.cols, "]");
    pool_.parallel_for(size_t(H * n_out), [&](size_t i0, size_t i1) {
      for (size_t i = i0; i < i1; ++i) {
        const int64_t h = int64_t(i) / n_out, r = int64_t(i) % n_out;
        for (int64_t t = 0; t < x.rows; ++t)
          out.data[t * out.cols + h * n_out + r] = cpu::dot_row(w[size_t(h)], r, x.data + t * x.cols + h * in);
      }
    }, rows_per_chunk(in, x.rows));
  }

  void mlp(const Buffer& x, const MlpWeights& w, Buffer& out) override {
    expert_mlp(x, w, MoeParams{}, out);
  }

  void moe(const Buffer& x, const Matrix& router, ExpertProvider& store, const MoeParams& p,
           Buffer& out) override {
    const int64_t T = x.rows, dim = x.cols;
    auto t_start = std::chrono::steady_clock::now();
    Buffer logits = scratch(2, T, p.n_experts);
    // Routing picks experts by comparing logits: float32 activations keep the choice stable.
    linear(x, router, nullptr, logits, /*precise=*/true);

    // Route every token; group tokens by expert so each expert's weights are read once.
    std::vector<std::vector<std::pair<int64_t, float>>>& by_expert = by_expert_;
    by_expert.assign(size_t(p.n_experts), {});
    std::vector<float> probs(size_t(p.n_experts));
    std::vector<int> order(size_t(p.n_experts));
    std::vector<float> weights(size_t(p.top_k));
    const bool lossy = p.cache_bias != 0.0f || p.miss_fallback;  // ask what is resident
    if (lossy) {
      resident_.resize(size_t(p.n_experts));
      store.resident(p.layer, resident_);
    }
    const char* resident = lossy ? resident_.data() : nullptr;
    skipped_.clear();
    for (int64_t t = 0; t < T; ++t) {
      route(logits.data + t * p.n_experts, p, resident, probs, order, weights);
      const bool dropped = p.miss_fallback && drop_missing(resident, order.data(), weights, p.top_k);
      for (int i = 0; i < p.top_k; ++i) {
        if (!dropped || resident[order[i]])
          by_expert[order[i]].emplace_back(t, weights[size_t(i)]);
        else if (std::find(skipped_.begin(), skipped_.end(), order[i]) == skipped_.end())
          skipped_.push_back(order[i]);
      }
    }
    std::vector<int>& ids = expert_ids_;
    ids.clear();
    int64_t routed_rows = 0;
    first_row_.assign(size_t(p.n_experts), 0);
    for (int e = 0; e < p.n_experts; ++e) {
      if (by_expert[e].empty()) continue;
      ids.push_back(e);
      first_row_[size_t(e)] = routed_rows;
      routed_rows += int64_t(by_expert[e].size());
    }

    // Experts arrive in the order the store has them ready; each one's output rows go to their
    // own place, and the combine below runs in expert order, so the sum does not depend on what
    // was cached.
    Buffer routed_out = scratch(5, routed_rows, dim);
    auto t_routed = std::chrono::steady_clock::now();
    times_.routing += std::chrono::duration<double>(t_routed - t_start).count();
    ScopedTimer compute(times_.expert_compute);  // includes waiting; the model subtracts it
    const bool together = T <= kTogetherTokens && all_resident(store, p, ids);
    store.request(p.layer, ids);
    if (!skipped_.empty()) store.fetch_later(p.layer, skipped_);
    if (!p.ahead.empty()) guess_next_experts(x, p, store);
    int e;
    MlpWeights w;
    if (together) {
      experts_together(x, store, p, routed_out);
    } else {
      while (store.next(e, w)) {
        const auto& routed = by_expert[size_t(e)];
        const int64_t n = int64_t(routed.size());
        Buffer xe = scratch(3, n, dim);
        gather_rows(x, routed, xe);
        Buffer ye = routed_out.rows_view(first_row_[size_t(e)], n);
        expert_mlp(xe, w, p, ye);
        store.release(e);
      }
    }
    // Each token's rows summed in ascending expert id (the order of ids), tokens in parallel.
    token_rows_.resize(size_t(T));
    for (auto& rows : token_rows_) rows.clear();
    for (int id : ids) {
      const auto& routed = by_expert[size_t(id)];
      for (size_t j = 0; j < routed.size(); ++j)
        token_rows_[size_t(routed[j].first)].emplace_back(first_row_[size_t(id)] + int64_t(j), routed[j].second);
    }
    pool_.parallel_for(size_t(T), [&](size_t t0, size_t t1) {
      for (size_t t = t0; t < t1; ++t) {
        float* o = out.data + int64_t(t) * dim;
        std::fill(o, o + dim, 0.0f);
        for (const auto& [row, w] : token_rows_[t]) cpu::axpy(w, routed_out.data + row * dim, o, dim);
      }
    }, rows_per_chunk(dim, 1));
  }

  void sigmoid_gate(Buffer& y, const Buffer& gate) override {
    if (gate.rows != y.rows || (gate.cols != 1 && gate.cols != y.cols))
      fail("sigmoid_gate: gate [", gate.rows, ", ", gate.cols, "] does not fit [", y.rows, ", ", y.cols, "]");
    pool_.parallel_for(size_t(y.rows), [&](size_t t0, size_t t1) {
      for (int64_t t = int64_t(t0); t < int64_t(t1); ++t)
        for (int64_t i = 0; i < y.cols; ++i)
          y.data[t * y.cols + i] *= 1.0f / (1.0f + std::exp(-gate.data[t * gate.cols + i % gate.cols]));
    }, ThreadPool::elementwise_chunk(y.cols));
  }

  void gated_delta_net(const Buffer& qkv, const Buffer& z, const Buffer& b, const Buffer& a,
                       const DeltaNetWeights& w, const DeltaNetParams& p, DeltaNetState& state,
                       Buffer& out) override {
    // Decode steps run the recurrence; prefill the chunked form.
    const auto form = qkv.rows > 1 ? cpu::DeltaRuleForm::Chunked : cpu::DeltaRuleForm::Recurrent;
    cpu::gated_delta_net(pool_, qkv, z, b, a, w, p, state, out, deltanet_, form);
  }

 private:
  // The experts a token goes to (order[0, top_k)) and their weights, from its router logits.
  // With p.cache_bias and a residency mask, resident experts rank with +cache_bias (MoeParams).
  void route(const float* l, const MoeParams& p, const char* resident, std::vector<float>& probs,
             std::vector<int>& order, std::vector<float>& weights) {
    const int n = p.n_experts, k = p.top_k;
    std::vector<float>& choice = route_.choice;  // what experts are ranked by, when it differs from probs
    const auto by = [](const std::vector<float>& v) {
      return [&v](int a, int b) { return v[size_t(a)] > v[size_t(b)] || (v[size_t(a)] == v[size_t(b)] && a < b); };
    };
    const bool bias = resident && p.cache_bias != 0.0f;
    const auto biased = [&](int e, float score) { return resident[e] ? score + p.cache_bias : score; };
    std::iota(order.begin(), order.end(), 0);
    switch (p.router) {
      case RouterKind::SoftmaxTopK: {
        float mx = *std::max_element(l, l + n), sum = 0;
        for (int e = 0; e < n; ++e) sum += (probs[e] = std::exp(l[e] - mx));
        for (int e = 0; e < n; ++e) probs[e] /= sum;
        if (bias) {
          choice.resize(size_t(n));
          for (int e = 0; e < n; ++e) choice[e] = biased(e, l[e]);
        }
        std::partial_sort(order.begin(), order.begin() + k, order.end(), by(bias ? choice : probs));
        break;
      }
      case RouterKind::SigmoidGroupTopK: {
        choice.resize(size_t(n));
        for (int e = 0; e < n; ++e) {
          probs[e] = 1.0f / (1.0f + std::exp(-l[e]));
          choice[e] = probs[e] + (p.router_bias ? p.router_bias->data[e] : 0.0f);
          if (bias) choice[e] = biased(e, choice[e]);
        }
        // Groups score the sum of their two best choices; experts outside the topk_group best
        // groups rank with 0, as transformers masks them.
        const int per = n / p.n_group;
        std::vector<float>& group_score = route_.group_score;
        std::vector<int>& groups = route_.groups;
        std::vector<char>& kept = route_.kept;
        group_score.resize(size_t(p.n_group));
        for (int g = 0; g < p.n_group; ++g) {
          const float* c = choice.data() + g * per;
          const float best = *std::max_element(c, c + per);
          float second = -INFINITY;
          for (int i = 0, skipped = 0; i < per; ++i) {
            if (c[i] == best && !skipped) skipped = 1;
            else second = std::max(second, c[i]);
          }
          group_score[size_t(g)] = best + (per > 1 ? second : 0.0f);
        }
        groups.resize(size_t(p.n_group));
        std::iota(groups.begin(), groups.end(), 0);
        std::partial_sort(groups.begin(), groups.begin() + p.topk_group, groups.end(), by(group_score));
        kept.assign(size_t(p.n_group), 0);
        for (int i = 0; i < p.topk_group; ++i) kept[size_t(groups[size_t(i)])] = 1;
        for (int e = 0; e < n; ++e)
          if (!kept[size_t(e / per)]) choice[e] = 0.0f;
        std::partial_sort(order.begin(), order.begin() + k, order.end(), by(choice));
        break;
      }
      case RouterKind::TopKSoftmax: {
        for (int e = 0; e < n; ++e) probs[e] = l[e] + (p.router_bias ? p.router_bias->data[e] : 0.0f);
        if (bias) {
          choice.resize(size_t(n));
          for (int e = 0; e < n; ++e) choice[e] = biased(e, probs[e]);
        }
        std::partial_sort(order.begin(), order.begin() + k, order.end(), by(bias ? choice : probs));
        const float mx = probs[order[0]];
        float sum = 0;
        for (int i = 0; i < k; ++i) sum += std::exp(probs[order[i]] - mx);
        for (int i = 0; i < k; ++i) weights[size_t(i)] = std::exp(probs[order[i]] - mx) / sum;
        for (float& w : weights) w *= p.routed_scaling_factor;
        return;
      }
    }
    float norm = 1.0f;
    if (p.norm_topk_prob) {
      float s = 0;
      for (int i = 0; i < k; ++i) s += probs[order[i]];
      norm = 1.0f / (s + (p.router == RouterKind::SigmoidGroupTopK ? 1e-20f : 0.0f));
    }
    for (int i = 0; i < k; ++i) weights[size_t(i)] = probs[order[i]] * norm * p.routed_scaling_factor;
  }

  // Miss fallback: the weights of a token's chosen experts that are not resident become 0 and
  // the resident ones' are scaled to the same sum; nothing changes when all or none are resident.
  // Returns whether it dropped any.
  static bool drop_missing(const char* resident, const int* order, std::vector<float>& weights, int k) {
    float all = 0, kept = 0;
    int n_kept = 0;
    for (int i = 0; i < k; ++i) {
      all += weights[size_t(i)];
      if (resident[order[i]]) {
        kept += weights[size_t(i)];
        ++n_kept;
      }
    }
    if (n_kept == k || n_kept == 0 || kept <= 0.0f) return false;
    const float scale = all / kept;
    for (int i = 0; i < k; ++i) weights[size_t(i)] = resident[order[i]] ? weights[size_t(i)] * scale : 0.0f;
    return true;
  }

  // A call of at most this many tokens whose experts are all in memory runs them together
  // (decode steps, and prompt chunks: their buffers hold every routed row at once, T * top_k rows
  // of x, gate and up).
  static constexpr int64_t kTogetherTokens = 2048;

  bool all_resident(ExpertProvider& store, const MoeParams& p, const std::vector<int>& ids) {
    resident_.resize(size_t(p.n_experts));
    store.resident(p.layer, resident_);
    return std::all_of(ids.begin(), ids.end(), [&](int id) { return resident_[size_t(id)] != 0; });
  }

  // The requested experts (all in memory) computed together, as expert_mlp computes each, bit for
  // bit: gate and up of every expert in one parallel loop, the activation, then every down, so
  // that a decode step's small matrices (8 experts of 768 x 2048) keep all threads busy with two
  // loops a layer instead of three per expert, and a prompt chunk's 128 experts of a few dozen
  // tokens each are whole panels spread over all threads instead of 128 loops of a few panels.
  void experts_together(const Buffer& x, ExpertProvider& store, const MoeParams& p, Buffer& routed_out) {
    size_t n = 0;  // together_ keeps its entries (and their names' storage) between calls
    int e;
    MlpWeights w;
    while (store.next(e, w)) {
      if (together_.size() == n) together_.emplace_back();
      together_[n].first = e;
      together_[n++].second = w;
    }
    compute_together(x, n, p, routed_out);
    for (size_t i = 0; i < n; ++i) store.release(together_[i].first);
  }

 public:
  void expert_rows(const Buffer& x, std::span<const ExpertRows> jobs, const MoeParams& p,
                   Buffer& out) override {
    const size_t n = jobs.size();
    if (together_.size() < n) together_.resize(n);
    by_expert_.assign(n, {});
    first_row_.assign(n, 0);
    for (size_t j = 0; j < n; ++j) {  // job j stands for expert j of by_expert_
      const ExpertRows& job = jobs[j];
      if (job.first_row < 0 || job.first_row + int64_t(job.tokens.size()) > out.rows ||
          out.cols != x.cols)
        fail("expert_rows: rows [", job.first_row, ", ", job.first_row + int64_t(job.tokens.size()),
             ") of [", out.rows, ", ", out.cols, "] for x [", x.rows, ", ", x.cols, "]");
      for (int64_t t : job.tokens) {
        if (t < 0 || t >= x.rows)
          fail("expert_rows: row ", t, " of x [", x.rows, ", ", x.cols, "]");
        by_expert_[j].emplace_back(t, 1.0f);
      }
      first_row_[j] = job.first_row;
      together_[j] = {int(j), job.weights};
    }
    compute_together(x, n, p, out);
  }

 private:
  // together_[0, n) (by_expert_ and first_row_ by their ids) computed as experts_together says.
  void compute_together(const Buffer& x, size_t n, const MoeParams& p, Buffer& routed_out) {
    const int64_t dim = x.cols;
    int64_t rows = 0, inter = n ? together_[0].second.gate.rows : 0;
    bool same = true;
    for (size_t i = 0; i < n; ++i) {
      const auto& [id, ew] = together_[i];
      rows = std::max(rows, first_row_[size_t(id)] +
                                int64_t(by_expert_[size_t(id)].size()));  // rows of xs, g, u
      same = same && ew.gate.rows == inter && ew.up.rows == inter && ew.down.cols == inter &&
             ew.gate.dtype == ew.up.dtype && ew.gate.quant.bits == ew.up.quant.bits &&
             ew.gate.quant.group_size == ew.up.quant.group_size;
    }
    Buffer xs = scratch(3, rows, dim), g = scratch(0, rows, inter), u = scratch(1, rows, inter);
    auto first = [&](size_t i) { return first_row_[size_t(together_[i].first)]; };
    auto count = [&](size_t i) { return int64_t(by_expert_[size_t(together_[i].first)].size()); };
    int64_t most = 0;  // the most tokens an expert has
    for (size_t i = 0; i < n; ++i) most = std::max(most, count(i));
    if (!same) {  // gate and up in different formats or shapes: one expert at a time
      for (size_t i = 0; i < n; ++i) {
        Buffer xe = xs.rows_view(0, count(i)), ye = routed_out.rows_view(first(i), count(i));
        gather_rows(x, by_expert_[size_t(together_[i].first)], xe);
        expert_mlp(xe, together_[i].second, p, ye);
      }
    } else {
      if (inputs_.size() < n) inputs_.resize(n);
      // Gathering and preparing the inputs in parallel pays for prompt chunks; a decode step's
      // few rows stay on this thread (a loop of n or fewer items runs inline).
      const size_t inline_up_to = rows < 256 ? n : 1;
      pool_.parallel_for(n, [&](size_t i0, size_t i1) {  // each expert's rows and input its own
        for (size_t i = i0; i < i1; ++i) {
          Buffer xe = xs.rows_view(first(i), count(i));
          gather_rows(x, by_expert_[size_t(together_[i].first)], xe);
          cpu::prepare_input(together_[i].second.gate, xe.data, count(i), precise_, inputs_[i]);
        }
      }, inline_up_to);
      // Output row r of the loop: expert r / (2 inter), gate or up, row r % inter; a chunk is cut
      // where a matrix ends.
      pool_.parallel_for(size_t(n) * size_t(2 * inter), [&](size_t a, size_t b) {
        while (a < b) {
          const size_t i = a / size_t(2 * inter), m = a / size_t(inter) % 2, row = a % size_t(inter);
          const size_t end = std::min(b, a + size_t(inter) - row);
          const MlpWeights& ew = together_[i].second;
          cpu::matmul_rows(m ? ew.up : ew.gate, inputs_[i], (m ? u.data : g.data) + first(i) * inter, inter,
                           int64_t(row), int64_t(row + end - a));
          a = end;
        }
      }, gemm_rows_per_chunk(dim, most, size_t(n) * size_t(2 * inter), size_t(pool_.size())));
      for (size_t i = 0; i < n; ++i) {
        const MlpWeights& ew = together_[i].second;
        add_bias(g.rows_view(first(i), count(i)), ew.gate_bias);
        add_bias(u.rows_view(first(i), count(i)), ew.up_bias);
      }
      activate(g, u, p);
      pool_.parallel_for(n, [&](size_t i0, size_t i1) {
        for (size_t i = i0; i < i1; ++i)
          cpu::prepare_input(together_[i].second.down, g.data + first(i) * inter, count(i), precise_, inputs_[i]);
      }, inline_up_to);
      pool_.parallel_for(size_t(n) * size_t(dim), [&](size_t a, size_t b) {
        while (a < b) {
          const size_t i = a / size_t(dim), row = a % size_t(dim);
          const size_t end = std::min(b, a + size_t(dim) - row);
          cpu::matmul_rows(together_[i].second.down, inputs_[i], routed_out.data + first(i) * dim, dim,
                           int64_t(row), int64_t(end - a + row));
          a = end;
        }
      }, gemm_rows_per_chunk(inter, most, size_t(n) * size_t(dim), size_t(pool_.size())));
      for (size_t i = 0; i < n; ++i)
        add_bias(routed_out.rows_view(first(i), count(i)), together_[i].second.down_bias);
    }
  }

  static void gather_rows(const Buffer& x, const std::vector<std::pair<int64_t, float>>& routed, Buffer& xe) {
    for (size_t j = 0; j < routed.size(); ++j)
      std::memcpy(xe.data + int64_t(j) * x.cols, x.data + routed[j].first * x.cols, size_t(x.cols) * sizeof(float));
  }

  // out rows += bias (linear's, and the experts' biases when they run together).
  static void add_bias(Buffer out, const Vector& bias) {
    if (!bias) return;
    for (int64_t t = 0; t < out.rows; ++t)
      for (int64_t r = 0; r < out.cols; ++r) out.data[t * out.cols + r] += bias.data[r];
  }

  // g = act(g, u) element-wise (SwiGLU, or gpt-oss's clamped form).
  void activate(Buffer& g, const Buffer& u, const MoeParams& p) {
    const int64_t n = g.rows * g.cols;
    pool_.parallel_for(size_t(n), [&](size_t i0, size_t i1) {
      if (p.activation == ExpertActivation::SwiGlu) {
        for (size_t i = i0; i < i1; ++i) {
          const float a = g.data[i];
          g.data[i] = a / (1.0f + std::exp(-a)) * u.data[i];
        }
      } else {
        const float limit = p.swiglu_limit, alpha = p.swiglu_alpha;
        for (size_t i = i0; i < i1; ++i) {
          const float a = std::min(g.data[i], limit), b = std::min(std::max(u.data[i], -limit), limit);
          g.data[i] = (b + 1.0f) * (a / (1.0f + std::exp(-alpha * a)));
        }
      }
    }, 2048);
  }

  // out = down(act(gate x + gate_bias, up x + up_bias)) + down_bias
  void expert_mlp(const Buffer& x, const MlpWeights& w, const MoeParams& p, Buffer& out) {
    const int64_t T = x.rows, inter = w.gate.rows;
    Buffer g = scratch(0, T, inter), u = scratch(1, T, inter);
    linear(x, w.gate, w.gate_bias ? &w.gate_bias : nullptr, g);
    linear(x, w.up, w.up_bias ? &w.up_bias : nullptr, u);
    activate(g, u, p);
    linear(g, w.down, w.down_bias ? &w.down_bias : nullptr, out);
  }

  // Lookahead (MoeParams::ahead): each next MoE layer's router on this call's one token guesses
  // that layer's experts, read behind this call's own reads.
  void guess_next_experts(const Buffer& x, const MoeParams& p, ExpertProvider& store) {
    for (const LookaheadGuess& a : p.ahead) {
      const int64_t E = a.router->rows;
      Buffer logits = scratch(6, 1, E);
      linear(x.rows_view(0, 1), *a.router, nullptr, logits, /*precise=*/true);
      top_k_ids(std::span<const float>(logits.data, size_t(E)), a.top_k, guess_);
      store.prefetch(a.layer, guess_);
    }
  }

  // Reusable per-slot scratch buffers: they grow to the largest size seen, then never allocate.
  Buffer scratch(int slot, int64_t rows, int64_t cols) {
    if (scratch_.size() <= size_t(slot)) scratch_.resize(size_t(slot) + 1);
    auto& s = scratch_[size_t(slot)];
    if (s.size() < size_t(rows * cols)) s.resize(size_t(rows * cols));
    return Buffer{s.data(), rows, cols};
  }

  ThreadPool pool_;
  std::vector<int> guess_;             // guess_next_experts'
  std::vector<int64_t> shared_first_;  // linear_shared_input: each matrix's first row in the loop
  std::vector<float> kv_staged_;  // attention_kv: a batch's packed K and V rows before they enter a ring
  bool precise_;                 // float32 activations everywhere
  cpu::PreparedInput input_;     // reused by every linear call
  std::unordered_map<float*, std::unique_ptr<float[]>> allocations_;  // behind alloc()
  std::unordered_map<float*, size_t> growable_;  // alloc_growable's mappings and their bytes

  // Sealed rows (seal_rows): pages of the arena file, shared by their buffer and its borrowers.
  static constexpr int64_t kPage = 4096;
  struct SealedPages {
    int64_t offset;
    size_t bytes;
    bool lender_alive = true;  // the sealed buffer still maps them
  };
  struct Lent {
    std::shared_ptr<SealedPages> pages;  // keeps the file's range while mapped here
    size_t bytes;                        // the buffer's first bytes read those pages
  };
  std::unordered_map<float*, std::shared_ptr<SealedPages>> sealed_;
  std::unordered_map<float*, Lent> lent_;
  int arena_fd_ = -1;
  int64_t arena_end_ = 0;
  std::map<int64_t, int64_t> arena_free_;  // offset -> bytes, ranges handed back

  bool open_arena() {
    if (arena_fd_ < 0) arena_fd_ = memfd_create("moestream-kv", MFD_CLOEXEC);
    return arena_fd_ >= 0;
  }
  // A page-aligned range of `bytes` in the arena; -1 when the file cannot grow.
  int64_t arena_take(size_t bytes) {
    for (auto it = arena_free_.begin(); it != arena_free_.end(); ++it)
      if (it->second >= int64_t(bytes)) {
        const int64_t offset = it->first, rest = it->second - int64_t(bytes);
        arena_free_.erase(it);
        if (rest > 0) arena_free_[offset + int64_t(bytes)] = rest;
        return offset;
      }
    if (ftruncate(arena_fd_, off_t(arena_end_ + int64_t(bytes))) != 0) return -1;
    const int64_t offset = arena_end_;
    arena_end_ += int64_t(bytes);
    return offset;
  }
  // The range's pages are freed (a hole punched) and the range reused; neighbours merge.
  void arena_give(int64_t offset, size_t bytes) {
    fallocate(arena_fd_, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, off_t(offset), off_t(bytes));
    int64_t lo = offset, size = int64_t(bytes);
    if (auto next = arena_free_.find(lo + size); next != arena_free_.end()) {
      size += next->second;
      arena_free_.erase(next);
    }
    if (auto prev = arena_free_.lower_bound(lo); prev != arena_free_.begin() && (--prev)->first + prev->second == lo) {
      lo = prev->first;
      size += prev->second;
      arena_free_.erase(prev);
    }
    arena_free_[lo] = size;
  }
  // The arena's `bytes` at `offset` mapped privately over the start of a growable buffer; false
  // when the mapping fails, and fresh zero pages stand there instead.
  bool map_arena(float* base, size_t bytes, int64_t offset) {
    if (mmap(base, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_FIXED, arena_fd_, off_t(offset)) != MAP_FAILED)
      return true;
    map_anonymous(base, 0, bytes);  // a failed fixed mapping may have taken the old pages with it
    return false;
  }
  // All `bytes` between memory at p and the arena at `offset` through op (pwrite or pread); false
  // on an error.
  template <class Op>
  bool arena_io(Op op, char* p, size_t bytes, int64_t offset) {
    for (size_t done = 0; done < bytes;) {
      const ssize_t n = op(arena_fd_, p + done, bytes - done, off_t(offset + int64_t(done)));
      if (n <= 0) return false;
      done += size_t(n);
    }
    return true;
  }
  // Fresh anonymous pages (reading as zeros) over bytes [from, to) of a growable buffer.
  static void map_anonymous(float* base, size_t from, size_t to) {
    if (to <= from) return;
    if (mmap(reinterpret_cast<char*>(base) + from, to - from, PROT_READ | PROT_WRITE,
             MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0) == MAP_FAILED)
      fail("KV cache: cannot map ", to - from, " bytes");
  }
  std::deque<std::vector<float>> vectors_;  // storage behind load_vector (stable addresses)
  std::vector<std::vector<float>> scratch_;
  cpu::DeltaNetScratch deltanet_;
  std::vector<std::vector<std::pair<int64_t, float>>> by_expert_;
  std::vector<std::vector<std::pair<int64_t, float>>> token_rows_;  // moe's combine: (routed row, weight)
  std::vector<int> expert_ids_;
  std::vector<char> resident_;  // the provider's residency of the layer's experts (lossy options)
  std::vector<int> skipped_;    // experts chosen but skipped by the miss fallback
  std::vector<int64_t> first_row_;
  std::vector<std::pair<int, MlpWeights>> together_;  // experts_together: the call's experts
  std::vector<cpu::PreparedInput> inputs_;            // and each one's prepared input
  struct RouteScratch {  // behind route(), reused
    std::vector<float> choice, group_score;
    std::vector<int> groups;
    std::vector<char> kept;
  } route_;
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend(int n_threads, bool precise, int spin_micros) {
  return std::make_unique<CpuBackend>(n_threads, precise, spin_micros);
}

}  // namespace moestream
