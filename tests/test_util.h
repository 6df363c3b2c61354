// Helpers shared by the tests: paths of the fixtures and running the moestream binary.
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace moestream::test {

inline std::string source_dir() { return MOESTREAM_SOURCE_DIR; }
inline std::string fixture(const std::string& rel) { return source_dir() + "/tests/fixtures/" + rel; }

inline std::string read_file(const std::string& path);

// Fixture directories under tests/fixtures/models with reference logits, in a given layout
// ("hub": Hugging Face safetensors, "mlx": mlx-community quantized).
inline std::vector<std::string> model_fixtures(const std::string& layout = "hub") {
  std::vector<std::string> dirs;
  for (const auto& e : std::filesystem::directory_iterator(fixture("models"))) {
    if (!std::filesystem::exists(e.path() / "ref_logits.npy")) continue;
    const std::string ref = read_file((e.path() / "ref.json").string());
    const bool mlx = ref.find("\"layout\": \"mlx\"") != std::string::npos;
    if (mlx == (layout == "mlx")) dirs.push_back(e.path().string());
  }
  std::sort(dirs.begin(), dirs.end());
  return dirs;
}

inline std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// A fresh empty directory under the test temp dir.
inline std::string temp_dir(const std::string& name) {
  auto dir = std::filesystem::temp_directory_path() /
             ("moestream-test-" + std::to_string(getpid()) + "-" + name);
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir.string();
}

struct CliResult {
  int exit_code = -1;
  std::string out, err;
};

// Runs the moestream binary with `args` (already shell-quoted as needed).
inline CliResult run_cli(const std::string& args) {
  const std::string err_path = temp_dir("cli") + "/stderr";
  const std::string cmd = std::string(MOESTREAM_BINARY) + " " + args + " 2>" + err_path;
  CliResult r;
  FILE* p = popen(cmd.c_str(), "r");
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) r.out.append(buf, n);
  int status = pclose(p);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.err = read_file(err_path);
  return r;
}

}  // namespace moestream::test
