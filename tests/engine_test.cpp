// The server's generation engine: requests run concurrently give exactly the tokens a lone
// generate() gives, the prefix cache reuses states without changing results, cancellation and
// the queue limit leave nothing behind.
#include "server/engine.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>

#include "core/error.h"
#include "models/generate.h"
#include "server/prefix_cache.h"
#include "test_util.h"

namespace moestream {
namespace {

std::vector<int32_t> drain(Job& job, FinishReason& reason) {
  std::vector<int32_t> out;
  do reason = job.take(out, std::chrono::milliseconds(50));
  while (reason == FinishReason::running);
  return out;
}

// As the server loads models: KV caches that take memory as sequences grow.
ModelOptions growable() {
  ModelOptions o;
  o.kv.growable = true;
  return o;
}

std::vector<int32_t> reference(Model& model, const std::vector<int32_t>& prompt, int n) {
  Sampler greedy(SamplingParams{});
  return generate(model, prompt, n, greedy, [](int32_t) { return true; }).tokens;
}

class EngineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    model_ = load_model(test::fixture("models/qwen3moe_gqa_tied"), growable());
    for (int i = 0; i < 5; ++i) {
      std::vector<int32_t> p;
      for (int j = 0; j < 6 + 3 * i; ++j) p.push_back((37 * i + 11 * j + 5) % 200);
      prompts_.push_back(p);
      expected_.push_back(reference(*model_, p, 12));
    }
  }
  JobRequest request(const std::vector<int32_t>& prompt, int n = 12) {
    JobRequest r;
    r.prompt = prompt;
    r.max_tokens = n;
    return r;
  }
  std::unique_ptr<Model> model_;
  std::vector<std::vector<int32_t>> prompts_, expected_;
};

TEST_F(EngineTest, ConcurrentRequestsMatchSequentialGeneration) {
  EngineOptions o;
  o.parallel = 3;
  o.ctx = 128;
  o.prefill_chunk = 4;  // several turns of prefill per prompt, interleaved with other requests
  Engine engine(*model_, o);
  std::vector<std::shared_ptr<Job>> jobs;
  for (const auto& p : prompts_) jobs.push_back(engine.submit(request(p)));
  for (size_t i = 0; i < jobs.size(); ++i) {
    FinishReason reason;
    EXPECT_EQ(drain(*jobs[i], reason), expected_[i]) << "request " << i;
    EXPECT_EQ(reason, FinishReason::length);
  }
  const EngineStats s = engine.stats();
  EXPECT_EQ(s.requests_finished, 5);
  EXPECT_EQ(s.generated_tokens, 5 * 12);
}

TEST_F(EngineTest, PrefixCacheReusesStateWithIdenticalResults) {
  EngineOptions o;
  o.parallel = 1;
  o.ctx = 128;
  o.kv_slots = 2;
  Engine engine(*model_, o);
  FinishReason reason;
  auto first = engine.submit(request(prompts_[4]));
  ASSERT_EQ(drain(*first, reason), expected_[4]);
  EXPECT_EQ(first->cached_tokens(), 0);

  // The next turn: the whole first exchange plus more. Everything before the last generated
  // token (never forwarded) is reused.
  std::vector<int32_t> turn2 = prompts_[4];
  turn2.insert(turn2.end(), expected_[4].begin(), expected_[4].end());
  turn2.insert(turn2.end(), {7, 8, 9});
  // (references first: the model must not run on two threads at once)
  const auto expect2 = reference(*model_, turn2, 12);
  auto second = engine.submit(request(turn2));
  EXPECT_EQ(drain(*second, reason), expect2);
  EXPECT_EQ(second->cached_tokens(), int64_t(prompts_[4].size() + expected_[4].size() - 1));

  // A prompt sharing only a prefix: the cached state is cut back to the shared part.
  std::vector<int32_t> branch(prompts_[4].begin(), prompts_[4].begin() + 10);
  branch.push_back(199);
  const auto expect3 = reference(*model_, branch, 12);
  auto third = engine.submit(request(branch));
  EXPECT_EQ(drain(*third, reason), expect3);
  EXPECT_EQ(third->cached_tokens(), 10);
  EXPECT_GE(engine.stats().cache.hits, 2);
}

