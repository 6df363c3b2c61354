// Model::forward_batch against lone runs (tests/batch_test.cpp on the CPU, tests/gpu/batch_test.cpp
// on CUDA): several sequences in one pass per layer (decode tokens of some, prompt chunks of
// others, at different positions) give each sequence what its lone run gives.
//
// Tolerance: an item's logits are not bit-identical to its lone run's. The CPU GEMM for several
// rows sums in another order than the single-row kernel (src/backend/cpu/kernels.h), and a batch
// changes how many rows each linear layer and each expert sees (a decode token alone is one row;
// in a batch it is one of several). Each row's values are the same products, so the difference
// is rounding: the tests bound it at kTolerance of the logits' scale and require the same greedy
// tokens; the largest difference measured is recorded as a test property. With a compact KV type
// the rounding can move a cached code by one step, so the bound there is the type's precision.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "models/model.h"
#include "test_util.h"

namespace moestream::batch_test {

constexpr double kTolerance = 1e-4;  // max |batched - lone| / max |lone| over a sequence's logits

inline std::string family(const std::string& name) { return test::fixture("families/" + name); }
inline std::string model_fixture(const std::string& name) { return test::fixture("models/" + name); }

inline std::unique_ptr<Model> load(const std::string& dir, double cache_mb = -1, KvCacheSpec kv = {},
                                   const std::string& device = "cpu") {
  ModelOptions opt;
  opt.device = device;
  opt.threads = 2;
  opt.experts.cache_mb = cache_mb;
  opt.kv = kv;
  return load_model(dir, opt);
}

inline int32_t argmax(std::span<const float> v) {
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
inline Run lone(Model& model, const Plan& p) {
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
inline std::vector<Run> batched(Model& model, const std::vector<Plan>& plans, int* max_items = nullptr) {
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

inline std::vector<int32_t> random_tokens(size_t n, int64_t vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> d(0, int32_t(vocab - 1));
  std::vector<int32_t> v(n);
  for (auto& t : v) t = d(rng);
  return v;
}

// Four sequences: a long prompt in chunks that cross the 128-row pass (the batch splits it), a
// one-token prompt, and two that join while others decode.
inline std::vector<Plan> scenario(int64_t vocab) {
  return {
      {random_tokens(150, vocab, 1), 0, 140, 16},
      {random_tokens(1, vocab, 2), 0, 1, 16},
      {random_tokens(23, vocab, 3), 3, 9, 16},
      {random_tokens(6, vocab, 4), 5, 6, 12},
  };
}

inline double scaled_difference(const std::vector<float>& a, const std::vector<float>& b) {
  double diff = 0, scale = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff = std::max(diff, double(std::fabs(a[i] - b[i])));
    scale = std::max(scale, double(std::fabs(b[i])));
  }
  return scale > 0 ? diff / scale : diff;
}

// Each of `plans`' sequences (scenario()'s when empty) batched against its lone run on a model
// loaded for `device`. Returns the model's expert counters after both runs.
inline ExpertStats expect_batch_matches_lone(const std::string& dir, double cache_mb = -1, KvCacheSpec kv = {},
                                             double tolerance = kTolerance, const std::string& device = "cpu",
                                             std::vector<Plan> plans = {}) {
  SCOPED_TRACE(dir);
  auto model = load(dir, cache_mb, kv, device);
  if (plans.empty()) plans = scenario(model->info().vocab_size);
  int max_items = 0;
  const std::vector<Run> together = batched(*model, plans, &max_items);
  EXPECT_EQ(max_items, int(plans.size()));
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

// Greedy items (SequenceBatch::greedy) against the argmax of the logits the same batches give:
// four sequences prefill together, then decode together; in one run every item asks for its
// logits, in one every item for its greedy id, in one they alternate. The batches have the same
// rows each time, so the ids must equal the logits' argmax exactly.
inline void expect_greedy_items_match_logits(const std::string& dir, const std::string& device = "cpu") {
  SCOPED_TRACE(dir);
  auto model = load(dir, -1, {}, device);
  const int64_t vocab = model->info().vocab_size;
  constexpr int kSeqs = 4, kSteps = 8;
  std::vector<std::vector<int32_t>> prompts;
  for (uint32_t i = 0; i < kSeqs; ++i) prompts.push_back(random_tokens(5 + 3 * i, vocab, 40 + i));
  auto run = [&](auto greedy_item) {
    std::vector<std::unique_ptr<SequenceState>> states;
    std::vector<int32_t> next(kSeqs, -1);
    std::vector<std::vector<float>> logits(kSeqs, std::vector<float>(size_t(vocab)));
    std::vector<std::vector<int32_t>> out(kSeqs);
    for (int i = 0; i < kSeqs; ++i) states.push_back(model->new_sequence(int64_t(prompts[size_t(i)].size()) + kSteps));
    for (int step = 0; step < kSteps; ++step) {
      std::vector<SequenceBatch> items;
      for (int i = 0; i < kSeqs; ++i) {
        const std::span<const int32_t> tokens = step == 0 ? std::span<const int32_t>(prompts[size_t(i)])
                                                          : std::span<const int32_t>(&next[size_t(i)], 1);
        if (greedy_item(i)) items.push_back({tokens, states[size_t(i)].get(), {}, &next[size_t(i)]});
        else items.push_back({tokens, states[size_t(i)].get(), logits[size_t(i)]});
      }
      model->forward_batch(items);
      for (int i = 0; i < kSeqs; ++i) {
        if (!greedy_item(i)) next[size_t(i)] = argmax(logits[size_t(i)]);
        out[size_t(i)].push_back(next[size_t(i)]);
      }
    }
    return out;
  };
  const auto from_logits = run([](int) { return false; });
  EXPECT_EQ(run([](int) { return true; }), from_logits);
  EXPECT_EQ(run([](int i) { return i % 2 == 1; }), from_logits);
}

}  // namespace moestream::batch_test
