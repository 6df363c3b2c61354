// moestream tokenize / detokenize: the model's tokenizer on its own.
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "cli/cli.h"
#include "core/error.h"
#include "core/files.h"
#include "text/tokenizer.h"

namespace moestream::cli {

void add_tokenize(CLI::App& app) {
  struct Flags {
    std::string dir, text, file, tokens;
  };
  auto f = std::make_shared<Flags>();
  CLI::App* tok = app.add_subcommand("tokenize", "Print the token ids of a text as a JSON array");
  tok->add_option("-m,--model", f->dir, "Model or tokenizer directory")->required();
  auto* text = tok->add_option("--text", f->text, "Text to tokenize");
  auto* file = tok->add_option("--file", f->file, "File whose contents to tokenize");
  text->excludes(file);
  tok->callback([f, text, file] {
    if (!*text && !*file) fail("tokenize: give --text or --file");
    std::string input = f->text;
    if (*file) input = read_file(f->file);
    auto t = Tokenizer::load(f->dir);
    std::printf("%s\n", nlohmann::json(t->encode(input)).dump().c_str());
  });

  CLI::App* detok = app.add_subcommand("detokenize", "Print the text of comma-separated token ids");
  detok->add_option("-m,--model", f->dir, "Model or tokenizer directory")->required();
  detok->add_option("--tokens", f->tokens, "Comma-separated token ids")->required();
  detok->callback([f] {
    auto t = Tokenizer::load(f->dir);
    std::vector<int32_t> ids = parse_token_list(f->tokens, "--tokens");
    for (int32_t id : ids)
      if (id >= t->vocab_size()) fail("--tokens: id ", id, " out of range [0, ", t->vocab_size(), ")");
    std::string s = t->decode(ids);
    std::fwrite(s.data(), 1, s.size(), stdout);
    std::printf("\n");
  });
}

}  // namespace moestream::cli
