#include "fuzz_util.h"

#include <fstream>
#include <sstream>
#include <typeinfo>

namespace moestream::fuzz {

void write_file(const std::string& path, std::string_view content) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(content.data(), std::streamsize(content.size()));
  if (!out) std::abort();
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    std::fprintf(stderr, "fuzz: cannot read %s (run from the repository root or set MOESTREAM_SOURCE_DIR)\n", path.c_str());
    std::abort();
  }
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

}  // namespace moestream::fuzz

namespace moestream::fuzz {

void foreign_exception(const std::exception& e) {
  static const bool strict = [] {
    const char* s = std::getenv("MOESTREAM_FUZZ_STRICT");
    return s && std::string(s) == "1";
  }();
  if (!strict) return;
  std::fprintf(stderr, "fuzz: an exception other than moestream's escaped: %s: %s\n", typeid(e).name(), e.what());
  std::abort();
}

}  // namespace moestream::fuzz
