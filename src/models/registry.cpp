#include "models/registry.h"

#include <filesystem>

#include "core/error.h"
#include "io/hf_config.h"

namespace moestream {

const std::vector<Architecture>& architectures() {
  static const std::vector<Architecture> table = {
      {"qwen3_moe", "Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder-30B-A3B, Qwen3-Coder-480B",
       load_qwen3_moe},
  };
  return table;
}

std::unique_ptr<Model> load_model(const std::string& dir, const ModelOptions& options) {
  if (!std::filesystem::is_directory(dir)) fail(dir, ": not a model directory");
  const std::string config_path = dir + "/config.json";
  if (!std::filesystem::exists(config_path)) fail(config_path, ": not found (is ", dir, " a model directory?)");
  HfConfig config = HfConfig::load(config_path).text();
  const std::string type = config.model_type();
  std::string supported;
  for (const auto& arch : architectures()) {
    if (arch.model_type == type) return arch.load(dir, config, options);
    supported += (supported.empty() ? "" : ", ") + arch.model_type;
  }
  fail(config_path, ": model_type '", type, "' is not supported (supported: ", supported, ")");
}

}  // namespace moestream
