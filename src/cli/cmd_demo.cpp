// moestream demo: the small trained model shipped in the repository (models/pystd-moe-20m-q4, a
// Qwen3.5-MoE trained on the Python standard library) generating Python and answering one chat
// turn with its experts held to a fraction of their size, and what that took, in plain words.
// --synthetic keeps the earlier demo: a random-weight Qwen3-MoE synthesized into the cache.
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "cli/cli.h"
#include "core/error.h"
#include "io/pack.h"
#include "models/generate.h"
#include "models/synth.h"
#include "text/chat_template.h"
#include "text/tokenizer.h"

namespace moestream::cli {

namespace {

constexpr const char* kDefaultPrompt = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n";

namespace fs = std::filesystem;

constexpr const char* kDemoModel = "pystd-moe-20m-q4";

// models/<kDemoModel> of the source tree: beside the binary's directory (build/moestream), beside
// the binary, or under the current directory.
std::string find_demo_model() {
  std::vector<fs::path> roots;
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) roots = {exe.parent_path().parent_path(), exe.parent_path(), exe.parent_path().parent_path().parent_path()};
  roots.push_back(fs::current_path(ec));
  for (const fs::path& root : roots) {
    const fs::path dir = root / "models" / kDemoModel;
    if (fs::exists(dir / "config.json", ec)) return dir.lexically_normal().string();
  }
  fail("the demo model models/", kDemoModel, " was not found beside the moestream binary or in the current "
       "directory; pass -m DIR, or --synthetic for a random-weight model");
}

struct Part {
  GenerationResult result;
  std::string title;
};

// Streams one generation to stdout.
GenerationResult stream(Model& model, const Tokenizer& tok, const std::vector<int32_t>& prompt, int n,
                        const SamplingParams& params) {
  Sampler sampler(params);
  StreamDecoder text(tok);
  GenerationResult r = generate(model, prompt, n, sampler, [&](int32_t id) {
    std::string piece = text.push(id);
    std::fwrite(piece.data(), 1, piece.size(), stdout);
    std::fflush(stdout);
    return true;
  });
  std::printf("%s\n", text.flush().c_str());
  return r;
}

void print_stats(Model& model, const std::vector<Part>& parts, double expert_mb) {
  for (const Part& p : parts)
    std::printf("speed (%s): prompt of %lld tokens at %.1f tok/s, %zu tokens generated at %.1f tok/s\n",
                p.title.c_str(), (long long)p.result.prompt_tokens, p.result.prefill_tok_per_s(),
                p.result.tokens.size(), p.result.decode_tok_per_s());
  const ExpertStats s = model.expert_stats();
  std::printf("experts: %llu of %llu expert uses were already in memory (hit rate %.0f%%); "
              "%llu were read from disk, %.1f MB at %.2f GB/s while reading\n",
              (unsigned long long)s.hits, (unsigned long long)(s.hits + s.misses), 100 * s.hit_rate(),
              (unsigned long long)s.misses, s.bytes_read / 1e6, s.read_gb_per_s());
  std::printf("memory: %.1f MB held for experts (budget %.1f MB) against %.1f MB of experts in the "
              "model; peak resident memory of the process %.1f MB\n",
              s.cache_bytes / 1e6, s.budget_bytes / 1e6, expert_mb, peak_rss_bytes() / 1e6);
  std::printf("(a miss reads the expert's bytes from the pack on disk, or from the page cache when the "
              "OS still holds them; a larger --expert-cache-mb raises the hit rate)\n");
}

void run_synthetic(const ModelOptions& base, int n_predict, const std::string& prompt) {
  const std::string dir = default_cache_dir() + "/demo-small-v2";
  if (!is_pack_dir(dir)) {
    std::fprintf(stderr, "synthesizing a random-weight Qwen3-MoE pack in %s ...\n", dir.c_str());
    fs::create_directories(default_cache_dir());
    SynthOptions so;
    so.zipf = 1.0;
    write_synthetic_pack(dir, synth_preset("small"), so);
  }
  const PackManifest pack = PackManifest::load(dir);
  const double expert_mb = pack.total_expert_bytes() / 1e6;
  ModelOptions options = base;
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
  std::printf("%s", prompt.c_str());
  Part p{stream(*model, *tok, tok->encode(prompt), n_predict, params), "text"};
  std::printf("\n(random weights: the text is noise; what matters is what it took)\n");
  print_stats(*model, {p}, expert_mb);
}

}  // namespace

