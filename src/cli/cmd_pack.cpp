// moestream pack / synth: write moestream's packed layout from a checkpoint or from random weights.
#include <cstdio>
#include <filesystem>
#include <optional>

#include "cli/cli.h"
#include "core/error.h"
#include "core/quant.h"
#include "io/expert_tiers.h"
#include "io/hf_config.h"
#include "io/pack.h"
#include "models/registry.h"
#include "models/synth.h"

namespace moestream::cli {

void add_pack(CLI::App& app) {
  struct Flags {
    std::string src, out;
    PackOptions options;
    std::string tiered;
    int hot_bits = 4, cold_bits = 2;
    double hot_share = 0.25;
  };
  auto f = std::make_shared<Flags>();
  CLI::App* cmd = app.add_subcommand("pack", "Convert a Hugging Face model directory into a moestream pack");
  cmd->add_option("SRC", f->src, "Hugging Face model directory")->required();
  cmd->add_option("OUT", f->out, "Output directory (must not exist)")->required();
  cmd->add_option("--quant", f->options.quant, "Expert storage: keep | bf16 | q8 | q6 | q4 | q3 | q2 (default keep)");
  cmd->add_option("--group-size", f->options.group_size, "Quantization group size: 32 | 64 | 128 (default 64)");
  cmd->add_flag("--quant-all", f->options.quant_all, "Also quantize the other linear layers and the embedding (routers at 8 bits)");
  cmd->add_flag("--clip-search", f->options.clip_search, "Choose per-group clipping by least squared error (for 2-bit)");
  cmd->add_option("-t,--threads", f->options.threads, "Experts converted at once (default: all hardware threads)")
      ->check(kNonNegative);
  cmd->add_option("--read-ahead", f->options.read_ahead,
                  "Batches of experts read ahead of the one converting (default 2; 0: read each when its turn comes)")
      ->check(kNonNegative);
  cmd->add_option("--read-io", f->options.read_io,
                  "How the source is read: direct (O_DIRECT; buffered where the filesystem refuses it), auto (direct, "
                  "but what the page cache holds is mapped from it), buffered (through the page cache) or mmap (the "
                  "kernel's readahead through the mapping) (default auto)")
      ->check(CLI::IsMember({"auto", "direct", "buffered", "mmap"}));
  cmd->add_option("--read-threads", f->options.read_threads,
                  "Source reads in flight, each of up to 8 MiB (default 16)")
      ->check(kPositive);
  CLI::Option* gptq = cmd->add_option("--gptq", f->options.gptq_text,
                                      "Quantize experts by GPTQ, calibrated on this text (not the one you measure on)");
  cmd->add_option("--gptq-tokens", f->options.gptq_tokens, "Calibration tokens at most (default 65536; 0: all)")
      ->check(kNonNegative)
      ->needs(gptq);
  cmd->add_option("--gptq-passes", f->options.gptq_passes,
                  "Calibration runs: each after the first on the model quantized by the one before (default 1)")
      ->check(CLI::Range(1, 8))
      ->needs(gptq);
  cmd->add_option("--gptq-expert-tokens", f->options.gptq_expert_tokens,
                  "Calibration tokens kept per expert to reconstruct its output after GPTQ (default 1024; 0: off)")
      ->check(CLI::Range(int64_t(0), int64_t(1) << 20))
      ->needs(gptq);
  CLI::Option* tiered = cmd->add_option("--tiered", f->tiered,
                                        "Usage profile (--profile-out's JSON): each layer's most used experts at "
                                        "--hot-bits, the rest at --cold-bits");
  cmd->add_option("--hot-bits", f->hot_bits, "Bits of the hot experts (default 4)")->needs(tiered);
  cmd->add_option("--cold-bits", f->cold_bits, "Bits of the other experts (default 2)")->needs(tiered);
  cmd->add_option("--hot-share", f->hot_share, "Share of each layer's experts that are hot (default 0.25)")->needs(tiered);
  cmd->callback([f] {
    if (!f->tiered.empty()) {
      if (f->options.quant != "keep")
        fail("--tiered: the expert formats come from --hot-bits and --cold-bits; leave out --quant");
      for (const auto& [flag, bits] : {std::pair{"--hot-bits", f->hot_bits}, {"--cold-bits", f->cold_bits}})
        check_quant_format(QuantFormat{bits, f->options.group_size}, flag);
      f->options.expert_bits = tier_bits(read_usage_profile(f->tiered), f->hot_share, f->hot_bits, f->cold_bits);
      f->options.quant = "q" + std::to_string(f->hot_bits);  // the resident weights' format under --quant-all
    }
    const HfConfig config = HfConfig::load(f->src + "/config.json").text();
    const Architecture& arch = find_architecture(config.model_type(), config.path());
    f->options.skip = arch.unused_tensors;
    write_pack(f->src, f->out, arch.expert_tensors, f->options);
    const PackManifest m = PackManifest::load(f->out);
    std::fprintf(stderr, "packed %s into %s: %zu expert files, %.3f GB of experts\n",
                 f->src.c_str(), f->out.c_str(), m.expert_files.size(), m.total_expert_bytes() / 1e9);
  });
}

void add_synth(CLI::App& app) {
  struct Flags {
    std::string out, preset = "small";
    std::optional<int> layers, experts, top_k, heads, kv_heads, head_dim;
    std::optional<int64_t> hidden, moe_intermediate, vocab;
    SynthOptions options;
  };
  auto f = std::make_shared<Flags>();
  CLI::App* cmd = app.add_subcommand("synth", "Write a random-weight Qwen3-MoE (or Qwen3.5 hybrid) directly as a pack (or, with --hf, a checkpoint)");
  cmd->add_option("-o,--output", f->out, "Output directory (must not exist)")->required();
  cmd->add_option("--preset", f->preset, "Shape: tiny | small | qwen3-30b-a3b | qwen3-235b-a22b | qwen3.5-35b-a3b | qwen3.5-397b-a17b (default small); the flags "
                  "below override it");
  cmd->add_option("--layers", f->layers, "Layers");
  cmd->add_option("--hidden", f->hidden, "Hidden size");
  cmd->add_option("--experts", f->experts, "Routed experts per layer");
  cmd->add_option("--top-k", f->top_k, "Experts per token");
  cmd->add_option("--moe-intermediate", f->moe_intermediate, "Expert intermediate size");
  cmd->add_option("--heads", f->heads, "Attention heads");
  cmd->add_option("--kv-heads", f->kv_heads, "Key/value heads");
  cmd->add_option("--head-dim", f->head_dim, "Head dimension");
  cmd->add_option("--vocab", f->vocab, "Vocabulary size");
  cmd->add_option("--quant", f->options.quant, "Expert storage: bf16 | q8 | q4 | q2 (default bf16)");
  cmd->add_option("--group-size", f->options.group_size, "Quantization group size (default 64)");
  cmd->add_option("--zipf", f->options.zipf, "Bias routers so expert popularity ~ rank^-A");
  cmd->add_option("--seed", f->options.seed, "Random seed (default 42)");
  cmd->add_flag("--hf", f->options.hf,
                "Write a Hugging Face checkpoint (bf16 safetensors shards, one tensor per expert) instead of a pack, "
                "for other engines' converters (scripts/peer-bench); the same values as the pack");
  cmd->add_option("--tokenizer", f->options.tokenizer_dir,
                  "Copy tokenizer.json and tokenizer_config.json from DIR instead of writing a synthetic byte-level "
                  "tokenizer (its ids must be below --vocab)");
  cmd->callback([f] {
    SynthShape s = synth_preset(f->preset);
    if (f->layers) s.layers = *f->layers;
    if (f->hidden) s.hidden = *f->hidden;
    if (f->experts) s.experts = *f->experts;
    if (f->top_k) s.top_k = *f->top_k;
    if (f->moe_intermediate) s.moe_intermediate = *f->moe_intermediate;
    if (f->heads) s.heads = *f->heads;
    if (f->kv_heads) s.kv_heads = *f->kv_heads;
    if (f->head_dim) s.head_dim = *f->head_dim;
    if (f->vocab) s.vocab = *f->vocab;
    write_synthetic_pack(f->out, s, f->options);
    if (f->options.hf) {
      std::fprintf(stderr, "wrote %s: a Hugging Face checkpoint of %d layers, %d experts per layer (bf16)\n",
                   f->out.c_str(), s.layers, s.experts);
      return;
    }
    const PackManifest m = PackManifest::load(f->out);
    std::fprintf(stderr, "wrote %s: %d layers, %d experts per layer, %.3f GB of experts (%s)\n",
                 f->out.c_str(), s.layers, s.experts, m.total_expert_bytes() / 1e9,
                 f->options.quant.c_str());
  });
}

}  // namespace moestream::cli
