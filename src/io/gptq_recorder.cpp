// pack --gptq's calibration: a recording decorator around the CPU backend, and the run of a bf16
// copy of the checkpoint over the calibration text (gptq.h).
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>

#include "backend/backend.h"
#include "backend/expert_provider.h"
#include "core/error.h"
#include "core/files.h"
#include "io/gptq.h"
#include "models/model.h"
#include "text/tokenizer.h"

namespace moestream {

namespace fs = std::filesystem;

namespace {

// Notes the experts a moe() call requests and hands none out: routing one token through the
// inner backend with it yields exactly that token's experts.
class RoutingProbe : public ExpertProvider {
 public:
  void request(int, std::span<const int> experts) override { experts_.assign(experts.begin(), experts.end()); }
  bool next(int&, MlpWeights&) override { return false; }
  void release(int) override {}
  const std::vector<int>& experts() const { return experts_; }

 private:
  std::vector<int> experts_;
};

// a (n, n) upper triangle += sum over the rows of x (rows, n) of x x^T, in float32 for the
// rows of one call (at most a batch), then into double.
void add_gram(std::vector<double>& a, const float* x, int64_t rows, int64_t n, std::vector<float>& scratch) {
  if (a.empty()) a.assign(size_t(n * n), 0.0);
  scratch.assign(size_t(n * n), 0.0f);
  for (int64_t t = 0; t < rows; ++t) {
    const float* v = x + t * n;
    for (int64_t i = 0; i < n; ++i) {
      const float vi = v[i];
      if (vi == 0) continue;
      float* row = scratch.data() + i * n;
      for (int64_t j = i; j < n; ++j) row[j] += vi * v[j];
    }
  }
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = i; j < n; ++j) a[size_t(i * n + j)] += double(scratch[size_t(i * n + j)]);
}

class HessianRecorder : public Backend {
 public:
  HessianRecorder(std::unique_ptr<Backend> inner, ExpertHessians& out) : in_(std::move(inner)), out_(out) {
    if (in_->name().rfind("cpu", 0) != 0) fail("GPTQ calibration runs on the CPU backend, not ", in_->name());
  }
  std::string name() const override { return in_->name(); }
  Matrix load_matrix(const TensorView& t) override { return in_->load_matrix(t); }
  Matrix load_quantized(const TensorView& words, const TensorView& scales, const TensorView& biases,
                        const QuantFormat& format) override {
    return in_->load_quantized(words, scales, biases, format);
  }
  Vector load_vector(const TensorView& t) override { return in_->load_vector(t); }
  Buffer alloc(int64_t rows, int64_t cols) override { return in_->alloc(rows, cols); }
  void free(Buffer& b) override { in_->free(b); }
  void to_host(const Buffer& b, float* dst) override { in_->to_host(b, dst); }
  void* alloc_host(size_t bytes) override { return in_->alloc_host(bytes); }
  void free_host(void* p) override { in_->free_host(p); }
  void copy_rows(const Buffer& src, Buffer& dst, int64_t rows) override { in_->copy_rows(src, dst, rows); }
  void embed(std::span<const int32_t> tokens, const Matrix& table, Buffer& out) override { in_->embed(tokens, table, out); }
  void rmsnorm(const Buffer& x, const Vector& w, float eps, int64_t group, Buffer& out) override {
    in_->rmsnorm(x, w, eps, group, out);
  }
  void linear(const Buffer& x, const Matrix& w, const Vector* bias, Buffer& out) override { in_->linear(x, w, bias, out); }
  void rope(Buffer& x, int n_heads, int head_dim, const RopeTable& rope, int64_t n_past) override {
    in_->rope(x, n_heads, head_dim, rope, n_past);
  }
  void attention(const Buffer& q, const Buffer& k, const Buffer& v, Buffer& k_cache, Buffer& v_cache,
                 const AttentionParams& p, Buffer& out) override {
    in_->attention(q, k, v, k_cache, v_cache, p, out);
  }
  void add(Buffer& x, const Buffer& y) override { in_->add(x, y); }
  void clamp(Buffer& x, float limit) override { in_->clamp(x, limit); }
  void copy_columns(const Buffer& src, ColumnBlocks from, Buffer& dst, ColumnBlocks to, int64_t width,
                    int64_t blocks) override {
    in_->copy_columns(src, from, dst, to, width, blocks);
  }
  void linear_per_head(const Buffer& x, std::span<const Matrix> w, Buffer& out) override { in_->linear_per_head(x, w, out); }
  void mlp(const Buffer& x, const MlpWeights& w, Buffer& out) override { in_->mlp(x, w, out); }
  void sigmoid_gate(Buffer& y, const Buffer& gate) override { in_->sigmoid_gate(y, gate); }
  void gated_delta_net(const Buffer& qkv, const Buffer& z, const Buffer& b, const Buffer& a, const DeltaNetWeights& w,
                       const DeltaNetParams& p, DeltaNetState& state, Buffer& out) override {
    in_->gated_delta_net(qkv, z, b, a, w, p, state, out);
  }

