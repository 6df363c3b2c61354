// moestream demo: generate from a small random-weight Qwen3-MoE made on first use, no download.
#include <cstdio>
#include <filesystem>

#include "cli/cli.h"
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
  CLI::App* cmd = app.add_subcommand("demo", "Generate from a small random-weight Qwen3-MoE (no download)");
  cmd->add_option("-n,--n-predict", f->n_predict, "Tokens to generate (default 64)")->check(CLI::NonNegativeNumber);
  cmd->add_option("-p,--prompt", f->prompt, "Prompt text");
  cmd->add_option("--threads", f->options.threads, "CPU threads (default: all)")->check(CLI::NonNegativeNumber);
  cmd->callback([f] {
    const std::string dir = default_cache_dir() + "/demo-qwen3-moe-v1";
    if (!std::filesystem::exists(dir + "/config.json")) {
      std::fprintf(stderr, "making a random-weight Qwen3-MoE in %s ...\n", dir.c_str());
      write_random_qwen3_moe(dir, SynthShape{}, 42);
    }
    auto model = load_model(dir, f->options);
    auto tok = Tokenizer::load(dir);
    const auto& info = model->info();
    std::fprintf(stderr,
                 "model: %s, %d layers, hidden %lld, %.1f MB of weights (random: the text is noise)\n",
                 info.model_type.c_str(), info.n_layers, (long long)info.hidden_size,
                 info.weight_bytes / 1e6);
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
    std::string rest = text.flush();
    std::printf("%s\n", rest.c_str());
    std::printf("prompt %lld tokens at %.1f tok/s; generated %zu tokens at %.1f tok/s "
                "(%.2f GB/s of weights read)\n",
                (long long)r.prompt_tokens, r.prefill_tok_per_s(), r.tokens.size(),
                r.decode_tok_per_s(), r.decode_tok_per_s() * info.active_bytes_per_token / 1e9);
  });
}

}  // namespace moestream::cli
