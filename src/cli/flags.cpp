// Command-line conventions shared by every subcommand: llama.cpp's spellings where they mean the
// same, number checks with short messages, and parse errors as one line with "did you mean".
#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>

#include "cli/cli.h"
#include "core/error.h"

namespace moestream::cli {

namespace {

// CLI11's built-in range checks print the whole double range ("not in range 0 to 1.797...e+308");
// these say what is expected in a few words.
CLI::Validator number_check(bool allow_zero) {
  return CLI::Validator(
      [allow_zero](std::string& value) -> std::string {
        errno = 0;
        char* end = nullptr;
        const double v = std::strtod(value.c_str(), &end);
        if (value.empty() || *end != '\0' || errno != 0 || !std::isfinite(v))
          return "'" + value + "' is not a number";
        if (allow_zero ? v < 0 : v <= 0)
          return "must be " + std::string(allow_zero ? ">= 0" : "> 0") + ", got " + value;
        return "";
      },
      allow_zero ? "N>=0" : "N>0");
}

int edit_distance(const std::string& a, const std::string& b) {
  std::vector<int> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = int(j);
  for (size_t i = 1; i <= a.size(); ++i) {
    int diagonal = row[0];
    row[0] = int(i);
    for (size_t j = 1; j <= b.size(); ++j) {
      const int up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] != b[j - 1])});
      diagonal = up;
    }
  }
  return row[b.size()];
}

// The closest of `names` to `word`, if close enough to be a likely typo.
std::string nearest(const std::string& word, const std::vector<std::string>& names) {
  std::string best;
  int best_distance = 1 + int(word.size()) / 3;
  for (const std::string& n : names) {
    // "--temperature" for "--temp": a spelling that is a long prefix of the word is meant.
    if (n.size() >= 5 && word.size() > n.size() && word.compare(0, n.size(), n) == 0 && best.empty()) best = n;
    const int d = edit_distance(word, n);
    if (d < best_distance || (d == best_distance && best.empty() && d <= 2)) {
      best = n;
      best_distance = d;
    }
  }
  return best;
}

// Every spelling of every option of `cmd`, with its dashes; and its subcommands' names.
std::vector<std::string> spellings(const CLI::App& cmd) {
  std::vector<std::string> names;
  for (const CLI::Option* o : cmd.get_options()) {
    for (const std::string& s : o->get_snames()) names.push_back("-" + s);
    for (const std::string& l : o->get_lnames()) names.push_back("--" + l);
  }
  for (const CLI::App* sub : cmd.get_subcommands([](const CLI::App*) { return true; }))
    names.push_back(sub->get_name());
  return names;
}

}  // namespace

const CLI::Validator kNonNegative = number_check(true);
const CLI::Validator kPositive = number_check(false);

std::vector<std::string> normalize_args(int argc, char** argv) {
  std::vector<std::string> out;
  for (int i = 0; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "-np") {
      out.push_back("--parallel");
    } else if (a == "-ngl" || a == "--n-gpu-layers" || a == "--gpu-layers") {
      // llama.cpp offloads whole layers; moestream puts every non-expert weight on the GPU and
      // caches experts there, so only "none" (0) and "all" map onto a device choice.
      if (i + 1 >= argc) fail(a, ": expects a number of layers");
      const std::string n = argv[++i];
      char* end = nullptr;
      const long long layers = std::strtoll(n.c_str(), &end, 10);
      if (n.empty() || *end != '\0' || layers < 0) fail(a, ": '", n, "' is not a number of layers");
      out.push_back("--device");
      out.push_back(layers == 0 ? "cpu" : "cuda");
    } else {
      out.push_back(a);
    }
  }
  return out;
}

std::string describe_parse_error(const CLI::App& app, const CLI::ParseError& e) {
  // The innermost subcommand that was given names the options that were possible.
  const CLI::App* cmd = &app;
  for (;;) {
    const auto subs = cmd->get_subcommands();
    if (subs.empty()) break;
    cmd = subs.front();
  }
  const std::string prefix = cmd == &app ? "" : cmd->get_name() + ": ";
  const std::string help = cmd == &app ? "moestream --help" : "moestream " + cmd->get_name() + " --help";
  // What was not understood, in command-line order: the first option-like word, else the first.
  const std::vector<std::string> left = cmd->remaining();
  std::string word;
  const bool want_option = cmd != &app;  // at the top the unknown word is usually the command
  for (const std::string& w : left)
    if (word.empty() && (w.size() > 1 && w[0] == '-') == want_option) word = w;
  if (word.empty() && !left.empty()) word = left.front();
  if (!word.empty()) {
    const std::string what = cmd == &app && word[0] != '-' ? "unknown command" : "unknown option or argument";
    std::string line = prefix + what + " '" + word + "'";
    const std::string guess = nearest(word, spellings(*cmd));
    if (!guess.empty()) line += " (did you mean " + guess + "?)";
    return line + "; see " + help;
  }
  if (cmd == &app) {
    std::string names;
    for (const CLI::App* sub : app.get_subcommands([](const CLI::App*) { return true; }))
      names += (names.empty() ? "" : ", ") + sub->get_name();
    return "give a command: " + names + " (moestream COMMAND --help for its options)";
  }
  // CLI11's other messages are already one line; name the command they belong to.
  return prefix + e.what();
}

}  // namespace moestream::cli
