// The lossy routing options over resident experts (MoeParams::miss_fallback, cache_bias): their
// rules checked on the CPU backend's moe() against sums computed here, and through whole models:
// nothing changes when every expert fits, prefill stays exact, and the counters add up.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <nlohmann/json.hpp>

#include "backend/backend.h"
#include "backend/expert_provider.h"
#include "io/pack.h"
#include "models/model.h"
#include "test_util.h"

namespace moestream {
namespace {

constexpr int kExperts = 8, kTopK = 4;
constexpr int64_t kHidden = 16, kInter = 8;

TensorView f32_view(const std::string& name, std::vector<int64_t> shape, const std::vector<float>& data) {
  TensorView t;
  t.name = name;
  t.dtype = DType::F32;
  t.shape = std::move(shape);
  t.data = data.data();
  t.nbytes = data.size() * sizeof(float);
  return t;
}

std::vector<float> random_values(size_t n, uint32_t seed, float scale) {
  std::vector<float> v(n);
  for (float& x : v) {
    seed = seed * 1664525u + 1013904223u;
    x = scale * (float(seed >> 8) / float(1 << 24) - 0.5f);
  }
  return v;
}

// Experts in memory with a residency mask of our choosing; records what moe() asked for.
class FakeProvider final : public ExpertProvider {
 public:
  std::vector<MlpWeights> weights;
  std::vector<char> mask = std::vector<char>(kExperts, 1);
  std::vector<int> requested, later;

  void request(int, std::span<const int> experts) override {
    requested.assign(experts.begin(), experts.end());
    queue_ = requested;
  }
  bool next(int& expert, MlpWeights& w) override {
    if (queue_.empty()) return false;
    expert = queue_.back();  // not in request order: moe() must not depend on it
    queue_.pop_back();
    w = weights[size_t(expert)];
    return true;
  }
  void release(int) override {}
  void resident(int, std::span<char> out) const override { std::copy(mask.begin(), mask.end(), out.begin()); }
  void fetch_later(int, std::span<const int> experts) override { later.assign(experts.begin(), experts.end()); }

 private:
  std::vector<int> queue_;
};

struct MoeSetup {
  std::unique_ptr<Backend> be = make_cpu_backend(1, true);
  std::vector<std::vector<float>> storage;
  Matrix router;
  FakeProvider store;
  Buffer x, out;
  std::vector<float> logits;  // the router's logits of x, computed here

  MoeSetup() {
    auto matrix = [&](const std::string& name, int64_t rows, int64_t cols, uint32_t seed) {
      storage.push_back(random_values(size_t(rows * cols), seed, 1.0f));
      return be->load_matrix(f32_view(name, {rows, cols}, storage.back()));
    };
    router = matrix("router", kExperts, kHidden, 1);
    for (int e = 0; e < kExperts; ++e) {
      MlpWeights w;
      w.gate = matrix("gate", kInter, kHidden, 100 + uint32_t(e));
      w.up = matrix("up", kInter, kHidden, 200 + uint32_t(e));
      w.down = matrix("down", kHidden, kInter, 300 + uint32_t(e));
      store.weights.push_back(w);
    }
    x = be->alloc(1, kHidden);
    out = be->alloc(1, kHidden);
    const std::vector<float> input = random_values(size_t(kHidden), 7, 2.0f);
    std::copy(input.begin(), input.end(), x.data);
    const std::vector<float>& r = storage[0];
    for (int e = 0; e < kExperts; ++e) {
      double s = 0;
      for (int64_t i = 0; i < kHidden; ++i) s += double(r[size_t(e * kHidden + i)]) * double(input[size_t(i)]);
      logits.push_back(float(s));
    }
  }

  static MoeParams params() {
    MoeParams p;
    p.n_experts = kExperts;
    p.top_k = kTopK;
    p.router = RouterKind::SoftmaxTopK;
    p.norm_topk_prob = true;
    return p;
  }

  std::vector<float> moe(const MoeParams& p) {
    be->moe(x, router, store, p, out);
    return std::vector<float>(out.data, out.data + kHidden);
  }

  // sum over `experts` of weight * expert(x), one expert at a time through be->mlp.
  std::vector<float> combine(const std::vector<std::pair<int, double>>& experts) {
    std::vector<float> sum(size_t(kHidden), 0.0f);
    Buffer y = be->alloc(1, kHidden);
    for (const auto& [e, w] : experts) {
      be->mlp(x, store.weights[size_t(e)], y);
      for (int64_t i = 0; i < kHidden; ++i) sum[size_t(i)] += float(w) * y.data[i];
    }
    return sum;
  }

