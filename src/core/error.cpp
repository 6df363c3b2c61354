#include "core/error.h"

#include <cerrno>
#include <cstdlib>
#include <cstring>

namespace moestream {

// The source location helps a developer, not a user: it is shown only with MOESTREAM_DEBUG set.
void fail_errno(const char* what, const std::string& path, const char* file, int line) {
  int e = errno;
  if (const char* debug = std::getenv("MOESTREAM_DEBUG"); debug && *debug && *debug != '0')
    fail(path, ": ", what, " failed: ", std::strerror(e), " (", file, ":", line, ")");
  fail(path, ": ", what, " failed: ", std::strerror(e));
}

}  // namespace moestream
