#include "models/registry.h"

#include <xxhash.h>

#include <cstdlib>
#include <filesystem>
#include <regex>

#include "core/error.h"
#include "io/hf_config.h"

namespace moestream {

namespace fs = std::filesystem;

const std::vector<Architecture>& architectures() {
  static const std::vector<Architecture> table = {
      {"qwen3_moe", "Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder-30B-A3B, Qwen3-Coder-480B",
       load_qwen3_moe, parse_qwen_expert_tensor},
      {"mixtral", "Mixtral-8x7B, Mixtral-8x22B", load_mixtral, parse_mixtral_expert_tensor},
      {"olmoe", "OLMoE-1B-7B", load_olmoe, parse_qwen_expert_tensor},
      {"glm4_moe", "GLM-4.5, GLM-4.5-Air, GLM-4.6", load_glm4_moe, parse_qwen_expert_tensor},
      {"deepseek_v3", "DeepSeek-V3, DeepSeek-R1", load_deepseek_v3, parse_qwen_expert_tensor},
      {"kimi_k2", "Kimi-K2 (the deepseek_v3 architecture)", load_deepseek_v3, parse_qwen_expert_tensor},
      {"gpt_oss", "gpt-oss-20b, gpt-oss-120b (bf16)", load_gpt_oss, parse_gpt_oss_expert_tensor},
      {"qwen3_next", "Qwen3-Next-80B-A3B-Instruct, Qwen3-Next-80B-A3B-Thinking", load_qwen3_next,
       parse_qwen_expert_tensor, is_qwen3_next_unused_tensor},
      {"qwen3_5_moe_text", "Qwen3.5-35B-A3B, Qwen3.5-122B-A10B, Qwen3.5-397B-A17B (language model)",
       load_qwen3_next, parse_qwen3_5_expert_tensor, is_qwen3_next_unused_tensor},
      {"qwen3_5_moe", "Qwen3.5-35B-A3B, Qwen3.5-122B-A10B, Qwen3.5-397B-A17B (language model)",
       load_qwen3_next, parse_qwen3_5_expert_tensor, is_qwen3_next_unused_tensor},
  };
  return table;
}

const Architecture& find_architecture(const std::string& model_type, const std::string& where) {
  std::string supported;
  for (const auto& arch : architectures()) {
    if (arch.model_type == model_type) return arch;
    supported += (supported.empty() ? "" : ", ") + arch.model_type;
  }
  fail(where, ": model_type '", model_type, "' is not supported (supported: ", supported, ")");
}

std::optional<ExpertTensorRef> parse_qwen_expert_tensor(const std::string& name) {
  // Hub layout: one tensor per expert.
  static const std::regex hub(R"(model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight)");
  // mlx-lm layout: experts stacked along dimension 0, possibly quantized.
  static const std::regex mlx(R"(model\.layers\.(\d+)\.mlp\.switch_mlp\.(gate|up|down)_proj\.(weight|scales|biases))");
  std::smatch m;
  if (std::regex_match(name, m, hub)) return ExpertTensorRef{std::stoi(m[1]), std::stoi(m[2]), m[3], false};
  if (std::regex_match(name, m, mlx)) {
    const std::string part = m[3];
    return ExpertTensorRef{std::stoi(m[1]), -1, part == "weight" ? std::string(m[2]) : std::string(m[2]) + "." + part, true};
  }
  return std::nullopt;
}

std::string default_cache_dir() {
  if (const char* env = std::getenv("MOESTREAM_CACHE"); env && *env) return env;
  const char* home = std::getenv("HOME");
  return std::string(home && *home ? home : "/tmp") + "/.cache/moestream";
}

namespace {

HfConfig load_config(const std::string& dir) {
  if (!fs::is_directory(dir)) fail(dir, ": not a model directory");
  const std::string path = dir + "/config.json";
  if (!fs::exists(path)) fail(path, ": not found (is ", dir, " a model directory?)");
  return HfConfig::load(path).text();
}

// Identifies a source directory's contents (path, and every file's name, size and mtime) and the
// packer's layout revision.
uint64_t source_key(const std::string& dir) {
  std::string key = fs::canonical(dir).string() + "\npacker " + std::to_string(kPackerRevision);
  std::vector<std::string> entries;
  for (const auto& e : fs::directory_iterator(dir)) {
    if (!e.is_regular_file()) continue;
    entries.push_back(e.path().filename().string() + ":" + std::to_string(e.file_size()) + ":" +
                      std::to_string(e.last_write_time().time_since_epoch().count()));
  }
  std::sort(entries.begin(), entries.end());
  for (const auto& s : entries) key += "\n" + s;
  return XXH64(key.data(), key.size(), 0);
}

// The name a pack of `dir` gets in the cache: the model's, i.e. the directory's, or for a snapshot
// of the Hugging Face hub cache (.../models--org--name/snapshots/<commit>) "org--name".
std::string pack_name(const fs::path& dir) {
  const fs::path canon = fs::canonical(dir);
  const std::string repo = canon.parent_path().parent_path().filename().string();
  if (canon.parent_path().filename() == "snapshots" && repo.rfind("models--", 0) == 0) return repo.substr(8);
  return canon.filename().string();
}

uint64_t bytes_in(const fs::path& dir) {
  uint64_t n = 0;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.is_regular_file()) n += e.file_size();
  return n;
}

}  // namespace

std::string ensure_pack(const std::string& dir, const std::string& cache_dir) {
  if (is_pack_dir(dir)) return dir;
  const HfConfig config = load_config(dir);
  const Architecture& arch = find_architecture(config.model_type(), config.path());
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", (unsigned long long)source_key(dir));
  const std::string packs = (cache_dir.empty() ? default_cache_dir() : cache_dir) + "/packs";
  const std::string out = packs + "/" + pack_name(dir) + "-" + hex;
  if (is_pack_dir(out)) return out;
  fs::create_directories(packs);
  // Packs an earlier run left unfinished (killed or interrupted): this source's is resumed by
  // write_pack (unless the options changed), the others, of other sources, removed.
  for (const AbandonedPack& a : remove_abandoned_packs(packs, out))
    std::fprintf(stderr, "moestream: removed %s, an unfinished pack left by process %d\n", a.path.c_str(), a.pid);
  std::fprintf(stderr, "moestream: packing %s (%.2f GB) into %s; later runs reuse it\n", dir.c_str(),
               bytes_in(dir) / 1e9, out.c_str());
  try {
    PackOptions options;
    options.skip = arch.unused_tensors;
    write_pack(dir, out, arch.expert_tensors, options);
  } catch (const std::exception&) {
    if (is_pack_dir(out)) return out;  // another process packed it at the same time
    throw;
  }
  return out;
}

std::unique_ptr<Model> load_model(const std::string& dir, const ModelOptions& options) {
  load_config(dir);  // a clear error for a missing directory before anything else
  const std::string pack = ensure_pack(dir, options.cache_dir);
  const HfConfig config = load_config(pack);
  return find_architecture(config.model_type(), config.path()).load(pack, config, options);
}

}  // namespace moestream
