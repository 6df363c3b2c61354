// config.json alias resolution across transformers versions, text_config nesting, RoPE
// parameters, generation defaults, and the validation of DecoderConfig's common fields.
#include "io/hf_config.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <initializer_list>

#include "core/error.h"
#include "models/decoder_config.h"
#include "test_util.h"

namespace moestream {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

class HfConfigTest : public test::TempDirTest {};

using test::error_of;
using test::expect_contains;

HfConfig cfg(const char* text) {
  return HfConfig(json::parse(text), "test/config.json");
}

// Abridged from a Mixtral-style config written by transformers 4.x.
TEST_F(HfConfigTest, Transformers4Names) {
  HfConfig c = cfg(R"({
    "model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 2,
    "torch_dtype": "bfloat16", "hidden_size": 4096, "num_hidden_layers": 32,
    "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "rope_scaling": null,
    "max_position_embeddings": 32768, "sliding_window": null})");
  EXPECT_EQ(c.model_type(), "mixtral");
  EXPECT_EQ(c.get_int("num_experts"), 8);
  EXPECT_EQ(c.get_int("num_local_experts"), 8);
  EXPECT_EQ(c.get_int("num_experts_per_token"), 2);
  EXPECT_EQ(c.torch_dtype(), "bfloat16");
  EXPECT_DOUBLE_EQ(c.get_double("layer_norm_epsilon"), 1e-5);
  EXPECT_TRUE(c.has("num_experts"));
  EXPECT_FALSE(c.has("sliding_window"));  // null counts as absent
  EXPECT_EQ(c.get_int("sliding_window", 4096), 4096);
  RopeParams r = c.rope();
  EXPECT_EQ(r.type, "default");
  EXPECT_DOUBLE_EQ(r.theta, 1e6);
  EXPECT_DOUBLE_EQ(r.factor, 1.0);
}

// The same fields as transformers 5.x writes them.
TEST_F(HfConfigTest, Transformers5Names) {
  HfConfig c = cfg(R"({
    "model_type": "qwen3_moe", "num_experts": 128, "num_experts_per_tok": 8, "dtype": "bfloat16",
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
      "original_max_position_embeddings": 32768, "beta_fast": 16, "beta_slow": 2,
      "mscale": 0.707, "mscale_all_dim": 1.0, "attention_factor": 1.1, "truncate": false}})");
  EXPECT_EQ(c.get_int("num_local_experts"), 128);
  EXPECT_EQ(c.get_int("n_routed_experts"), 128);
  EXPECT_EQ(c.torch_dtype(), "bfloat16");
  RopeParams r = c.rope();
  EXPECT_EQ(r.type, "yarn");
  EXPECT_DOUBLE_EQ(r.theta, 1e6);
  EXPECT_DOUBLE_EQ(r.factor, 4.0);
  EXPECT_DOUBLE_EQ(r.original_max_position, 32768);
  EXPECT_DOUBLE_EQ(r.beta_fast, 16);
  EXPECT_DOUBLE_EQ(r.beta_slow, 2);
  EXPECT_DOUBLE_EQ(r.mscale.value(), 0.707);
  EXPECT_DOUBLE_EQ(r.mscale_all_dim.value(), 1.0);
  EXPECT_DOUBLE_EQ(r.attention_factor.value(), 1.1);
  EXPECT_FALSE(r.truncate);
  // A layer type on a flat rope_parameters gets the same parameters.
  EXPECT_EQ(c.rope("full_attention").type, "yarn");
}

// DeepSeek-style 4.x yarn: top-level rope_theta, rope_scaling with the old "type" key.
TEST_F(HfConfigTest, Transformers4YarnRopeScaling) {
  HfConfig c = cfg(R"({"model_type": "deepseek_v3", "n_routed_experts": 256, "rope_theta": 10000,
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
      "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}})");
  EXPECT_EQ(c.get_int("num_experts"), 256);
  RopeParams r = c.rope();
  EXPECT_EQ(r.type, "yarn");
  EXPECT_DOUBLE_EQ(r.theta, 10000);
  EXPECT_DOUBLE_EQ(r.factor, 40);
  EXPECT_DOUBLE_EQ(r.original_max_position, 4096);
  EXPECT_DOUBLE_EQ(r.mscale_all_dim.value(), 1.0);
  EXPECT_FALSE(r.attention_factor.has_value());
  EXPECT_TRUE(r.truncate);
}

