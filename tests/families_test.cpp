// The MoE families beyond Qwen3-MoE against their transformers fixtures
// (tools/make_family_fixtures.py): logits, prefill then decode, CLI greedy tokens, and streaming
// under a tiny expert budget.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/npy.h"
#include "io/pack.h"
#include "models/model.h"
#include "test_util.h"

namespace moestream {
namespace {

// Families with a fixture under tests/fixtures/families/<name>_tiny that moestream supports.
const std::vector<std::string> kFamilies = {"mixtral", "olmoe", "glm4_moe", "deepseek_v3", "gpt_oss"};

struct Reference {
  std::vector<int32_t> logit_tokens, prompt_tokens, greedy_tokens;
  NpyArray logits;
};

std::string fixture_dir(const std::string& family) { return test::fixture("families/" + family + "_tiny"); }

Reference load_reference(const std::string& dir) {
  auto j = nlohmann::json::parse(test::read_file(dir + "/ref.json"));
  Reference r;
  r.logit_tokens = j["logit_tokens"].get<std::vector<int32_t>>();
  r.prompt_tokens = j["prompt_tokens"].get<std::vector<int32_t>>();
  r.greedy_tokens = j["greedy_tokens"].get<std::vector<int32_t>>();
  r.logits = read_npy_f32(dir + "/ref_logits.npy");
  return r;
}

// max|a - b| / max|b|
double relative_error(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num = std::max(num, double(std::fabs(a[i] - b[i])));
    den = std::max(den, double(std::fabs(b[i])));
  }
  return num / den;
}

std::string join(const std::vector<int32_t>& ids, const char* sep) {
  std::string s;
  for (size_t i = 0; i < ids.size(); ++i) s += (i ? sep : "") + std::to_string(ids[i]);
  return s;
}

// Logits of every position: the first `split` tokens as one prefill, the rest one at a time.
std::vector<float> run_split(Model& model, const std::vector<int32_t>& ids, size_t split) {
  const size_t vocab = size_t(model.info().vocab_size);
  std::vector<float> logits(ids.size() * vocab);
  auto seq = model.new_sequence(int64_t(ids.size()));
  model.forward(std::span(ids).first(split), *seq, std::span(logits).first(split * vocab));
  for (size_t i = split; i < ids.size(); ++i)
    model.forward(std::span(ids).subspan(i, 1), *seq, std::span(logits).subspan(i * vocab, vocab));
  EXPECT_EQ(seq->n_past, int64_t(ids.size()));
  return logits;
}

class FamilyFixture : public ::testing::TestWithParam<std::string> {};

TEST_P(FamilyFixture, LogitsMatchTransformers) {
  const std::string dir = fixture_dir(GetParam());
  Reference ref = load_reference(dir);
  for (bool precise : {true, false}) {
    ModelOptions opt;
    opt.precise = precise;
    opt.threads = 2;
    auto model = load_model(dir, opt);
    EXPECT_EQ(model->info().model_type, GetParam());
    const int64_t vocab = model->info().vocab_size;
    ASSERT_EQ(ref.logits.shape, (std::vector<int64_t>{int64_t(ref.logit_tokens.size()), vocab}));
    std::vector<float> logits(ref.logit_tokens.size() * size_t(vocab));
    auto seq = model->new_sequence(int64_t(ref.logit_tokens.size()));
    model->forward(ref.logit_tokens, *seq, logits);
    const double err = relative_error(logits, ref.logits.data);
    EXPECT_LE(err, precise ? 1e-3 : 3e-2) << GetParam() << (precise ? " --precise" : " default");
    char measured[32];
    std::snprintf(measured, sizeof measured, "%.2e", err);
    RecordProperty(precise ? "precise_error" : "default_error", measured);
  }
}

TEST_P(FamilyFixture, PrefillThenDecodeEqualsWholeSequence) {
  const std::string dir = fixture_dir(GetParam());
  Reference ref = load_reference(dir);
  ModelOptions opt;
  opt.precise = true;
  opt.threads = 2;
  auto model = load_model(dir, opt);
  const size_t n = ref.logit_tokens.size();
  const std::vector<float> whole = run_split(*model, ref.logit_tokens, n);
  const std::vector<float> stepped = run_split(*model, ref.logit_tokens, 13);
  EXPECT_LE(relative_error(stepped, whole), 1e-5);
}

TEST_P(FamilyFixture, CliGreedyTokensMatchTransformers) {
  const std::string dir = fixture_dir(GetParam());
  Reference ref = load_reference(dir);
  for (const char* mode : {"--precise", ""}) {
    auto r = test::run_cli("run -m " + dir + " --tokens " + join(ref.prompt_tokens, ",") + " -n " +
                           std::to_string(ref.greedy_tokens.size()) + " --temp 0 --ids " + mode);
    ASSERT_EQ(r.exit_code, 0) << r.err;
    EXPECT_EQ(r.out, join(ref.greedy_tokens, " ") + "\n") << mode;
  }
}

TEST_P(FamilyFixture, StreamingUnderATinyBudgetIsBitIdentical) {
  const std::string dir = fixture_dir(GetParam());
  Reference ref = load_reference(dir);
  ModelOptions opt;
  opt.threads = 2;
  auto unbounded = load_model(dir, opt);
  const std::vector<float> reference = run_split(*unbounded, ref.logit_tokens, 20);
  const ExpertStats base = unbounded->expert_stats();
  const PackManifest pack = PackManifest::load(ensure_pack(dir, ""));
  for (const char* policy : {"lru", "lcp"}) {
    opt.experts.cache_mb = pack.max_expert_size() / 1e6 * 1.5;  // one expert slot
    opt.experts.policy = policy;
    auto bounded = load_model(dir, opt);
    const std::vector<float> got = run_split(*bounded, ref.logit_tokens, 20);
    ASSERT_EQ(got.size(), reference.size());
    EXPECT_EQ(std::memcmp(got.data(), reference.data(), got.size() * sizeof(float)), 0) << policy;
    EXPECT_GT(bounded->expert_stats().misses, base.misses) << "a bounded cache must re-read experts";
  }
}

INSTANTIATE_TEST_SUITE_P(Families, FamilyFixture, ::testing::ValuesIn(kFamilies),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace moestream
