// Clean-up of test::temp_dir's directories (moestream-test-<pid>-<name>) that a killed test
// process left. TempDirRegistry removes a process's directories in a static destructor, which a
// process ended by a signal never runs (a CI timeout's kill, the OOM killer, a crash): one killed
// sanitizer run left 215 in /tmp. So each test process, as it starts, removes the directories of
// processes that are gone; those of processes still running (tests of other checkouts sharing
// /tmp) are kept. MOESTREAM_KEEP_TEST_DIRS=1 keeps them all, as it keeps the registry's.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <string>

#include "test_util.h"

namespace moestream {
namespace {

namespace fs = std::filesystem;

void remove_dead_processes_temp_dirs(const fs::path& base) {
  const std::string prefix = "moestream-test-";
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(base, ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind(prefix, 0) != 0) continue;
    const size_t dash = name.find('-', prefix.size());
    if (dash == std::string::npos) continue;
    const std::string pid = name.substr(prefix.size(), dash - prefix.size());
    if (pid.empty() || pid.size() > 9 || !std::all_of(pid.begin(), pid.end(), [](char c) { return c >= '0' && c <= '9'; }))
      continue;
    if (::kill(pid_t(std::stol(pid)), 0) == 0 || errno != ESRCH) continue;  // alive, or not ours to judge
    std::error_code rm;
    fs::remove_all(e.path(), rm);
  }
}

// At start-up, before any test makes a directory.
const bool swept = [] {
  const char* keep = std::getenv("MOESTREAM_KEEP_TEST_DIRS");
  if (keep && *keep && std::string(keep) != "0") return false;
  std::error_code ec;
  const fs::path tmp = fs::temp_directory_path(ec);
  if (!ec) remove_dead_processes_temp_dirs(tmp);
  return true;
}();

TEST(TestTempDirs, DirectoriesOfDeadProcessesAreRemoved) {
  const fs::path base = test::unique_temp_dir("moestream_tempdirs_");
  // A pid that has surely ended: a child that exited and was waited for.
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) _exit(0);
  ASSERT_EQ(waitpid(child, nullptr, 0), child);
  const fs::path dead = base / ("moestream-test-" + std::to_string(child) + "-killed-run");
  const fs::path alive = base / ("moestream-test-" + std::to_string(getpid()) + "-running");
  const fs::path other = base / "moestream-test-notapid-x";
  for (const auto& d : {dead, alive, other}) fs::create_directories(d / "sub");
  remove_dead_processes_temp_dirs(base);
  EXPECT_FALSE(fs::exists(dead));
  EXPECT_TRUE(fs::exists(alive / "sub"));
  EXPECT_TRUE(fs::exists(other));
  fs::remove_all(base);
}

// The sweep ran when this process started (it is what removes the leftovers in /tmp).
TEST(TestTempDirs, TheSweepRunsAtStartUp) {
  const char* keep = std::getenv("MOESTREAM_KEEP_TEST_DIRS");
  EXPECT_EQ(swept, !(keep && *keep && std::string(keep) != "0"));
}

}  // namespace
}  // namespace moestream