TEST_F(HfConfigTest, Llama3RopeAndPartialRotary) {
  HfConfig c = cfg(R"({"rope_theta": 500000, "partial_rotary_factor": 0.25, "rope_scaling":
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192}})");
  RopeParams r = c.rope();
  EXPECT_EQ(r.type, "llama3");
  EXPECT_DOUBLE_EQ(r.low_freq_factor, 1.0);
  EXPECT_DOUBLE_EQ(r.high_freq_factor, 4.0);
  EXPECT_DOUBLE_EQ(r.partial_rotary_factor, 0.25);
}

TEST_F(HfConfigTest, RopeParametersPerLayerType) {
  HfConfig c = cfg(R"({"rope_parameters": {
    "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0},
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}})");
  RopeParams full = c.rope("full_attention");
  EXPECT_EQ(full.type, "linear");
  EXPECT_DOUBLE_EQ(full.theta, 1e6);
  EXPECT_DOUBLE_EQ(full.factor, 8.0);
  RopeParams sliding = c.rope("sliding_attention");
  EXPECT_EQ(sliding.type, "default");
  EXPECT_DOUBLE_EQ(sliding.theta, 1e4);
  expect_contains(error_of([&] { c.rope(); }),
                  {"test/config.json", "per layer type", "full_attention", "sliding_attention"});
  expect_contains(error_of([&] { c.rope("chunked_attention"); }),
                  {"no entry for layer type 'chunked_attention'"});
}

TEST_F(HfConfigTest, RopeErrors) {
  expect_contains(error_of([&] { cfg(R"({"hidden_size": 8})").rope(); }),
                  {"test/config.json", "missing field 'rope_theta'"});
  expect_contains(error_of([&] { cfg(R"({"rope_parameters": {"rope_type": "default"}})").rope(); }),
                  {"missing field 'rope_theta'", "rope_parameters"});
  expect_contains(
      error_of([&] { cfg(R"({"rope_theta": 1e4, "rope_scaling": {"factor": 2}})").rope(); }),
      {"rope_scaling sets 'factor' but has no 'rope_type'"});
  expect_contains(error_of([&] { cfg(R"({"rope_theta": "1e4"})").rope(); }),
                  {"field 'rope_theta' must be a number, found string"});
  expect_contains(
      error_of([&] {
        cfg(R"({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1, "factor": "4"}})").rope();
      }),
      {"field 'rope_parameters.factor' must be a number"});
}

TEST_F(HfConfigTest, TextConfigNesting) {
  HfConfig top = cfg(R"({"model_type": "qwen3_vl_moe", "tie_word_embeddings": false,
    "hidden_size": 1, "vision_config": {"depth": 27},
    "text_config": {"model_type": "qwen3_vl_moe_text", "hidden_size": 2048, "num_experts": 128,
      "dtype": "bfloat16", "rope_theta": 5000000}})");
  EXPECT_EQ(top.model_type(), "qwen3_vl_moe");
  HfConfig text = top.text();
  EXPECT_EQ(text.model_type(), "qwen3_vl_moe_text");
  EXPECT_EQ(text.get_int("hidden_size"), 2048);  // text_config wins
  EXPECT_EQ(text.get_int("num_experts"), 128);
  EXPECT_FALSE(text.get_bool("tie_word_embeddings"));  // top level still visible
  EXPECT_EQ(text.torch_dtype(), "bfloat16");
  EXPECT_DOUBLE_EQ(text.rope().theta, 5e6);
  EXPECT_FALSE(text.json().contains("text_config"));
  expect_contains(error_of([&] { text.get_int("num_hidden_layers"); }),
                  {"test/config.json (text_config)", "missing field 'num_hidden_layers'"});
  // Without text_config, text() is the config itself.
  EXPECT_EQ(cfg(R"({"model_type": "mixtral"})").text().path(), "test/config.json");
}

TEST_F(HfConfigTest, MissingFieldNamesAliases) {
  HfConfig c = cfg(R"({"model_type": "x"})");
  EXPECT_EQ(error_of([&] { c.get_int("num_experts"); }),
            "test/config.json: missing field 'num_experts' (also accepted: num_local_experts, "
            "n_routed_experts)");
  EXPECT_EQ(error_of([&] { c.get_string("chat_template"); }),
            "test/config.json: missing field 'chat_template'");
  expect_contains(error_of([&] { cfg("{}").model_type(); }), {"missing field 'model_type'"});
  EXPECT_EQ(cfg("{}").torch_dtype(), "");
}

