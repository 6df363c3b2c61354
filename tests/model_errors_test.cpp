// Bad model directories and bad command lines give one clear error, never a crash.
#include <gtest/gtest.h>

#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "models/model.h"
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
      {"frobnicate", "subcommand"},
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
