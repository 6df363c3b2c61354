// moestream run: generate text (or token ids) from a prompt.
#include <cstdio>
#include <optional>

#include "cli/cli.h"
#include "core/error.h"
#include "models/generate.h"
#include "text/tokenizer.h"

namespace moestream::cli {

namespace {

struct RunFlags {
  ModelFlags model;
  SamplingFlags sampling;
  std::string prompt, tokens;
  int n_predict = 128;
  bool ids = false;
};

void run(const RunFlags& f) {
  if (f.prompt.empty() == f.tokens.empty()) fail("run: give exactly one of -p/--prompt and --tokens");
  if (f.n_predict < 0) fail("-n: must be >= 0, got ", f.n_predict);
  const SamplingParams params = f.sampling.resolve(f.model.dir);
  std::unique_ptr<Tokenizer> tok;
  std::vector<int32_t> prompt;
  if (!f.prompt.empty()) {
    tok = Tokenizer::load(f.model.dir);
    if (tok->add_bos() && tok->bos_id()) prompt.push_back(*tok->bos_id());
    for (int32_t id : tok->encode(f.prompt)) prompt.push_back(id);
  } else {
    prompt = parse_token_list(f.tokens, "--tokens");
  }
  auto model = load_model(f.model.dir, f.model.options);
  if (!tok && !f.ids) tok = Tokenizer::load(f.model.dir);

  Sampler sampler(params);
  std::optional<StreamDecoder> text;
  if (!f.ids) text.emplace(*tok);
  bool first = true;
  GenerationResult r = generate(*model, prompt, f.n_predict, sampler, [&](int32_t id) {
    if (f.ids) {
      std::printf(first ? "%d" : " %d", id);
    } else {
      std::string piece = text->push(id);
      std::fwrite(piece.data(), 1, piece.size(), stdout);
    }
    first = false;
    std::fflush(stdout);
    return true;
  });
  if (text) {
    std::string rest = text->flush();
    std::fwrite(rest.data(), 1, rest.size(), stdout);
  }
  std::printf("\n");
  std::fflush(stdout);
  std::fprintf(stderr, "prompt: %lld tokens, %.1f tok/s | generated: %zu tokens, %.2f tok/s%s\n",
               (long long)r.prompt_tokens, r.prefill_tok_per_s(), r.tokens.size(),
               r.decode_tok_per_s(), r.stopped_on_eos ? " (stopped at end of sequence)" : "");
  report(f.model, *model, {r.prompt_tokens, int64_t(r.tokens.size()), r.prefill_seconds, r.decode_seconds});
}

}  // namespace

void add_run(CLI::App& app) {
  auto flags = std::make_shared<RunFlags>();
  CLI::App* cmd = app.add_subcommand("run", "Generate a continuation of a prompt");
  flags->model.add_to(*cmd);
  cmd->add_option("-p,--prompt", flags->prompt, "Prompt text");
  cmd->add_option("--tokens", flags->tokens, "Prompt as comma-separated token ids");
  cmd->add_option("-n,--n-predict", flags->n_predict, "Tokens to generate (default 128)");
  flags->sampling.add_to(*cmd);
  cmd->add_flag("--ids", flags->ids, "Print only the generated token ids, space-separated");
  cmd->callback([flags] { run(*flags); });
}

}  // namespace moestream::cli
