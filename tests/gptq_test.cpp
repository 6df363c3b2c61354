// pack --gptq and pack --tiered: GPTQ against round to nearest on a known Hessian, the Hessian
// recorder's routed tokens, the packs' layouts, and the flags' errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "backend/backend.h"
#include "backend/expert_provider.h"
#include "core/quant.h"
#include "io/gptq.h"
#include "io/pack.h"
#include "models/model.h"
#include "test_util.h"

namespace moestream {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

// ||X W^T - X Q^T||^2 over the rows of x (n, cols), Q the dequantized codes.
double output_error(const std::vector<float>& x, int64_t n, const std::vector<float>& w, int64_t rows, int64_t cols,
                    const QuantFormat& f, const std::vector<uint32_t>& words, const std::vector<uint16_t>& scales,
                    const std::vector<uint16_t>& biases) {
  std::vector<float> q(size_t(rows * cols));
  const int64_t wpr = quant_words_per_row(f, cols), gpr = quant_groups_per_row(f, cols);
  for (int64_t r = 0; r < rows; ++r)
    dequantize_row(f, cols, words.data() + r * wpr, scales.data() + r * gpr, biases.data() + r * gpr, q.data() + r * cols);
  double err = 0;
  for (int64_t t = 0; t < n; ++t)
    for (int64_t r = 0; r < rows; ++r) {
      double d = 0;
      for (int64_t c = 0; c < cols; ++c) d += double(x[size_t(t * cols + c)]) * (w[size_t(r * cols + c)] - q[size_t(r * cols + c)]);
      err += d * d;
    }
  return err;
}

// Inputs whose features are correlated (a random mixing of normal samples, features of
// different scales), as a layer's activations are; GPTQ's compensation has something to use.
std::vector<float> correlated_inputs(int64_t n, int64_t cols, uint32_t seed) {
  const std::vector<float> z = test::gaussian(size_t(n * cols), seed);
  const std::vector<float> mix = test::gaussian(size_t(cols * cols), seed + 1, 0.3f);
  std::vector<float> x(size_t(n * cols));
  for (int64_t t = 0; t < n; ++t)
    for (int64_t i = 0; i < cols; ++i) {
      double s = z[size_t(t * cols + i)];
      for (int64_t k = 0; k < cols; ++k) s += mix[size_t(i * cols + k)] * z[size_t(t * cols + k)];
      x[size_t(t * cols + i)] = float(s * (1.0 + double(i % 7)));
    }
  return x;
}

// H = sum over the n inputs of x x^T (cols, cols).
std::vector<double> hessian_of(const std::vector<float>& x, int64_t n, int64_t cols) {
  std::vector<double> h(size_t(cols * cols), 0.0);
  for (int64_t t = 0; t < n; ++t)
    for (int64_t i = 0; i < cols; ++i)
      for (int64_t j = 0; j < cols; ++j) h[size_t(i * cols + j)] += double(x[size_t(t * cols + i)]) * x[size_t(t * cols + j)];
  return h;
}

TEST(Gptq, LowersOutputErrorBelowRoundToNearest) {
  const int64_t rows = 24, cols = 128, n = 512;
  const std::vector<float> w = test::gaussian(size_t(rows * cols), 7);
  const std::vector<float> x = correlated_inputs(n, cols, 11);
  const std::vector<double> h = hessian_of(x, n, cols);
  for (int bits : {2, 3, 4, 8}) {
    const QuantFormat f{bits, 32};
    const int64_t wpr = quant_words_per_row(f, cols), gpr = quant_groups_per_row(f, cols);
    std::vector<uint32_t> rw(size_t(rows * wpr)), gw(size_t(rows * wpr));
    std::vector<uint16_t> rs(size_t(rows * gpr)), rb(size_t(rows * gpr)), gsc(size_t(rows * gpr)), gb(size_t(rows * gpr));
    quantize_affine(w.data(), rows, cols, f, rw.data(), rs.data(), rb.data());
    const double rtn = output_error(x, n, w, rows, cols, f, rw, rs, rb);
    for (bool act_order : {false, true}) {
      GptqOptions o;
      o.block = 64;  // two lazy blocks: the batched update between them is exercised
      o.act_order = act_order;
      quantize_gptq(w.data(), rows, cols, h.data(), f, gw.data(), gsc.data(), gb.data(), o);
      const double gptq = output_error(x, n, w, rows, cols, f, gw, gsc, gb);
      RecordProperty("q" + std::to_string(bits) + (act_order ? "_act" : "") + "_gptq_over_rtn", test::sci(gptq / rtn));
      EXPECT_LT(gptq, 0.9 * rtn) << bits << " bits";
    }
  }
}

// Refinement (codes by coordinate descent, group parameters by least squares) lowers GPTQ's own
// objective, the output error on the calibration inputs, at every bit width, and never raises it.
TEST(Gptq, RefinementLowersTheOutputErrorOfGptq) {
  const int64_t rows = 24, cols = 128, n = 512;
  const std::vector<float> w = test::gaussian(size_t(rows * cols), 7);
  const std::vector<float> x = correlated_inputs(n, cols, 11);
  const std::vector<double> h = hessian_of(x, n, cols);
  for (int bits : {2, 3, 4, 8}) {
    const QuantFormat f{bits, 32};
    const int64_t wpr = quant_words_per_row(f, cols), gpr = quant_groups_per_row(f, cols);
    std::vector<uint32_t> pw(size_t(rows * wpr)), rw(size_t(rows * wpr));
    std::vector<uint16_t> ps(size_t(rows * gpr)), pb(size_t(rows * gpr)), rs(size_t(rows * gpr)), rb(size_t(rows * gpr));
    GptqOptions plain;
    plain.refine_rounds = 0;
    quantize_gptq(w.data(), rows, cols, h.data(), f, pw.data(), ps.data(), pb.data(), plain);
    GptqOptions refined = plain;
    refined.refine_rounds = 4;
    quantize_gptq(w.data(), rows, cols, h.data(), f, rw.data(), rs.data(), rb.data(), refined);
    const double before = output_error(x, n, w, rows, cols, f, pw, ps, pb);
    const double after = output_error(x, n, w, rows, cols, f, rw, rs, rb);
    RecordProperty("q" + std::to_string(bits) + "_refined_over_gptq", test::sci(after / before));
    EXPECT_LT(after, (bits <= 4 ? 0.95 : 1.0) * before) << bits << " bits";
    // The objective as refine_quantized sees it (H undamped here) agrees with the output error.
    EXPECT_NEAR(quantized_error(w.data(), rows, cols, h.data(), f, rw.data(), rs.data(), rb.data()), after, 1e-3 * after);
    // Refining again from its own result does not make it worse.
    std::vector<uint32_t> again_w = rw;
    std::vector<uint16_t> again_s = rs, again_b = rb;
    refine_quantized(w.data(), rows, cols, h.data(), f, again_w.data(), again_s.data(), again_b.data(), refined);
    EXPECT_LE(output_error(x, n, w, rows, cols, f, again_w, again_s, again_b), after * (1 + 1e-6)) << bits << " bits";
  }
}

TEST(Gptq, SingularHessianIsDampedAndDeadColumnsQuantize) {
  const int64_t rows = 4, cols = 64;
  const std::vector<float> w = test::gaussian(size_t(rows * cols), 3);
  std::vector<double> h(size_t(cols * cols), 0.0);
  const std::vector<float> x = test::gaussian(size_t(cols), 5);
  for (int64_t i = 0; i < cols / 2; ++i)  // rank one, and half the inputs always zero
    for (int64_t j = 0; j < cols / 2; ++j) h[size_t(i * cols + j)] = double(x[size_t(i)]) * x[size_t(j)];
  const QuantFormat f{4, 32};
  std::vector<uint32_t> words(size_t(rows * quant_words_per_row(f, cols)));
  std::vector<uint16_t> scales(size_t(rows * 2)), biases(size_t(rows * 2));
  quantize_gptq(w.data(), rows, cols, h.data(), f, words.data(), scales.data(), biases.data());
  std::vector<uint32_t> rtn_words(words.size());
  std::vector<uint16_t> rtn_scales(scales.size()), rtn_biases(biases.size());
  quantize_affine(w.data(), rows, cols, f, rtn_words.data(), rtn_scales.data(), rtn_biases.data());
  std::vector<float> q(static_cast<size_t>(cols)), rtn(static_cast<size_t>(cols));
  for (int64_t r = 0; r < rows; ++r) {
    dequantize_row(f, cols, words.data() + r * 8, scales.data() + r * 2, biases.data() + r * 2, q.data());
    dequantize_row(f, cols, rtn_words.data() + r * 8, rtn_scales.data() + r * 2, rtn_biases.data() + r * 2, rtn.data());
    for (float v : q) ASSERT_TRUE(std::isfinite(v));
    // Dead columns: no compensation reaches them (H is block diagonal), so they are rounded as
    // round to nearest rounds them (up to a code where the rounded scale tips a tie).
    for (int64_t c = cols / 2; c < cols; ++c)
      EXPECT_NEAR(q[size_t(c)], rtn[size_t(c)], 1e-6 + std::fabs(scale_to_f32(rtn_scales[size_t(r * 2 + 1)], DType::BF16)) * 1.01)
          << r << "," << c;
  }
}

// A synthetic SwiGLU expert with correlated inputs, quantized at `bits` by round to nearest and
// by GPTQ (with refinement) under the Hessians of `calib` calibration tokens; x holds the first n
// of them (the sample reconstruction sees), held n other tokens from the same distribution.
struct SyntheticExpert {
  static constexpr int64_t hidden = 128, inter = 64, calib = 4096, n = 512;
  QuantFormat f;
  std::vector<float> x, held, gate, up, down;
  std::vector<double> h_in, h_act;  // calibration's Hessians
  struct Quantized {
    std::vector<uint32_t> w[3];
    std::vector<uint16_t> s[3], b[3];
    QuantizedMatrix m(int i) { return {w[i].data(), s[i].data(), b[i].data()}; }
  };
  Quantized rtn, gptq;

