// Helpers shared by the tests: paths and discovery of the fixtures, running the moestream binary,
// errors and temp dirs.
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <mutex>
#include <set>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "backend/cpu/kernels.h"
#include "core/error.h"
#include "io/npy.h"
#include "models/model.h"

namespace moestream::test {

// The checkout whose fixtures the tests read: $MOESTREAM_SOURCE_DIR when set (a binary built
// elsewhere, as the GPU tests are), else the one this binary was built from.
inline std::string source_dir() {
  const char* env = std::getenv("MOESTREAM_SOURCE_DIR");
  return env && *env ? env : MOESTREAM_SOURCE_DIR;
}
inline std::string fixture(const std::string& rel) { return source_dir() + "/tests/fixtures/" + rel; }

inline std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Every fixture directory with transformers reference logits (ref.json and ref_logits.npy, from
// the tools/make_*fixtures.py scripts) under tests/fixtures/models and tests/fixtures/families,
// sorted: what the parity suites (tests/parity_test.cpp, tests/gpu/fixtures_test.cpp) run on.
inline std::vector<std::string> reference_fixtures() {
  std::vector<std::string> dirs;
  for (const char* group : {"models", "families"})
    for (const auto& e : std::filesystem::directory_iterator(fixture(group)))
      if (std::filesystem::exists(e.path() / "ref.json") && std::filesystem::exists(e.path() / "ref_logits.npy"))
        dirs.push_back(e.path().string());
  std::sort(dirs.begin(), dirs.end());
  return dirs;
}

// The reference fixtures under tests/fixtures/models in a given layout ("hub": Hugging Face
// safetensors, "mlx": mlx-community quantized).
inline std::vector<std::string> model_fixtures(const std::string& layout = "hub") {
  std::vector<std::string> dirs;
  for (const std::string& dir : reference_fixtures()) {
    if (std::filesystem::path(dir).parent_path().filename() != "models") continue;
    const std::string ref = read_file(dir + "/ref.json");
    const bool mlx = ref.find("\"layout\": \"mlx\"") != std::string::npos;
    if (mlx == (layout == "mlx")) dirs.push_back(dir);
  }
  return dirs;
}

// The message of the moestream::Error that f throws; a test failure when it throws none.
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected moestream::Error";
  return "";
}

// Each of `parts` occurs in `msg`.
inline void expect_contains(const std::string& msg, const std::vector<std::string>& parts) {
  for (const auto& part : parts)
    EXPECT_NE(msg.find(part), std::string::npos) << "message: " << msg << "\nmissing: " << part;
}

// A number as "%.2e" writes it, for RecordProperty.
inline std::string sci(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2e", x);
  return buf;
}

// A new directory of its own under the temp dir (mkdtemp), named <prefix>XXXXXX.
inline std::string unique_temp_dir(const std::string& prefix) {
  std::string tmpl = (std::filesystem::temp_directory_path() / (prefix + "XXXXXX")).string();
  if (!::mkdtemp(tmpl.data())) ADD_FAILURE() << "mkdtemp " << tmpl << " failed";
  return tmpl;
}

// A test with a fresh directory of its own (dir_), removed after the test.
class TempDirTest : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = unique_temp_dir("moestream_test_"); }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  std::string path(const std::string& name) const { return dir_ + "/" + name; }
  // Writes `bytes` to path(name); returns that path.
  std::string write(const std::string& name, const std::string& bytes) const {
    const std::string p = path(name);
    std::ofstream(p, std::ios::binary) << bytes;
    return p;
  }

  std::string dir_;
};

// The directories temp_dir made in this process, removed when it exits (set
// MOESTREAM_KEEP_TEST_DIRS=1 to keep them for a look after a failure).
class TempDirRegistry {
 public:
  static TempDirRegistry& get() {
    static TempDirRegistry registry;
    return registry;
  }
  void add(const std::filesystem::path& dir) {
    std::lock_guard<std::mutex> lock(mu_);
    dirs_.insert(dir);
  }
  ~TempDirRegistry() {
    const char* keep = std::getenv("MOESTREAM_KEEP_TEST_DIRS");
    if (keep && *keep && std::string(keep) != "0") return;
    for (const auto& dir : dirs_) {
      std::error_code ec;
      std::filesystem::remove_all(dir, ec);
    }
  }

 private:
  std::mutex mu_;
  std::set<std::filesystem::path> dirs_;
};

// A fresh empty directory under the test temp dir, removed when the test process exits.
inline std::string temp_dir(const std::string& name) {
  auto dir = std::filesystem::temp_directory_path() /
             ("moestream-test-" + std::to_string(getpid()) + "-" + name);
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  TempDirRegistry::get().add(dir);
  return dir.string();
}

