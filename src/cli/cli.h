// Subcommands of the moestream CLI; each file registers one on the app.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <string>
#include <vector>

#include "models/model.h"

namespace moestream::cli {

void add_run(CLI::App& app);
void add_logits(CLI::App& app);
void add_tokenize(CLI::App& app);  // tokenize and detokenize
void add_demo(CLI::App& app);

// "1,2,3" -> {1, 2, 3}; throws Error naming the flag on anything else.
std::vector<int32_t> parse_token_list(const std::string& text, const std::string& flag);

// Options every command that loads a model takes.
struct ModelFlags {
  std::string dir;
  ModelOptions options;
  void add_to(CLI::App& cmd, bool required = true);
};

}  // namespace moestream::cli