  explicit SyntheticExpert(int bits) : f{bits, 32} {
    std::vector<float> all = correlated_inputs(calib + n, hidden, 11);
    for (float& v : all) v *= 0.1f;  // gate outputs of a few units: silu's bend matters
    x.assign(all.begin(), all.begin() + n * hidden);
    held.assign(all.begin() + calib * hidden, all.end());
    all.resize(size_t(calib * hidden));
    gate = test::gaussian(size_t(inter * hidden), 21, 0.3f);
    up = test::gaussian(size_t(inter * hidden), 22, 0.3f);
    down = test::gaussian(size_t(hidden * inter), 23, 0.3f);
    std::vector<float> a(size_t(calib * inter));
    for (int64_t t = 0; t < calib; ++t)
      for (int64_t i = 0; i < inter; ++i) {
        double g = 0, u = 0;
        for (int64_t c = 0; c < hidden; ++c) {
          g += double(all[size_t(t * hidden + c)]) * gate[size_t(i * hidden + c)];
          u += double(all[size_t(t * hidden + c)]) * up[size_t(i * hidden + c)];
        }
        a[size_t(t * inter + i)] = float(g / (1 + std::exp(-g)) * u);
      }
    h_in = hessian_of(all, calib, hidden), h_act = hessian_of(a, calib, inter);
    const float* ws[3] = {gate.data(), up.data(), down.data()};
    for (int i = 0; i < 3; ++i) {
      const int64_t rows = i < 2 ? inter : hidden, cols = i < 2 ? hidden : inter;
      for (Quantized* q : {&rtn, &gptq}) {
        q->w[i].resize(size_t(rows * quant_words_per_row(f, cols)));
        q->s[i].resize(size_t(rows * quant_groups_per_row(f, cols)));
        q->b[i].resize(q->s[i].size());
      }
      quantize_affine(ws[i], rows, cols, f, rtn.w[i].data(), rtn.s[i].data(), rtn.b[i].data());
      quantize_gptq(ws[i], rows, cols, (i < 2 ? h_in : h_act).data(), f, gptq.w[i].data(), gptq.s[i].data(),
                    gptq.b[i].data());
    }
  }
  ExpertMatrices matrices() const {
    return {gate.data(), up.data(), down.data(), hidden, inter, h_in.data(), h_act.data(), calib};
  }
  double error(Quantized& q, const std::vector<float>& on) const {
    return expert_output_error(on.data(), int64_t(on.size()) / hidden, matrices(), f, q.m(0), q.m(1), q.m(2));
  }
  Quantized reconstructed() const {
    Quantized q = gptq;
    reconstruct_expert(x.data(), n, matrices(), f, q.m(0), q.m(1), q.m(2), GptqOptions{});
    return q;
  }
};

// Reconstructing the whole expert lowers its output error on its sample of calibration inputs
// below GPTQ's (each matrix refined alone), which is below round to nearest's. On other inputs
// from the same distribution the error is recorded, not asserted: 1.03 and 1.04 times GPTQ's
// here at 2 and 3 bits (this expert's 25k codes against 512 sampled tokens), 0.96 on the
// trained model's experts (PERFORMANCE.md), where perplexity and KL improve.
TEST(GptqExpert, ReconstructionLowersTheExpertOutputErrorBelowGptq) {
  for (int bits : {2, 3}) {
    SyntheticExpert e(bits);
    SyntheticExpert::Quantized rec = e.reconstructed();
    const double rtn = e.error(e.rtn, e.x), gptq = e.error(e.gptq, e.x), after = e.error(rec, e.x);
    RecordProperty("q" + std::to_string(bits) + "_gptq_over_rtn", test::sci(gptq / rtn));
    RecordProperty("q" + std::to_string(bits) + "_reconstructed_over_gptq", test::sci(after / gptq));
    EXPECT_LT(gptq, rtn) << bits << " bits";
    EXPECT_LT(after, 0.8 * gptq) << bits << " bits";
    const double held_gptq = e.error(e.gptq, e.held), held_after = e.error(rec, e.held);
    RecordProperty("q" + std::to_string(bits) + "_heldout_reconstructed_over_gptq", test::sci(held_after / held_gptq));
    EXPECT_LT(held_after, 1.1 * held_gptq) << bits << " bits";
  }
}

// The same inputs give the same bytes.
TEST(GptqExpert, ReconstructionIsDeterministic) {
  SyntheticExpert e(2);
  SyntheticExpert::Quantized one = e.reconstructed(), two = e.reconstructed();
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(one.w[i], two.w[i]) << i;
    EXPECT_EQ(one.s[i], two.s[i]) << i;
    EXPECT_EQ(one.b[i], two.b[i]) << i;
  }
}

