// Model::forward_batch on CUDA against each sequence's lone run (tests/batch_util.h): prompt
// chunks and decode rows in one pass, and decode steps of up to 8 sequences, which take the
// batched attention, BF16 weights on the tensor cores, the 8-token GEMV and the decode expert
// kernels row by row.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "backend/cuda/cuda_backend.h"
#include "batch_util.h"

namespace moestream {
namespace {

using namespace batch_test;

class GpuBatch : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    if (!cuda_device_available(&why)) GTEST_SKIP() << why;
  }
};

// Eight sequences with short prompts that decode together (batches of 8 decode rows).
std::vector<Plan> eight_decoders(int64_t vocab) {
  std::vector<Plan> plans;
  for (uint32_t i = 0; i < 8; ++i) plans.push_back({random_tokens(3 + i, vocab, 20 + i), 0, 16, 12});
  return plans;
}

TEST_F(GpuBatch, Qwen3MoeMatchesLoneRuns) {
  expect_batch_matches_lone(model_fixture("qwen3moe_gqa_tied"), -1, {}, kTolerance, "cuda");
}
TEST_F(GpuBatch, EightDecodersMatchLoneRuns) {
  const std::string dir = model_fixture("qwen3moe_mlx_g32");
  expect_batch_matches_lone(dir, -1, {}, kTolerance, "cuda", eight_decoders(load(dir)->info().vocab_size));
}
// Sinks and a sliding window (the batched attention's window), and MLA (span by span).
TEST_F(GpuBatch, GptOssMatchesLoneRuns) {
  expect_batch_matches_lone(family("gpt_oss_tiny"), -1, {}, kTolerance, "cuda");
}
TEST_F(GpuBatch, DeepseekV3MatchesLoneRuns) {
  expect_batch_matches_lone(family("deepseek_v3_tiny"), -1, {}, kTolerance, "cuda");
}
// Gated DeltaNet state per sequence.
TEST_F(GpuBatch, Qwen3NextMatchesLoneRuns) {
  expect_batch_matches_lone(family("qwen3_next_tiny"), -1, {}, kTolerance, "cuda");
}

// Greedy ids found on the GPU (Backend::greedy_rows) against the argmax of the same batches'
// logits, one to four rows a step.
TEST_F(GpuBatch, GreedyItemsMatchTheirLogits) {
  expect_greedy_items_match_logits(model_fixture("qwen3moe_mlx_g32"), "cuda");
  expect_greedy_items_match_logits(family("gpt_oss_tiny"), "cuda");
}

}  // namespace
}  // namespace moestream
