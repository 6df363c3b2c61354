// Model::forward_batch on the CPU: each sequence of a batch against its lone run (batch_util.h),
// and the engine's batching.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "models/generate.h"
#include "models/model.h"
#include "server/engine.h"
#include "batch_util.h"
#include "test_util.h"

namespace moestream {
namespace {

using namespace batch_test;

TEST(ForwardBatch, Qwen3MoeMatchesLoneRuns) { expect_batch_matches_lone(model_fixture("qwen3moe_gqa_tied")); }
TEST(ForwardBatch, MixtralMatchesLoneRuns) { expect_batch_matches_lone(family("mixtral_tiny")); }
TEST(ForwardBatch, OlmoeMatchesLoneRuns) { expect_batch_matches_lone(family("olmoe_tiny")); }
TEST(ForwardBatch, Glm4MoeMatchesLoneRuns) { expect_batch_matches_lone(family("glm4_moe_tiny")); }
// Sinks and a sliding window.
TEST(ForwardBatch, GptOssMatchesLoneRuns) { expect_batch_matches_lone(family("gpt_oss_tiny")); }
// Latent attention (MLA), dense first layers, shared experts.
TEST(ForwardBatch, DeepseekV3MatchesLoneRuns) { expect_batch_matches_lone(family("deepseek_v3_tiny")); }
// Gated DeltaNet: conv and recurrent state per sequence, the recurrent form for a decode token
// and the chunked form for a prompt chunk, inside one pass.
TEST(ForwardBatch, Qwen3NextMatchesLoneRuns) { expect_batch_matches_lone(family("qwen3_next_tiny")); }
TEST(ForwardBatch, Qwen35MoeMatchesLoneRuns) { expect_batch_matches_lone(family("qwen3_5_moe_text_tiny")); }
// MLX 4-bit weights (the quantized GEMM).
TEST(ForwardBatch, QuantizedMatchesLoneRuns) { expect_batch_matches_lone(model_fixture("qwen3moe_mlx_g32")); }
// Experts streamed through a cache that holds a few of them: the batch's rows still reach
// every expert they route to.
TEST(ForwardBatch, StreamedExpertsMatchLoneRuns) {
  const ExpertStats s = expect_batch_matches_lone(family("qwen3_next_tiny"), 0.05);
  EXPECT_GT(s.misses, s.hits);  // the cache holds few of the experts: most are read again
}

// A KV window (--kv-window 32 --kv-sinks 4): each sequence's new rows enter its own ring of
// sinks + window rows; the long prompt wraps it.
TEST(ForwardBatch, KvWindowRingMatchesLoneRuns) {
  expect_batch_matches_lone(model_fixture("qwen3moe_gqa_tied"), -1, KvCacheSpec{KvType::F32, 32, 4});
  expect_batch_matches_lone(family("qwen3_next_tiny"), -1, KvCacheSpec{KvType::F32, 32, 4});
}

// Compact KV rows (--kv-type q8) in a ring: a rounding difference in a decode token's key can move
// its 8-bit code by one step (1/127 of the row's largest value), so the batched logits follow the
// lone run's within the KV type's precision, not the float rounding: measured 4.6e-4 of scale on
// qwen3_next_tiny, bound 1e-2; the same greedy tokens.
TEST(ForwardBatch, CompactKvMatchesLoneRunsWithinItsPrecision) {
  const KvCacheSpec q8{KvType::Q8, 32, 4};
  expect_batch_matches_lone(model_fixture("qwen3moe_gqa_tied"), -1, q8, 1e-2);
  expect_batch_matches_lone(family("qwen3_next_tiny"), -1, q8, 1e-2);
}

// SequenceBatch::greedy: the ids equal the argmax of the logits the same batches give.
TEST(ForwardBatch, GreedyItemsMatchTheirLogits) {
  expect_greedy_items_match_logits(model_fixture("qwen3moe_gqa_tied"));
  expect_greedy_items_match_logits(family("qwen3_next_tiny"));
}

// A batch of one is forward itself: bit-identical.
TEST(ForwardBatch, OneItemIsForward) {
  auto model = load(family("mixtral_tiny"));
  const size_t vocab = size_t(model->info().vocab_size);
  const std::vector<int32_t> ids = random_tokens(20, int64_t(vocab), 7);
  const std::vector<float> want = test::prefill_logits(*model, ids);
  auto seq = model->new_sequence(20);
  std::vector<float> got(ids.size() * vocab);
  const SequenceBatch item{ids, seq.get(), got};
  model->forward_batch(std::span(&item, 1));
  EXPECT_EQ(got, want);
  EXPECT_EQ(seq->n_past, 20);
}

// Bad items are refused before any sequence moves.
TEST(ForwardBatch, ErrorsNameTheProblemAndMoveNothing) {
  auto model = load(family("mixtral_tiny"));
  const int64_t vocab = model->info().vocab_size;
  auto a = model->new_sequence(8), b = model->new_sequence(4);
  std::vector<int32_t> ok{1, 2}, bad{1, int32_t(vocab)}, many{1, 2, 3, 4, 5};
  std::vector<float> la(static_cast<size_t>(vocab)), lb(static_cast<size_t>(vocab));
  auto run = [&](std::span<const int32_t> second, SequenceState* state, std::span<float> logits) {
    const SequenceBatch items[] = {{ok, a.get(), la}, {second, state, logits}};
    return test::error_of([&] { model->forward_batch(items); });
  };
  test::expect_contains(run(bad, b.get(), lb), {"token id " + std::to_string(vocab), "out of range"});
  test::expect_contains(run(many, b.get(), lb), {"context full", "5 positions"});
  test::expect_contains(run(ok, a.get(), lb), {"twice"});
  test::expect_contains(run(ok, b.get(), std::span(lb).first(3)), {"logits span holds 3 floats"});
  int32_t id = -1;
  const SequenceBatch both[] = {{ok, a.get(), la}, {ok, b.get(), lb, &id}};
  test::expect_contains(test::error_of([&] { model->forward_batch(both); }), {"item 1", "logits and a greedy token"});
  EXPECT_EQ(a->n_past, 0);
  EXPECT_EQ(b->n_past, 0);
}

// A model that records the batches the engine sends it.
class RecordingModel final : public Model {
 public:
  explicit RecordingModel(Model& inner) : inner_(inner) {}
  const ModelInfo& info() const override { return inner_.info(); }
  Backend& backend() override { return inner_.backend(); }
  std::unique_ptr<SequenceState> new_sequence(int64_t capacity) override { return inner_.new_sequence(capacity); }
  ExpertStats expert_stats() const override { return inner_.expert_stats(); }
  std::vector<std::vector<uint64_t>> expert_usage() const override { return inner_.expert_usage(); }
  void forward(std::span<const int32_t> tokens, SequenceState& state, std::span<float> logits) override {
    const SequenceBatch item{tokens, &state, logits};
    forward_batch(std::span(&item, 1));
  }
  void forward_batch(std::span<const SequenceBatch> items) override {
    int64_t rows = 0;
    for (const SequenceBatch& it : items) rows += int64_t(it.tokens.size());
    {
      std::lock_guard lock(mu);
      steps.push_back({int(items.size()), rows});
    }
    inner_.forward_batch(items);
  }
  struct Step {
    int items;
    int64_t rows;  // tokens of all items
  };
  std::mutex mu;
  std::vector<Step> steps;

