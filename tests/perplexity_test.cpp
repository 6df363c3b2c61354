// moestream perplexity against the value transformers computes over the same windows.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "test_util.h"

namespace moestream {
namespace {

double value_after(const std::string& text, const std::string& key) {
  const size_t at = text.find(key);
  if (at == std::string::npos) return -1;
  return std::stod(text.substr(at + key.size()));
}

TEST(Perplexity, MatchesTransformersOverTheSameWindows) {
  const std::string dir = test::fixture("models/qwen3moe_ppl");
  auto ref = nlohmann::json::parse(test::read_file(dir + "/ref.json"))["perplexity"];
  const std::string kl = test::temp_dir("ppl") + "/base.kl";
  auto r = test::run_cli("perplexity -m " + dir + " -f " + dir + "/text.txt --ctx " +
                         std::to_string(ref["ctx"].get<int>()) + " --chunks " +
                         std::to_string(ref["chunks"].get<int>()) + " --precise --kl-save " + kl);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const double ppl = value_after(r.out, "ppl = "), want = ref["ppl"].get<double>();
  EXPECT_NEAR(ppl / want, 1.0, 1e-3) << r.out;
  EXPECT_EQ(value_after(r.out, "tokens scored: "), ref["tokens_scored"].get<double>());

  // Against itself: no divergence, full agreement.
  auto again = test::run_cli("perplexity -m " + dir + " -f " + dir + "/text.txt --ctx " +
                             std::to_string(ref["ctx"].get<int>()) + " --chunks " +
                             std::to_string(ref["chunks"].get<int>()) + " --kl-base " + kl);
  ASSERT_EQ(again.exit_code, 0) << again.err;
  EXPECT_LT(value_after(again.out, "kl divergence (base || this run) = "), 1e-4) << again.out;
  EXPECT_EQ(value_after(again.out, "top-1 agreement = "), 100.0) << again.out;
}

// --one-token runs each window as decoding does, one position per forward call: the same
// perplexity as transformers' up to rounding.
TEST(Perplexity, OneTokenAtATimeMatchesTransformers) {
  const std::string dir = test::fixture("models/qwen3moe_ppl");
  auto ref = nlohmann::json::parse(test::read_file(dir + "/ref.json"))["perplexity"];
  auto r = test::run_cli("perplexity -m " + dir + " -f " + dir + "/text.txt --ctx " +
                         std::to_string(ref["ctx"].get<int>()) + " --chunks " +
                         std::to_string(ref["chunks"].get<int>()) + " --precise --one-token");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NEAR(value_after(r.out, "ppl = ") / ref["ppl"].get<double>(), 1.0, 1e-3) << r.out;
  EXPECT_EQ(value_after(r.out, "tokens scored: "), ref["tokens_scored"].get<double>());
}

TEST(Perplexity, TooShortTextIsAClearError) {
  const std::string dir = test::fixture("models/qwen3moe_ppl");
  auto r = test::run_cli("perplexity -m " + dir + " -f " + dir + "/ref.json --ctx 100000");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("too few"), std::string::npos) << r.err;
}

}  // namespace
}  // namespace moestream
