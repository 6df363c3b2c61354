// End to end on every reference fixture: CUDA logits against the CPU's --precise logits (1e-2
// relative), the same greedy tokens, and the same CUDA logits with tiny VRAM and host budgets
// (every expert streamed through one slot) as with everything resident.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "backend/cuda/cuda_backend.h"
#include "core/error.h"
#include "models/model.h"
#include "test_util.h"

namespace moestream {
namespace {

std::string cache_dir() {
  static const std::string dir = test::temp_dir("gpu-cache");
  return dir;
}

std::vector<float> logits_of(Model& m, const std::vector<int32_t>& ids) {
  const size_t vocab = size_t(m.info().vocab_size);
  std::vector<float> out(ids.size() * vocab);
  auto seq = m.new_sequence(int64_t(ids.size()) + 8);
  // A prefill of all but the last 2 tokens, then single-token decode steps.
  const size_t split = ids.size() > 2 ? ids.size() - 2 : ids.size();
  m.forward(std::span(ids).first(split), *seq, std::span(out).first(split * vocab));
  for (size_t i = split; i < ids.size(); ++i)
    m.forward(std::span(ids).subspan(i, 1), *seq, std::span(out).subspan(i * vocab, vocab));
  return out;
}

std::vector<int32_t> greedy(Model& m, const std::vector<int32_t>& prompt, size_t n) {
  const size_t vocab = size_t(m.info().vocab_size);
  std::vector<float> logits(vocab);
  auto seq = m.new_sequence(int64_t(prompt.size() + n) + 1);
  m.forward(prompt, *seq, logits);
  std::vector<int32_t> out;
  for (size_t i = 0; i < n; ++i) {
    const int32_t t = int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin());
    out.push_back(t);
    const std::vector<int32_t> one{t};
    m.forward(one, *seq, logits);
  }
  return out;
}

ModelOptions options(const std::string& device) {
  ModelOptions o;
  o.device = device;
  o.precise = true;
  o.threads = 4;
  o.cache_dir = cache_dir();
  return o;
}

class Fixture : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    std::string why;
    if (!cuda_device_available(&why)) GTEST_SKIP() << why;
  }
};

TEST_P(Fixture, CudaMatchesCpuPrecise) {
  const std::string dir = GetParam();
  const auto ref = nlohmann::json::parse(test::read_file(dir + "/ref.json"));
  const auto ids = ref["logit_tokens"].get<std::vector<int32_t>>();
  auto cpu = load_model(dir, options("cpu"));
  const std::vector<float> want = logits_of(*cpu, ids);
  auto gpu = load_model(dir, options("cuda"));
  const std::vector<float> got = logits_of(*gpu, ids);
  const double err = test::relative_error(got, want);
  std::printf("[ parity   ] %s: max rel err %.3g over %zu logits\n",
              std::filesystem::path(dir).filename().c_str(), err, got.size());
  EXPECT_LT(err, 1e-2);

  // Budgets: one VRAM slot and one host slot; results identical to the unbounded run.
  ModelOptions tight = options("cuda");
  tight.gpu_expert_mb = 0;
  tight.experts.cache_mb = 0;
  auto streamed = load_model(dir, tight);
  const std::vector<float> got_tight = logits_of(*streamed, ids);
  EXPECT_EQ(test::relative_error(got_tight, got), 0.0) << "tiny expert budgets changed the CUDA logits";

  if (ref.contains("prompt_tokens") && ref.contains("greedy_tokens")) {
    const auto prompt = ref["prompt_tokens"].get<std::vector<int32_t>>();
    const size_t n = ref["greedy_tokens"].size();
    const auto g_cpu = greedy(*cpu, prompt, n), g_gpu = greedy(*gpu, prompt, n);
    EXPECT_EQ(g_gpu, g_cpu) << "greedy tokens differ";
    EXPECT_EQ(greedy(*streamed, prompt, n), g_gpu);
  }
}

INSTANTIATE_TEST_SUITE_P(All, Fixture, ::testing::ValuesIn(test::reference_fixtures()), [](const auto& info) {
  std::string name = std::filesystem::path(info.param).filename().string();
  std::replace_if(name.begin(), name.end(), [](char c) { return !std::isalnum(static_cast<unsigned char>(c)); }, '_');
  return name;
});

}  // namespace
}  // namespace moestream
