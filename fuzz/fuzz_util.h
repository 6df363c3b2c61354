// What the fuzz targets share: where the repository's fixtures are, inputs that the code under
// test can only read from a path (a memfd, or a file in a private temporary directory), and
// splitting one input into several parts.
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

namespace moestream::fuzz {

// The repository root: $MOESTREAM_SOURCE_DIR, else the one this was built from, else the current
// directory (so a prebuilt build-fuzz/ works from the root of another checkout).
inline std::string source_dir() {
  if (const char* env = std::getenv("MOESTREAM_SOURCE_DIR")) return env;
  if (std::filesystem::exists(MOESTREAM_SOURCE_DIR "/tests/fixtures")) return MOESTREAM_SOURCE_DIR;
  return ".";
}

// An anonymous in-memory file, reachable by path as /proc/self/fd/N; rewritten for every input.
class MemFile {
 public:
  MemFile() : fd_(memfd_create("moestream-fuzz", 0)) {
    if (fd_ < 0) std::abort();
  }
  ~MemFile() { close(fd_); }
  const std::string& set(const uint8_t* data, size_t size) {
    if (ftruncate(fd_, 0) != 0) std::abort();
    size_t done = 0;
    while (done < size) {
      const ssize_t n = pwrite(fd_, data + done, size - done, off_t(done));
      if (n <= 0) std::abort();
      done += size_t(n);
    }
    return path_;
  }
  const std::string& set(std::string_view s) { return set(reinterpret_cast<const uint8_t*>(s.data()), s.size()); }

 private:
  int fd_;
  std::string path_ = "/proc/self/fd/" + std::to_string(fd_);
};

// A temporary directory (on /dev/shm when there is one), removed at exit, for code that reads
// fixed file names from a directory.
class TempDir {
 public:
  TempDir() {
    std::string base = std::filesystem::is_directory("/dev/shm") ? "/dev/shm" : std::filesystem::temp_directory_path().string();
    std::string tmpl = base + "/moestream-fuzz-XXXXXX";
    if (!mkdtemp(tmpl.data())) std::abort();
    path_ = tmpl;
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

void write_file(const std::string& path, std::string_view content);
std::string read_file(const std::string& path);

// The parts of an input separated by NUL bytes (at most max_parts; the last one keeps any further
// NULs). JSON and Jinja sources never hold a raw NUL, so seeds can be "file\0text".
inline std::vector<std::string_view> split_input(const uint8_t* data, size_t size, size_t max_parts) {
  std::vector<std::string_view> parts;
  std::string_view rest(reinterpret_cast<const char*>(data), size);
  while (parts.size() + 1 < max_parts) {
    const size_t nul = rest.find('\0');
    if (nul == std::string_view::npos) break;
    parts.push_back(rest.substr(0, nul));
    rest.remove_prefix(nul + 1);
  }
  parts.push_back(rest);
  return parts;
}

}  // namespace moestream::fuzz

// Runs one input through `body`. An Error (moestream's own exception: a clear one-line message) is
// the expected answer to bad input. Any other exception is tolerated too unless
// MOESTREAM_FUZZ_STRICT=1, when it aborts as a finding: the project wants bad input answered with
// a message naming the file or field, not a library's (nlohmann's "[json.exception...]", std::stoi's).
#define MOESTREAM_FUZZ_GUARD(ExpectedError, ...)                         \
  do {                                                                    \
    try {                                                                 \
      __VA_ARGS__;                                                        \
    } catch (const ExpectedError&) {                                      \
    } catch (const std::exception& e) {                                   \
      ::moestream::fuzz::foreign_exception(e);                            \
    }                                                                     \
  } while (0)

namespace moestream::fuzz {
void foreign_exception(const std::exception& e);
}  // namespace moestream::fuzz
