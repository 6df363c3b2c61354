#include "core/error.h"

#include <cerrno>
#include <cstring>

namespace moestream {

void fail_errno(const char* what, const std::string& path, const char* file, int line) {
  int e = errno;
  fail(path, ": ", what, " failed: ", std::strerror(e), " (", file, ":", line, ")");
}

}  // namespace moestream
