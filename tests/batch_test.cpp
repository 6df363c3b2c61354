// Model::forward_batch: several sequences in one pass per layer (decode tokens of some, prompt
// chunks of others, at different positions) give each sequence what its lone run gives.
//
// Tolerance: an item's logits are not bit-identical to its lone run's. The CPU GEMM for several
// rows sums in another order than the single-row kernel (src/backend/cpu/kernels.h), and a batch
// changes how many rows each linear layer and each expert sees (a decode token alone is one row;
// in a batch it is one of several). Each row's values are the same products, so the difference
// is rounding: the tests bound it at kTolerance of the logits' scale and require the same greedy
// tokens; the largest difference measured is recorded as a test property. With a compact KV type
// the rounding can move a cached code by one step, so the bound there is the type's precision.
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
#include "test_util.h"

namespace moestream {
namespace {

constexpr double kTolerance = 1e-4;  // max |batched - lone| / max |lone| over a sequence's logits

std::string family(const std::string& name) { return test::fixture("families/" + name); }
std::string model_fixture(const std::string& name) { return test::fixture("models/" + name); }

std::unique_ptr<Model> load(const std::string& dir, double cache_mb = -1, KvCacheSpec kv = {}) {
  ModelOptions opt;
  opt.threads = 2;
  opt.experts.cache_mb = cache_mb;
  opt.kv = kv;
  return load_model(dir, opt);
}

int32_t argmax(std::span<const float> v) {
  return int32_t(std::max_element(v.begin(), v.end()) - v.begin());
}

// One sequence of a scenario: its prompt, the step at which it joins, the prompt tokens it
// sends per step, and how many tokens it decodes greedily after the prompt.
struct Plan {
  std::vector<int32_t> prompt;
  int start = 0;
  int64_t chunk = 0;
  int decode = 16;
};

// What a sequence computed: the logits of every prompt position, then of each decode step, and
// its greedy tokens.
struct Run {
  std::vector<float> logits;
  std::vector<int32_t> tokens;
};

// The sequence alone: the prompt in forward calls of p.chunk tokens (the batch's chunks: where a
// compact KV type keeps a chunk's own keys exact, the chunking changes results beyond
// rounding), then one token per call.
Run lone(Model& model, const Plan& p) {
  const size_t vocab = size_t(model.info().vocab_size);
  auto seq = model.new_sequence(int64_t(p.prompt.size()) + p.decode);
  Run r;
  r.logits.resize(p.prompt.size() * vocab);
  for (size_t i = 0; i < p.prompt.size(); i += size_t(p.chunk)) {
    const size_t n = std::min(size_t(p.chunk), p.prompt.size() - i);
    model.forward(std::span(p.prompt).subspan(i, n), *seq, std::span(r.logits).subspan(i * vocab, n * vocab));
  }
  int32_t next = argmax(std::span(r.logits).last(vocab));
  for (int i = 0; i < p.decode; ++i) {
    r.tokens.push_back(next);
    std::vector<float> step(vocab);
    model.forward(std::span(&next, 1), *seq, step);
    r.logits.insert(r.logits.end(), step.begin(), step.end());
    next = argmax(step);
  }
  return r;
}

// All sequences together: each step, one forward_batch call holds every active sequence's next
// prompt chunk (all positions' logits) or its one decode token (the last position's logits).
std::vector<Run> batched(Model& model, const std::vector<Plan>& plans, int* max_items = nullptr) {
  const size_t vocab = size_t(model.info().vocab_size);
  struct Seq {
    std::unique_ptr<SequenceState> state;
    int64_t prompt_done = 0;
    int32_t next = -1;
    std::vector<float> out;  // this step's logits
  };
  std::vector<Seq> seqs(plans.size());
  std::vector<Run> runs(plans.size());
  for (size_t i = 0; i < plans.size(); ++i)
    seqs[i].state = model.new_sequence(int64_t(plans[i].prompt.size()) + plans[i].decode);
  for (int step = 0;; ++step) {
    std::vector<SequenceBatch> items;
    std::vector<size_t> who;
    bool pending = false;
    for (size_t i = 0; i < plans.size(); ++i) {
      const Plan& p = plans[i];
      Seq& s = seqs[i];
      const int64_t n = int64_t(p.prompt.size());
      const bool finished = int(runs[i].tokens.size()) == p.decode && s.prompt_done == n;
      if (finished) continue;
      pending = true;
      if (step < p.start) continue;
      if (s.prompt_done < n) {
        const int64_t m = std::min(p.chunk, n - s.prompt_done);
        s.out.assign(size_t(m) * vocab, 0.0f);
        items.push_back({std::span(p.prompt).subspan(size_t(s.prompt_done), size_t(m)), s.state.get(), s.out});
      } else {
        s.out.assign(vocab, 0.0f);
        items.push_back({std::span(&s.next, 1), s.state.get(), s.out});
      }
      who.push_back(i);
    }
    if (!pending) break;
    if (max_items) *max_items = std::max(*max_items, int(items.size()));
    model.forward_batch(items);
    for (size_t k = 0; k < who.size(); ++k) {
      const Plan& p = plans[who[k]];
      Seq& s = seqs[who[k]];
      Run& r = runs[who[k]];
      r.logits.insert(r.logits.end(), s.out.begin(), s.out.end());
      if (s.prompt_done < int64_t(p.prompt.size())) {
        s.prompt_done += int64_t(items[k].tokens.size());
        if (s.prompt_done < int64_t(p.prompt.size())) continue;
      } else {
        r.tokens.push_back(s.next);
        if (int(r.tokens.size()) == p.decode) continue;
      }
      s.next = argmax(std::span(s.out).last(vocab));
    }
  }
  return runs;
}

std::vector<int32_t> random_tokens(size_t n, int64_t vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> d(0, int32_t(vocab - 1));
  std::vector<int32_t> v(n);
  for (auto& t : v) t = d(rng);
  return v;
}

// Four sequences: a long prompt in chunks that cross the 128-row pass (the batch splits it), a
// one-token prompt, and two that join while others decode.
std::vector<Plan> scenario(int64_t vocab) {
  return {
      {random_tokens(150, vocab, 1), 0, 140, 16},
      {random_tokens(1, vocab, 2), 0, 1, 16},
      {random_tokens(23, vocab, 3), 3, 9, 16},
      {random_tokens(6, vocab, 4), 5, 6, 12},
  };
}

double scaled_difference(const std::vector<float>& a, const std::vector<float>& b) {
  double diff = 0, scale = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff = std::max(diff, double(std::fabs(a[i] - b[i])));
    scale = std::max(scale, double(std::fabs(b[i])));
  }
  return scale > 0 ? diff / scale : diff;
}

// Returns the model's expert counters after both runs.
ExpertStats expect_batch_matches_lone(const std::string& dir, double cache_mb = -1, KvCacheSpec kv = {},
                                      double tolerance = kTolerance) {
  SCOPED_TRACE(dir);
  auto model = load(dir, cache_mb, kv);
  const std::vector<Plan> plans = scenario(model->info().vocab_size);
  int max_items = 0;
  const std::vector<Run> together = batched(*model, plans, &max_items);
  EXPECT_EQ(max_items, 4);
  double worst = 0;
  for (size_t i = 0; i < plans.size(); ++i) {
    SCOPED_TRACE("sequence " + std::to_string(i));
    const Run alone = lone(*model, plans[i]);
    EXPECT_EQ(together[i].tokens, alone.tokens);
    EXPECT_EQ(together[i].logits.size(), alone.logits.size());
    if (together[i].logits.size() != alone.logits.size()) continue;
    const double d = scaled_difference(together[i].logits, alone.logits);
    EXPECT_LE(d, tolerance);
    worst = std::max(worst, d);
  }
  ::testing::Test::RecordProperty("max_scaled_difference", test::sci(worst));
  return model->expert_stats();
}

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