TEST_F(HfConfigTest, WrongTypeMessages) {
  HfConfig c = cfg(R"({"hidden_size": "4096", "d_ff": 1.5, "n_layer": 24.0, "flag": 1,
    "name": 3, "eps": 1})");
  expect_contains(error_of([&] { c.get_int("hidden_size"); }),
                  {"test/config.json: field 'hidden_size' must be an integer, found string"});
  expect_contains(error_of([&] { c.get_int("d_ff"); }), {"must be an integer, found number 1.5"});
  EXPECT_EQ(c.get_int("num_hidden_layers"), 24);  // a float that is an exact integer
  expect_contains(error_of([&] { c.get_bool("flag"); }), {"field 'flag' must be a boolean"});
  expect_contains(error_of([&] { c.get_string("name"); }), {"field 'name' must be a string"});
  EXPECT_DOUBLE_EQ(c.get_double("eps"), 1.0);  // integers are numbers
  // The message names the spelling found in the file.
  expect_contains(error_of([&] { cfg(R"({"d_model": true})").get_int("hidden_size"); }),
                  {"field 'd_model' must be an integer, found boolean"});
  // Optional getters still check the type.
  expect_contains(error_of([&] { c.get_int("hidden_size", 1); }), {"must be an integer"});
}

TEST_F(HfConfigTest, ConflictingAliasesAreAnError) {
  HfConfig c = cfg(R"({"num_experts": 8, "num_local_experts": 16, "dtype": "bfloat16",
    "torch_dtype": "bfloat16"})");
  expect_contains(error_of([&] { c.get_int("num_experts"); }),
                  {"'num_experts' (8)", "'num_local_experts' (16)"});
  EXPECT_EQ(c.torch_dtype(), "bfloat16");  // agreeing spellings are fine
}

TEST_F(HfConfigTest, IntAndStringLists) {
  HfConfig c = cfg(R"({"a": 5, "b": [1, 2, 3], "c": ["x", "y"], "d": "z", "e": [1, "2"]})");
  EXPECT_EQ(c.get_int_list("a"), std::vector<int64_t>{5});
  EXPECT_EQ(c.get_int_list("b"), (std::vector<int64_t>{1, 2, 3}));
  EXPECT_TRUE(c.get_int_list("missing").empty());
  EXPECT_EQ(c.get_string_list("c"), (std::vector<std::string>{"x", "y"}));
  EXPECT_EQ(c.get_string_list("d"), std::vector<std::string>{"z"});
  expect_contains(error_of([&] { c.get_int_list("e"); }), {"field 'e[1]' must be an integer"});
}

TEST_F(HfConfigTest, LoadErrorsNameTheFile) {
  expect_contains(error_of([&] { HfConfig::load(dir_ + "/absent.json"); }), {"absent.json"});
  std::string p = write("bad.json", "{\"a\": ");
  expect_contains(error_of([&] { HfConfig::load(p); }), {"bad.json", "not valid JSON"});
  p = write("list.json", "[1]");
  expect_contains(error_of([&] { HfConfig::load(p); }), {"list.json", "must be a JSON object"});
  p = write("ok.json", R"({"model_type": "olmoe"})");
  HfConfig c = HfConfig::load(p);
  EXPECT_EQ(c.model_type(), "olmoe");
  EXPECT_EQ(c.path(), p);
}

// A valid Mixtral-style config with `field` set to `value` (null removes it).
HfConfig decoder_cfg(const std::string& field, const json& value) {
  json j = json::parse(R"({"model_type": "mixtral", "vocab_size": 300, "hidden_size": 64,
    "intermediate_size": 48, "num_hidden_layers": 3, "num_attention_heads": 4,
    "num_key_value_heads": 2, "num_local_experts": 6, "num_experts_per_tok": 2,
    "rope_theta": 10000.0})");
  if (value.is_null())
    j.erase(field);
  else
    j[field] = value;
  return HfConfig(j, "test/config.json");
}

DecoderConfig parse_decoder(const std::string& field, const json& value) {
  return DecoderConfig::parse(decoder_cfg(field, value), {.expert_size_field = "intermediate_size"});
}

