// The MoE families beyond Qwen3-MoE against their transformers fixtures
// (tools/make_family_fixtures.py): logits, prefill then decode, CLI greedy tokens, and streaming
// under a tiny expert budget.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/npy.h"
#include "io/pack.h"
#include "models/blocks.h"
#include "models/model.h"
#include "models/registry.h"
#include "test_util.h"

namespace moestream {
namespace {

// Families with a fixture under tests/fixtures/families/<name>_tiny that moestream supports.
const std::vector<std::string> kFamilies = {"mixtral", "olmoe", "glm4_moe", "deepseek_v3", "gpt_oss"};

struct Reference {
  std::vector<int32_t> logit_tokens, prompt_tokens, greedy_tokens;
  NpyArray logits;
};

std::string fixture_dir(const std::string& family) { return test::fixture("families/" + family + "_tiny"); }

Reference load_reference(const std::string& dir) {
  auto j = nlohmann::json::parse(test::read_file(dir + "/ref.json"));
  Reference r;
  r.logit_tokens = j["logit_tokens"].get<std::vector<int32_t>>();
  r.prompt_tokens = j["prompt_tokens"].get<std::vector<int32_t>>();
  r.greedy_tokens = j["greedy_tokens"].get<std::vector<int32_t>>();
  r.logits = read_npy_f32(dir + "/ref_logits.npy");
  return r;
}

// max|a - b| / max|b|
double relative_error(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num = std::max(num, double(std::fabs(a[i] - b[i])));
    den = std::max(den, double(std::fabs(b[i])));
  }
  return num / den;
}

std::string join(const std::vector<int32_t>& ids, const char* sep) {
  std::string s;
  for (size_t i = 0; i < ids.size(); ++i) s += (i ? sep : "") + std::to_string(ids[i]);
  return s;
}

// Logits of every position: the first `split` tokens as one prefill, the rest one at a time.
std::vector<float> run_split(Model& model, const std::vector<int32_t>& ids, size_t split) {
  const size_t vocab = size_t(model.info().vocab_size);
  std::vector<float> logits(ids.size() * vocab);
  auto seq = model.new_sequence(int64_t(ids.size()));
  model.forward(std::span(ids).first(split), *seq, std::span(logits).first(split * vocab));
  for (size_t i = split; i < ids.size(); ++i)
    model.forward(std::span(ids).subspan(i, 1), *seq, std::span(logits).subspan(i * vocab, vocab));
  EXPECT_EQ(seq->n_past, int64_t(ids.size()));
  return logits;
}

class FamilyFixture : public ::testing::TestWithParam<std::string> {};

TEST_P(FamilyFixture, LogitsMatchTransformers) {
  const std::string dir = fixture_dir(GetParam());
  Reference ref = load_reference(dir);
  for (bool precise : {true, false}) {
    ModelOptions opt;
    opt.precise = precise;
    opt.threads = 2;
    auto model = load_model(dir, opt);
    EXPECT_EQ(model->info().model_type, GetParam());
    const int64_t vocab = model->info().vocab_size;
    ASSERT_EQ(ref.logits.shape, (std::vector<int64_t>{int64_t(ref.logit_tokens.size()), vocab}));
    std::vector<float> logits(ref.logit_tokens.size() * size_t(vocab));
    auto seq = model->new_sequence(int64_t(ref.logit_tokens.size()));
    model->forward(ref.logit_tokens, *seq, logits);
    const double err = relative_error(logits, ref.logits.data);
    EXPECT_LE(err, precise ? 1e-3 : 3e-2) << GetParam() << (precise ? " --precise" : " default");
    char measured[32];
    std::snprintf(measured, sizeof measured, "%.2e", err);
    RecordProperty(precise ? "precise_error" : "default_error", measured);
  }
}

TEST_P(FamilyFixture, PrefillThenDecodeEqualsWholeSequence) {
  const std::string dir = fixture_dir(GetParam());
  Reference ref = load_reference(dir);
  ModelOptions opt;
  opt.precise = true;
  opt.threads = 2;
  auto model = load_model(dir, opt);
  const size_t n = ref.logit_tokens.size();
  const std::vector<float> whole = run_split(*model, ref.logit_tokens, n);
  const std::vector<float> stepped = run_split(*model, ref.logit_tokens, 13);
  EXPECT_LE(relative_error(stepped, whole), 1e-5);
}

TEST_P(FamilyFixture, CliGreedyTokensMatchTransformers) {
  const std::string dir = fixture_dir(GetParam());
  Reference ref = load_reference(dir);
  for (const char* mode : {"--precise", ""}) {
    auto r = test::run_cli("run -m " + dir + " --tokens " + join(ref.prompt_tokens, ",") + " -n " +
                           std::to_string(ref.greedy_tokens.size()) + " --temp 0 --ids " + mode);
    ASSERT_EQ(r.exit_code, 0) << r.err;
    EXPECT_EQ(r.out, join(ref.greedy_tokens, " ") + "\n") << mode;
  }
}

TEST_P(FamilyFixture, StreamingUnderATinyBudgetIsBitIdentical) {
  const std::string dir = fixture_dir(GetParam());
  Reference ref = load_reference(dir);
  ModelOptions opt;
  opt.threads = 2;
  auto unbounded = load_model(dir, opt);
  const std::vector<float> reference = run_split(*unbounded, ref.logit_tokens, 20);
  const ExpertStats base = unbounded->expert_stats();
  const PackManifest pack = PackManifest::load(ensure_pack(dir, ""));
  for (const char* policy : {"lru", "lcp"}) {
    opt.experts.cache_mb = pack.max_expert_size() / 1e6 * 1.5;  // one expert slot
    opt.experts.policy = policy;
    auto bounded = load_model(dir, opt);
    const std::vector<float> got = run_split(*bounded, ref.logit_tokens, 20);
    ASSERT_EQ(got.size(), reference.size());
    EXPECT_EQ(std::memcmp(got.data(), reference.data(), got.size() * sizeof(float)), 0) << policy;
    EXPECT_GT(bounded->expert_stats().misses, base.misses) << "a bounded cache must re-read experts";
  }
}

// The latent attention caches one row [c, k_rope] per position and layer, nothing per head.
TEST(DeepseekV3, KvCacheHoldsTheCompressedLatent) {
  ModelOptions opt;
  opt.threads = 2;
  auto model = load_model(fixture_dir("deepseek_v3"), opt);
  auto seq = model->new_sequence(16);
  auto* kv = dynamic_cast<KvSequence*>(seq.get());
  ASSERT_NE(kv, nullptr);
  for (size_t l = 0; l < kv->k.size(); ++l) {
    EXPECT_EQ(kv->k[l].cols, 32 + 8);  // kv_lora_rank + qk_rope_head_dim
    EXPECT_EQ(kv->v[l].cols, 0);       // values are read from the key rows
  }
}

TEST(Mixtral, ExpertNamesMapW1W3W2ToGateUpDown) {
  const auto ref = [](const std::string& w) {
    return parse_mixtral_expert_tensor("model.layers.2.block_sparse_moe.experts.5." + w + ".weight");
  };
  ASSERT_TRUE(ref("w1") && ref("w2") && ref("w3"));
  EXPECT_EQ(ref("w1")->role, "gate");
  EXPECT_EQ(ref("w3")->role, "up");
  EXPECT_EQ(ref("w2")->role, "down");
  EXPECT_EQ(ref("w1")->layer, 2);
  EXPECT_EQ(ref("w1")->expert, 5);
  EXPECT_FALSE(parse_mixtral_expert_tensor("model.layers.2.block_sparse_moe.gate.weight"));
}

TEST(GptOss, MxFp4ExpertsAreAnErrorNamingTheTensor) {
  const std::string name = "model.layers.0.mlp.experts.gate_up_proj_blocks";
  try {
    parse_gpt_oss_expert_tensor(name);
    FAIL() << "no error for " << name;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(name), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("MXFP4"), std::string::npos) << e.what();
  }
}