// What reconstruction writes is the layout the kernels read: the CPU backend's expert MLP over
// the reconstructed q2 matrices gives the output expert_output_error scored.
TEST(GptqExpert, KernelsReadTheReconstructedLayout) {
  SyntheticExpert e(2);
  SyntheticExpert::Quantized rec = e.reconstructed();
  auto be = make_cpu_backend(1, true);
  MlpWeights w;
  Matrix* mats[3] = {&w.gate, &w.up, &w.down};
  for (int i = 0; i < 3; ++i) {
    const int64_t rows = i < 2 ? e.inter : e.hidden, cols = i < 2 ? e.hidden : e.inter;
    const TensorView words{"w", DType::U32, {rows, quant_words_per_row(e.f, cols)}, rec.w[i].data(), rec.w[i].size() * 4};
    const TensorView scales{"s", DType::BF16, {rows, cols / 32}, rec.s[i].data(), rec.s[i].size() * 2};
    const TensorView biases{"b", DType::BF16, {rows, cols / 32}, rec.b[i].data(), rec.b[i].size() * 2};
    *mats[i] = be->load_quantized(words, scales, biases, e.f);
  }
  std::vector<float> x = e.x, y(size_t(e.n * e.hidden));
  Buffer out{y.data(), e.n, e.hidden};
  be->mlp(Buffer{x.data(), e.n, e.hidden}, w, out);
  // The reference: dequantized matrices, in double.
  std::vector<float> q[3];
  for (int i = 0; i < 3; ++i) {
    const int64_t rows = i < 2 ? e.inter : e.hidden, cols = i < 2 ? e.hidden : e.inter;
    q[i].resize(size_t(rows * cols));
    for (int64_t r = 0; r < rows; ++r)
      dequantize_row(e.f, cols, rec.w[i].data() + r * quant_words_per_row(e.f, cols), rec.s[i].data() + r * cols / 32,
                     rec.b[i].data() + r * cols / 32, q[i].data() + r * cols);
  }
  double err = 0, norm = 0;
  for (int64_t t = 0; t < e.n; ++t) {
    std::vector<double> a(static_cast<size_t>(e.inter));
    for (int64_t i = 0; i < e.inter; ++i) {
      double g = 0, u = 0;
      for (int64_t c = 0; c < e.hidden; ++c) {
        g += double(x[size_t(t * e.hidden + c)]) * q[0][size_t(i * e.hidden + c)];
        u += double(x[size_t(t * e.hidden + c)]) * q[1][size_t(i * e.hidden + c)];
      }
      a[size_t(i)] = g / (1 + std::exp(-g)) * u;
    }
    for (int64_t k = 0; k < e.hidden; ++k) {
      double v = 0;
      for (int64_t i = 0; i < e.inter; ++i) v += a[size_t(i)] * q[2][size_t(k * e.inter + i)];
      err += (y[size_t(t * e.hidden + k)] - v) * (y[size_t(t * e.hidden + k)] - v);
      norm += v * v;
    }
  }
  EXPECT_LT(err, 1e-8 * norm);
}