// The prefix cache seals what it stores (SequenceState::seal), so on the CPU a request restored
// from an entry borrows the entry's KV pages: the KV memory of the entry and its borrower together
// stays below two copies, the borrower continues as a fresh sequence would, and so does a second
// borrower after the first wrote its own tokens.
TEST(PrefixCacheMemory, RestoredStatesBorrowTheEntry) {
  auto model = load_model(test::fixture("models/qwen3moe_gqa_tied"), growable());
  std::vector<int32_t> prompt;
  for (int j = 0; j < 200; ++j) prompt.push_back((13 * j + 7) % 200);
  auto seq = model->new_sequence(256);
  std::vector<float> logits(size_t(model->info().vocab_size));
  model->forward(prompt, *seq, logits);
  PrefixCache cache(2);
  cache.store(prompt, *seq);
  const int64_t copy = seq->bytes_at(200) - seq->bytes_at(0);  // the 200 positions, unshared
  seq.reset();
  EXPECT_EQ(cache.kv_bytes(), copy);
  std::vector<int32_t> longer = prompt;
  longer.insert(longer.end(), {3, 4, 5});
  const auto want = reference(*model, longer, 6);
  for (int round = 0; round < 2; ++round) {
    auto s = model->new_sequence(256);
    s->trim();
    ASSERT_EQ(cache.restore(longer, *s), 200);
    EXPECT_LT(s->held_bytes() - s->bytes_at(0), copy / 2) << "the borrower holds a fraction of a copy";
    Sampler greedy(SamplingParams{});
    std::vector<int32_t> got;
    model->forward(std::span<const int32_t>(longer).subspan(200), *s, logits);
    got.push_back(greedy.sample(logits, {}));
    for (int i = 1; i < 6; ++i) {
      model->forward(std::span<const int32_t>(&got.back(), 1), *s, logits);
      got.push_back(greedy.sample(logits, {}));
    }
    EXPECT_EQ(got, want) << "round " << round;
  }
}

TEST_F(EngineTest, CancelStopsAndFreesTheSlot) {
  EngineOptions o;
  o.parallel = 1;
  // Long enough that the cancel always lands mid-generation: 100 tokens of this tiny model took
  // less than the 50 ms poll below on a fast machine.
  o.ctx = 2048;
  Engine engine(*model_, o);
  auto job = engine.submit(request(prompts_[0], 2000));
  std::vector<int32_t> got;
  while (got.size() < 2) job->take(got, std::chrono::milliseconds(50));
  job->cancel();
  FinishReason reason;
  drain(*job, reason);
  EXPECT_EQ(reason, FinishReason::cancelled);
  // The slot is free again and the next request is unaffected.
  auto next = engine.submit(request(prompts_[1]));
  EXPECT_EQ(drain(*next, reason), expected_[1]);
  EXPECT_EQ(engine.stats().active, 0);
  EXPECT_EQ(engine.stats().requests_cancelled, 1);
}

// A model whose first forward pass waits until open() (so that requests submitted meanwhile are
// all queued when the engine goes on); everything else is the wrapped model's.
class GatedModel final : public Model {
 public:
  explicit GatedModel(Model& m) : m_(m) {}
  void open() {
    std::lock_guard lock(mu_);
    open_ = true;
    cv_.notify_all();
  }
  const ModelInfo& info() const override { return m_.info(); }
  Backend& backend() override { return m_.backend(); }
  std::unique_ptr<SequenceState> new_sequence(int64_t capacity) override {
    return m_.new_sequence(capacity);
  }
  ExpertStats expert_stats() const override { return m_.expert_stats(); }
  std::vector<std::vector<uint64_t>> expert_usage() const override { return m_.expert_usage(); }
  void forward(std::span<const int32_t> tokens, SequenceState& state,
               std::span<float> logits) override {
    m_.forward(tokens, state, logits);
  }
  void forward_batch(std::span<const SequenceBatch> items) override {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return open_; });
    lock.unlock();
    m_.forward_batch(items);
  }

 private:
  Model& m_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool open_ = false;
};

// One request running and one queued fill an engine of one slot and a queue of one: a third is
// refused. The first step waits at the gate, so the first request cannot finish before the third
// is submitted (on a loaded machine it once did, and the third was taken).
TEST_F(EngineTest, QueueLimitRefusesAndContextIsChecked) {
  EngineOptions o;
  o.parallel = 1;
  o.max_queue = 1;
  o.ctx = 64;
  GatedModel gated(*model_);
  Engine engine(gated, o);
  auto a = engine.submit(request(prompts_[0], 40));
  auto b = engine.submit(request(prompts_[1], 40));
  EXPECT_THROW(engine.submit(request(prompts_[2], 40)), QueueFull);
  a->cancel();
  b->cancel();
  EXPECT_THROW(engine.submit(request(prompts_[0], 60)), Error);  // 6 + 60 > 64
  gated.open();
  FinishReason reason;
  drain(*a, reason);
  drain(*b, reason);
}