  // Experts by logit, best first.
  std::vector<int> ranking() const {
    std::vector<int> r(kExperts);
    std::iota(r.begin(), r.end(), 0);
    std::sort(r.begin(), r.end(), [&](int a, int b) { return logits[size_t(a)] > logits[size_t(b)]; });
    return r;
  }
};

void expect_near(const std::vector<float>& got, const std::vector<float>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[i], 1e-5f * (1.0f + std::fabs(want[i]))) << i;
}

TEST(LossyRouting, OptionsChangeNothingWhenEveryChosenExpertIsResident) {
  MoeSetup s;
  const std::vector<float> plain = s.moe(MoeSetup::params());
  MoeParams p = MoeSetup::params();
  p.miss_fallback = true;
  p.cache_bias = 3.0f;  // every expert resident: all get the same bias
  EXPECT_EQ(s.moe(p), plain);
  EXPECT_TRUE(s.store.later.empty());
}

TEST(LossyRouting, MissFallbackUsesTheResidentExpertsRenormalized) {
  MoeSetup s;
  const std::vector<int> rank = s.ranking();
  // The 2nd and 4th choices are not resident.
  s.store.mask[size_t(rank[1])] = 0;
  s.store.mask[size_t(rank[3])] = 0;
  MoeParams p = MoeSetup::params();
  p.miss_fallback = true;
  const std::vector<float> got = s.moe(p);
  std::vector<int> want_requested{rank[0], rank[2]};
  std::sort(want_requested.begin(), want_requested.end());
  EXPECT_EQ(s.store.requested, want_requested);
  std::vector<int> later = s.store.later, want_later{rank[1], rank[3]};
  std::sort(later.begin(), later.end());
  std::sort(want_later.begin(), want_later.end());
  EXPECT_EQ(later, want_later);
  // norm_topk_prob: the kept two share weight 1 in proportion to exp(logit).
  const double a = std::exp(double(s.logits[size_t(rank[0])])), c = std::exp(double(s.logits[size_t(rank[2])]));
  expect_near(got, s.combine({{rank[0], a / (a + c)}, {rank[2], c / (a + c)}}));
}

TEST(LossyRouting, MissFallbackKeepsTheSumOfUnnormalizedWeights) {
  MoeSetup s;
  const std::vector<int> rank = s.ranking();
  s.store.mask[size_t(rank[0])] = 0;
  MoeParams p = MoeSetup::params();
  p.norm_topk_prob = false;
  p.miss_fallback = true;
  const std::vector<float> got = s.moe(p);
  double z = 0;
  for (float l : s.logits) z += std::exp(double(l));
  double all = 0, kept = 0;
  for (int i = 0; i < kTopK; ++i) {
    const double w = std::exp(double(s.logits[size_t(rank[size_t(i)])])) / z;
    all += w;
    if (i > 0) kept += w;
  }
  std::vector<std::pair<int, double>> want;
  for (int i = 1; i < kTopK; ++i) want.push_back({rank[size_t(i)], std::exp(double(s.logits[size_t(rank[size_t(i)])])) / z * all / kept});
  expect_near(got, s.combine(want));
}

TEST(LossyRouting, MissFallbackWaitsWhenNoChosenExpertIsResident) {
  MoeSetup s;
  const std::vector<float> plain = s.moe(MoeSetup::params());
  const std::vector<int> rank = s.ranking();
  for (int i = 0; i < kTopK; ++i) s.store.mask[size_t(rank[size_t(i)])] = 0;
  MoeParams p = MoeSetup::params();
  p.miss_fallback = true;
  EXPECT_EQ(s.moe(p), plain);
  EXPECT_EQ(s.store.requested.size(), size_t(kTopK));
  EXPECT_TRUE(s.store.later.empty());
}

TEST(LossyRouting, CacheBiasPrefersResidentExpertsWithTrueWeights) {
  MoeSetup s;
  const std::vector<int> rank = s.ranking();
  // Resident: the 1st, 2nd, 5th and 6th choices. The 5th's logit + B must beat the 3rd's.
  for (char& m : s.store.mask) m = 0;
  for (int i : {0, 1, 4, 5}) s.store.mask[size_t(rank[size_t(i)])] = 1;
  MoeParams p = MoeSetup::params();
  p.cache_bias = s.logits[size_t(rank[2])] - s.logits[size_t(rank[5])] + 0.01f;
  const std::vector<float> got = s.moe(p);
  std::vector<int> want_requested{rank[0], rank[1], rank[4], rank[5]};
  std::sort(want_requested.begin(), want_requested.end());
  EXPECT_EQ(s.store.requested, want_requested);
  double sum = 0;
  for (int e : want_requested) sum += std::exp(double(s.logits[size_t(e)]));
  std::vector<std::pair<int, double>> want;
  for (int e : want_requested) want.push_back({e, std::exp(double(s.logits[size_t(e)])) / sum});
  expect_near(got, s.combine(want));

  // A bias below the gaps changes nothing.
  MoeParams small = MoeSetup::params();
  small.cache_bias = 1e-6f;
  const std::vector<float> plain = s.moe(MoeSetup::params());
  std::vector<int> plain_requested = s.store.requested;
  s.moe(small);
  EXPECT_EQ(s.store.requested, plain_requested);
}

// Mixtral / gpt-oss routing (top k of the logits, softmax over the chosen): the bias ranks,
// the softmax runs over the chosen experts' true logits; the fallback renormalizes to 1.
TEST(LossyRouting, TopKSoftmaxRouterBiasAndFallback) {
  MoeSetup s;
  const std::vector<int> rank = s.ranking();
  for (char& m : s.store.mask) m = 0;
  for (int i : {0, 5, 6, 7}) s.store.mask[size_t(rank[size_t(i)])] = 1;
  MoeParams p = MoeSetup::params();
  p.router = RouterKind::TopKSoftmax;
  p.cache_bias = 1000.0f;  // the resident four win whatever their logits
  const std::vector<float> got = s.moe(p);
  std::vector<int> chosen{rank[0], rank[5], rank[6], rank[7]};
  std::sort(chosen.begin(), chosen.end());
  EXPECT_EQ(s.store.requested, chosen);
  double z = 0;
  for (int e : chosen) z += std::exp(double(s.logits[size_t(e)]));
  std::vector<std::pair<int, double>> want;
  for (int e : chosen) want.push_back({e, std::exp(double(s.logits[size_t(e)])) / z});
  expect_near(got, s.combine(want));

  MoeParams fb = MoeSetup::params();
  fb.router = RouterKind::TopKSoftmax;
  fb.miss_fallback = true;  // of the model's top 4, only the best is resident: it gets weight 1
  expect_near(s.moe(fb), s.combine({{rank[0], 1.0}}));
  EXPECT_EQ(s.store.requested, std::vector<int>{rank[0]});
}

// DeepSeek / GLM routing (sigmoid scores plus a correction bias, groups): the cache bias is added
// to the biased score the experts are ranked by; weights are the sigmoids, renormalized, scaled.
TEST(LossyRouting, SigmoidGroupRouterBias) {
  MoeSetup s;
  const std::vector<int> rank = s.ranking();
  for (char& m : s.store.mask) m = 0;
  for (int i : {1, 2, 3, 7}) s.store.mask[size_t(rank[size_t(i)])] = 1;
  MoeParams p = MoeSetup::params();
  p.router = RouterKind::SigmoidGroupTopK;
  p.n_group = 2;
  p.topk_group = 2;
  p.routed_scaling_factor = 2.5f;
  p.cache_bias = 10.0f;  // above any sigmoid difference
  const std::vector<float> got = s.moe(p);
  std::vector<int> chosen{rank[1], rank[2], rank[3], rank[7]};
  std::sort(chosen.begin(), chosen.end());
  EXPECT_EQ(s.store.requested, chosen);
  const auto sigmoid = [&](int e) { return 1.0 / (1.0 + std::exp(-double(s.logits[size_t(e)]))); };
  double sum = 0;
  for (int e : chosen) sum += sigmoid(e);
  std::vector<std::pair<int, double>> want;
  for (int e : chosen) want.push_back({e, sigmoid(e) / sum * 2.5});
  expect_near(got, s.combine(want));
}

// Whole models: the options act only on decode steps with a cache smaller than the experts.
std::vector<int32_t> fixture_tokens(const std::string& dir) {
  return nlohmann::json::parse(test::read_file(dir + "/ref.json"))["logit_tokens"].get<std::vector<int32_t>>();
}

// Logits of a prefill of `split` tokens, then one token at a time.
std::vector<float> run(const std::string& dir, const ModelOptions& opt, size_t split, ExpertStats* stats = nullptr) {
  auto model = load_model(dir, opt);
  const std::vector<int32_t> ids = fixture_tokens(dir);
  const size_t vocab = size_t(model->info().vocab_size);
  std::vector<float> logits(ids.size() * vocab);
  auto seq = model->new_sequence(int64_t(ids.size()));
  model->forward(std::span(ids).first(split), *seq, std::span(logits).first(split * vocab));
  for (size_t i = split; i < ids.size(); ++i)
    model->forward(std::span(ids).subspan(i, 1), *seq, std::span(logits).subspan(i * vocab, vocab));
  if (stats) *stats = model->expert_stats();
  return logits;
}

TEST(LossyRouting, ModelsBitIdenticalWhenEveryExpertFits) {
  const std::string dir = test::fixture("models/qwen3moe_gqa_tied");
  ModelOptions base;
  base.threads = 2;
  const std::vector<float> reference = run(dir, base, 4);
  const PackManifest pack = PackManifest::load(ensure_pack(dir, ""));
  for (double mb : {-1.0, pack.total_expert_bytes() / 1e6 + 1}) {
    ModelOptions opt = base;
    opt.experts.cache_mb = mb;
    opt.experts.miss_fallback = true;
    opt.experts.cache_bias = 2.0f;
    ExpertStats s;
    EXPECT_EQ(run(dir, opt, 4, &s), reference) << "budget " << mb;
    EXPECT_EQ(s.fallbacks, 0u);
  }
}

TEST(LossyRouting, ModelsFallBackOnDecodeMissesOnlyWithABoundedCache) {
  const std::string dir = test::fixture("models/qwen3moe_gqa_tied");
  const PackManifest pack = PackManifest::load(ensure_pack(dir, ""));
  ModelOptions base;
  base.threads = 2;
  base.experts.cache_mb = pack.total_expert_bytes() / 3e6;
  const size_t n = fixture_tokens(dir).size();
  ExpertStats exact_stats;
  const std::vector<float> exact = run(dir, base, 4, &exact_stats);

  // Prefill alone (every position in one call) is exact with both options on.
  ModelOptions lossy = base;
  lossy.experts.miss_fallback = true;
  lossy.experts.cache_bias = 2.0f;
  EXPECT_EQ(run(dir, lossy, n), run(dir, base, n));

  ModelOptions fallback = base;
  fallback.experts.miss_fallback = true;
  ExpertStats s;
  const std::vector<float> got = run(dir, fallback, 4, &s);
  EXPECT_NE(got, exact);
  EXPECT_GT(s.fallbacks, 0u);
  EXPECT_GE(s.fallback_skipped, s.fallbacks);
  EXPECT_GT(s.fallback_reads, 0u);
  EXPECT_LT(s.misses, exact_stats.misses) << "decode steps skip their misses";
  const size_t vocab = got.size() / n;  // the prefill's logits are untouched
  EXPECT_TRUE(std::equal(got.begin(), got.begin() + long(4 * vocab), exact.begin()));

  ModelOptions biased = base;
  biased.experts.cache_bias = 50.0f;  // far above any logit gap: resident experts always win
  ExpertStats b;
  EXPECT_NE(run(dir, biased, 4, &b), exact);
  EXPECT_GT(b.hits, exact_stats.hits);
  EXPECT_EQ(b.fallbacks, 0u);
}

TEST(LossyRouting, CliFlagsAreCheckedAndCounted) {
  const std::string dir = test::fixture("models/qwen3moe_odd_sparse_step");
  const auto bad = test::run_cli("run -m " + dir + " --tokens 1,2,3 -n 2 --ids --cache-bias -1");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.err.find("--cache-bias"), std::string::npos) << bad.err;
  const auto ok = test::run_cli("run -m " + dir + " --tokens 1,2,3 -n 12 --temp 0 --ids --device cpu "
                                "--expert-cache-mb 0.01 --miss-fallback --cache-bias 0.5 --stats");
  ASSERT_EQ(ok.exit_code, 0) << ok.err;
  const auto stats = nlohmann::json::parse(ok.err.substr(ok.err.rfind('{')));
  for (const char* key : {"fallbacks", "fallback_experts_skipped", "fallback_reads"})
    EXPECT_TRUE(stats.contains(key)) << key;
}

}  // namespace
}  // namespace moestream