// A copy of the serve fixture (tests/fixtures/serve/qwen3_tiny_chat: a tiny random-weight
// Qwen3-MoE with a chat template) in a fresh temp dir, with the Qwen3 tokenizer beside it (fetched
// by scripts/setup, not committed). Returns the directory.
inline std::string tiny_chat_copy(const std::string& name) {
  const std::string d = temp_dir(name);
  for (const auto& e : std::filesystem::directory_iterator(fixture("serve/qwen3_tiny_chat")))
    std::filesystem::copy_file(e.path(), std::filesystem::path(d) / e.path().filename());
  const std::filesystem::path tok = std::filesystem::path(source_dir()) / ".cache/tokenizer-qwen3/tokenizer.json";
  if (!std::filesystem::exists(tok)) ADD_FAILURE() << tok << " is missing: run scripts/setup --test";
  else std::filesystem::copy_file(tok, std::filesystem::path(d) / "tokenizer.json");
  return d;
}

struct CliResult {
  int exit_code = -1;
  std::string out, err;
};

// Runs the moestream binary with `args` (already shell-quoted as needed): the one built beside the
// tests, or $MOESTREAM_TEST_BINARY (a command line: scripts/gpu-test runs carried binaries through
// a loader).
inline CliResult run_cli(const std::string& args) {
  const std::string err_path = temp_dir("cli") + "/stderr";
  const char* over = std::getenv("MOESTREAM_TEST_BINARY");
  const std::string bin = over && *over ? over : MOESTREAM_BINARY;
  const std::string cmd = bin + " " + args + " 2>" + err_path;
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

// Attention over `heads` query and `kv_heads` KV heads of hd dims (values of vd dims; 0 or hd: the
// same), scaled by hd^-0.5, with the model's sliding window and MLA's values in the keys.
inline AttentionParams attention_params(int heads, int kv_heads, int hd, int vd = 0, int64_t window = 0,
                                        bool values_in_keys = false) {
  AttentionParams p;
  p.n_heads = heads;
  p.n_kv_heads = kv_heads;
  p.head_dim = hd;
  p.v_head_dim = vd == hd ? 0 : vd;
  p.scale = 1.0f / std::sqrt(float(hd));
  p.sliding_window = window;
  p.values_in_keys = values_in_keys;
  return p;
}

// max|a - b| / max|b| (max|a - b| when b is all zero); infinity when a holds a NaN or Inf.
inline double relative_error(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i])) return INFINITY;  // a NaN would otherwise vanish in the max
    num = std::max(num, double(std::fabs(a[i] - b[i])));
    den = std::max(den, double(std::fabs(b[i])));
  }
  return den > 0 ? num / den : num;
}

inline std::string join(const std::vector<int32_t>& ids, const char* sep) {
  std::string s;
  for (size_t i = 0; i < ids.size(); ++i) s += (i ? sep : "") + std::to_string(ids[i]);
  return s;
}

// A fixture's ref.json and ref_logits.npy, as the tools/make_*fixtures.py scripts write them.
struct Reference {
  std::vector<int32_t> logit_tokens, prompt_tokens, greedy_tokens;
  NpyArray logits;
};

inline Reference load_reference(const std::string& dir) {
  auto j = nlohmann::json::parse(read_file(dir + "/ref.json"));
  Reference r;
  r.logit_tokens = j["logit_tokens"].get<std::vector<int32_t>>();
  r.prompt_tokens = j["prompt_tokens"].get<std::vector<int32_t>>();
  r.greedy_tokens = j["greedy_tokens"].get<std::vector<int32_t>>();
  r.logits = read_npy_f32(dir + "/ref_logits.npy");
  return r;
}

// The logits of every position of `ids` through one prefill.
inline std::vector<float> prefill_logits(Model& model, const std::vector<int32_t>& ids) {
  std::vector<float> logits(ids.size() * size_t(model.info().vocab_size));
  auto seq = model.new_sequence(int64_t(ids.size()));
  model.forward(ids, *seq, logits);
  return logits;
}

// n normal samples (mean 0, standard deviation sigma) from a fixed seed.
inline std::vector<float> gaussian(size_t n, uint32_t seed, float sigma = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, sigma);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

// The CPU kernel levels this machine runs, scalar first.
inline std::vector<cpu::KernelLevel> supported_levels() {
  std::vector<cpu::KernelLevel> out;
  for (cpu::KernelLevel l : {cpu::KernelLevel::Scalar, cpu::KernelLevel::Avx2, cpu::KernelLevel::Avx512})
    if (cpu::kernel_level_supported(l)) out.push_back(l);
  return out;
}

}  // namespace moestream::test