  void moe(const Buffer& x, const Matrix& router, ExpertProvider& experts, const MoeParams& p, Buffer& out) override {
    record(x, router, experts, p);
    in_->moe(x, router, experts, p, out);
  }

 private:
  void record(const Buffer& x, const Matrix& router, ExpertProvider& experts, const MoeParams& p) {
    const int64_t dim = x.cols;
    // Which tokens each expert gets, as the inner backend routes them.
    std::vector<std::vector<int64_t>> tokens(size_t(p.n_experts));
    if (probe_out_.cols != dim) {
      if (probe_out_.data) in_->free(probe_out_);
      probe_out_ = in_->alloc(1, dim);
    }
    for (int64_t t = 0; t < x.rows; ++t) {
      RoutingProbe probe;
      in_->moe(x.rows_view(t, 1), router, probe, p, probe_out_);
      for (int e : probe.experts()) tokens[size_t(e)].push_back(t);
    }
    if (out_.layers.size() <= size_t(p.layer)) out_.layers.resize(size_t(p.layer) + 1);
    std::vector<ExpertHessian>& layer = out_.layers[size_t(p.layer)];
    if (layer.empty()) layer.resize(size_t(p.n_experts));

    std::vector<int> ids;
    for (int e = 0; e < p.n_experts; ++e) {
      const std::vector<int64_t>& list = tokens[size_t(e)];
      if (list.empty()) continue;
      ids.push_back(e);
      xe_.resize(list.size() * size_t(dim));
      for (size_t j = 0; j < list.size(); ++j)
        std::copy_n(x.data + list[j] * dim, dim, xe_.data() + j * size_t(dim));
      ExpertHessian& h = layer[size_t(e)];
      keep_sample(h, p.layer, e, xe_.data(), int64_t(list.size()), dim);
      h.tokens += int64_t(list.size());
      add_gram(h.in, xe_.data(), int64_t(list.size()), dim, gram_);
    }
    // down's input: the expert's activation of its tokens, from its own (bf16) weights.
    experts.request(p.layer, ids);
    int e;
    MlpWeights w;
    while (experts.next(e, w)) {
      const std::vector<int64_t>& list = tokens[size_t(e)];
      const int64_t n = int64_t(list.size()), inter = w.gate.rows;
      xe_.resize(size_t(n * dim));
      for (int64_t j = 0; j < n; ++j) std::copy_n(x.data + list[size_t(j)] * dim, dim, xe_.data() + j * dim);
      gate_.resize(size_t(n * inter));
      up_.resize(size_t(n * inter));
      Buffer xb{xe_.data(), n, dim}, gb{gate_.data(), n, inter}, ub{up_.data(), n, inter};
      in_->linear(xb, w.gate, w.gate_bias ? &w.gate_bias : nullptr, gb);
      in_->linear(xb, w.up, w.up_bias ? &w.up_bias : nullptr, ub);
      activate(p, gate_, up_);
      add_gram(layer[size_t(e)].act, gate_.data(), n, inter, gram_);
      experts.release(e);
    }
  }