TEST_F(HfConfigTest, DecoderConfigReadsTheCommonFields) {
  const DecoderConfig c = parse_decoder("rms_norm_eps", 1e-5);
  EXPECT_EQ(c.model_type, "mixtral");
  EXPECT_EQ(c.vocab_size, 300);
  EXPECT_EQ(c.hidden_size, 64);
  EXPECT_EQ(c.n_layers, 3);
  EXPECT_EQ(c.n_heads, 4);
  EXPECT_EQ(c.n_kv_heads, 2);
  EXPECT_EQ(c.head_dim, 16);  // hidden_size / num_attention_heads
  EXPECT_EQ(c.expert_size, 48);
  EXPECT_EQ(c.n_experts, 6);  // from num_local_experts
  EXPECT_EQ(c.top_k, 2);
  EXPECT_FLOAT_EQ(c.rms_norm_eps, 1e-5f);
  EXPECT_EQ(c.max_position, 32768);  // the default
  EXPECT_EQ(parse_decoder("num_key_value_heads", nullptr).n_kv_heads, 4);  // MHA by default
  EXPECT_EQ(parse_decoder("head_dim", 24).head_dim, 24);  // may differ from hidden / heads
  // An integer written as a float that is exact still reads (as json.dumps of some tools writes them).
  EXPECT_EQ(parse_decoder("num_hidden_layers", 3.0).n_layers, 3);
}

// Each bad value: one line naming config.json, the field and the value.
TEST_F(HfConfigTest, DecoderConfigRejectsOutOfRangeIntegers) {
  struct Case {
    std::string field;
    json value;
    std::string expect;
  } cases[] = {
      {"num_attention_heads", 0, "field 'num_attention_heads' must be in [1, 65536], found 0"},
      {"num_hidden_layers", -1, "field 'num_hidden_layers' must be in [1, 4096], found -1"},
      {"num_hidden_layers", int64_t(1) << 31, "field 'num_hidden_layers' must be in [1, 4096], found 2147483648"},
      {"num_hidden_layers", int64_t(1) << 40, "found 1099511627776"},
      {"num_hidden_layers", 4097, "found 4097"},
      {"hidden_size", 0, "field 'hidden_size' must be in [1, "},
      {"vocab_size", int64_t(1) << 32, "field 'vocab_size' must be in [1, 16777216], found 4294967296"},
      {"num_key_value_heads", 0, "field 'num_key_value_heads' must be in [1, 4], found 0"},
      {"num_key_value_heads", 8, "field 'num_key_value_heads' must be in [1, 4], found 8"},
      {"num_key_value_heads", 3, "field 'num_key_value_heads' (3) must divide num_attention_heads (4)"},
      {"head_dim", 0, "field 'head_dim' must be in [1, "},
      {"head_dim", 15, "field 'head_dim' must be even"},
      {"hidden_size", 66, "hidden_size (66) is not a multiple of num_attention_heads (4)"},
      {"num_local_experts", 0, "field 'num_local_experts' must be in [1, 65536], found 0"},
      {"num_experts_per_tok", 0, "field 'num_experts_per_tok' must be in [1, num_local_experts = 6], found 0"},
      {"num_experts_per_tok", 7, "field 'num_experts_per_tok' must be in [1, num_local_experts = 6], found 7"},
      {"num_experts_per_tok", (int64_t(1) << 32) + 2, "found 4294967298"},
      {"intermediate_size", -48, "field 'intermediate_size' must be in [1, "},
      {"max_position_embeddings", 0, "field 'max_position_embeddings' must be in [1, "},
      {"rms_norm_eps", -1.0, "field 'rms_norm_eps' must be in [0, 1), found -1"},
  };
  for (const Case& c : cases) {
    const std::string msg = error_of([&] { parse_decoder(c.field, c.value); });
    expect_contains(msg, {"test/config.json: ", c.expect});
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  }
}

TEST_F(HfConfigTest, DecoderConfigRejectsWrongTypes) {
  expect_contains(error_of([&] { parse_decoder("hidden_size", "64"); }),
                  {"test/config.json: field 'hidden_size' must be an integer, found string \"64\""});
  expect_contains(error_of([&] { parse_decoder("num_hidden_layers", 2.5); }),
                  {"field 'num_hidden_layers' must be an integer, found number 2.5"});
  expect_contains(error_of([&] { parse_decoder("num_attention_heads", true); }),
                  {"field 'num_attention_heads' must be an integer, found boolean"});
  expect_contains(error_of([&] { parse_decoder("num_experts_per_tok", json::array({2})); }),
                  {"field 'num_experts_per_tok' must be an integer, found array"});
  expect_contains(error_of([&] { parse_decoder("tie_word_embeddings", 1); }),
                  {"field 'tie_word_embeddings' must be a boolean"});
  expect_contains(error_of([&] { parse_decoder("rms_norm_eps", "1e-5"); }),
                  {"field 'rms_norm_eps' must be a number, found string"});
  expect_contains(error_of([&] { parse_decoder("vocab_size", nullptr); }), {"missing field 'vocab_size'"});
}

