// Errors: every failure the user can cause (bad file, bad flag, bad config) is a moestream::Error
// whose message names the file, tensor, field or parameter. The CLI prints it on one line and
// exits non-zero; the server turns it into an HTTP error with a JSON body.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace moestream {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// fail("tensor ", name, ": expected shape ", a, " got ", b) throws Error with the concatenation.
template <class... Args>
[[noreturn]] void fail(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  throw Error(os.str());
}

// System-call boundary check: throws with file:line and strerror(errno).
[[noreturn]] void fail_errno(const char* what, const std::string& path, const char* file, int line);
#define MS_CHECK_SYS(cond, what, path) \
  do {                                 \
    if (!(cond)) ::moestream::fail_errno(what, path, __FILE__, __LINE__); \
  } while (0)

}  // namespace moestream
