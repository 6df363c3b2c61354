// The one table of supported architectures: model_type -> loader.
#pragma once

#include <functional>
#include <optional>
#include <memory>
#include <string>
#include <vector>

#include "io/pack.h"
#include "models/model.h"

namespace moestream {

class HfConfig;

using ModelLoader = std::function<std::unique_ptr<Model>(const std::string& dir,
                                                         const HfConfig& config,
                                                         const ModelOptions& options)>;

struct Architecture {
  std::string model_type;  // config.json model_type
  std::string examples;    // published models of this family
  ModelLoader load;        // from a pack directory
  ExpertTensorParser expert_tensors;  // which checkpoint tensors are routed experts
  std::function<bool(const std::string& name)> unused_tensors;  // left out of packs; may be empty
};

const Architecture& find_architecture(const std::string& model_type, const std::string& where);

// Per-expert tensors named "model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight".
std::optional<ExpertTensorRef> parse_qwen_expert_tensor(const std::string& name);

const std::vector<Architecture>& architectures();

// Per-family loaders, defined in their own files.
std::unique_ptr<Model> load_qwen3_moe(const std::string& dir, const HfConfig& config,
                                      const ModelOptions& options);
std::unique_ptr<Model> load_mixtral(const std::string& dir, const HfConfig& config, const ModelOptions& options);
std::unique_ptr<Model> load_olmoe(const std::string& dir, const HfConfig& config, const ModelOptions& options);
std::unique_ptr<Model> load_glm4_moe(const std::string& dir, const HfConfig& config, const ModelOptions& options);
std::unique_ptr<Model> load_deepseek_v3(const std::string& dir, const HfConfig& config, const ModelOptions& options);
std::unique_ptr<Model> load_gpt_oss(const std::string& dir, const HfConfig& config, const ModelOptions& options);
// Mixtral's "block_sparse_moe.experts.E.w{1,2,3}.weight" (w1 gate, w3 up, w2 down).
std::optional<ExpertTensorRef> parse_mixtral_expert_tensor(const std::string& name);
// gpt-oss's stacked "mlp.experts.{gate_up_proj,down_proj}[_bias]" (x @ W, gate/up interleaved).
std::optional<ExpertTensorRef> parse_gpt_oss_expert_tensor(const std::string& name);
// Qwen3-Next and Qwen3.5-MoE (qwen3_next.cpp): hybrid Gated DeltaNet / gated attention layers.
std::unique_ptr<Model> load_qwen3_next(const std::string& dir, const HfConfig& config,
                                       const ModelOptions& options);
// parse_qwen_expert_tensor's names, also under "model.language_model." (multimodal Qwen3.5) and
// "language_model.model." (its MLX conversions).
std::optional<ExpertTensorRef> parse_qwen3_5_expert_tensor(const std::string& name);
// Qwen3-Next / Qwen3.5 tensors the language model never reads: model.visual.*, mtp.*, and in MLX
// conversions vision_tower.*, language_model.mtp.*.
bool is_qwen3_next_unused_tensor(const std::string& name);

}  // namespace moestream