// Generates prompts[i] with max_tokens n each, all submitted at once to an engine of `parallel`
// slots with a KV budget that holds two of them at their longest: the third is preempted once
// they outgrow it, and resumes by recomputing its tokens. Every reply equals its lone run, and the
// KV memory stays within the budget throughout.
EngineStats run_over_budget(Model& model, const std::vector<std::vector<int32_t>>& prompts,
                            const std::vector<std::vector<int32_t>>& expected, int n) {
  EngineOptions o;
  o.parallel = int(prompts.size());
  o.ctx = 128;
  o.prefill_chunk = 4;
  int64_t longest = 0;
  for (const auto& p : prompts) longest = std::max(longest, int64_t(p.size()) + n);
  auto probe = model.new_sequence(o.ctx);
  o.kv_budget = 2 * (probe->bytes_at(longest) - probe->bytes_at(0));
  EXPECT_GT(probe->bytes_at(longest), probe->bytes_at(int64_t(prompts.back().size()) + 1))
      << "the sequences must outgrow their first memory for the test to preempt";
  GatedModel gated(model);
  Engine engine(gated, o);
  std::atomic<bool> done{false};
  std::atomic<int64_t> most{0};
  std::thread watch([&] {
    while (!done) {
      most = std::max(most.load(), engine.stats().kv_bytes);
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  });
  std::vector<std::shared_ptr<Job>> jobs;
  for (const auto& p : prompts) {
    JobRequest r;
    r.prompt = p;
    r.max_tokens = n;
    jobs.push_back(engine.submit(r));
  }
  gated.open();
  for (size_t i = 0; i < jobs.size(); ++i) {
    FinishReason reason;
    EXPECT_EQ(drain(*jobs[i], reason), expected[i]) << "request " << i;
    EXPECT_EQ(reason, FinishReason::length);
  }
  done = true;
  watch.join();
  const EngineStats s = engine.stats();
  EXPECT_LE(most.load(), o.kv_budget);
  EXPECT_LE(s.kv_bytes, o.kv_budget);
  EXPECT_EQ(s.paused, 0);
  EXPECT_EQ(s.active, 0);
  return s;
}

TEST_F(EngineTest, KvBudgetPreemptsAndResumesExactly) {
  const int n = 40;  // 6-12 prompt tokens + 40: past the first page of this fixture's caches
  std::vector<std::vector<int32_t>> prompts(prompts_.begin(), prompts_.begin() + 3), expected;
  for (const auto& p : prompts) expected.push_back(reference(*model_, p, n));
  const EngineStats s = run_over_budget(*model_, prompts, expected, n);
  EXPECT_GE(s.preemptions, 1);
}

// The context shrinks to what the KV budget holds for one sequence; a budget that holds less
// than two positions is refused.
TEST_F(EngineTest, KvBudgetBoundsTheContext) {
  EngineOptions o;
  o.parallel = 2;
  o.ctx = 128;
  auto probe = model_->new_sequence(o.ctx);
  o.kv_budget = probe->bytes_at(20);  // this model has no fixed state: all of it is KV memory
  {
    Engine engine(*model_, o);
    const int64_t ctx = engine.options().ctx;
    EXPECT_GE(ctx, 20);
    EXPECT_LT(ctx, 128);
    EXPECT_LE(probe->bytes_at(ctx), o.kv_budget);
    EXPECT_GT(probe->bytes_at(ctx + 1), o.kv_budget);
    test::expect_contains(test::error_of([&] { engine.submit(request(prompts_[0], 100)); }),
                          {"context"});
    FinishReason reason;
    auto fits = engine.submit(request(prompts_[0], 12));
    EXPECT_EQ(drain(*fits, reason), expected_[0]);
    EXPECT_LE(engine.stats().kv_bytes, o.kv_budget);
  }
  o.kv_budget = 1;
  test::expect_contains(test::error_of([&] { Engine engine(*model_, o); }),
                        {"--kv-mb", "2 positions"});
}

// A model that declares `eos` its end-of-sequence id; everything else is the wrapped model's.
class EosModel final : public Model {
 public:
  EosModel(Model& m, int32_t eos) : m_(m), info_(m.info()) { info_.eos_token_ids = {eos}; }
  const ModelInfo& info() const override { return info_; }
  Backend& backend() override { return m_.backend(); }
  std::unique_ptr<SequenceState> new_sequence(int64_t capacity) override { return m_.new_sequence(capacity); }
  ExpertStats expert_stats() const override { return m_.expert_stats(); }
  std::vector<std::vector<uint64_t>> expert_usage() const override { return m_.expert_usage(); }
  void forward(std::span<const int32_t> tokens, SequenceState& state, std::span<float> logits) override {
    m_.forward(tokens, state, logits);
  }
  void forward_batch(std::span<const SequenceBatch> items) override { m_.forward_batch(items); }

 private:
  Model& m_;
  ModelInfo info_;
};

// ignore_eos: the end-of-sequence id is generated like any token, up to max_tokens (with the
// greedy id found by the model, and with logprobs, which need the logits).
TEST_F(EngineTest, IgnoreEosGeneratesPastTheEndOfSequenceId) {
  const std::vector<int32_t>& want = expected_[0];
  const int32_t eos = want[3];
  const long first = long(std::find(want.begin(), want.end(), eos) - want.begin());
  EosModel model(*model_, eos);
  EngineOptions o;
  o.parallel = 2;
  o.ctx = 64;
  Engine engine(model, o);
  FinishReason reason;
  auto stopped = engine.submit(request(prompts_[0]));
  EXPECT_EQ(drain(*stopped, reason), std::vector<int32_t>(want.begin(), want.begin() + first));
  EXPECT_EQ(reason, FinishReason::eos);
  for (int logprobs : {-1, 2}) {
    JobRequest r = request(prompts_[0]);
    r.ignore_eos = true;
    r.logprobs = logprobs;
    auto job = engine.submit(r);
    EXPECT_EQ(drain(*job, reason), want) << "logprobs " << logprobs;
    EXPECT_EQ(reason, FinishReason::length);
  }
}

}  // namespace
}  // namespace moestream

