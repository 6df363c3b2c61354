// What is particular to the MoE families beyond Qwen3-MoE: DeepSeek-V3's latent KV cache, expert
// tensor names, the published quantized layouts (gpt-oss MXFP4, DeepSeek-V3 FP8, from
// tools/make_quantized_family_fixtures.py) packed natively or requantized, and errors naming the
// tensor or field. Their logits, greedy tokens, prefill-then-decode and streaming against
// transformers are tests/parity_test.cpp's (each fixture's parity.json).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/quant.h"
#include "io/npy.h"
#include "io/pack.h"
#include "io/safetensors.h"
#include "models/blocks.h"
#include "models/model.h"
#include "models/registry.h"
#include "test_util.h"

namespace moestream {
namespace {

struct Reference : test::Reference {
  // FP8 fixtures: the same model with every dequantized weight rounded to bf16, which is what a
  // pack made with --quant bf16 holds, and its greedy tokens; empty for the others.
  NpyArray logits_bf16;
  std::vector<int32_t> greedy_tokens_bf16;
};

std::string fixture_dir(const std::string& family) { return test::fixture("families/" + family + "_tiny"); }

Reference load_reference(const std::string& dir) {
  Reference r;
  static_cast<test::Reference&>(r) = test::load_reference(dir);
  if (std::filesystem::exists(dir + "/ref_logits_bf16.npy")) {
    auto j = nlohmann::json::parse(test::read_file(dir + "/ref.json"));
    r.logits_bf16 = read_npy_f32(dir + "/ref_logits_bf16.npy");
    r.greedy_tokens_bf16 = j.at("greedy_tokens_bf16").get<std::vector<int32_t>>();
  }
  return r;
}

using test::join;
using test::relative_error;

// Logits of every reference token through one prefill, with --precise.
std::vector<float> precise_logits(const std::string& dir, const std::vector<int32_t>& tokens) {
  ModelOptions opt;
  opt.precise = true;
  opt.threads = 2;
  return test::prefill_logits(*load_model(dir, opt), tokens);
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

TEST(GptOss, Mxfp4ExpertNamesMapToInterleavedRows) {
  const auto ref = [](const std::string& suffix) {
    return parse_gpt_oss_expert_tensor("model.layers.3.mlp.experts." + suffix);
  };
  ASSERT_TRUE(ref("gate_up_proj_blocks") && ref("gate_up_proj_scales") && ref("down_proj_blocks") &&
              ref("down_proj_scales"));
  EXPECT_EQ(ref("gate_up_proj_blocks")->role, "gate_up");
  EXPECT_EQ(ref("gate_up_proj_blocks")->layout, ExpertLayout::GateUpInterleavedRows);
  EXPECT_EQ(ref("gate_up_proj_scales")->role, "gate_up.scales");
  EXPECT_EQ(ref("gate_up_proj_scales")->layout, ExpertLayout::GateUpInterleavedRows);
  EXPECT_EQ(ref("down_proj_blocks")->role, "down");
  EXPECT_EQ(ref("down_proj_blocks")->layout, ExpertLayout::OutIn);
  EXPECT_EQ(ref("down_proj_scales")->role, "down.scales");
  EXPECT_TRUE(ref("down_proj_blocks")->stacked);
  EXPECT_EQ(ref("down_proj_blocks")->layer, 3);
}

// The published MXFP4 experts stay MXFP4 in the pack; --quant requantizes them.
TEST(GptOss, Mxfp4ExpertsArePackedNativelyOrRequantized) {
  const std::string dir = fixture_dir("gpt_oss_mxfp4");
  const PackManifest pack = PackManifest::load(ensure_pack(dir, ""));
  for (const auto& layer : pack.layers)
    for (const PackedExpert& e : layer) {
      EXPECT_EQ(e.format, "mxfp4");
      EXPECT_EQ(e.quant_format("gate"), kMxfp4Format);
      EXPECT_EQ(e.logical_shape("down"), (std::vector<int64_t>{64, 96}));
    }
  const std::string out = test::temp_dir("mxfp4-q8") + "/pack";
  auto r = test::run_cli("pack " + dir + " " + out + " --quant q8 --group-size 32");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(PackManifest::load(out).expert(0, 0).format, "q8g32");
  Reference ref = load_reference(dir);
  const double err = relative_error(precise_logits(out, ref.logit_tokens), ref.logits.data);
  EXPECT_LE(err, 3e-2) << "MXFP4 requantized to q8";
  RecordProperty("q8_requantized_error", test::sci(err));
}

// FP8 weights stay FP8 in the pack: codes as they are, the block scales repeated for each row
// (<module>.scales), the fp8 quantization_config kept; the scale_inv tensors are gone.
TEST(DeepseekV3, Fp8WeightsArePackedNatively) {
  const std::string dir = fixture_dir("deepseek_v3_fp8");
  const std::string pack = ensure_pack(dir, "");
  const WeightSet weights = WeightSet::open_dir(pack), source = WeightSet::open_dir(dir);
  for (const auto& name : weights.names()) EXPECT_EQ(name.find("scale_inv"), std::string::npos) << name;
  const std::string q_b = "model.layers.1.self_attn.q_b_proj";
  const TensorView& codes = weights.get(q_b + ".weight");
  const TensorView& scales = weights.get(q_b + ".scales");
  const TensorView& scale_inv = source.get(q_b + ".weight_scale_inv");  // [1, 1]: one 128 x 128 block
  EXPECT_EQ(codes.dtype, DType::F8_E4M3);
  EXPECT_EQ(std::memcmp(codes.data, source.get(q_b + ".weight").data, codes.nbytes), 0);
  ASSERT_EQ(scales.dtype, DType::F32);
  ASSERT_EQ(scales.shape, (std::vector<int64_t>{codes.shape[0], 1}));
  for (int64_t r = 0; r < codes.shape[0]; ++r) EXPECT_EQ(scales.as<float>()[r], scale_inv.as<float>()[0]) << r;
  const auto config = nlohmann::json::parse(test::read_file(pack + "/config.json"));
  EXPECT_EQ(config.at("quantization_config").at("quant_method"), "fp8");
  const PackManifest manifest = PackManifest::load(pack);
  const PackedExpert& e = manifest.expert(1, 0);
  EXPECT_EQ(e.format, "fp8g128");
  EXPECT_EQ(e.quant_format("down"), fp8_format(128));
  EXPECT_EQ(e.logical_shape("down"), (std::vector<int64_t>{192, 48}));
}

// --quant bf16 dequantizes FP8 weights to bf16: then the pack is the model transformers runs on
// the bf16-rounded weights (ref_logits_bf16.npy), and the fp8 config is gone.
TEST(DeepseekV3, Fp8PackedAsBf16MatchesTheBf16RoundedReference) {
  const std::string dir = fixture_dir("deepseek_v3_fp8");
  const std::string out = test::temp_dir("fp8-bf16") + "/pack";
  auto r = test::run_cli("pack " + dir + " " + out + " --quant bf16");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const WeightSet weights = WeightSet::open_dir(out);
  EXPECT_EQ(weights.get("model.layers.0.self_attn.q_a_proj.weight").dtype, DType::BF16);
  EXPECT_FALSE(nlohmann::json::parse(test::read_file(out + "/config.json")).contains("quantization_config"));
  EXPECT_EQ(PackManifest::load(out).expert(1, 0).format, "bf16");
  const Reference ref = load_reference(dir);
  EXPECT_LE(relative_error(precise_logits(out, ref.logit_tokens), ref.logits_bf16.data), 1e-3);
  auto g = test::run_cli("run -m " + out + " --tokens " + join(ref.prompt_tokens, ",") + " -n " +
                         std::to_string(ref.greedy_tokens_bf16.size()) + " --temp 0 --ids --precise");
  ASSERT_EQ(g.exit_code, 0) << g.err;
  EXPECT_EQ(g.out, join(ref.greedy_tokens_bf16, " ") + "\n");
}

// A copy of a fixture whose safetensors file holds `edit`'s choice of tensors, and whose
// config.json `edit_config` may change; loading it must fail with an error containing `want`.
void expect_load_error(const std::string& fixture, const std::string& name,
                       const std::function<bool(const std::string&, std::vector<uint8_t>&)>& edit,
                       const std::function<void(nlohmann::json&)>& edit_config,
                       const std::vector<std::string>& want) {
  const std::string src = fixture_dir(fixture), dir = test::temp_dir("broken-" + name);
  for (const char* f : {"config.json", "generation_config.json"})
    std::filesystem::copy_file(src + "/" + f, dir + "/" + f, std::filesystem::copy_options::overwrite_existing);
  const WeightSet weights = WeightSet::open_dir(src);
  std::vector<TensorToWrite> out;
  std::deque<std::vector<uint8_t>> bytes;
  for (const auto& n : weights.names()) {
    const TensorView& t = weights.get(n);
    std::vector<uint8_t>& b = bytes.emplace_back(static_cast<const uint8_t*>(t.data),
                                                 static_cast<const uint8_t*>(t.data) + t.nbytes);
    if (edit(n, b)) out.push_back({n, t.dtype, t.shape, b.data()});
  }
  write_safetensors(dir + "/model.safetensors", out, {{"format", "pt"}});
  auto config = nlohmann::json::parse(test::read_file(dir + "/config.json"));
  edit_config(config);
  std::ofstream(dir + "/config.json") << config.dump(1);
  ModelOptions opt;
  opt.threads = 1;
  opt.cache_dir = test::temp_dir("broken-cache-" + name);
  SCOPED_TRACE(name);
  test::expect_contains(test::error_of([&] { load_model(dir, opt); }), want);
}

TEST(QuantizedCheckpoints, ErrorsNameTheTensor) {
  const auto keep_all = [](const std::string&, std::vector<uint8_t>&) { return true; };
  const auto same_config = [](nlohmann::json&) {};
  const std::string scale = "model.layers.1.mlp.experts.3.up_proj.weight_scale_inv";
  expect_load_error("deepseek_v3_fp8", "fp8-no-scale", [&](const std::string& n, std::vector<uint8_t>&) { return n != scale; },
                    same_config, {"model.layers.1.mlp.experts.3.up_proj.weight", "_scale_inv"});
  const std::string up = "model.layers.1.mlp.experts.3.up_proj.weight";
  expect_load_error("deepseek_v3_fp8", "fp8-nan",
                    [&](const std::string& n, std::vector<uint8_t>& b) {
                      if (n == up) b[5] = 0x7f;
                      return true;
                    },
                    same_config, {up, "element 5", "NaN"});
  expect_load_error("deepseek_v3_fp8", "fp8-no-config", keep_all,
                    [](nlohmann::json& c) { c.erase("quantization_config"); }, {"F8_E4M3", "quant_method"});
  expect_load_error("gpt_oss_mxfp4", "mxfp4-no-config", keep_all,
                    [](nlohmann::json& c) { c.erase("quantization_config"); }, {"_blocks", "mxfp4"});
  const std::string exps = "model.layers.2.mlp.experts.down_proj_scales";
  expect_load_error("gpt_oss_mxfp4", "mxfp4-nan-exponent",
                    [&](const std::string& n, std::vector<uint8_t>& b) {
                      if (n == exps) b[5] = 255;
                      return true;
                    },
                    same_config, {exps, "exponent 255"});
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
    SCOPED_TRACE(c.family + ": " + c.field + " = " + c.value.dump());
    test::expect_contains(test::error_of([&] { load_model(dir, opt); }), {c.field});
  }
}

// bench's weight bytes per token: a decoded token reads one row of an untied embedding table,
// and a tied one whole (it is the output head).
TEST(ActiveBytes, OneRowOfAnUntiedEmbedding) {
  const WeightSet untied = WeightSet::open_dir(test::fixture("models/qwen3moe_mha_untied_dense"));
  const TensorView& e = untied.get("model.embed_tokens.weight");
  EXPECT_EQ(unread_embedding_bytes(untied), int64_t(e.nbytes) - int64_t(e.nbytes) / e.shape[0]);
  EXPECT_EQ(unread_embedding_bytes(WeightSet::open_dir(test::fixture("models/qwen3moe_gqa_tied"))), 0);
}

}  // namespace
}  // namespace moestream