// Hands out F32 experts of a layer; counts requests.
class TestExperts : public ExpertProvider {
 public:
  std::vector<MlpWeights> weights;
  void request(int, std::span<const int> experts) override { pending_.assign(experts.begin(), experts.end()); }
  bool next(int& e, MlpWeights& w) override {
    if (pending_.empty()) return false;
    e = pending_.front();
    pending_.erase(pending_.begin());
    w = weights[size_t(e)];
    return true;
  }
  void release(int) override {}

 private:
  std::vector<int> pending_;
};

TEST(Gptq, RecorderSeesExactlyTheRoutedTokens) {
  const int64_t T = 9, dim = 16, inter = 8;
  const int n_experts = 4, top_k = 2;
  ExpertHessians hs;
  auto be = make_hessian_recorder(make_cpu_backend(1, true), hs);
  const std::vector<float> router_w = test::gaussian(size_t(n_experts * dim), 21);
  const auto load = [&](const std::vector<float>& v, int64_t rows, int64_t cols, const std::string& name) {
    return be->load_matrix(TensorView{name, DType::F32, {rows, cols}, v.data(), v.size() * 4});
  };
  const Matrix router = load(router_w, n_experts, dim, "router");
  std::vector<std::vector<float>> mats;
  TestExperts experts;
  for (int e = 0; e < n_experts; ++e) {
    mats.push_back(test::gaussian(size_t(inter * dim), 100 + e));
    mats.push_back(test::gaussian(size_t(inter * dim), 200 + e));
    mats.push_back(test::gaussian(size_t(dim * inter), 300 + e));
  }
  for (int e = 0; e < n_experts; ++e)
    experts.weights.push_back(MlpWeights{load(mats[size_t(3 * e)], inter, dim, "gate"),
                                         load(mats[size_t(3 * e + 1)], inter, dim, "up"),
                                         load(mats[size_t(3 * e + 2)], dim, inter, "down"), {}, {}, {}});
  const std::vector<float> xv = test::gaussian(size_t(T * dim), 9);
  Buffer x = be->alloc(T, dim), out = be->alloc(T, dim);
  std::copy(xv.begin(), xv.end(), x.data);
  MoeParams p;
  p.n_experts = n_experts;
  p.top_k = top_k;
  p.layer = 1;
  be->moe(x, router, experts, p, out);
  finish_hessians(hs);

  // The expected routing: softmax is monotonic, so the top-k logits.
  ASSERT_EQ(hs.layers.size(), 2u);
  EXPECT_TRUE(hs.layers[0].empty());
  std::vector<std::vector<double>> in(n_experts, std::vector<double>(dim * dim, 0.0));
  std::vector<std::vector<double>> act(n_experts, std::vector<double>(inter * inter, 0.0));
  std::vector<int64_t> count(n_experts, 0);
  for (int64_t t = 0; t < T; ++t) {
    const float* xt = xv.data() + t * dim;
    std::vector<std::pair<float, int>> logits;
    for (int e = 0; e < n_experts; ++e) {
      float s = 0;
      for (int64_t i = 0; i < dim; ++i) s += router_w[size_t(e * dim + i)] * xt[i];
      logits.push_back({-s, e});
    }
    std::sort(logits.begin(), logits.end());
    for (int k = 0; k < top_k; ++k) {
      const int e = logits[size_t(k)].second;
      ++count[size_t(e)];
      std::vector<double> a(inter);
      for (int64_t o = 0; o < inter; ++o) {
        double g = 0, u = 0;
        for (int64_t i = 0; i < dim; ++i) {
          g += mats[size_t(3 * e)][size_t(o * dim + i)] * xt[i];
          u += mats[size_t(3 * e + 1)][size_t(o * dim + i)] * xt[i];
        }
        a[size_t(o)] = g / (1 + std::exp(-g)) * u;
      }
      for (int64_t i = 0; i < dim; ++i)
        for (int64_t j = 0; j < dim; ++j) in[size_t(e)][size_t(i * dim + j)] += double(xt[i]) * xt[j];
      for (int64_t i = 0; i < inter; ++i)
        for (int64_t j = 0; j < inter; ++j) act[size_t(e)][size_t(i * inter + j)] += a[size_t(i)] * a[size_t(j)];
    }
  }
  ASSERT_EQ(hs.layers[1].size(), size_t(n_experts));
  for (int e = 0; e < n_experts; ++e) {
    const ExpertHessian& h = hs.layers[1][size_t(e)];
    EXPECT_EQ(h.tokens, count[size_t(e)]) << e;
    if (count[size_t(e)] == 0) continue;
    ASSERT_EQ(h.in.size(), in[size_t(e)].size());
    ASSERT_EQ(h.act.size(), act[size_t(e)].size());
    for (size_t i = 0; i < h.in.size(); ++i) EXPECT_NEAR(h.in[i], in[size_t(e)][i], 1e-3 * (1 + std::fabs(in[size_t(e)][i])));
    for (size_t i = 0; i < h.act.size(); ++i) EXPECT_NEAR(h.act[i], act[size_t(e)][i], 1e-3 * (1 + std::fabs(act[size_t(e)][i])));
  }
}