 private:
  Model& inner_;
};

// The engine runs its requests as one batch per step: every decoding request in each step,
// prompt chunks within the step's budget, and each request's tokens those of its lone run.
TEST(EngineBatch, EachStepHoldsEveryActiveRequest) {
  auto inner = load(model_fixture("qwen3moe_gqa_tied"));
  RecordingModel model(*inner);
  std::vector<std::vector<int32_t>> prompts, expected;
  for (int i = 0; i < 4; ++i) {
    prompts.push_back(random_tokens(size_t(5 + 4 * i), 200, uint32_t(10 + i)));
    Sampler greedy(SamplingParams{});
    expected.push_back(generate(*inner, prompts.back(), 16, greedy, [](int32_t) { return true; }).tokens);
  }
  EngineOptions o;
  o.parallel = 4;
  o.ctx = 64;
  o.prefill_chunk = 6;
  std::vector<std::shared_ptr<Job>> jobs;
  {
    Engine engine(model, o);
    for (const auto& p : prompts) {
      JobRequest r;
      r.prompt = p;
      r.max_tokens = 16;
      jobs.push_back(engine.submit(r));
    }
    for (size_t i = 0; i < jobs.size(); ++i) {
      std::vector<int32_t> out;
      FinishReason reason;
      do reason = jobs[i]->take(out, std::chrono::milliseconds(50));
      while (reason == FinishReason::running);
      EXPECT_EQ(reason, FinishReason::length);
      EXPECT_EQ(out, expected[i]) << "request " << i;
    }
  }
  std::lock_guard lock(model.mu);
  int most = 0;
  for (const auto& s : model.steps) {
    most = std::max(most, s.items);
    // Decode tokens, then prompt tokens up to prefill_chunk rows (at least one prompt token).
    EXPECT_LE(s.rows, std::max<int64_t>(o.prefill_chunk, s.items));
  }
  EXPECT_EQ(most, 4);
  // 4 x 16 decode tokens and 44 prompt tokens: far fewer steps than the 64 decode calls of
  // one request at a time.
  EXPECT_LT(model.steps.size(), 40u);
}

}  // namespace
}  // namespace moestream
