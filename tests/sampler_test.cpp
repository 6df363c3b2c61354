#include "text/sampler.h"

#include <gtest/gtest.h>

#include <map>

#include "core/error.h"

namespace moestream {
namespace {

std::vector<float> logits_of(std::vector<float> v) { return v; }

TEST(Sampler, GreedyTakesArgmaxAndFirstOnTies) {
  Sampler s(SamplingParams{});
  auto l = logits_of({0.1f, 2.0f, -1.0f, 2.0f});
  EXPECT_EQ(s.sample(l, {}), 1);
}

TEST(Sampler, RepetitionPenaltyAppliesOncePerDistinctToken) {
  SamplingParams p;
  p.repetition_penalty = 2.0f;
  Sampler s(p);
  // Token 0 (logit 3) seen twice is divided by 2 once -> 1.5 < 2.0 of token 1.
  auto l = logits_of({3.0f, 2.0f, -1.0f});
  std::vector<int32_t> ctx = {0, 0, 2};
  EXPECT_EQ(s.sample(l, ctx), 1);
  EXPECT_FLOAT_EQ(l[0], 1.5f);
  EXPECT_FLOAT_EQ(l[2], -2.0f);  // negative logits are multiplied
}

TEST(Sampler, RepeatLastNPenalizesOnlyTheContextsLastTokens) {
  SamplingParams p;
  p.repetition_penalty = 2.0f;
  p.repeat_last_n = 2;
  Sampler s(p);
  // Of the context 0 0 1 2, the last two (1 and 2) are penalized; token 0 keeps its 3 and wins.
  auto l = logits_of({3.0f, 2.0f, -1.0f});
  const std::vector<int32_t> ctx = {0, 0, 1, 2};
  EXPECT_EQ(s.sample(l, ctx), 0);
  EXPECT_FLOAT_EQ(l[0], 3.0f);
  EXPECT_FLOAT_EQ(l[1], 1.0f);
  EXPECT_FLOAT_EQ(l[2], -2.0f);
  p.repeat_last_n = 0;  // none
  Sampler none(p);
  l = logits_of({3.0f, 2.0f, -1.0f});
  none.sample(l, ctx);
  EXPECT_EQ(l, logits_of({3.0f, 2.0f, -1.0f}));
  p.repeat_last_n = 10;  // more than the context: all of it
  Sampler all(p);
  l = logits_of({3.0f, 2.0f, -1.0f});
  all.sample(l, ctx);
  EXPECT_EQ(l, logits_of({1.5f, 1.0f, -2.0f}));
  p.repeat_last_n = -2;
  EXPECT_THROW(Sampler{p}, Error);
}

TEST(Sampler, PresenceAndFrequencyPenaltiesCountGeneratedTokensOnly) {
  SamplingParams p;
  p.presence_penalty = 0.5f;
  p.frequency_penalty = 0.25f;
  Sampler s(p);
  auto l = logits_of({1.0f, 2.0f, 3.0f, 0.0f});
  const std::vector<int32_t> context = {3, 3, 3, 2, 2, 1}, generated = {2, 2, 1};
  s.sample(l, context, generated);
  // Token 2 twice: 3 - 0.25 * 2 - 0.5; token 1 once: 2 - 0.25 - 0.5; token 3 only in the prompt.
  EXPECT_FLOAT_EQ(l[2], 2.0f);
  EXPECT_FLOAT_EQ(l[1], 1.25f);
  EXPECT_FLOAT_EQ(l[3], 0.0f);
  EXPECT_FLOAT_EQ(l[0], 1.0f);
}

TEST(Sampler, LogitBiasShiftsAndBans) {
  SamplingParams p;
  p.logit_bias = {{1, -100.0f}, {3, 2.5f}};
  Sampler s(p);
  auto l = logits_of({1.0f, 5.0f, 3.0f, 0.0f});
  EXPECT_EQ(s.sample(l, {}), 2);  // 1 is banned; 3 rises to 2.5, below 2's 3
  EXPECT_FLOAT_EQ(l[3], 2.5f);
  p.logit_bias = {{0, 100.0f}};
  Sampler t(p);
  l = logits_of({1.0f, 5.0f, 3.0f, 0.0f});
  EXPECT_EQ(t.sample(l, {}), 0);
  p.logit_bias = {{0, 101.0f}};
  EXPECT_THROW(Sampler{p}, Error);
  p.logit_bias = {};
  p.presence_penalty = 2.5f;
  EXPECT_THROW(Sampler{p}, Error);
}

TEST(Sampler, TopKOneIsGreedy) {
  SamplingParams p;
  p.temperature = 5.0f;
  p.top_k = 1;
  Sampler s(p);
  for (int i = 0; i < 50; ++i) {
    auto l = logits_of({0.0f, 0.5f, 0.4f});
    EXPECT_EQ(s.sample(l, {}), 1);
  }
}

TEST(Sampler, TemperatureSamplingFollowsSoftmax) {
  SamplingParams p;
  p.temperature = 1.0f;
  p.seed = 7;
  Sampler s(p);
  std::map<int, int> counts;
  const int n = 20000;
  for (int i = 0; i < n; ++i) {
    auto l = logits_of({0.0f, std::log(3.0f)});  // p = 0.25, 0.75
    counts[s.sample(l, {})]++;
  }
  EXPECT_NEAR(counts[1] / double(n), 0.75, 0.02);
}

TEST(Sampler, TopPAndMinPCutTheTail) {
  SamplingParams p;
  p.temperature = 1.0f;
  p.top_p = 0.7f;  // probabilities 0.6, 0.3, 0.1: keeps the first two
  Sampler s(p);
  SamplingParams q = p;
  q.top_p = 1.0f;
  q.min_p = 0.6f;  // 0.3 < 0.6 * 0.6: keeps only the first
  Sampler t(q);
  for (int i = 0; i < 500; ++i) {
    auto l = logits_of({std::log(0.6f), std::log(0.3f), std::log(0.1f)});
    EXPECT_NE(s.sample(l, {}), 2);
    auto m = logits_of({std::log(0.6f), std::log(0.3f), std::log(0.1f)});
    EXPECT_EQ(t.sample(m, {}), 0);
  }
}

TEST(Sampler, SameSeedSameSequence) {
  SamplingParams p;
  p.temperature = 1.0f;
  p.seed = 123;
  Sampler a(p), b(p);
  for (int i = 0; i < 100; ++i) {
    auto l1 = logits_of({0.1f, 0.2f, 0.3f, 0.4f});
    auto l2 = l1;
    EXPECT_EQ(a.sample(l1, {}), b.sample(l2, {}));
  }
}

TEST(Sampler, RejectsBadParameters) {
  SamplingParams p;
  p.top_p = 0.0f;
  EXPECT_THROW(validate(p), Error);
  p = {};
  p.temperature = -1;
  EXPECT_THROW(validate(p), Error);
  p = {};
  p.min_p = 2;
  EXPECT_THROW(validate(p), Error);
}

}  // namespace
}  // namespace moestream