std::string pack(const std::string& src, const std::string& name, const std::string& flags) {
  const std::string out = test::temp_dir(name) + "/pack";
  auto r = test::run_cli("pack " + src + " " + out + " " + flags);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  return out;
}

// The manifest's layout without the checksums: which tensors, where, in what format.
json layout_of(const std::string& dir) {
  json m = json::parse(test::read_file(dir + "/moestream-pack.json"));
  for (auto& layer : m["layers"])
    for (auto& e : layer) e.erase("xxh64");
  m.erase("manifest_xxh64");
  m.erase("source");
  return m;
}

std::vector<float> logits_of(const std::string& dir, const std::vector<int32_t>& ids) {
  auto model = load_model(dir, ModelOptions{});
  return test::prefill_logits(*model, ids);
}

const std::vector<int32_t> kIds = {1, 5, 9, 17, 33, 65, 129, 200, 3, 7};

TEST(Gptq, PackHasTheLayoutOfRoundToNearest) {
  const std::string src = test::fixture("models/qwen3moe_ppl");
  const std::string rtn = pack(src, "gptq-rtn", "--quant q4 --group-size 32");
  const std::string gptq = test::temp_dir("gptq-q4") + "/pack";
  const auto r = test::run_cli("pack " + src + " " + gptq + " --quant q4 --group-size 32 --gptq " + src + "/text.txt");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  test::expect_contains(r.err, {"gptq: calibrated on", "experts by GPTQ"});
  EXPECT_EQ(layout_of(gptq), layout_of(rtn));
  EXPECT_EQ(test::read_file(gptq + "/weights.safetensors"), test::read_file(rtn + "/weights.safetensors"));
  const PackManifest m = PackManifest::load(gptq), base = PackManifest::load(rtn);
  int differ = 0;
  for (size_t l = 0; l < m.layers.size(); ++l)
    for (size_t e = 0; e < m.layers[l].size(); ++e) differ += m.layers[l][e].checksum != base.layers[l][e].checksum;
  EXPECT_GT(differ, 0);
  EXPECT_TRUE(verify_pack(gptq).problems.empty());
  for (float v : logits_of(gptq, kIds)) ASSERT_TRUE(std::isfinite(v));
  for (const auto& e : fs::directory_iterator(fs::path(gptq).parent_path()))  // the calibration pack is gone
    EXPECT_EQ(e.path().filename(), "pack");
}

