// Model::forward_batch on CUDA against each sequence's lone run (tests/batch_util.h): prompt
// chunks and decode rows in one pass, and decode steps of up to 8 sequences, which take the
// batched attention, BF16 weights on the tensor cores, the 8-token GEMV and the decode expert
// kernels row by row.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "backend/backend_factory.h"
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

// Decode steps of one sequence and of several, replayed as CUDA graphs captured in segments
// (the default: the first of 8 operations, each next one twice as long; MOESTREAM_CUDA_GRAPH_SEGMENT=1:
// segments end after operations 1, 3, 7, 15, ...; 0: one graph a step), with the cache append
// inside the attention kernel and its pipelined key loop, give the logits of the same steps
// launched one operation at a time with the append as copies and the plain key loop, bit for bit.
TEST_F(GpuBatch, GraphSegmentsEqualLaunchesBitForBit) {
  for (const std::string& dir : {model_fixture("qwen3moe_gqa_tied"), family("gpt_oss_tiny"),
                                 family("qwen3_next_tiny"), family("deepseek_v3_tiny")}) {
    SCOPED_TRACE(dir);
    struct Result {
      std::vector<batch_test::Run> runs;
      uint64_t graph_steps = 0;
    };
    auto run = [&](bool launched, const char* segment) {
      if (launched) {
        setenv("MOESTREAM_CUDA_GRAPHS", "0", 1);
        setenv("MOESTREAM_CUDA_ATTN_APPEND", "0", 1);
        setenv("MOESTREAM_CUDA_ATTN_PIPELINE", "0", 1);
      }
      if (segment) setenv("MOESTREAM_CUDA_GRAPH_SEGMENT", segment, 1);
      auto model = load(dir, -1, {}, "cuda");
      unsetenv("MOESTREAM_CUDA_GRAPHS");
      unsetenv("MOESTREAM_CUDA_ATTN_APPEND");
      unsetenv("MOESTREAM_CUDA_GRAPH_SEGMENT");
      const int64_t vocab = model->info().vocab_size;
      // 5 decoders stopping after 6, 10, 14, 14, 14 tokens: steps of 5, 4 and 3 rows, each
      // count long enough to become graphs.
      std::vector<Plan> plans;
      for (uint32_t i = 0; i < 5; ++i) plans.push_back({random_tokens(4 + i, vocab, 40 + i), 0, 16, i == 0 ? 6 : i == 1 ? 10 : 14});
      Result r;
      r.runs = batched(*model, plans);
      r.runs.push_back(lone(*model, {random_tokens(7, vocab, 60), 0, 7, 10}));
      r.graph_steps = gpu_tier_stats(model->backend())->graph_steps;
      unsetenv("MOESTREAM_CUDA_ATTN_PIPELINE");  // read at each launch
      return r;
    };
    const Result launched = run(true, nullptr);
    EXPECT_EQ(launched.graph_steps, 0u);
    for (const char* segment : {static_cast<const char*>(nullptr), "1", "0"}) {
      SCOPED_TRACE(segment ? std::string("segment ") + segment : std::string("default segments"));
      const Result graphed = run(false, segment);
      EXPECT_GT(graphed.graph_steps, 10u);
      ASSERT_EQ(graphed.runs.size(), launched.runs.size());
      for (size_t i = 0; i < launched.runs.size(); ++i) {
        EXPECT_EQ(graphed.runs[i].logits, launched.runs[i].logits) << "sequence " << i;
        EXPECT_EQ(graphed.runs[i].tokens, launched.runs[i].tokens) << "sequence " << i;
      }
    }
  }
}

}  // namespace
}  // namespace moestream
