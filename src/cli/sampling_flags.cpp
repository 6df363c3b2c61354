// The sampling flags shared by run and chat.
#include "cli/cli.h"
#include "io/hf_config.h"
#include "server/generation.h"

namespace moestream::cli {

void SamplingFlags::add_to(CLI::App& cmd) {
  cmd.add_option("--temp", temperature, "Temperature; 0 = greedy (default: generation_config.json, else greedy)");
  cmd.add_option("--top-k", top_k, "Keep the k most likely tokens (0 = off)");
  cmd.add_option("--top-p", top_p, "Nucleus sampling threshold");
  cmd.add_option("--min-p", min_p, "Drop tokens below min-p times the best probability");
  cmd.add_option("--repeat-penalty", repeat_penalty, "Repetition penalty (1 = off)");
  cmd.add_option("--repeat-last-n", repeat_last_n,
                 "Tokens of the context the repetition penalty looks at (-1 = all, the default; 0 = none)")
      ->check(CLI::Range(-1, 1 << 30));
  cmd.add_option("-s,--seed", seed, "Random seed for sampling (default 0)");
}

SamplingParams SamplingFlags::resolve(const std::string& model_dir) const {
  const HfConfig config = HfConfig::load(model_dir + "/config.json").text();
  SamplingParams p = sampling_defaults(load_generation_defaults(model_dir, config));
  if (temperature) p.temperature = *temperature;
  if (top_k) p.top_k = *top_k;
  if (top_p) p.top_p = *top_p;
  if (min_p) p.min_p = *min_p;
  if (repeat_penalty) p.repetition_penalty = *repeat_penalty;
  if (repeat_last_n) p.repeat_last_n = *repeat_last_n;
  p.seed = seed;
  validate(p);
  return p;
}

}  // namespace moestream::cli
