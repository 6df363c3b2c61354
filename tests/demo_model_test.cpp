// The demo model shipped in models/pystd-moe-20m-q4 (tools/train_demo_model.py: a Qwen3.5-MoE
// trained on the Python standard library, 4-bit MLX layout) against transformers running on its
// dequantized weights (tests/fixtures/families/pystd_moe_20m_q4, whose model files are links into
// models/): logits, greedy tokens, perplexity of the held-out text, and streaming under a budget.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <nlohmann/json.hpp>
#include <string>

#include "io/pack.h"
#include "models/model.h"
#include "test_util.h"

namespace moestream {
namespace {

std::string fixture_dir() { return test::fixture("families/pystd_moe_20m_q4"); }
std::string model_dir() { return test::source_dir() + "/models/pystd-moe-20m-q4"; }

std::vector<float> logits_of(const std::string& dir, const ModelOptions& opt, const std::vector<int32_t>& ids,
                             ExpertStats* stats = nullptr) {
  auto model = load_model(dir, opt);
  std::vector<float> logits(ids.size() * size_t(model->info().vocab_size));
  auto seq = model->new_sequence(int64_t(ids.size()));
  // A prefill of 20, then one token at a time: the decode path too.
  model->forward(std::span(ids).first(20), *seq, std::span(logits).first(20 * size_t(model->info().vocab_size)));
  const size_t vocab = size_t(model->info().vocab_size);
  for (size_t i = 20; i < ids.size(); ++i)
    model->forward(std::span(ids).subspan(i, 1), *seq, std::span(logits).subspan(i * vocab, vocab));
  if (stats) *stats = model->expert_stats();
  return logits;
}

TEST(DemoModel, FixtureLinksToTheShippedModel) {
  // The fixture holds no copy of the weights: its model files resolve to models/.
  for (const char* f : {"config.json", "model.safetensors", "tokenizer.json", "heldout.txt"}) {
    const std::filesystem::path p = fixture_dir() + "/" + f;
    ASSERT_TRUE(std::filesystem::is_symlink(p)) << p;
    EXPECT_TRUE(std::filesystem::equivalent(p, model_dir() + "/" + f)) << p;
  }
}

TEST(DemoModel, LogitsMatchTransformersOnTheDequantizedWeights) {
  const test::Reference ref = test::load_reference(fixture_dir());
  for (bool precise : {true, false}) {
    ModelOptions opt;
    opt.precise = precise;
    opt.threads = 2;
    const std::vector<float> logits = logits_of(model_dir(), opt, ref.logit_tokens);
    ASSERT_EQ(logits.size(), ref.logits.data.size());
    // The bounds of the other fixtures (families_test, qwen3_next_test).
    EXPECT_LE(test::relative_error(logits, ref.logits.data), precise ? 1e-3 : 3e-2) << (precise ? "--precise" : "default");
  }
}

TEST(DemoModel, GreedyTokensMatchTransformers) {
  const test::Reference ref = test::load_reference(fixture_dir());
  for (const char* mode : {"--precise", ""}) {
    auto r = test::run_cli("run -m " + model_dir() + " --threads 2 --tokens " + test::join(ref.prompt_tokens, ",") +
                           " -n " + std::to_string(ref.greedy_tokens.size()) + " --temp 0 --ids " + mode);
    ASSERT_EQ(r.exit_code, 0) << r.err;
    EXPECT_EQ(r.out, test::join(ref.greedy_tokens, " ") + "\n") << mode;
  }
}

TEST(DemoModel, PerplexityOfTheHeldOutTextMatchesTransformers) {
  // transformers' NLL of each 512-token window of heldout.txt, windowed as moestream perplexity
  // windows it; two windows keep the test at a few seconds on two cores.
  const auto ppl = nlohmann::json::parse(test::read_file(fixture_dir() + "/perplexity.json"));
  const std::vector<double> nll = ppl.at("window_nll_dequantized").get<std::vector<double>>();
  const int chunks = 2;
  ASSERT_GE(int(nll.size()), chunks);
  const double expected = std::exp((nll[0] + nll[1]) / (512.0 * chunks));
  auto r = test::run_cli("perplexity -m " + model_dir() + " -f " + model_dir() + "/heldout.txt --ctx 512 --chunks " +
                         std::to_string(chunks) + " --threads 2");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const size_t at = r.out.find("ppl = ");
  ASSERT_NE(at, std::string::npos) << r.out;
  const double got = std::stod(r.out.substr(at + 6));
  EXPECT_LE(std::abs(got - expected) / expected, 1e-3) << "moestream " << got << ", transformers " << expected;
  EXPECT_NE(r.out.find("tokens scored: 1024 (2 windows of 512)"), std::string::npos) << r.out;
}

TEST(DemoModel, StreamingUnderASmallExpertBudgetIsBitIdentical) {
  const test::Reference ref = test::load_reference(fixture_dir());
  ModelOptions unbounded;
  unbounded.threads = 2;
  ExpertStats all;
  const std::vector<float> expected = logits_of(model_dir(), unbounded, ref.logit_tokens, &all);
  const PackManifest pack = PackManifest::load(ensure_pack(model_dir(), ""));
  ModelOptions bounded = unbounded;
  bounded.experts.cache_mb = double(pack.total_expert_bytes()) * 0.25 / 1e6;  // a quarter of the experts
  ExpertStats s;
  const std::vector<float> got = logits_of(model_dir(), bounded, ref.logit_tokens, &s);
  ASSERT_EQ(got.size(), expected.size());
  EXPECT_EQ(std::memcmp(got.data(), expected.data(), got.size() * sizeof(float)), 0);
  EXPECT_GT(s.misses, all.misses) << "the bounded cache re-reads experts";
  EXPECT_LE(s.cache_bytes, s.budget_bytes);
}

TEST(DemoModel, DemoCommandStreamsUnderItsBudget) {
  auto r = test::run_cli("demo -m " + model_dir() + " -n 12 --threads 2 --device cpu");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("def fibonacci(n):"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("--- chat ---"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("hit rate"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("(30% of the experts)"), std::string::npos) << r.out;
}

}  // namespace
}  // namespace moestream