  // Reservoir sampling of the expert's inputs (rows of x, the next of its tokens): the n-th
  // token seen replaces a kept row with probability cap / (n + 1), by a hash of (layer,
  // expert, n) rather than a random generator, so the sample depends on nothing but the run.
  void keep_sample(ExpertHessian& h, int layer, int expert, const float* x, int64_t rows, int64_t dim) const {
    const int64_t cap = out_.sample_cap;
    for (int64_t j = 0; j < rows && cap > 0; ++j) {
      const int64_t seen = h.tokens + j, kept = int64_t(h.sample.size()) / dim;
      if (kept < cap) {
        h.sample.insert(h.sample.end(), x + j * dim, x + (j + 1) * dim);
        continue;
      }
      uint64_t z = (uint64_t(layer) << 48) ^ (uint64_t(expert) << 32) ^ uint64_t(seen);
      z += 0x9e3779b97f4a7c15ull;  // splitmix64's finalizer
      z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
      z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
      z ^= z >> 31;
      const uint64_t slot = z % uint64_t(seen + 1);
      if (slot < uint64_t(cap)) std::copy_n(x + j * dim, dim, h.sample.data() + slot * uint64_t(dim));
    }
  }

  // gate = act(gate, up), as the CPU backend's expert MLP computes it.
  static void activate(const MoeParams& p, std::vector<float>& gate, const std::vector<float>& up) {
    for (size_t i = 0; i < gate.size(); ++i) {
      if (p.activation == ExpertActivation::SwiGlu) {
        const float a = gate[i];
        gate[i] = a / (1.0f + std::exp(-a)) * up[i];
      } else {
        const float a = std::min(gate[i], p.swiglu_limit);
        const float b = std::min(std::max(up[i], -p.swiglu_limit), p.swiglu_limit);
        gate[i] = (b + 1.0f) * (a / (1.0f + std::exp(-p.swiglu_alpha * a)));
      }
    }
  }

  std::unique_ptr<Backend> in_;
  ExpertHessians& out_;
  Buffer probe_out_;
  std::vector<float> xe_, gate_, up_, gram_;
};

// A directory removed when this goes out of scope.
struct ScratchDir {
  std::string path;
  ~ScratchDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

}  // namespace

std::unique_ptr<Backend> make_hessian_recorder(std::unique_ptr<Backend> inner, ExpertHessians& out) {
  return std::make_unique<HessianRecorder>(std::move(inner), out);
}

ExpertHessians collect_expert_hessians(const std::string& src, const std::string& out, const ExpertTensorParser& experts,
                                       const GptqCalibration& c) {
  const std::optional<std::string> text = try_read_file(c.text_path);
  if (!text) fail("--gptq: cannot read ", c.text_path);
  // Named like a PackWriter temporary, so that remove_abandoned_packs cleans it after a kill.
  ScratchDir dir{c.quantized_pack.empty() ? out + ".calib.tmp-" + std::to_string(getpid()) : c.quantized_pack};
  if (c.quantized_pack.empty()) {
    fs::remove_all(dir.path);
    PackOptions bf16;
    bf16.quant = "bf16";
    bf16.progress = false;
    bf16.threads = c.threads;
    bf16.skip = c.skip;
    write_pack(src, dir.path, experts, bf16);
  }

  if (!fs::exists(dir.path + "/tokenizer.json")) fail("--gptq: ", src, " has no tokenizer.json to read the calibration text with");
  std::vector<int32_t> ids = Tokenizer::load(dir.path)->encode(*text);
  if (c.max_tokens > 0 && int64_t(ids.size()) > c.max_tokens) ids.resize(size_t(c.max_tokens));
  if (ids.size() < 2) fail("--gptq: ", c.text_path, " has fewer than 2 tokens");

  ExpertHessians h;
  h.sample_cap = c.sample_tokens;
  ModelOptions mo;
  mo.threads = c.threads;
  mo.precise = true;
  mo.device = "cpu";
  mo.wrap_backend = [&h](std::unique_ptr<Backend> b) { return make_hessian_recorder(std::move(b), h); };
  auto model = load_model(dir.path, mo);
  std::vector<float> logits(size_t(model->info().vocab_size));
  for (size_t at = 0; at < ids.size(); at += size_t(c.ctx)) {
    const size_t n = std::min(ids.size() - at, size_t(c.ctx));
    auto seq = model->new_sequence(int64_t(n));
    model->forward(std::span(ids).subspan(at, n), *seq, logits);
  }
  h.tokens = int64_t(ids.size());
  finish_hessians(h);
  return h;
}

}  // namespace moestream