// --gptq-passes 2 calibrates again on the pack quantized by the first pass: other Hessians, so
// other codes; the same layout, and no temporary pack left behind.
TEST(Gptq, SecondPassCalibratesOnTheQuantizedPack) {
  const std::string src = test::fixture("models/qwen3moe_ppl");
  const std::string flags = "--quant q2 --group-size 32 --gptq " + src + "/text.txt";
  const std::string one = pack(src, "gptq-pass1", flags);
  const std::string two = test::temp_dir("gptq-pass2") + "/pack";
  const auto r = test::run_cli("pack " + src + " " + two + " " + flags + " --gptq-passes 2");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  test::expect_contains(r.err, {"gptq: pass 2 calibrated on the pass 1 pack"});
  EXPECT_EQ(layout_of(two), layout_of(one));
  const PackManifest m = PackManifest::load(two), base = PackManifest::load(one);
  int differ = 0;
  for (size_t l = 0; l < m.layers.size(); ++l)
    for (size_t e = 0; e < m.layers[l].size(); ++e) differ += m.layers[l][e].checksum != base.layers[l][e].checksum;
  EXPECT_GT(differ, 0);
  EXPECT_TRUE(verify_pack(two).problems.empty());
  for (float v : logits_of(two, kIds)) ASSERT_TRUE(std::isfinite(v));
  for (const auto& e : fs::directory_iterator(fs::path(two).parent_path()))  // no calibration pack left
    EXPECT_EQ(e.path().filename(), "pack");
}

