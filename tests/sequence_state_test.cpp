// SequenceState snapshots (clone, restore, truncate) on every model fixture: a state brought back
// by any of them must continue exactly as a fresh sequence fed the same tokens in the same calls
// (bit-identical logits), and a clone must share nothing with its source.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <span>
#include <vector>

#include "core/error.h"
#include "models/model.h"
#include "test_util.h"

namespace moestream {
namespace {

namespace fs = std::filesystem;

// Every model directory under tests/fixtures/models and tests/fixtures/families.
std::vector<std::string> all_fixtures() {
  std::vector<std::string> dirs;
  for (const char* group : {"models", "families"})
    for (const auto& e : fs::directory_iterator(test::fixture(group)))
      if (fs::exists(e.path() / "config.json")) dirs.push_back(e.path().string());
  std::sort(dirs.begin(), dirs.end());
  return dirs;
}

using Tokens = std::vector<int32_t>;
using Calls = std::vector<Tokens>;  // token batches, one forward call each

class SequenceStateTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    ModelOptions opt;
    opt.threads = 2;
    opt.kv.growable = true;  // the server's caches (memory as they grow); the rest hold capacity
    model_ = load_model(GetParam(), opt);
    vocab_ = size_t(model_->info().vocab_size);
  }

  // n distinct-looking token ids below the vocab size, different for each `seed`.
  Tokens tokens(size_t n, int seed) const {
    Tokens t(n);
    for (size_t i = 0; i < n; ++i) t[i] = int32_t((i * 37 + size_t(seed) * 101 + 11) % vocab_);
    return t;
  }

  // Runs each call on `seq`, returns the logits of every token of every call.
  std::vector<float> run(SequenceState& seq, const Calls& calls) {
    std::vector<float> logits;
    for (const Tokens& c : calls) {
      std::vector<float> part(c.size() * vocab_);
      model_->forward(c, seq, part);
      logits.insert(logits.end(), part.begin(), part.end());
    }
    return logits;
  }

  // The logits of the calls after the first `skip`, from a fresh sequence fed all of them.
  std::vector<float> fresh(const Calls& calls, size_t skip) {
    auto seq = model_->new_sequence(kCapacity);
    run(*seq, Calls(calls.begin(), calls.begin() + long(skip)));
    return run(*seq, Calls(calls.begin() + long(skip), calls.end()));
  }

  static bool identical(const std::vector<float>& a, const std::vector<float>& b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
  }

  static constexpr int64_t kCapacity = 64;
  std::unique_ptr<Model> model_;
  size_t vocab_ = 0;
};

// A prompt as one prefill, continuations as a 2-token batch then single decoded tokens.
Calls continuation(const Tokens& t) {
  Calls c{Tokens(t.begin(), t.begin() + 2)};
  for (size_t i = 2; i < t.size(); ++i) c.push_back({t[i]});
  return c;
}

