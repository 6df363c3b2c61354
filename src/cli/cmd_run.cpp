// moestream run: generate text (or token ids) from a prompt.
#include <cstdio>
#include <fstream>
#include <sstream>
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
  std::string prompt, prompt_file, tokens;
  int n_predict = 128;
  bool ids = false;
};

// The prompt text of -p or -f; empty when --tokens gives ids.
std::string prompt_text(const RunFlags& f) {
  if (int(!f.prompt.empty()) + int(!f.prompt_file.empty()) + int(!f.tokens.empty()) != 1)
    fail("run: give exactly one of -p/--prompt, -f/--file and --tokens");
  if (f.prompt_file.empty()) return f.prompt;
  std::ifstream in(f.prompt_file, std::ios::binary);
  if (!in) fail(f.prompt_file, ": cannot open for reading");
  std::ostringstream ss;
  ss << in.rdbuf();
  if (ss.str().empty()) fail(f.prompt_file, ": the prompt file is empty");
  return ss.str();
}

// Positions the run needs fit the context: -c when given (a warning past the model's trained
// length), else the model's trained length.
void check_context(const RunFlags& f, const ModelInfo& info, int64_t prompt_tokens) {
  const int64_t needed = prompt_tokens + f.n_predict;
  const int64_t trained = info.max_position;
  if (f.model.ctx > 0) {
    if (trained > 0 && f.model.ctx > trained)
      std::fprintf(stderr, "warning: -c %lld is past the %lld positions the model was trained on; quality may drop there\n",
                   (long long)f.model.ctx, (long long)trained);
    if (needed > f.model.ctx)
      fail("the prompt (", prompt_tokens, " tokens) and -n ", f.n_predict, " need ", needed, " positions, more than -c ",
           f.model.ctx);
  } else if (trained > 0 && needed > trained) {
    fail("the prompt (", prompt_tokens, " tokens) and -n ", f.n_predict, " need ", needed,
         " positions, past the model's trained context of ", trained, " (max_position_embeddings); lower -n, or give -c ",
         needed, " to go past it anyway");
  }
}

void run(const RunFlags& f) {
  const std::string text_prompt = prompt_text(f);
  if (f.n_predict < 0) fail("-n: must be >= 0, got ", f.n_predict);
  const SamplingParams params = f.sampling.resolve(f.model.dir);
  std::unique_ptr<Tokenizer> tok;
  std::vector<int32_t> prompt;
  if (!text_prompt.empty()) {
    tok = Tokenizer::load(f.model.dir);
    if (tok->add_bos() && tok->bos_id()) prompt.push_back(*tok->bos_id());
    for (int32_t id : tok->encode(text_prompt)) prompt.push_back(id);
  } else {
    prompt = parse_token_list(f.tokens, "--tokens");
  }
  auto model = load_model(f.model.dir, f.model.options);
  check_profile_out(f.model, *model);
  check_context(f, model->info(), int64_t(prompt.size()));
  if (!tok && !f.ids) tok = Tokenizer::load(f.model.dir);
  // Ctrl-C ends the generation early and still prints the text and statistics; a second one
  // ends the process.
  catch_interrupts(/*exit_on_second=*/true);

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
    return interrupts() == 0;
  });
  if (text) {
    std::string rest = text->flush();
    std::fwrite(rest.data(), 1, rest.size(), stdout);
  }
  std::printf("\n");
  std::fflush(stdout);
  std::fprintf(stderr, "prompt: %lld tokens, %.1f tok/s | generated: %zu tokens, %.2f tok/s%s\n",
               (long long)r.prompt_tokens, r.prefill_tok_per_s(), r.tokens.size(),
               r.decode_tok_per_s(), r.stopped_on_eos ? " (stopped at end of sequence)" : interrupts() ? " (interrupted)" : "");
  report(f.model, *model, {r.prompt_tokens, int64_t(r.tokens.size()), r.prefill_seconds, r.decode_seconds});
}

}  // namespace

void add_run(CLI::App& app) {
  auto flags = std::make_shared<RunFlags>();
  CLI::App* cmd = app.add_subcommand("run", "Generate a continuation of a prompt");
  flags->model.add_to(*cmd);
  cmd->add_option("-p,--prompt", flags->prompt, "Prompt text");
  cmd->add_option("-f,--file", flags->prompt_file, "Read the prompt text from a file");
  cmd->add_option("--tokens", flags->tokens, "Prompt as comma-separated token ids");
  cmd->add_option("-n,--n-predict,--predict", flags->n_predict, "Tokens to generate (default 128)");
  flags->sampling.add_to(*cmd);
  cmd->add_flag("--ids", flags->ids, "Print only the generated token ids, space-separated");
  cmd->callback([flags] { run(*flags); });
}

}  // namespace moestream::cli
