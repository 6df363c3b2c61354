// moestream verify: check a whole pack (manifest, every resident tensor, every expert) against
// its checksums and print one line per problem.
#include <cstdio>

#include "cli/cli.h"
#include "core/error.h"
#include "io/pack.h"

namespace moestream::cli {

void add_verify(CLI::App& app) {
  auto dir = std::make_shared<std::string>();
  CLI::App* cmd = app.add_subcommand("verify", "Check a pack's manifest, resident weights and experts against their checksums");
  cmd->add_option("DIR", *dir, "Pack directory")->required();
  cmd->callback([dir] {
    const PackCheck check = verify_pack(*dir);
    for (const std::string& problem : check.problems) std::printf("%s\n", problem.c_str());
    if (!check.problems.empty())
      fail(*dir, ": ", check.problems.size(), check.problems.size() == 1 ? " problem" : " problems", " found");
    std::printf("ok: manifest, %lld tensors (%.1f MB) and %lld experts (%.1f MB) checked\n",
                (long long)check.tensors, check.tensor_bytes / 1e6, (long long)check.experts,
                check.expert_bytes / 1e6);
  });
}

}  // namespace moestream::cli