Calls concat(Calls a, const Calls& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

TEST_P(SequenceStateTest, CloneContinuesIndependently) {
  const Tokens prompt = tokens(24, 1);
  const Calls b1 = continuation(tokens(6, 2)), b2 = continuation(tokens(6, 3));
  auto seq = model_->new_sequence(kCapacity);
  run(*seq, {prompt});
  auto copy = seq->clone();
  EXPECT_EQ(copy->n_past, 24);
  EXPECT_EQ(copy->capacity(), kCapacity);
  EXPECT_EQ(copy->bytes(), seq->bytes());
  EXPECT_GT(seq->bytes(), 0);
  // Interleaved, so a buffer shared between the two would show.
  std::vector<float> got1, got2;
  for (size_t i = 0; i < b1.size(); ++i) {
    const std::vector<float> x = run(*seq, {b1[i]}), y = run(*copy, {b2[i]});
    got1.insert(got1.end(), x.begin(), x.end());
    got2.insert(got2.end(), y.begin(), y.end());
  }
  EXPECT_TRUE(identical(got1, fresh(concat({prompt}, b1), 1))) << "the source after cloning";
  EXPECT_TRUE(identical(got2, fresh(concat({prompt}, b2), 1))) << "the clone";
  EXPECT_EQ(seq->n_past, 30);
  EXPECT_EQ(copy->n_past, 30);
}

TEST_P(SequenceStateTest, RestoreReturnsToTheSnapshot) {
  const Tokens prompt = tokens(24, 4);
  const Calls b1 = continuation(tokens(6, 5)), b2 = continuation(tokens(7, 6));
  const std::vector<float> want1 = fresh(concat({prompt}, b1), 1), want2 = fresh(concat({prompt}, b2), 1);
  auto seq = model_->new_sequence(kCapacity);
  run(*seq, {prompt});
  auto snapshot = seq->clone(24);  // sized to what it holds
  EXPECT_EQ(snapshot->capacity(), 24);
  EXPECT_LT(snapshot->bytes(), seq->bytes());

  EXPECT_TRUE(identical(run(*seq, b1), want1));
  seq->restore(*snapshot);
  EXPECT_EQ(seq->n_past, 24);
  EXPECT_TRUE(identical(run(*seq, b2), want2)) << "continuing after restore";
  seq->restore(*snapshot);  // the snapshot did not change when restored from
  EXPECT_TRUE(identical(run(*seq, b1), want1)) << "a second restore of the same snapshot";

  // Into another sequence of a different capacity, which had computed something else.
  auto other = model_->new_sequence(40);
  run(*other, {tokens(30, 7)});
  other->restore(*snapshot);
  EXPECT_TRUE(identical(run(*other, b2), want2)) << "restored into a sequence of capacity 40";
  // A clone of a snapshot continues as well (a prefix cache hands out copies of its entries).
  auto from_snapshot = snapshot->clone(kCapacity);
  EXPECT_TRUE(identical(run(*from_snapshot, b1), want1)) << "a clone of the snapshot";
  seq->restore(*seq);  // restoring a state from itself changes nothing
  EXPECT_EQ(seq->n_past, 30);
}

TEST_P(SequenceStateTest, TruncateThenReforward) {
  const Tokens a1 = tokens(10, 8), a2 = tokens(14, 9), other_a2 = tokens(14, 10);
  const Calls b1 = continuation(tokens(6, 11)), b2 = continuation(tokens(6, 12));
  auto seq = model_->new_sequence(kCapacity);
  run(*seq, concat({a1, a2}, b1));
  ASSERT_EQ(seq->n_past, 30);
  for (int64_t bad : {int64_t(-1), int64_t(31)}) {
    EXPECT_FALSE(seq->can_truncate(bad));
    EXPECT_THROW(seq->truncate(bad), Error) << bad;
  }
  EXPECT_TRUE(seq->can_truncate(30));
  EXPECT_TRUE(seq->can_truncate(0));
  seq->truncate(30);  // keeps everything
  EXPECT_EQ(seq->n_past, 30);

  if (seq->can_truncate(24)) {
    // Attention-only: any prefix can be kept.
    for (int64_t n = 0; n <= 30; ++n) EXPECT_TRUE(seq->can_truncate(n)) << n;
    seq->truncate(24);
    EXPECT_TRUE(identical(run(*seq, b2), fresh(concat({a1, a2}, b2), 2))) << "cut back to the prompt";
    seq->truncate(10);
    EXPECT_TRUE(identical(run(*seq, concat({other_a2}, b1)), fresh(concat({a1, other_a2}, b1), 1)))
        << "cut inside the prompt";
  } else {
    // Recurrent state: only whole or reset; a refused cut leaves the state as it was.
    for (int64_t n = 1; n < 30; ++n) EXPECT_FALSE(seq->can_truncate(n)) << n;
    test::expect_contains(test::error_of([&] { seq->truncate(24); }), {"recurrent state"});
    EXPECT_EQ(seq->n_past, 30);
    EXPECT_TRUE(identical(run(*seq, b2), fresh(concat(concat({a1, a2}, b1), b2), 2 + b1.size())))
        << "continuing after a refused truncate";
  }
  // Reset: the state is a fresh sequence again (recurrent and conv states zeroed).
  seq->truncate(0);
  EXPECT_EQ(seq->n_past, 0);
  EXPECT_TRUE(identical(run(*seq, concat({a1, a2}, b1)), fresh(concat({a1, a2}, b1), 0))) << "after truncate(0)";
}

// KV caches hold memory for the positions reserved, not for the capacity: forward commits what
// it writes, trim() gives back what lies past n_past, and a sequence grown again after giving
// memory back continues exactly.
TEST_P(SequenceStateTest, MemoryFollowsThePositions) {
  const Tokens a = tokens(40, 13), b = tokens(6, 14);
  auto seq = model_->new_sequence(kCapacity);
  const int64_t none = seq->bytes_at(0);
  EXPECT_EQ(seq->held_bytes(), seq->bytes_at(kCapacity)) << "a new sequence holds its capacity";
  seq->trim();
  EXPECT_EQ(seq->held_bytes(), none);
  EXPECT_LE(seq->bytes_at(40), seq->bytes_at(kCapacity));
  EXPECT_GT(seq->bytes_at(40), none);
  const std::vector<float> first = run(*seq, continuation(a));
  EXPECT_EQ(seq->held_bytes(), seq->bytes_at(40));
  seq->truncate(0);
  seq->trim();
  EXPECT_EQ(seq->held_bytes(), none);
  EXPECT_TRUE(identical(run(*seq, continuation(a)), first)) << "grown again after trim";
  // A snapshot holds its positions only; restoring it commits them in the target.
  auto snap = seq->clone(40);
  EXPECT_EQ(snap->held_bytes(), snap->bytes_at(40));
  auto other = model_->new_sequence(kCapacity);
  other->trim();
  other->restore(*snap);
  EXPECT_EQ(other->held_bytes(), other->bytes_at(40));
  EXPECT_TRUE(identical(run(*other, {b}), run(*seq, {b}))) << "restored";
}

// A sealed snapshot (a prefix cache's entry) lends its KV memory to the states restored from it:
// on the CPU they map its whole pages copy-on-write and hold less than a copy, each continues
// exactly (interleaved, so a page written through by either would show), a cut inside the
// borrowed rows rewrites only the borrower's, and once the snapshot is gone they continue and
// count that memory as their own.
TEST_P(SequenceStateTest, SealedSnapshotsLendTheirMemory) {
  constexpr int64_t kLong = 256;  // rows enough for whole pages in the narrowest fixture's caches
  const Tokens prompt = tokens(200, 15), cut_tail = tokens(5, 18);
  const Calls b1 = continuation(tokens(6, 16)), b2 = continuation(tokens(6, 17)), more = continuation(tokens(4, 19));
  auto reference = [&](const Calls& calls, size_t skip) {
    auto seq = model_->new_sequence(kLong);
    run(*seq, Calls(calls.begin(), calls.begin() + long(skip)));
    return run(*seq, Calls(calls.begin() + long(skip), calls.end()));
  };
  const std::vector<float> want1 = reference(concat({prompt}, b1), 1), want2 = reference(concat({prompt}, b2), 1);
  auto seq = model_->new_sequence(kLong);
  run(*seq, {prompt});
  auto snap = seq->clone(200);
  snap->seal();
  seq.reset();
  auto a = model_->new_sequence(kLong), b = model_->new_sequence(kLong);
  a->trim();
  b->trim();
  a->restore(*snap);
  b->restore(*snap);
  const int64_t copy_bytes = snap->held_bytes() - snap->bytes_at(0);
  EXPECT_LT(a->held_bytes() - a->bytes_at(0), copy_bytes) << "a restored state borrows the snapshot's pages";
  EXPECT_LT(b->held_bytes() - b->bytes_at(0), copy_bytes);
  std::vector<float> got1, got2;
  for (size_t i = 0; i < b1.size(); ++i) {
    const std::vector<float> x = run(*a, {b1[i]}), y = run(*b, {b2[i]});
    got1.insert(got1.end(), x.begin(), x.end());
    got2.insert(got2.end(), y.begin(), y.end());
  }
  EXPECT_TRUE(identical(got1, want1)) << "the first borrower";
  EXPECT_TRUE(identical(got2, want2)) << "the second borrower";
  if (a->can_truncate(20)) {  // attention-only: rewrite borrowed rows of one borrower
    auto ref = model_->new_sequence(kLong);
    run(*ref, {prompt});
    ref->truncate(20);
    const std::vector<float> want_cut = run(*ref, {cut_tail});
    a->truncate(20);
    EXPECT_TRUE(identical(run(*a, {cut_tail}), want_cut)) << "rows rewritten inside the borrowed pages";
    auto c = model_->new_sequence(kLong);
    c->restore_prefix(*snap, 20);
    EXPECT_EQ(c->n_past, 20);
    EXPECT_TRUE(identical(run(*c, {cut_tail}), want_cut))
        << "a prefix of the snapshot, which the other borrower's writes left unchanged";
  }
  auto c = model_->new_sequence(kLong);
  c->restore(*snap);
  EXPECT_TRUE(identical(run(*c, b2), want2)) << "the snapshot after its borrowers wrote";
  snap.reset();  // the lender goes; the borrowers keep the pages
  auto d = model_->new_sequence(kLong);
  run(*d, concat({prompt}, b2));
  d->trim();
  b->trim();
  EXPECT_EQ(b->held_bytes(), d->held_bytes()) << "a borrower counts the pages once the lender is gone";
  EXPECT_TRUE(identical(run(*b, more), run(*d, more))) << "a borrower continuing after the lender is gone";
}

TEST_P(SequenceStateTest, MismatchesAreErrors) {
  auto seq = model_->new_sequence(kCapacity);
  run(*seq, {tokens(20, 13)});
  EXPECT_THROW(seq->clone(19), Error) << "a clone smaller than n_past";
  auto small = model_->new_sequence(16);
  test::expect_contains(test::error_of([&] { small->restore(*seq); }), {"room for 16"});
  EXPECT_EQ(small->n_past, 0);
  ModelOptions opt;
  opt.threads = 1;
  auto other_model = load_model(GetParam(), opt);
  auto foreign = other_model->new_sequence(kCapacity);
  test::expect_contains(test::error_of([&] { foreign->restore(*seq); }), {"another model"});
}

INSTANTIATE_TEST_SUITE_P(Fixtures, SequenceStateTest, ::testing::ValuesIn(all_fixtures()),
                         [](const auto& info) { return fs::path(info.param).filename().string(); });

}  // namespace
}  // namespace moestream
