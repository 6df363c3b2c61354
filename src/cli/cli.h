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
void add_profile(CLI::App& app);   // expert usage on a text, for --profile
void add_template(CLI::App& app);  // render a conversation with the chat template
void add_serve(CLI::App& app);
void add_chat(CLI::App& app);
void add_list(CLI::App& app);   // models in the caches and given directories
void add_cache(CLI::App& app);  // cache list | prune

// llama.cpp's multi-letter single-dash options (-np, -ngl) rewritten to moestream's before CLI11
// parses them (CLI11 would read "-ngl 99" as "-n gl 99"); argv[0] included.
std::vector<std::string> normalize_args(int argc, char** argv);
// A parse error as one line naming the command, with "did you mean" for a near miss.
std::string describe_parse_error(const CLI::App& app, const CLI::ParseError& e);
// Number checks whose messages are short (CLI11's print the whole double range).
extern const CLI::Validator kNonNegative, kPositive;

// What -m names, as a directory: a model directory or pack as given, or a Hugging Face repo id
// ("org/name") found in the hub cache (its snapshot). A GGUF file, a plain file or a missing
// path is an Error saying what -m takes.
std::string resolve_model_arg(const std::string& arg);
// $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub.
std::string hf_hub_cache_dir();

// "1,2,3" -> {1, 2, 3}; throws Error naming the flag on anything else.
std::vector<int32_t> parse_token_list(const std::string& text, const std::string& flag);

// Options every command that loads a model takes.
struct ModelFlags {
  std::string dir;
  ModelOptions options;
  int64_t ctx = 0;  // -c/--ctx-size: context length in tokens; 0 = the command's default
  bool stats = false, timing = false;
  std::string profile_in;   // --profile: read into options.experts.profile when parsed
  std::string profile_out;  // --profile-out: the run's expert usage, written by report()
  void add_to(CLI::App& cmd, bool required = true);
};

// Sampling flags (--temp, --top-k, --top-p, --min-p, --repeat-penalty, --seed); each one given
// overrides the model's generation_config.json defaults.
struct SamplingFlags {
  std::optional<float> temperature, top_p, min_p, repeat_penalty;
  std::optional<int> top_k, repeat_last_n;
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
// Fails (one line) when --profile-out was given and the model runs on a backend that does not
// count expert use (CUDA): checked right after loading, before the run.
void check_profile_out(const ModelFlags& flags, Model& model);

uint64_t peak_rss_bytes();  // VmHWM of this process

// Ctrl-C. catch_interrupts() counts presses instead of ending the process (installed without
// SA_RESTART, so a blocking read returns); with exit_on_second the second press ends it as
// usual. The generation loops poll interrupts() and stop.
void catch_interrupts(bool exit_on_second);
int interrupts();
void reset_interrupts();

}  // namespace moestream::cli
