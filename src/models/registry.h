// The one table of supported architectures: model_type -> loader.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "models/model.h"

namespace moestream {

class HfConfig;

using ModelLoader = std::function<std::unique_ptr<Model>(const std::string& dir,
                                                         const HfConfig& config,
                                                         const ModelOptions& options)>;

struct Architecture {
  std::string model_type;  // config.json model_type
  std::string examples;    // published models of this family
  ModelLoader load;
};

const std::vector<Architecture>& architectures();

// Per-family loaders, defined in their own files.
std::unique_ptr<Model> load_qwen3_moe(const std::string& dir, const HfConfig& config,
                                      const ModelOptions& options);

}  // namespace moestream
