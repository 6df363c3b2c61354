// A pack whose experts mix formats (pack --tiered: q4g32 and q2g32 in one layer). CUDA runs each
// format's expert kernels over that format's experts: its logits match the CPU's, for prefill and
// for decode (the one-token kernels), with every expert in VRAM and streamed through one slot.
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <span>
#include <nlohmann/json.hpp>

#include "backend/backend_factory.h"
#include "backend/cuda/cuda_backend.h"
#include "core/error.h"
#include "io/pack.h"
#include "models/model.h"
#include "test_util.h"

namespace moestream {
namespace {

std::unique_ptr<Model> load(const std::string& dir, const std::string& device, double gpu_expert_mb, double cache_mb) {
  ModelOptions o;
  o.device = device;
  o.precise = true;
  o.threads = 4;
  o.gpu_expert_mb = gpu_expert_mb;
  o.experts.cache_mb = cache_mb;
  return load_model(dir, o);
}

const std::vector<int32_t> kTokens = {1, 5, 9, 17, 33, 65, 129, 200, 3, 7};

// The logits of each token fed alone, one after the other.
std::vector<float> decode_logits(Model& m) {
  const int64_t vocab = m.info().vocab_size;
  std::vector<float> all(kTokens.size() * size_t(vocab));
  auto seq = m.new_sequence(int64_t(kTokens.size()));
  for (size_t i = 0; i < kTokens.size(); ++i)
    m.forward(std::span<const int32_t>(&kTokens[i], 1), *seq, std::span<float>(all.data() + i * size_t(vocab), size_t(vocab)));
  return all;
}

TEST(TieredGpu, MixedFormatsMatchTheCpu) {
  std::string why;
  if (!cuda_device_available(&why)) GTEST_SKIP() << why;
  const std::string src = test::fixture("models/qwen3moe_ppl");
  const std::string dir = test::temp_dir("gpu-tiered");
  const std::string profile = dir + "/profile.json";
  const std::vector<std::vector<int>> counts = {{1, 2, 30, 4, 5, 6, 70, 8}, {90, 1, 1, 1, 1, 50, 1, 50}};
  std::ofstream(profile) << nlohmann::json{{"counts", counts}}.dump();
  const auto r = test::run_cli("pack " + src + " " + dir + "/pack --group-size 32 --tiered " + profile);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const PackManifest m = PackManifest::load(dir + "/pack");
  ASSERT_EQ(m.expert(0, 6).format, "q4g32");
  ASSERT_EQ(m.expert(0, 0).format, "q2g32");

  auto cpu = load(dir + "/pack", "cpu", -1, -1);
  const std::vector<float> want_prefill = test::prefill_logits(*cpu, kTokens), want_decode = decode_logits(*cpu);
  // Every expert in VRAM; one slot fed by the host round trip (a bounded host tier); one slot and
  // the rest read in place (an unbounded host tier).
  for (const auto& [vram_mb, host_mb] : {std::pair{-1.0, -1.0}, std::pair{0.0, 0.0}, std::pair{0.0, -1.0}}) {
    SCOPED_TRACE("gpu expert MB " + std::to_string(vram_mb) + ", host " + std::to_string(host_mb));
    auto gpu = load(dir + "/pack", "cuda", vram_mb, host_mb);
    const double prefill_err = test::relative_error(test::prefill_logits(*gpu, kTokens), want_prefill);
    const double decode_err = test::relative_error(decode_logits(*gpu), want_decode);
    std::printf("[ tiered   ] gpu expert MB %g, host %g: max rel err prefill %.2e, decode %.2e\n", vram_mb, host_mb,
                prefill_err, decode_err);
    EXPECT_LT(prefill_err, 1e-5);
    EXPECT_LT(decode_err, 1e-5);
    if (vram_mb == 0 && host_mb < 0) {
      EXPECT_GT(gpu_tier_stats(gpu->backend())->in_place_calls, 0u);
    }
  }
}

}  // namespace
}  // namespace moestream
