#include <cstdlib>
#include <filesystem>

#include "cli/cli.h"
#include "core/error.h"

namespace moestream::cli {

std::vector<int32_t> parse_token_list(const std::string& text, const std::string& flag) {
  std::vector<int32_t> ids;
  size_t pos = 0;
  while (pos <= text.size()) {
    size_t comma = text.find(',', pos);
    if (comma == std::string::npos) comma = text.size();
    std::string item = text.substr(pos, comma - pos);
    while (!item.empty() && item.front() == ' ') item.erase(item.begin());
    while (!item.empty() && item.back() == ' ') item.pop_back();
    char* end = nullptr;
    errno = 0;
    long long v = item.empty() ? -1 : std::strtoll(item.c_str(), &end, 10);
    if (item.empty() || *end != '\0' || errno != 0 || v < 0 || v > INT32_MAX)
      fail(flag, ": '", item, "' is not a token id (expected comma-separated non-negative integers)");
    ids.push_back(int32_t(v));
    pos = comma + 1;
  }
  return ids;
}

void ModelFlags::add_to(CLI::App& cmd, bool required) {
  auto* m = cmd.add_option("-m,--model", dir, "Model directory (Hugging Face layout)");
  if (required) m->required();
  cmd.add_option("--threads", options.threads, "CPU threads (default: all hardware threads)")
      ->check(CLI::NonNegativeNumber);
  cmd.add_flag("--precise", options.precise, "Keep activations in float32 everywhere");
}

}  // namespace moestream::cli
