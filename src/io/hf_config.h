// config.json and generation_config.json of a Hugging Face model directory.
//
// HfConfig wraps the parsed JSON and resolves the names that changed across transformers
// versions in one place (kAliases in hf_config.cpp): e.g. num_experts / num_local_experts,
// torch_dtype / dtype, rope_theta + rope_scaling (4.x) / rope_parameters (5.x). Multimodal
// checkpoints nest the language model under "text_config"; HfConfig::text() returns that view.
// Missing or mistyped fields throw Error naming the field and the file.
#pragma once

#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

namespace moestream {

struct RopeParams {
  std::string type = "default";      // default | linear | dynamic | yarn | llama3 | longrope
  double theta = 10000.0;            // base frequency
  double factor = 1.0;               // context extension factor (linear, yarn, ...)
  double original_max_position = 0;  // yarn / llama3: original_max_position_embeddings; 0 if absent
  double beta_fast = 32, beta_slow = 1;                            // yarn
  std::optional<double> mscale, mscale_all_dim, attention_factor;  // yarn variants
  double low_freq_factor = 1, high_freq_factor = 4;                // llama3
  bool truncate = true;                // yarn: truncate correction range (transformers default)
  double partial_rotary_factor = 1.0;  // fraction of head_dim that is rotated
};

class HfConfig {
 public:
  HfConfig(nlohmann::json json, std::string path);
  static HfConfig load(const std::string& path);  // throws Error on missing file / bad JSON

  const nlohmann::json& json() const { return json_; }
  const std::string& path() const { return path_; }

  // The language-model part: json["text_config"] merged over the top level when present.
  HfConfig text() const;

  bool has(const std::string& field) const;  // field or one of its aliases present and non-null
  // Required fields: throw Error("<path>: missing field 'x' (also accepted: y)" or
  // "<path>: field 'x' must be an integer, found string ..."). Integer getters accept floats that
  // are exact integers; double getters accept integers. Two spellings of one field with
  // different values are an error.
  int64_t get_int(const std::string& field) const;
  double get_double(const std::string& field) const;
  bool get_bool(const std::string& field) const;
  std::string get_string(const std::string& field) const;
  // Optional fields: the default when absent or null.
  int64_t get_int(const std::string& field, int64_t dflt) const;
  double get_double(const std::string& field, double dflt) const;
  bool get_bool(const std::string& field, bool dflt) const;
  std::string get_string(const std::string& field, const std::string& dflt) const;
  // Integers that must lie in [lo, hi]: "<path>: field 'x' must be in [lo, hi], found v" (the
  // spelling found in the file). The default is not checked.
  int64_t get_int_in(const std::string& field, int64_t lo, int64_t hi) const;
  int64_t get_int_in(const std::string& field, int64_t lo, int64_t hi, int64_t dflt) const;
  // The spelling of field (or of one of its aliases) present in the file; field when absent.
  std::string spelling(const std::string& field) const;
  // [] when absent or null; a single value (eos_token_id: 2) counts as a one-element list.
  std::vector<int64_t> get_int_list(const std::string& field) const;
  std::vector<std::string> get_string_list(const std::string& field) const;

  std::string model_type() const;   // required
  std::string torch_dtype() const;  // "bfloat16", ... from torch_dtype or dtype; "" if absent
  // From rope_parameters (5.x), or rope_theta + rope_scaling (4.x). Some 5.x configs nest
  // rope_parameters per layer type ({"full_attention": {..}, "sliding_attention": {..}}); those
  // need layer_type, and a flat rope_parameters applies to every layer type.
  RopeParams rope(const std::string& layer_type = "") const;

 private:
  const nlohmann::json* lookup(const std::string& field) const;  // follows aliases
  nlohmann::json json_;
  std::string path_;
};

// generation_config.json (optional) merged with config.json: the ids generation stops on and
// the sampling defaults the model's authors chose.
struct GenerationDefaults {
  std::vector<int32_t> eos_token_ids;  // union of config.json and generation_config.json
  std::optional<int32_t> bos_token_id;
  std::optional<float> temperature, top_p, min_p, repetition_penalty;
  std::optional<int> top_k;
  std::optional<bool> do_sample;
};
GenerationDefaults load_generation_defaults(const std::string& model_dir, const HfConfig& config);

}  // namespace moestream
