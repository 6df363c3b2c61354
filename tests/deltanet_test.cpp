// The Gated DeltaNet kernel (Qwen3-Next, Qwen3.5-MoE linear attention): chunked (prefill) and
// recurrent (decode) forms agree, threads change nothing, state carries across calls, shape errors
// name the input.
#include <gtest/gtest.h>

#include <random>
#include <utility>
#include <vector>

#include "backend/cpu/deltanet.h"
#include "core/error.h"
#include "core/thread_pool.h"
#include "test_util.h"

namespace moestream {
namespace {

using test::relative_error;

struct DeltaNetCase {
  DeltaNetParams p;
  DeltaNetWeights w;
  std::vector<std::vector<float>> storage;
  std::vector<float> qkv, z, b, a;
  int64_t T;

  DeltaNetCase(int64_t tokens, uint32_t seed) : T(tokens) {
    p.n_k_heads = 2;
    p.n_v_heads = 4;
    p.k_head_dim = 8;
    p.v_head_dim = 6;
    p.conv_kernel = 4;
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    auto fill = [&](std::vector<float>& v, size_t n, float scale, float shift) {
      v.resize(n);
      for (float& x : v) x = normal(rng) * scale + shift;
    };
    const int64_t conv_dim = 2 * 16 + 24;
    auto vec = [&](size_t n, float scale, float shift, const char* name) {
      fill(storage.emplace_back(), n, scale, shift);
      return Vector{name, storage.back().data(), int64_t(n)};
    };
    storage.reserve(4);
    w.conv = vec(size_t(conv_dim * 4), 0.5f, 0.0f, "conv");
    w.A_log = vec(4, 0.5f, 0.0f, "A_log");
    w.dt_bias = vec(4, 0.5f, 0.0f, "dt_bias");
    w.norm = vec(6, 0.2f, 1.0f, "norm");
    fill(qkv, size_t(T * conv_dim), 1.0f, 0.0f);
    fill(z, size_t(T * 24), 1.0f, 0.0f);
    fill(b, size_t(T * 4), 1.0f, 0.0f);
    fill(a, size_t(T * 4), 1.0f, -1.0f);
  }

  struct State {
    std::vector<float> conv, recurrent;
    DeltaNetState view() { return DeltaNetState{{conv.data(), 3, 56}, {recurrent.data(), 32, 6}}; }
  };
  State fresh_state() const { return State{std::vector<float>(3 * 56), std::vector<float>(32 * 6)}; }

  // Runs tokens [begin, begin + n) with `form`, returns their outputs [n, 24].
  std::vector<float> run(ThreadPool& pool, State& s, int64_t begin, int64_t n, cpu::DeltaRuleForm form) {
    auto rows = [&](std::vector<float>& v, int64_t cols) {
      return Buffer{v.data() + begin * cols, n, cols};
    };
    std::vector<float> out(size_t(n * 24));
    Buffer o{out.data(), n, 24};
    DeltaNetState view = s.view();
    cpu::DeltaNetScratch scratch;
    cpu::gated_delta_net(pool, rows(qkv, 56), rows(z, 24), rows(b, 4), rows(a, 4), w, p, view, o, scratch, form);
    return out;
  }
};

TEST(GatedDeltaNet, ChunkedFormEqualsRecurrence) {
  ThreadPool pool(2);
  const int64_t T = 2 * cpu::kDeltaNetChunk + 22;  // three chunks, the last one partial
  DeltaNetCase c(T, 1);
  auto s1 = c.fresh_state(), s2 = c.fresh_state();
  // A warm start first, so the chunked form also starts from a non-zero state.
  c.run(pool, s1, 0, 5, cpu::DeltaRuleForm::Recurrent);
  c.run(pool, s2, 0, 5, cpu::DeltaRuleForm::Recurrent);
  const std::vector<float> rec = c.run(pool, s1, 5, T - 5, cpu::DeltaRuleForm::Recurrent);
  const std::vector<float> chunked = c.run(pool, s2, 5, T - 5, cpu::DeltaRuleForm::Chunked);
  EXPECT_LE(relative_error(chunked, rec), 1e-5);
  EXPECT_LE(relative_error(s2.recurrent, s1.recurrent), 1e-5);
  EXPECT_EQ(s2.conv, s1.conv);
}

// A prompt long enough that the conv, the q/k norms and the gated norm split its tokens over the
// pool: the same outputs and states bit for bit as on one thread.
TEST(GatedDeltaNet, ThreadsDoNotChangeTheOutput) {
  ThreadPool one(1), three(3);
  const int64_t T = 6000;
  DeltaNetCase c(T, 3);
  auto s1 = c.fresh_state(), s3 = c.fresh_state();
  const std::vector<float> o1 = c.run(one, s1, 0, T, cpu::DeltaRuleForm::Chunked);
  const std::vector<float> o3 = c.run(three, s3, 0, T, cpu::DeltaRuleForm::Chunked);
  EXPECT_EQ(o3, o1);
  EXPECT_EQ(s3.recurrent, s1.recurrent);
  EXPECT_EQ(s3.conv, s1.conv);
}

TEST(GatedDeltaNet, StateCarriesAcrossCalls) {
  ThreadPool pool(1);
  const int64_t T = 30;
  DeltaNetCase c(T, 2);
  auto whole_state = c.fresh_state(), split_state = c.fresh_state();
  const std::vector<float> whole = c.run(pool, whole_state, 0, T, cpu::DeltaRuleForm::Chunked);
  std::vector<float> split;
  // Pieces shorter than the conv kernel exercise the rolling conv state.
  for (auto [begin, n] : std::vector<std::pair<int64_t, int64_t>>{{0, 2}, {2, 1}, {3, 11}, {14, 16}}) {
    const auto form = n == 1 ? cpu::DeltaRuleForm::Recurrent : cpu::DeltaRuleForm::Chunked;
    const std::vector<float> part = c.run(pool, split_state, begin, n, form);
    split.insert(split.end(), part.begin(), part.end());
  }
  EXPECT_LE(relative_error(split, whole), 1e-5);
  EXPECT_LE(relative_error(split_state.recurrent, whole_state.recurrent), 1e-5);
}

TEST(GatedDeltaNet, ShapeErrorsNameTheInput) {
  ThreadPool pool(1);
  DeltaNetCase c(3, 3);
  auto s = c.fresh_state();
  DeltaNetState view = s.view();
  std::vector<float> out(3 * 24);
  Buffer o{out.data(), 3, 24};
  Buffer wrong{c.qkv.data(), 3, 50};
  cpu::DeltaNetScratch scratch;
  test::expect_contains(test::error_of([&] {
                          cpu::gated_delta_net(pool, wrong, Buffer{c.z.data(), 3, 24}, Buffer{c.b.data(), 3, 4},
                                               Buffer{c.a.data(), 3, 4}, c.w, c.p, view, o, scratch,
                                               cpu::DeltaRuleForm::Chunked);
                        }),
                        {"qkv is [3, 50], expected [3, 56]"});
}

}  // namespace
}  // namespace moestream
