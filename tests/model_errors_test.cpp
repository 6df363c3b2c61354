// Bad model directories and bad command lines give one clear error, never a crash.
#include <gtest/gtest.h>

#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "models/model.h"
#include "models/registry.h"
#include "test_util.h"

namespace moestream {
namespace {

namespace fs = std::filesystem;

std::string copy_fixture(const std::string& name) {
  const std::string dir = test::temp_dir(name) + "/model";
  fs::copy(test::fixture("models/qwen3moe_gqa_tied"), dir, fs::copy_options::recursive);
  return dir;
}

void edit_config(const std::string& dir, const std::function<void(nlohmann::json&)>& edit) {
  auto j = nlohmann::json::parse(test::read_file(dir + "/config.json"));
  edit(j);
  std::ofstream(dir + "/config.json") << j.dump(2);
}

std::string load_error(const std::string& dir) {
  return test::error_of([&] { load_model(dir, ModelOptions()); });
}

TEST(ModelErrors, TruncatedSafetensors) {
  const std::string dir = copy_fixture("truncated");
  const std::string file = dir + "/model.safetensors";
  fs::resize_file(file, fs::file_size(file) - 1000);
  const std::string msg = load_error(dir);
  EXPECT_NE(msg.find("model.safetensors"), std::string::npos) << msg;
  EXPECT_NE(msg.find("truncated"), std::string::npos) << msg;
}

TEST(ModelErrors, CorruptedSafetensorsHeader) {
  const std::string dir = copy_fixture("corrupt");
  {
    std::fstream f(dir + "/model.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(8);
    f.write("#garbage#", 9);
  }
  const std::string msg = load_error(dir);
  EXPECT_NE(msg.find("model.safetensors"), std::string::npos) << msg;
}

TEST(ModelErrors, ConfigMissingField) {
  const std::string dir = copy_fixture("missing");
  edit_config(dir, [](auto& j) { j.erase("moe_intermediate_size"); });
  const std::string msg = load_error(dir);
  EXPECT_NE(msg.find("config.json"), std::string::npos) << msg;
  EXPECT_NE(msg.find("moe_intermediate_size"), std::string::npos) << msg;
}

TEST(ModelErrors, UnknownArchitectureListsSupported) {
  const std::string dir = copy_fixture("unknown");
  edit_config(dir, [](auto& j) { j["model_type"] = "llama_moe_9000"; });
  const std::string msg = load_error(dir);
  EXPECT_NE(msg.find("llama_moe_9000"), std::string::npos) << msg;
  EXPECT_NE(msg.find("qwen3_moe"), std::string::npos) << msg;
}

TEST(ModelErrors, TensorWithWrongShapeIsNamed) {
  const std::string dir = copy_fixture("shape");
  edit_config(dir, [](auto& j) { j["moe_intermediate_size"] = 33; });
  const std::string msg = load_error(dir);
  EXPECT_NE(msg.find("mlp.experts.0.gate_proj.weight"), std::string::npos) << msg;
  EXPECT_NE(msg.find("[33, 64]"), std::string::npos) << msg;
}

TEST(ModelErrors, MissingDirectory) {
  const std::string msg = load_error("/nonexistent/model");
  EXPECT_NE(msg.find("/nonexistent/model"), std::string::npos) << msg;
}

// One tiny checkpoint of each family; Qwen3.5 both text-only and multimodal (text_config).
const char* const kFamilyFixtures[] = {
    "models/qwen3moe_gqa_tied",  "families/mixtral_tiny",          "families/olmoe_tiny",
    "families/glm4_moe_tiny",    "families/deepseek_v3_tiny",      "families/gpt_oss_tiny",
    "families/qwen3_next_tiny",  "families/qwen3_5_moe_text_tiny", "families/qwen3_5_moe_vl",
};

// A copy of the fixture's pack (packed once into the test cache) whose config.json has `field`
// set to `value`, in text_config where the checkpoint nests the language model there.
std::string pack_with(const std::string& fixture, const std::string& field, const nlohmann::json& value) {
  const std::string pack = ensure_pack(test::fixture(fixture), "");
  static int n = 0;
  const std::string dir = test::temp_dir("cfg" + std::to_string(n++)) + "/pack";
  fs::copy(pack, dir, fs::copy_options::recursive);
  edit_config(dir, [&](nlohmann::json& j) { (j.contains("text_config") ? j["text_config"] : j)[field] = value; });
  return dir;
}

// Out-of-range, overflowing and mistyped integers in config.json: one error naming config.json,
// the field and the value, for every family (a zero head count used to divide by zero, a
// negative or 2^31 layer count loaded a model of no layers, and 2^40 was cut to 32 bits).
TEST(ModelErrors, ConfigIntegersAreValidatedInEveryFamily) {
  struct Case {
    std::string field;
    nlohmann::json value;
    std::vector<std::string> expect;
  } cases[] = {
      {"num_attention_heads", 0, {"num_attention_heads", "found 0"}},
      {"num_hidden_layers", -1, {"num_hidden_layers", "found -1"}},
      {"num_hidden_layers", int64_t(1) << 31, {"num_hidden_layers", "found 2147483648"}},
      {"num_hidden_layers", int64_t(1) << 40, {"num_hidden_layers", "found 1099511627776"}},
      {"num_attention_heads", (int64_t(1) << 32) + 4, {"num_attention_heads", "found 4294967300"}},
      {"num_experts_per_tok", (int64_t(1) << 32) + 2, {"num_experts_per_tok", "4294967298"}},
      {"num_experts_per_tok", 1000, {"num_experts_per_tok", "1000"}},
      {"hidden_size", "64", {"hidden_size", "must be an integer, found string"}},
      {"num_hidden_layers", 2.5, {"num_hidden_layers", "must be an integer, found number 2.5"}},
  };
  for (const char* fixture : kFamilyFixtures)
    for (const Case& c : cases) {
      const std::string msg = load_error(pack_with(fixture, c.field, c.value));
      EXPECT_NE(msg.find("config.json"), std::string::npos) << fixture << " " << c.field << ": " << msg;
      for (const std::string& part : c.expect)
        EXPECT_NE(msg.find(part), std::string::npos) << fixture << " " << c.field << " = " << c.value.dump()
                                                     << ": " << msg;
      EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
    }
}

TEST(CliErrors, OneLineMessageAndNonZeroExit) {
  const std::string dir = test::fixture("models/qwen3moe_gqa_tied");
  struct Case {
    std::string args, expect;
  } cases[] = {
      {"run -m " + dir + " --tokens 1,2,999999 -n 2 --ids", "999999"},
      {"run -m " + dir + " --tokens 1,x,3 -n 2", "--tokens"},
      {"run -m " + dir + " --tokens 1,2 --temp -1", "temperature"},
      {"run -m " + dir + " --tokens 1,2 --top-p 1.5", "top_p"},
      {"run -m /nonexistent --tokens 1", "/nonexistent"},
      {"run -m " + dir + " --tokens 1 --temp abc", "--temp"},
      {"logits -m " + dir + " --tokens 1,2", "--output"},
      {"frobnicate", "unknown command"},
  };
  for (const auto& c : cases) {
    auto r = test::run_cli(c.args);
    EXPECT_NE(r.exit_code, 0) << c.args;
    EXPECT_NE(r.err.find(c.expect), std::string::npos) << c.args << "\n" << r.err;
    EXPECT_EQ(r.out, "") << c.args;
  }
}

}  // namespace
}  // namespace moestream
