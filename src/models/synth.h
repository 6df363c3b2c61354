// Random-weight models written in Hugging Face layout, for the demo and tests that need a model
// of a given shape without downloading one. The tokenizer is byte-level BPE over the 256 bytes
// plus chat special tokens, so any text round-trips.
#pragma once

#include <cstdint>
#include <string>

namespace moestream {

struct SynthShape {
  int64_t hidden = 256;
  int layers = 4;
  int heads = 4, kv_heads = 2, head_dim = 64;
  int experts = 16, top_k = 4;
  int64_t moe_intermediate = 128;
  int64_t intermediate = 512;  // dense layers (none unless first_dense > 0)
  int first_dense = 0;         // layers [0, first_dense) use a dense MLP (mlp_only_layers)
};

// Writes config.json, generation_config.json, model.safetensors, tokenizer.json and
// tokenizer_config.json into `dir` (created through a temporary directory renamed into place).
void write_random_qwen3_moe(const std::string& dir, const SynthShape& shape, uint64_t seed);

}  // namespace moestream
