// moestream: run Mixture-of-Experts language models larger than the machine.
#include <cstdio>
#include <string>
#include <vector>

#include "cli/cli.h"
#include "core/error.h"

int main(int argc, char** argv) {
  CLI::App app{"moestream: Mixture-of-Experts inference with expert streaming", "moestream"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "moestream 0.1.0");
  moestream::cli::add_run(app);
  moestream::cli::add_logits(app);
  moestream::cli::add_tokenize(app);
  moestream::cli::add_demo(app);
  moestream::cli::add_pack(app);
  moestream::cli::add_synth(app);
  moestream::cli::add_verify(app);
  moestream::cli::add_bench(app);
  moestream::cli::add_perplexity(app);
  moestream::cli::add_profile(app);
  moestream::cli::add_template(app);
  moestream::cli::add_serve(app);
  moestream::cli::add_chat(app);
  moestream::cli::add_list(app);
  moestream::cli::add_cache(app);
  try {
    const std::vector<std::string> args = moestream::cli::normalize_args(argc, argv);
    std::vector<const char*> ptrs;
    for (const std::string& a : args) ptrs.push_back(a.c_str());
    app.parse(int(ptrs.size()), ptrs.data());
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help, --version
    std::fprintf(stderr, "moestream: error: %s\n", moestream::cli::describe_parse_error(app, e).c_str());
    return e.get_exit_code();
  } catch (const moestream::Error& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "moestream: error: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "moestream: internal error: %s\n", e.what());
    return 2;
  }
  return 0;
}