TEST_F(HfConfigTest, LayerTypesAndSparseLayersAreChecked) {
  const HfConfig ok = decoder_cfg("layer_types", json::array({"full_attention", "sliding_attention", "full_attention"}));
  EXPECT_EQ(parse_layer_types(ok, 3, "sliding_attention", "full_attention"), (std::vector<bool>{false, true, false}));
  expect_contains(error_of([&] { parse_layer_types(ok, 4, "sliding_attention", "full_attention"); }),
                  {"test/config.json: layer_types has 3 entries, num_hidden_layers is 4"});
  expect_contains(error_of([&] { parse_layer_types(ok, 3, "linear_attention", "full_attention"); }),
                  {"layer_types entry 'sliding_attention' is not supported"});
  expect_contains(error_of([&] { SparseLayers::parse(decoder_cfg("decoder_sparse_step", 0), 3); }),
                  {"field 'decoder_sparse_step' must be in [1, 4096], found 0"});
  expect_contains(error_of([&] { SparseLayers::parse(decoder_cfg("mlp_only_layers", json::array({1, 3})), 3); }),
                  {"field 'mlp_only_layers' lists layer 3, outside [0, num_hidden_layers = 3)"});
  const SparseLayers s = SparseLayers::parse(decoder_cfg("decoder_sparse_step", 2), 3);
  EXPECT_EQ(std::vector<bool>({s.is_moe(0), s.is_moe(1), s.is_moe(2)}), (std::vector<bool>{false, true, false}));
}

TEST_F(HfConfigTest, GetIntInNamesTheSpellingFound) {
  const HfConfig c = cfg(R"({"n_layer": 5000})");
  EXPECT_EQ(error_of([&] { c.get_int_in("num_hidden_layers", 1, 4096); }),
            "test/config.json: field 'n_layer' must be in [1, 4096], found 5000");
  EXPECT_EQ(c.get_int_in("head_dim", 1, 8, 99), 99);  // absent: the default, unchecked
  EXPECT_EQ(c.spelling("num_hidden_layers"), "n_layer");
}

TEST_F(HfConfigTest, GenerationDefaultsUnionOfEosIds) {
  HfConfig c = cfg(R"({"eos_token_id": [1, 2], "bos_token_id": 0})");
  write("generation_config.json", R"({"eos_token_id": [2, 7, 1, 9], "bos_token_id": 5,
    "temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0, "repetition_penalty": 1.05,
    "do_sample": true, "transformers_version": "4.51.0"})");
  GenerationDefaults g = load_generation_defaults(dir_, c);
  EXPECT_EQ(g.eos_token_ids, (std::vector<int32_t>{1, 2, 7, 9}));
  EXPECT_EQ(g.bos_token_id, 5);
  EXPECT_FLOAT_EQ(g.temperature.value(), 0.6f);
  EXPECT_FLOAT_EQ(g.top_p.value(), 0.95f);
  EXPECT_EQ(g.top_k, 20);
  EXPECT_FLOAT_EQ(g.min_p.value(), 0.0f);
  EXPECT_FLOAT_EQ(g.repetition_penalty.value(), 1.05f);
  EXPECT_EQ(g.do_sample, true);
}

TEST_F(HfConfigTest, GenerationDefaultsWithoutGenerationConfig) {
  HfConfig c = cfg(R"({"eos_token_id": 151645, "bos_token_id": null,
    "text_config": {"eos_token_id": [151645, 151643]}})");
  GenerationDefaults g = load_generation_defaults(dir_, c);
  EXPECT_EQ(g.eos_token_ids, (std::vector<int32_t>{151645, 151643}));
  EXPECT_FALSE(g.bos_token_id.has_value());
  EXPECT_FALSE(g.temperature.has_value());
  EXPECT_FALSE(g.top_k.has_value());
  EXPECT_FALSE(g.do_sample.has_value());
}

TEST_F(HfConfigTest, GenerationDefaultsMalformedFile) {
  HfConfig c = cfg(R"({"eos_token_id": 2})");
  write("generation_config.json", "{\"eos_token_id\": [2,");
  expect_contains(error_of([&] { load_generation_defaults(dir_, c); }),
                  {"generation_config.json", "not valid JSON"});
  write("generation_config.json", R"({"top_k": "20"})");
  expect_contains(error_of([&] { load_generation_defaults(dir_, c); }),
                  {"generation_config.json", "field 'top_k' must be an integer"});
  write("generation_config.json", R"({"eos_token_id": -1})");
  expect_contains(error_of([&] { load_generation_defaults(dir_, c); }),
                  {"generation_config.json", "eos_token_id -1"});
}

}  // namespace
}  // namespace moestream
