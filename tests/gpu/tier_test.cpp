// The CUDA expert tier after a failed expert read (issue 21): the request fails naming the expert,
// fails the same way when asked again (never "request before the previous one was consumed"), and
// once the bytes are right again the same loaded model computes the logits of a fresh one, for
// tiered budgets (one VRAM slot, a few) and everything resident.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "backend/cuda/cuda_backend.h"
#include "core/error.h"
#include "io/pack.h"
#include "models/model.h"
#include "test_util.h"

namespace moestream {
namespace {

namespace fs = std::filesystem;

std::vector<float> run(Model& m, const std::vector<int32_t>& ids) {
  std::vector<float> logits(size_t(m.info().vocab_size));
  auto seq = m.new_sequence(int64_t(ids.size()) + 1);
  m.forward(ids, *seq, logits);
  return logits;
}

TEST(CudaTier, FailedExpertReadLeavesTheTierUsable) {
  std::string why;
  if (!cuda_device_available(&why)) GTEST_SKIP() << why;
  const std::string src = test::fixture("models/qwen3moe_gqa_tied");
  const std::string cache = test::temp_dir("gpu-tier-cache");
  const std::string dir = test::temp_dir("gpu-tier-damaged") + "/pack";
  fs::copy(ensure_pack(src, cache), dir, fs::copy_options::recursive);
  const PackManifest m = PackManifest::load(dir);
  const PackedExpert& e = m.expert(1, 3);
  const std::string file = dir + "/" + m.expert_files[size_t(e.file)];
  auto flip = [&] {  // a second flip restores the byte
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(std::streamoff(e.offset + 100));
    char c = 0;
    f.read(&c, 1);
    f.seekp(std::streamoff(e.offset + 100));
    c = char(c ^ 0x55);
    f.write(&c, 1);
  };
  const auto ref = nlohmann::json::parse(test::read_file(src + "/ref.json"));
  const auto ids = ref["logit_tokens"].get<std::vector<int32_t>>();
  for (double vram_mb : {0.0, 0.05, -1.0}) {
    SCOPED_TRACE("gpu expert MB " + std::to_string(vram_mb));
    ModelOptions o;
    o.device = "cuda";
    o.precise = true;
    o.cache_dir = cache;
    o.gpu_expert_mb = vram_mb;
    o.experts.cache_mb = vram_mb < 0 ? -1 : 0.05;
    auto fresh = load_model(dir, o);
    const std::vector<float> want = run(*fresh, ids);
    fresh.reset();
    auto model = load_model(dir, o);
    flip();
    for (int attempt = 0; attempt < 2; ++attempt) {
      try {
        run(*model, ids);
        ADD_FAILURE() << "no error for the damaged expert";
      } catch (const Error& err) {
        EXPECT_NE(std::string(err.what()).find("checksum mismatch for layer 1 expert 3"), std::string::npos)
            << err.what();
      }
    }
    flip();
    EXPECT_EQ(run(*model, ids), want);
  }
}

}  // namespace
}  // namespace moestream
