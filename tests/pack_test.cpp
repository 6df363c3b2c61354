// moestream pack: layouts, quantization, requantization, atomicity.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/npy.h"
#include "io/pack.h"
#include "io/safetensors.h"
#include "models/model.h"
#include "test_util.h"

namespace moestream {
namespace {

namespace fs = std::filesystem;

std::vector<int32_t> logit_tokens(const std::string& dir) {
  return nlohmann::json::parse(test::read_file(dir + "/ref.json"))["logit_tokens"].get<std::vector<int32_t>>();
}

std::vector<float> logits_of(const std::string& model_dir, const std::vector<int32_t>& ids,
                             double cache_mb = -1) {
  ModelOptions opt;
  opt.experts.cache_mb = cache_mb;
  auto model = load_model(model_dir, opt);
  std::vector<float> out(ids.size() * size_t(model->info().vocab_size));
  auto seq = model->new_sequence(int64_t(ids.size()));
  model->forward(ids, *seq, out);
  return out;
}

using test::relative_error;

// Median over positions of max|a - b| / max|b|: a rounding-sized change of one routing decision
// in a tiny random model moves a single position a lot; the median measures the quantization.
double median_position_error(const std::vector<float>& a, const std::vector<float>& b, size_t vocab) {
  double den = 0;
  for (float v : b) den = std::max(den, double(std::fabs(v)));
  std::vector<double> rows;
  for (size_t r = 0; r < a.size() / vocab; ++r) {
    double num = 0;
    for (size_t i = r * vocab; i < (r + 1) * vocab; ++i) num = std::max(num, double(std::fabs(a[i] - b[i])));
    rows.push_back(num / den);
  }
  std::sort(rows.begin(), rows.end());
  return rows[rows.size() / 2];
}

std::string pack(const std::string& src, const std::string& name, const std::string& flags) {
  const std::string out = test::temp_dir(name) + "/pack";
  auto r = test::run_cli("pack " + src + " " + out + " " + flags);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  return out;
}

TEST(Pack, QuantizedExpertsAreCloseAndStreamBitIdentically) {
  const std::string src = test::fixture("models/qwen3moe_gqa_tied");
  const auto ids = logit_tokens(src);
  const NpyArray ref = read_npy_f32(src + "/ref_logits.npy");
  // Round-to-nearest error grows as bits shrink; q2 only has to run.
  for (auto [quant, bound] : {std::pair{"q8", 0.01}, {"q4", 0.1}, {"q2", 10.0}}) {
    const std::string out = pack(src, std::string("quant-") + quant, std::string("--quant ") + quant + " --group-size 32");
    const PackManifest m = PackManifest::load(out);
    EXPECT_EQ(m.expert(1, 0).format, std::string(quant) + "g32");
    const std::vector<float> full = logits_of(out, ids);
    const double err = median_position_error(full, ref.data, size_t(ref.shape[1]));
    EXPECT_GT(err, 1e-6) << quant;
    EXPECT_LT(err, bound) << quant;
    const std::vector<float> tight = logits_of(out, ids, m.max_expert_size() / 1e6);
    EXPECT_EQ(std::memcmp(full.data(), tight.data(), full.size() * 4), 0) << quant;
  }
}

TEST(Pack, MlxCheckpointRequantizesAndStreams) {
  const std::string src = test::fixture("models/qwen3moe_mlx_q4_router8");
  const auto ids = logit_tokens(src);
  const NpyArray ref = read_npy_f32(src + "/ref_logits.npy");
  const std::string kept = pack(src, "mlx-keep", "");
  EXPECT_EQ(PackManifest::load(kept).expert(0, 0).format, "q4g64");
  const std::vector<float> full = logits_of(kept, ids);
  EXPECT_LE(relative_error(full, ref.data), 1e-3);
  const std::vector<float> tight = logits_of(kept, ids, 0.001);
  EXPECT_EQ(std::memcmp(full.data(), tight.data(), full.size() * 4), 0);

  const std::string q2 = pack(src, "mlx-q2", "--quant q2 --clip-search");
  EXPECT_EQ(PackManifest::load(q2).expert(1, 7).format, "q2g64");
  const std::vector<float> low = logits_of(q2, ids);
  EXPECT_GT(relative_error(low, ref.data), 1e-4);
  for (float v : low) ASSERT_TRUE(std::isfinite(v));
}

// Experts are converted by several threads and written in order: the expert files are the same
// bytes whatever the thread count.
TEST(Pack, ThreadCountDoesNotChangeTheBytes) {
  const std::string src = test::fixture("models/qwen3moe_mlx_q4_router8");
  const std::string one = pack(src, "threads-1", "--quant q3 -t 1");
  const std::string many = pack(src, "threads-3", "--quant q3 -t 3");
  const PackManifest m = PackManifest::load(one);
  ASSERT_FALSE(m.expert_files.empty());
  for (const std::string& f : m.expert_files)
    EXPECT_EQ(test::read_file(one + "/" + f), test::read_file(many + "/" + f)) << f;
  EXPECT_EQ(test::read_file(one + "/weights.safetensors"), test::read_file(many + "/weights.safetensors"));
}

TEST(Pack, MixedGroupSizesInOneExpert) {
  const std::string src = test::fixture("models/qwen3moe_mlx_g32");
  const std::string kept = pack(src, "mlx-g32", "");
  const PackManifest m = PackManifest::load(kept);
  EXPECT_EQ(m.expert(0, 0).format, "mixed");
  EXPECT_EQ(m.expert(0, 0).find("down")->group_size, 32);
  EXPECT_EQ(m.expert(0, 0).find("gate")->group_size, 64);
}

TEST(Pack, QuantAllQuantizesLinearLayersAndKeepsRouters8Bit) {
  const std::string src = test::fixture("models/qwen3moe_gqa_tied");
  const std::string out = pack(src, "quant-all", "--quant q8 --group-size 32 --quant-all");
  const WeightSet w = WeightSet::open_files({out + "/weights.safetensors"});
  EXPECT_EQ(w.get("model.layers.0.self_attn.q_proj.weight").dtype, DType::U32);
  EXPECT_EQ(w.get("model.embed_tokens.weight").dtype, DType::U32);
  EXPECT_EQ(w.get("model.layers.0.input_layernorm.weight").dtype, DType::BF16);
  auto config = nlohmann::json::parse(test::read_file(out + "/config.json"));
  EXPECT_EQ(config["quantization"]["bits"], 8);
  const NpyArray ref = read_npy_f32(src + "/ref_logits.npy");
  EXPECT_LT(median_position_error(logits_of(out, logit_tokens(src)), ref.data, size_t(ref.shape[1])), 0.02);
}

TEST(Pack, FailureLeavesNothingAndSourceUntouched) {
  const std::string src = test::temp_dir("pack-src") + "/model";
  fs::copy(test::fixture("models/qwen3moe_gqa_tied"), src, fs::copy_options::recursive);
  const std::string before = test::read_file(src + "/model.safetensors");
  // A tensor of the last expert of the last layer has the wrong shape: found late in the pack.
  auto r0 = test::run_cli("pack " + src + " " + src + "-ok");
  ASSERT_EQ(r0.exit_code, 0) << r0.err;
  EXPECT_EQ(test::read_file(src + "/model.safetensors"), before);
  const std::string out = test::temp_dir("pack-fail") + "/pack";
  auto r = test::run_cli("pack " + src + " " + out + " --quant q4 --group-size 128");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("--group-size"), std::string::npos) << r.err;
  EXPECT_FALSE(fs::exists(out));
  for (const auto& e : fs::directory_iterator(fs::path(out).parent_path()))
    ADD_FAILURE() << "left behind: " << e.path();
  EXPECT_EQ(test::read_file(src + "/model.safetensors"), before);
}

TEST(Synth, QuantizedPacksRunAndStreamBitIdentically) {
  for (const char* quant : {"bf16", "q8", "q4", "q2"}) {
    const std::string out = test::temp_dir(std::string("synth-") + quant) + "/pack";
    auto r = test::run_cli("synth -o " + out + " --preset tiny --zipf 1 --quant " + quant + " --group-size 32");
    ASSERT_EQ(r.exit_code, 0) << r.err;
    const PackManifest m = PackManifest::load(out);
    EXPECT_EQ(m.expert(0, 0).format, std::string(quant) == "bf16" ? "bf16" : std::string(quant) + "g32");
    const std::vector<int32_t> ids = {1, 50, 300, 7, 99, 258, 3, 77, 500, 12};
    const std::vector<float> full = logits_of(out, ids);
    for (float v : full) ASSERT_TRUE(std::isfinite(v)) << quant;
    const std::vector<float> tight = logits_of(out, ids, m.max_expert_size() / 1e6);
    EXPECT_EQ(std::memcmp(full.data(), tight.data(), full.size() * 4), 0) << quant;
  }
}

TEST(Pack, ExistingOutputIsRefused) {
  const std::string out = test::temp_dir("pack-exists");
  auto r = test::run_cli("pack " + test::fixture("models/qwen3moe_gqa_tied") + " " + out);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("already exists"), std::string::npos) << r.err;
}

}  // namespace
}  // namespace moestream