void add_demo(CLI::App& app) {
  struct Flags {
    ModelOptions options;
    std::string dir;
    int n_predict = 120;
    // With the docstring the model writes a body; after a bare signature it tends to ramble on
    // in a docstring of its own.
    std::string prompt = kDefaultPrompt;
    std::string chat = "Close the file.";
    double budget_fraction = 0.3;
    bool synthetic = false;
    uint64_t seed = 1;
  };
  auto f = std::make_shared<Flags>();
  CLI::App* cmd = app.add_subcommand(
      "demo", "Stream the small trained MoE shipped in models/ through a bounded expert cache (no download)");
  cmd->add_option("-m,--model", f->dir, std::string("Model directory (default: models/") + kDemoModel + " of the source tree)");
  cmd->add_option("-n,--n-predict", f->n_predict, "Tokens to generate per part (default 120)")->check(kNonNegative);
  cmd->add_option("-p,--prompt", f->prompt, "Code to continue (default: def fibonacci(n): and its docstring)");
  cmd->add_option("--chat", f->chat, "The user's message of the chat turn (empty: no chat turn)");
  cmd->add_option("--expert-cache-mb", f->options.experts.cache_mb,
                  "Memory for expert weights in MB (default: 30% of the model's experts)")
      ->check(kNonNegative);
  cmd->add_option("--seed", f->seed, "Sampling seed (default 1)");
  cmd->add_option("--threads", f->options.threads, "CPU threads (default: all)")->check(kNonNegative);
  f->options.device = "auto";
  cmd->add_option("--device", f->options.device, "Where to compute: auto | cuda | cpu")
      ->check(CLI::IsMember({"auto", "cuda", "cpu"}));
  cmd->add_flag("--synthetic", f->synthetic, "The earlier demo: a random-weight Qwen3-MoE synthesized into the cache");
  cmd->callback([f] {
    if (f->synthetic)
      return run_synthetic(f->options, f->n_predict, f->prompt == kDefaultPrompt ? "Once upon a time" : f->prompt);
    const std::string dir = f->dir.empty() ? find_demo_model() : f->dir;
    fs::path name = fs::path(dir).lexically_normal();
    if (name.filename().empty()) name = name.parent_path();  // "models/x/"
    const std::string pack_dir = ensure_pack(dir, f->options.cache_dir);
    const PackManifest pack = PackManifest::load(pack_dir);
    const double expert_mb = pack.total_expert_bytes() / 1e6;
    ModelOptions options = f->options;
    if (options.experts.cache_mb <= 0) options.experts.cache_mb = expert_mb * f->budget_fraction;
    auto model = load_model(dir, options);
    auto tok = Tokenizer::load(pack_dir);
    const auto& info = model->info();
    std::printf("model: %s (%s: %d layers, %d experts per layer, %.1f MB of experts on disk), a small "
                "model trained on the Python standard library; expect plausible-looking Python, not "
                "correct programs\n",
                name.filename().c_str(), info.model_type.c_str(), info.n_layers, pack.n_experts, expert_mb);
    std::printf("expert cache: %.1f MB (%.0f%% of the experts); the rest is read from disk on demand\n\n",
                options.experts.cache_mb, 100 * options.experts.cache_mb / expert_mb);
    SamplingParams params;
    params.temperature = 0.6f;
    params.top_k = 20;
    params.top_p = 0.95f;
    params.repetition_penalty = 1.1f;
    params.seed = f->seed;
    std::vector<Part> parts;
    std::printf("--- code completion ---\n%s", f->prompt.c_str());
    parts.push_back({stream(*model, *tok, tok->encode(f->prompt), f->n_predict, params), "completion"});
    if (!f->chat.empty()) {
      const ChatTemplate chat = ChatTemplate::load(pack_dir);
      const nlohmann::ordered_json messages = {{{"role", "user"}, {"content", f->chat}}};
      const std::string prompt = chat.render(messages, nullptr, true, nlohmann::ordered_json::object());
      std::printf("\n--- chat ---\nuser: %s\nassistant: ", f->chat.c_str());
      parts.push_back({stream(*model, *tok, tok->encode(prompt), f->n_predict, params), "chat"});
    }
    std::printf("\n");
    print_stats(*model, parts, expert_mb);
  });
}

}  // namespace moestream::cli
