// moestream synth's Qwen3.5-397B-A17B preset: the hybrid structure (3 Gated DeltaNet layers to 1
// gated attention, 10 routed + 1 shared expert) written at a tiny width runs, and streams its
// experts bit-identically.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "io/pack.h"
#include "models/model.h"
#include "models/synth.h"
#include "test_util.h"

namespace moestream {
namespace {

// Logits of a prefill of the first 6 tokens, then one token at a time.
std::vector<float> logits_of(const std::string& dir, const std::vector<int32_t>& ids, double cache_mb) {
  ModelOptions opt;
  opt.threads = 2;
  opt.experts.cache_mb = cache_mb;
  auto model = load_model(dir, opt);
  const size_t vocab = size_t(model->info().vocab_size);
  std::vector<float> out(ids.size() * vocab);
  auto seq = model->new_sequence(int64_t(ids.size()));
  model->forward(std::span(ids).first(6), *seq, std::span(out).first(6 * vocab));
  for (size_t i = 6; i < ids.size(); ++i)
    model->forward(std::span(ids).subspan(i, 1), *seq, std::span(out).subspan(i * vocab, vocab));
  return out;
}

TEST(Synth, Qwen35PresetHasTheModelsShape) {
  const SynthShape s = synth_preset("qwen3.5-397b-a17b");
  EXPECT_EQ(s.layers, 60);
  EXPECT_EQ(s.hidden, 4096);
  EXPECT_EQ(s.experts, 512);
  EXPECT_EQ(s.top_k, 10);
  EXPECT_EQ(s.moe_intermediate, 1024);
  EXPECT_EQ(s.shared_intermediate, 1024);
  EXPECT_EQ(s.full_attention_interval, 4);  // 45 linear + 15 full attention layers
  const SynthShape m = synth_preset("qwen3.5-35b-a3b");
  EXPECT_EQ(m.layers, 40);
  EXPECT_EQ(m.hidden, 2048);
  EXPECT_EQ(m.experts, 256);
  EXPECT_EQ(m.top_k, 8);
  EXPECT_EQ(m.moe_intermediate, 512);
  EXPECT_EQ(m.shared_intermediate, 512);
  EXPECT_EQ(m.heads, 16);
  EXPECT_EQ(m.kv_heads, 2);
  EXPECT_EQ(m.head_dim, 256);
  EXPECT_EQ(m.linear_v_heads, 32);
  EXPECT_EQ(m.vocab, 248320);
}

TEST(Synth, Qwen35PresetAtTinyWidthRunsAndStreamsBitIdentically) {
  const std::string out = test::temp_dir("synth-qwen35") + "/pack";
  // Four layers: three Gated DeltaNet, one gated attention, as the preset's first four.
  auto r = test::run_cli("synth -o " + out + " --preset qwen3.5-397b-a17b --layers 4 --hidden 64 --experts 16 "
                         "--moe-intermediate 32 --vocab 512 --quant q4 --group-size 32 --zipf 1");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const auto config = nlohmann::json::parse(test::read_file(out + "/config.json"));
  EXPECT_EQ(config["model_type"], "qwen3_5_moe_text");
  EXPECT_EQ(config["layer_types"], nlohmann::json({"linear_attention", "linear_attention", "linear_attention",
                                                   "full_attention"}));
  EXPECT_EQ(config["num_experts_per_tok"], 10);
  const PackManifest m = PackManifest::load(out);
  ASSERT_EQ(m.layers.size(), 4u);
  for (const auto& layer : m.layers) EXPECT_EQ(layer.size(), 16u);

  const std::vector<int32_t> ids = {1, 50, 300, 7, 99, 258, 3, 77, 500, 12, 40, 41};
  const std::vector<float> full = logits_of(out, ids, -1);
  for (float v : full) ASSERT_TRUE(std::isfinite(v));
  const std::vector<float> tight = logits_of(out, ids, m.total_expert_bytes() / 4e6);
  EXPECT_EQ(std::memcmp(full.data(), tight.data(), full.size() * 4), 0);

  // The CLI runs it too.
  auto run = test::run_cli("run -m " + out + " -p hello -n 4 --temp 0 --device cpu");
  EXPECT_EQ(run.exit_code, 0) << run.err;
}

// synth --hf: the same weights as a Hugging Face checkpoint (bf16 shards with their index, one
// tensor per expert in the Hub's names), as llama.cpp's converter reads it for scripts/peer-bench.
// Packed by moestream it gives the logits of the pack synth writes directly, bit for bit, for the
// hybrid and the plain Qwen3-MoE shape; --tokenizer brings a real tokenizer and its end of turn.
TEST(Synth, HfCheckpointHoldsThePacksWeights) {
  const std::string root = test::temp_dir("synth-hf");
  const std::vector<int32_t> ids = {1, 50, 300, 7, 99, 258, 3, 77, 500, 12};
  for (const std::string preset : {"qwen3.5-35b-a3b", "small"}) {
    SCOPED_TRACE(preset);
    const std::string shape = " --preset " + preset + " --layers 4 --hidden 64 --experts 16 --moe-intermediate 32 "
                              "--vocab 512 --heads 4 --kv-heads 2 --zipf 1";
    const std::string pack = root + "/" + preset + "-pack", hf = root + "/" + preset + "-hf";
    auto r = test::run_cli("synth -o " + pack + shape);
    ASSERT_EQ(r.exit_code, 0) << r.err;
    r = test::run_cli("synth -o " + hf + shape + " --hf");
    ASSERT_EQ(r.exit_code, 0) << r.err;
    EXPECT_FALSE(std::filesystem::exists(hf + "/moestream-pack.json"));
    const auto index = nlohmann::json::parse(test::read_file(hf + "/model.safetensors.index.json"));
    EXPECT_EQ(index["weight_map"]["model.layers.3.mlp.experts.15.down_proj.weight"], "model-00005-of-00005.safetensors");
    EXPECT_EQ(index["weight_map"]["lm_head.weight"], "model-00001-of-00005.safetensors");
    ModelOptions opt;
    opt.threads = 2;
    opt.cache_dir = root + "/cache";
    auto direct = load_model(pack, opt), packed = load_model(hf, opt);
    std::vector<float> a(size_t(direct->info().vocab_size)), b(a.size());
    auto sa = direct->new_sequence(16), sb = packed->new_sequence(16);
    direct->forward(ids, *sa, a);
    packed->forward(ids, *sb, b);
    EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * 4), 0);
  }
  // A real tokenizer: its files copied, its end of turn in the configs.
  const std::string tok = test::source_dir() + "/.cache/tokenizer-qwen3";
  const std::string with_tok = root + "/tok-hf";
  auto r = test::run_cli("synth -o " + with_tok + " --preset tiny --vocab 151936 --hf --tokenizer " + tok);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(test::read_file(with_tok + "/tokenizer.json"), test::read_file(tok + "/tokenizer.json"));
  EXPECT_EQ(nlohmann::json::parse(test::read_file(with_tok + "/config.json"))["eos_token_id"], 151645);
  // Refused in one line: quantized experts in a checkpoint, a vocabulary below the tokenizer's ids.
  r = test::run_cli("synth -o " + root + "/q4-hf --preset tiny --hf --quant q4");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("--quant bf16"), std::string::npos) << r.err;
  r = test::run_cli("synth -o " + root + "/small-vocab --preset tiny --hf --tokenizer " + tok);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("--vocab"), std::string::npos) << r.err;
  EXPECT_FALSE(std::filesystem::exists(root + "/small-vocab"));
  for (const auto& e : std::filesystem::directory_iterator(root))
    EXPECT_EQ(e.path().filename().string().find(".tmp-"), std::string::npos) << e.path();
}

}  // namespace
}  // namespace moestream