namespace moestream {
namespace {

// Qwen3-Next keeps recurrent DeltaNet state: a cached sequence is reused only when the new prompt
// extends all of it, and results stay identical either way.
TEST(EngineHybrid, PrefixCacheWithRecurrentState) {
  auto model = load_model(test::fixture("families/qwen3_next_tiny"), {});
  std::vector<int32_t> prompt;
  for (int j = 0; j < 20; ++j) prompt.push_back((13 * j + 7) % 150);
  const auto first_ref = reference(*model, prompt, 8);
  std::vector<int32_t> extended = prompt;
  extended.insert(extended.end(), first_ref.begin(), first_ref.end());
  extended.insert(extended.end(), {3, 4});
  const auto extended_ref = reference(*model, extended, 8);
  std::vector<int32_t> branch(prompt.begin(), prompt.begin() + 12);
  branch.push_back(149);
  const auto branch_ref = reference(*model, branch, 8);

  EngineOptions o;
  o.parallel = 1;
  o.ctx = 96;
  o.prefill_chunk = 7;
  Engine engine(*model, o);
  FinishReason reason;
  JobRequest r;
  r.max_tokens = 8;
  r.prompt = prompt;
  auto a = engine.submit(r);
  EXPECT_EQ(drain(*a, reason), first_ref);
  r.prompt = extended;
  auto b = engine.submit(r);
  EXPECT_EQ(drain(*b, reason), extended_ref);
  EXPECT_EQ(b->cached_tokens(), int64_t(prompt.size() + first_ref.size() - 1));
  r.prompt = branch;  // diverges inside the cached sequence: the recurrent state cannot be cut back
  auto c = engine.submit(r);
  EXPECT_EQ(drain(*c, reason), branch_ref);
  EXPECT_EQ(c->cached_tokens(), 0);
}

// Preempted hybrid sequences resume exactly too: their recurrent state is recomputed with the rest.
TEST(EngineHybrid, KvBudgetPreemptsAndResumesExactly) {
  auto model = load_model(test::fixture("families/qwen3_next_tiny"), growable());
  const int n = 40;
  std::vector<std::vector<int32_t>> prompts, expected;
  for (int i = 0; i < 3; ++i) {
    std::vector<int32_t> p;
    for (int j = 0; j < 8 + 2 * i; ++j) p.push_back((29 * i + 13 * j + 7) % 290);
    prompts.push_back(p);
    expected.push_back(reference(*model, p, n));
  }
  EXPECT_GE(run_over_budget(*model, prompts, expected, n).preemptions, 1);
}

}  // namespace
}  // namespace moestream
