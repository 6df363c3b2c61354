// moestream profile: which experts a model uses on a text, as a usage profile for --profile.
//
// The text is run one token at a time (as decoding sees it), so each count is a token that chose
// the expert; the profile is written like --profile-out's (JSON counts[layer][expert]).
#include <algorithm>
#include <chrono>
#include <cstdio>

#include "cli/cli.h"
#include "core/error.h"
#include "core/files.h"
#include "text/tokenizer.h"

namespace moestream::cli {

void add_profile(CLI::App& app) {
  struct Flags {
    ModelFlags model;
    std::string file;
    int64_t max_tokens = 4096;
  };
  auto f = std::make_shared<Flags>();
  CLI::App* cmd = app.add_subcommand("profile", "Record which experts a model uses on a text (a profile for --profile)");
  f->model.add_to(*cmd);
  cmd->add_option("-f,--file", f->file, "Text file (prompts or any text)")->required();
  cmd->add_option("-o,--output", f->model.profile_out, "Where to write the profile (JSON)")->required();
  cmd->add_option("--max-tokens", f->max_tokens, "Tokens of the file to run (default 4096)")->check(kPositive);
  cmd->callback([f] {
    // Expert use is counted on the CPU backend (the CUDA tier routes on the device).
    if (f->model.options.device == "auto") f->model.options.device = "cpu";
    if (f->model.options.device != "cpu") fail("profile: --device ", f->model.options.device, ": expert use is counted on the CPU backend only (--device cpu)");
    const std::string text = read_file(f->file);
    auto tok = Tokenizer::load(ensure_pack(f->model.dir, f->model.options.cache_dir));
    std::vector<int32_t> ids = tok->encode(text);
    if (ids.empty()) fail(f->file, ": no tokens to run");
    auto model = load_model(f->model.dir, f->model.options);
    const int64_t ctx = f->model.ctx > 0 ? f->model.ctx : std::min<int64_t>(model->info().max_position > 0 ? model->info().max_position : 2048, 2048);
    ids.resize(size_t(std::min<int64_t>(int64_t(ids.size()), f->max_tokens)));
    std::vector<float> logits(size_t(model->info().vocab_size));
    auto seq = model->new_sequence(ctx);
    const auto t0 = std::chrono::steady_clock::now();
    for (size_t i = 0; i < ids.size(); ++i) {
      if (seq->n_past >= ctx) seq = model->new_sequence(ctx);  // a fresh context every ctx tokens
      model->forward(std::span(ids).subspan(i, 1), *seq, logits);
    }
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    report(f->model, *model, {int64_t(ids.size()), 0, secs, 0});
    std::fprintf(stderr, "profile of %zu tokens written to %s\n", ids.size(), f->model.profile_out.c_str());
  });
}

}  // namespace moestream::cli
