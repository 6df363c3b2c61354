// Random-weight models written directly in packed form (no full-precision intermediate), for the
// demo, the benchmarks and tests that need a model of a given shape without a download. The
// tokenizer is byte-level BPE over the 256 bytes, chat special tokens, and filler word pieces up
// to the vocabulary size, so any text round-trips.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace moestream {

struct SynthShape {
  int64_t vocab = 512;
  int64_t hidden = 256;
  int layers = 4;
  int heads = 4, kv_heads = 2, head_dim = 64;
  int experts = 16, top_k = 4;
  int64_t moe_intermediate = 128;
  int64_t intermediate = 512;  // dense layers (mlp_only_layers)
  int first_dense = 0;         // layers [0, first_dense) use a dense MLP
  // > 0: the Qwen3.5 hybrid (a qwen3_5_moe_text checkpoint): every full_attention_interval-th
  // layer is gated full attention, the others Gated DeltaNet with the linear_* heads, and each
  // MoE layer adds a sigmoid-gated shared expert of width shared_intermediate.
  int full_attention_interval = 0;
  int linear_k_heads = 0, linear_v_heads = 0, linear_head_dim = 0, linear_conv_kernel = 4;
  int64_t shared_intermediate = 0;
  double partial_rotary = 1.0;  // rotated share of each full-attention head
  double rope_theta = 1000000.0;
};

struct SynthOptions {
  std::string quant = "bf16";  // expert storage: bf16 | q8 | q4 | q2 (group size below)
  int group_size = 64;
  double zipf = 0;             // > 0: expert popularity ~ rank^-zipf (router bias)
  uint64_t seed = 42;
  // A Hugging Face checkpoint instead of a pack (--hf): every tensor bf16 in safetensors shards
  // with their index, experts one tensor each in the Hub's names, as other engines' converters
  // read it (the peer benchmark); the same values as the pack of the same options.
  bool hf = false;
  // tokenizer.json and tokenizer_config.json copied from here instead of the synthetic
  // byte-level ones (--tokenizer; the vocabulary must hold its ids).
  std::string tokenizer_dir;
};

// Named shapes: tiny, small, qwen3-30b-a3b, qwen3-235b-a22b, qwen3.5-35b-a3b and qwen3.5-397b-a17b (hybrids). Error
// lists them when unknown.
SynthShape synth_preset(const std::string& name);
std::vector<std::string> synth_preset_names();

// Writes the pack (or with options.hf the checkpoint) to `dir`, which must not exist, through a
// temporary directory.
void write_synthetic_pack(const std::string& dir, const SynthShape& shape, const SynthOptions& options);

}  // namespace moestream