// --gptq-expert-tokens 0 leaves the experts as GPTQ and refinement wrote them; by default the
// experts are reconstructed: other codes in the same layout, a model that loads and runs.
TEST(GptqExpert, PackReconstructsByDefault) {
  const std::string src = test::fixture("models/qwen3moe_ppl");
  const std::string flags = "--quant q2 --group-size 32 --gptq " + src + "/text.txt";
  const std::string off = pack(src, "gptq-xr-off", flags + " --gptq-expert-tokens 0"), on = pack(src, "gptq-xr-on", flags);
  EXPECT_EQ(layout_of(on), layout_of(off));
  const PackManifest m = PackManifest::load(on), base = PackManifest::load(off);
  int differ = 0;
  for (size_t l = 0; l < m.layers.size(); ++l)
    for (size_t e = 0; e < m.layers[l].size(); ++e) differ += m.layers[l][e].checksum != base.layers[l][e].checksum;
  EXPECT_GT(differ, 0);
  EXPECT_TRUE(verify_pack(on).problems.empty());
  for (float v : logits_of(on, kIds)) ASSERT_TRUE(std::isfinite(v));
}

// Calibration and quantization give the same bytes whatever the thread count.
TEST(Gptq, ThreadCountDoesNotChangeTheBytes) {
  const std::string src = test::fixture("models/qwen3moe_ppl");
  const std::string flags = "--quant q3 --group-size 32 --gptq " + src + "/text.txt";
  const std::string one = pack(src, "gptq-t1", flags + " -t 1"), two = pack(src, "gptq-t2", flags + " -t 2");
  for (const std::string& f : PackManifest::load(one).expert_files)
    EXPECT_EQ(test::read_file(one + "/" + f), test::read_file(two + "/" + f)) << f;
}

std::string write_profile(const std::string& name, const std::vector<std::vector<int>>& counts) {
  const std::string path = test::temp_dir(name) + "/profile.json";
  std::ofstream(path) << json{{"counts", counts}}.dump();
  return path;
}

TEST(Tiered, HotExpertsAtHotBitsByTheProfile) {
  const std::string src = test::fixture("models/qwen3moe_ppl");
  // Layer 0: experts 6 and 2 most used; layer 1: 0 and 5 (a tie with 7 goes to the lower id).
  const std::string profile = write_profile("tiered-profile", {{1, 2, 30, 4, 5, 6, 70, 8}, {90, 1, 1, 1, 1, 50, 1, 50}});
  const std::string tiered = pack(src, "tiered", "--group-size 32 --tiered " + profile + " --hot-bits 4 --cold-bits 2 --hot-share 0.25");
  const std::string q4 = pack(src, "tiered-q4", "--group-size 32 --quant q4");
  const std::string q2 = pack(src, "tiered-q2", "--group-size 32 --quant q2");
  const PackManifest m = PackManifest::load(tiered), m4 = PackManifest::load(q4), m2 = PackManifest::load(q2);
  const std::vector<std::vector<int>> hot = {{2, 6}, {0, 5}};
  for (int l = 0; l < 2; ++l)
    for (int e = 0; e < 8; ++e) {
      const bool is_hot = std::count(hot[size_t(l)].begin(), hot[size_t(l)].end(), e) > 0;
      EXPECT_EQ(m.expert(l, e).format, is_hot ? "q4g32" : "q2g32") << l << "/" << e;
      // Each expert is the same bytes as in the pack of its format.
      EXPECT_EQ(m.expert(l, e).checksum, (is_hot ? m4 : m2).expert(l, e).checksum) << l << "/" << e;
    }
  // Mixed formats load and compute: all hot is the q4 pack, bit for bit; the mix lies between.
  const std::string all_hot = pack(src, "tiered-all", "--group-size 32 --tiered " + profile + " --hot-share 1");
  const std::vector<float> a = logits_of(all_hot, kIds), b = logits_of(q4, kIds), mixed = logits_of(tiered, kIds);
  EXPECT_EQ(a, b);
  for (float v : mixed) ASSERT_TRUE(std::isfinite(v));
  EXPECT_NE(mixed, b);
  EXPECT_NE(mixed, logits_of(q2, kIds));
}

