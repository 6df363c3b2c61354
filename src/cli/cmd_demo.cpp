// moestream demo: a synthesized Qwen3-MoE whose experts are several times the expert-cache
// budget, generating with the budget enforced, and what that took, in plain words.
#include <cstdio>
#include <filesystem>

#include "cli/cli.h"
#include "io/pack.h"
#include "models/generate.h"
#include "models/synth.h"
#include "text/tokenizer.h"

namespace moestream::cli {

void add_demo(CLI::App& app) {
  struct Flags {
    ModelOptions options;
    int n_predict = 64;
    std::string prompt = "Once upon a time";
  };
  auto f = std::make_shared<Flags>();
  CLI::App* cmd = app.add_subcommand("demo", "Stream a small random-weight Qwen3-MoE through a bounded expert cache (no download)");
  cmd->add_option("-n,--n-predict", f->n_predict, "Tokens to generate (default 64)")->check(kNonNegative);
  cmd->add_option("-p,--prompt", f->prompt, "Prompt text");
  cmd->add_option("--threads", f->options.threads, "CPU threads (default: all)")->check(kNonNegative);
  f->options.device = "auto";
  cmd->add_option("--device", f->options.device, "Where to compute: auto | cuda | cpu")
      ->check(CLI::IsMember({"auto", "cuda", "cpu"}));
  cmd->callback([f] {
    const std::string dir = default_cache_dir() + "/demo-small-v1";
    if (!is_pack_dir(dir)) {
      std::fprintf(stderr, "synthesizing a random-weight Qwen3-MoE pack in %s ...\n", dir.c_str());
      std::filesystem::create_directories(default_cache_dir());
      SynthOptions so;
      so.zipf = 1.0;
      write_synthetic_pack(dir, synth_preset("small"), so);
    }
    const PackManifest pack = PackManifest::load(dir);
    const double expert_mb = pack.total_expert_bytes() / 1e6;
    ModelOptions options = f->options;
    options.experts.cache_mb = expert_mb / 5;  // the experts are 5x the memory they may use
    auto model = load_model(dir, options);
    auto tok = Tokenizer::load(dir);
    const auto& info = model->info();
    std::printf("model: random-weight %s, %d layers, %d experts per layer, %.1f MB of experts on disk\n",
                info.model_type.c_str(), info.n_layers, pack.n_experts, expert_mb);
    std::printf("expert cache: %.1f MB (a fifth of the experts); the rest is read from disk on demand\n\n",
                options.experts.cache_mb);
    SamplingParams params;
    params.temperature = 0.8f;
    params.top_k = 40;
    params.seed = 1;
    Sampler sampler(params);
    StreamDecoder text(*tok);
    std::printf("%s", f->prompt.c_str());
    GenerationResult r = generate(*model, tok->encode(f->prompt), f->n_predict, sampler, [&](int32_t id) {
      std::string piece = text.push(id);
      std::fwrite(piece.data(), 1, piece.size(), stdout);
      std::fflush(stdout);
      return true;
    });
    std::printf("%s\n\n", text.flush().c_str());
    const ExpertStats s = model->expert_stats();
    std::printf("(random weights: the text is noise; what matters is what it took)\n");
    std::printf("speed: prompt of %lld tokens at %.1f tok/s, %zu tokens generated at %.1f tok/s\n",
                (long long)r.prompt_tokens, r.prefill_tok_per_s(), r.tokens.size(), r.decode_tok_per_s());
    std::printf("experts: %llu of %llu expert uses were already in memory (hit rate %.0f%%); "
                "%llu were read from disk, %.1f MB at %.2f GB/s while reading\n",
                (unsigned long long)s.hits, (unsigned long long)(s.hits + s.misses), 100 * s.hit_rate(),
                (unsigned long long)s.misses, s.bytes_read / 1e6, s.read_gb_per_s());
    std::printf("memory: %.1f MB held for experts (budget %.1f MB) against %.1f MB of experts in the "
                "model; peak resident memory of the process %.1f MB\n",
                s.cache_bytes / 1e6, s.budget_bytes / 1e6, expert_mb, peak_rss_bytes() / 1e6);
  });
}

}  // namespace moestream::cli