// A bad config.json value is an error naming the field.
TEST(Families, ConfigErrorsNameTheField) {
  struct Case {
    std::string family, field;
    nlohmann::json value;
  };
  const std::vector<Case> cases = {
      {"olmoe", "clip_qkv", -1.0},
      {"glm4_moe", "n_group", 3},
      {"deepseek_v3", "qk_rope_head_dim", 7},
      {"gpt_oss", "layer_types", nlohmann::json::array({"full_attention"})},
      {"mixtral", "num_experts_per_tok", 7},
  };
  for (const Case& c : cases) {
    const std::string dir = test::temp_dir("config-" + c.family);
    for (const auto& e : std::filesystem::directory_iterator(fixture_dir(c.family)))
      std::filesystem::copy_file(e.path(), dir + "/" + e.path().filename().string());
    auto config = nlohmann::json::parse(test::read_file(dir + "/config.json"));
    config[c.field] = c.value;
    std::ofstream(dir + "/config.json") << config.dump(1);
    ModelOptions opt;
    opt.threads = 1;
    opt.cache_dir = test::temp_dir("config-cache-" + c.family);
    try {
      load_model(dir, opt);
      ADD_FAILURE() << c.family << ": no error for " << c.field << " = " << c.value.dump();
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(c.field), std::string::npos) << c.family << ": " << e.what();
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Families, FamilyFixture, ::testing::ValuesIn(kFamilies),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace moestream