TEST(Tiered, CombinesWithGptq) {
  const std::string src = test::fixture("models/qwen3moe_ppl");
  const std::string profile = write_profile("tiered-gptq-profile", {{1, 2, 30, 4, 5, 6, 70, 8}, {90, 1, 1, 1, 1, 50, 1, 50}});
  const std::string out = pack(src, "tiered-gptq", "--group-size 32 --tiered " + profile + " --gptq " + src + "/text.txt");
  const PackManifest m = PackManifest::load(out);
  EXPECT_EQ(m.expert(0, 6).format, "q4g32");
  EXPECT_EQ(m.expert(0, 0).format, "q2g32");
  for (float v : logits_of(out, kIds)) ASSERT_TRUE(std::isfinite(v));
}

TEST(Gptq, FlagErrorsAreOneLine) {
  const std::string src = test::fixture("models/qwen3moe_ppl");
  const std::string dir = test::temp_dir("gptq-flags");
  const std::string profile = write_profile("gptq-flags-profile", {{1, 2, 3, 4, 5, 6, 7, 8}, {1, 2, 3, 4, 5, 6, 7, 8}});
  const std::string short_profile = write_profile("gptq-flags-short", {{1, 2, 3, 4, 5, 6, 7, 8}});
  const std::string text = src + "/text.txt";
  const std::vector<std::pair<std::string, std::vector<std::string>>> cases = {
      {"--quant q2 --gptq " + dir + "/missing.txt", {"--gptq", "missing.txt"}},
      {"--quant bf16 --gptq " + text, {"--gptq", "quantized --quant", "bf16"}},
      {"--gptq " + text, {"--gptq", "quantized --quant", "keep"}},
      {"--quant q2 --gptq-tokens 10", {"--gptq-tokens", "--gptq"}},
      {"--quant q2 --gptq-passes 2", {"--gptq-passes", "--gptq"}},
      {"--quant q2 --gptq " + text + " --gptq-passes 0", {"--gptq-passes", "0"}},
      {"--quant q2 --gptq-expert-tokens 64", {"--gptq-expert-tokens", "--gptq"}},
      {"--quant q2 --gptq " + text + " --gptq-expert-tokens -1", {"--gptq-expert-tokens", "-1"}},
      {"--tiered " + dir + "/missing.json", {"missing.json", "cannot read"}},
      {"--tiered " + text, {"text.txt", "not a usage profile"}},
      {"--tiered " + profile + " --hot-share 1.5", {"--hot-share", "1.5"}},
      {"--tiered " + profile + " --hot-bits 5", {"--hot-bits"}},
      {"--tiered " + profile + " --quant q4", {"--tiered", "leave out --quant"}},
      {"--quant q4 --hot-share 0.5", {"--hot-share", "--tiered"}},
      {"--group-size 32 --tiered " + short_profile, {"--tiered", "layer 1"}},
  };
  for (const auto& [flags, parts] : cases) {
    const auto r = test::run_cli("pack " + src + " " + dir + "/out " + flags);
    EXPECT_NE(r.exit_code, 0) << flags;
    test::expect_contains(r.err, parts);
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << flags << ": " << r.err;
    EXPECT_FALSE(fs::exists(dir + "/out")) << flags;
  }
}

}  // namespace
}  // namespace moestream
