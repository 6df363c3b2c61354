// Subcommands of the moestream CLI; each file registers one on the app.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "models/model.h"
#include "text/sampler.h"

namespace moestream::cli {

void add_run(CLI::App& app);
void add_logits(CLI::App& app);
void add_tokenize(CLI::App& app);  // tokenize and detokenize
void add_demo(CLI::App& app);
void add_pack(CLI::App& app);
void add_synth(CLI::App& app);
void add_verify(CLI::App& app);  // check a pack against its checksums
void add_bench(CLI::App& app);
void add_perplexity(CLI::App& app);
void add_template(CLI::App& app);  // render a conversation with the chat template
void add_serve(CLI::App& app);
void add_chat(CLI::App& app);

// "1,2,3" -> {1, 2, 3}; throws Error naming the flag on anything else.
std::vector<int32_t> parse_token_list(const std::string& text, const std::string& flag);

// Options every command that loads a model takes.
struct ModelFlags {
  std::string dir;
  ModelOptions options;
  bool stats = false, timing = false;
  void add_to(CLI::App& cmd, bool required = true);
};

// Sampling flags (--temp, --top-k, --top-p, --min-p, --repeat-penalty, --seed); each one given
// overrides the model's generation_config.json defaults.
struct SamplingFlags {
  std::optional<float> temperature, top_p, min_p, repeat_penalty;
  std::optional<int> top_k;
  uint64_t seed = 0;
  void add_to(CLI::App& cmd);
  SamplingParams resolve(const std::string& model_dir) const;  // validated
};

// Counters of a run, printed at the end: --stats as one JSON line on stderr, --timing as a
// per-phase table on stderr.
struct RunCounters {
  int64_t prompt_tokens = 0, generated_tokens = 0;
  double prefill_seconds = 0, decode_seconds = 0;
};
void report(const ModelFlags& flags, Model& model, const RunCounters& c);

uint64_t peak_rss_bytes();  // VmHWM of this process

}  // namespace moestream::cli
