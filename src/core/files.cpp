#include "core/files.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "core/error.h"

namespace moestream {

namespace {

// The file's bytes, or nullopt with errno's reason in `why` (a directory fails at the read).
std::optional<std::string> read(const std::string& path, std::string& why) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    why = std::strerror(errno);
    return std::nullopt;
  }
  std::string bytes;
  char buf[1 << 16];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      why = std::strerror(errno);
      ::close(fd);
      return std::nullopt;
    }
    if (n == 0) break;
    bytes.append(buf, size_t(n));
  }
  ::close(fd);
  return bytes;
}

}  // namespace

std::optional<std::string> try_read_file(const std::string& path) {
  std::string why;
  return read(path, why);
}

std::string read_file(const std::string& path) {
  std::string why;
  std::optional<std::string> bytes = read(path, why);
  if (!bytes) fail(path, ": cannot open for reading: ", why);
  return std::move(*bytes);
}

double memory_available() {
  const std::optional<std::string> info = try_read_file("/proc/meminfo");
  if (!info) return 0;
  const size_t at = info->find("MemAvailable:");
  if (at == std::string::npos) return 0;
  return std::strtod(info->c_str() + at + 13, nullptr) * 1024.0;  // "MemAvailable:  N kB"
}

}  // namespace moestream
