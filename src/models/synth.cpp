#include "models/synth.h"

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "io/safetensors.h"

namespace moestream {

namespace {

using json = nlohmann::json;

const char* const kSpecialTokens[] = {"<|endoftext|>", "<|im_start|>", "<|im_end|>"};

// GPT-2's printable stand-ins for the 256 byte values, as UTF-8 strings.
std::vector<std::string> byte_level_alphabet() {
  std::vector<std::string> out(256);
  int next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
    const int cp = printable ? b : next++;
    std::string s;
    if (cp < 0x80) {
      s += char(cp);
    } else {
      s += char(0xC0 | (cp >> 6));
      s += char(0x80 | (cp & 0x3F));
    }
    out[size_t(b)] = s;
  }
  return out;
}

json tokenizer_json() {
  json vocab = json::object();
  const auto alphabet = byte_level_alphabet();
  for (int b = 0; b < 256; ++b) vocab[alphabet[size_t(b)]] = b;
  json added = json::array();
  int id = 256;
  for (const char* t : kSpecialTokens)
    added.push_back({{"id", id++}, {"content", t}, {"single_word", false}, {"lstrip", false},
                     {"rstrip", false}, {"normalized", false}, {"special", true}});
  json byte_level = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", false},
                     {"use_regex", true}};
  return {{"version", "1.0"},
          {"truncation", nullptr},
          {"padding", nullptr},
          {"added_tokens", added},
          {"normalizer", {{"type", "NFC"}}},
          {"pre_tokenizer", byte_level},
          {"post_processor", nullptr},
          {"decoder", byte_level},
          {"model",
           {{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", nullptr},
            {"continuing_subword_prefix", ""}, {"end_of_word_suffix", ""}, {"fuse_unk", false},
            {"byte_fallback", false}, {"ignore_merges", false}, {"vocab", vocab},
            {"merges", json::array()}}}};
}

void write_json(const std::string& path, const json& j) {
  std::ofstream out(path);
  out << j.dump(2) << "\n";
  if (!out) fail(path, ": write failed");
}

}  // namespace

void write_random_qwen3_moe(const std::string& dir, const SynthShape& s, uint64_t seed) {
  namespace fs = std::filesystem;
  const int64_t vocab = 256 + int64_t(std::size(kSpecialTokens));
  const std::string tmp = dir + ".tmp-" + std::to_string(getpid());
  fs::remove_all(tmp);
  fs::create_directories(tmp);

  json mlp_only = json::array();
  for (int l = 0; l < s.first_dense; ++l) mlp_only.push_back(l);
  const int32_t eos = 258;  // <|im_end|>
  write_json(tmp + "/config.json",
             {{"architectures", {"Qwen3MoeForCausalLM"}}, {"model_type", "qwen3_moe"},
              {"vocab_size", vocab}, {"hidden_size", s.hidden},
              {"intermediate_size", s.intermediate}, {"moe_intermediate_size", s.moe_intermediate},
              {"num_hidden_layers", s.layers}, {"num_attention_heads", s.heads},
              {"num_key_value_heads", s.kv_heads}, {"head_dim", s.head_dim},
              {"num_experts", s.experts}, {"num_experts_per_tok", s.top_k},
              {"norm_topk_prob", true}, {"decoder_sparse_step", 1}, {"mlp_only_layers", mlp_only},
              {"tie_word_embeddings", false}, {"rms_norm_eps", 1e-6},
              {"max_position_embeddings", 4096}, {"rope_theta", 1000000.0},
              {"hidden_act", "silu"}, {"torch_dtype", "bfloat16"}, {"eos_token_id", eos},
              {"bos_token_id", nullptr}});
  write_json(tmp + "/generation_config.json",
             {{"eos_token_id", {256, eos}}, {"do_sample", true}, {"temperature", 0.8},
              {"top_k", 40}, {"top_p", 0.95}});
  write_json(tmp + "/tokenizer.json", tokenizer_json());
  write_json(tmp + "/tokenizer_config.json",
             {{"add_bos_token", false}, {"bos_token", nullptr}, {"eos_token", "<|im_end|>"},
              {"tokenizer_class", "Qwen2Tokenizer"}});

  // Weights: unit-variance embeddings, norms near 1, projections scaled by 1/sqrt(fan_in).
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<std::vector<uint16_t>> storage;
  std::vector<TensorToWrite> tensors;
  auto add = [&](const std::string& name, std::vector<int64_t> shape, float scale, float offset) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    std::vector<uint16_t>& data = storage.emplace_back(size_t(n));
    for (auto& v : data) v = f32_to_bf16(offset + scale * normal(rng));
    tensors.push_back({name, DType::BF16, std::move(shape), nullptr});
  };
  auto matrix = [&](const std::string& name, int64_t rows, int64_t cols, float gain = 1.0f) {
    add(name, {rows, cols}, gain / std::sqrt(float(cols)), 0.0f);
  };
  const int64_t h = s.hidden, q_dim = int64_t(s.heads) * s.head_dim,
                kv_dim = int64_t(s.kv_heads) * s.head_dim;
  add("model.embed_tokens.weight", {vocab, h}, 1.0f, 0.0f);
  for (int l = 0; l < s.layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    add(p + "input_layernorm.weight", {h}, 0.1f, 1.0f);
    add(p + "post_attention_layernorm.weight", {h}, 0.1f, 1.0f);
    matrix(p + "self_attn.q_proj.weight", q_dim, h);
    matrix(p + "self_attn.k_proj.weight", kv_dim, h);
    matrix(p + "self_attn.v_proj.weight", kv_dim, h);
    matrix(p + "self_attn.o_proj.weight", h, q_dim);
    add(p + "self_attn.q_norm.weight", {s.head_dim}, 0.1f, 1.0f);
    add(p + "self_attn.k_norm.weight", {s.head_dim}, 0.1f, 1.0f);
    if (l < s.first_dense) {
      matrix(p + "mlp.gate_proj.weight", s.intermediate, h);
      matrix(p + "mlp.up_proj.weight", s.intermediate, h);
      matrix(p + "mlp.down_proj.weight", h, s.intermediate);
      continue;
    }
    matrix(p + "mlp.gate.weight", s.experts, h, 3.0f);
    for (int e = 0; e < s.experts; ++e) {
      const std::string x = p + "mlp.experts." + std::to_string(e) + ".";
      matrix(x + "gate_proj.weight", s.moe_intermediate, h);
      matrix(x + "up_proj.weight", s.moe_intermediate, h);
      matrix(x + "down_proj.weight", h, s.moe_intermediate);
    }
  }
  add("model.norm.weight", {h}, 0.1f, 1.0f);
  matrix("lm_head.weight", vocab, h);
  for (size_t i = 0; i < tensors.size(); ++i) tensors[i].data = storage[i].data();
  write_safetensors(tmp + "/model.safetensors", tensors, {{"format", "pt"}});

  fs::remove_all(dir);
  fs::create_directories(fs::path(dir).parent_path());
  fs::rename(tmp, dir);
}

}  // namespace moestream
