// moestream logits: the logits at every position of a token sequence, as float32 .npy.
#include <chrono>
#include <cstdio>

#include "cli/cli.h"
#include "core/error.h"
#include "io/npy.h"

namespace moestream::cli {

void add_logits(CLI::App& app) {
  struct Flags {
    ModelFlags model;
    std::string tokens, out;
  };
  auto f = std::make_shared<Flags>();
  CLI::App* cmd = app.add_subcommand("logits", "Write the logits of every position to a .npy file");
  f->model.add_to(*cmd);
  cmd->add_option("--tokens", f->tokens, "Comma-separated token ids")->required();
  cmd->add_option("-o,--output", f->out, "Output .npy file, float32 [n_tokens, vocab]")->required();
  cmd->callback([f] {
    const std::vector<int32_t> ids = parse_token_list(f->tokens, "--tokens");
    auto model = load_model(f->model.dir, f->model.options);
    check_profile_out(f->model, *model);
    const int64_t vocab = model->info().vocab_size;
    std::vector<float> logits(ids.size() * size_t(vocab));
    auto state = model->new_sequence(int64_t(ids.size()));
    auto t0 = std::chrono::steady_clock::now();
    model->forward(ids, *state, logits);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    write_npy_f32(f->out, logits.data(), {int64_t(ids.size()), vocab});
    std::fprintf(stderr, "wrote %s: [%zu, %lld]\n", f->out.c_str(), ids.size(), (long long)vocab);
    report(f->model, *model, {int64_t(ids.size()), 0, seconds, 0});
  });
}

}  // namespace moestream::cli
