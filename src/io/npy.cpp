#include "io/npy.h"

#include <fcntl.h>
#include <unistd.h>

#include <bit>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <limits>
#include <optional>

#include "core/error.h"
#include "core/files.h"
#include "core/tensor.h"

namespace moestream {

static_assert(std::endian::native == std::endian::little,
              "npy I/O copies '<f4' data as is; a big-endian host would need byte swaps");

namespace {

constexpr char kMagic[] = "\x93NUMPY";  // 6 bytes, then major and minor version
constexpr size_t kMagicLen = 6;

std::optional<uint64_t> element_count(const std::vector<int64_t>& shape) {
  uint64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0) return std::nullopt;
    if (d != 0 && n > std::numeric_limits<uint64_t>::max() / 8 / uint64_t(d)) return std::nullopt;
    n *= uint64_t(d);
  }
  return n;
}

// Python tuple spelling, as numpy writes it: (), (3,), (2, 3).
std::string tuple_str(const std::vector<int64_t>& shape) {
  std::string s = "(";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + (shape.size() == 1 ? ",)" : ")");
}

// The header dict: a Python literal with string keys and values that are strings, booleans or
// tuples of integers. Only what numpy writes is accepted.
struct HeaderParser {
  const std::string& s;
  const std::string& path;
  size_t i = 0;

  [[noreturn]] void bad(const std::string& what) {
    fail(path, ": malformed npy header (", what, " at offset ", i, "): ", s);
  }
  void skip_ws() {
    while (i < s.size() && std::isspace(static_cast<unsigned char>(s[i]))) ++i;
  }
  bool eat(char c) {
    skip_ws();
    if (i < s.size() && s[i] == c) return ++i, true;
    return false;
  }
  void expect(char c) {
    if (!eat(c)) bad(std::string("expected '") + c + "'");
  }
  bool at_string() {
    skip_ws();
    return i < s.size() && (s[i] == '\'' || s[i] == '"');
  }
  std::string string() {
    if (!at_string()) bad("expected a string");
    char q = s[i++];
    size_t end = s.find(q, i);
    if (end == std::string::npos) bad("unterminated string");
    std::string out = s.substr(i, end - i);
    i = end + 1;
    return out;
  }
  bool word(const char* w) {
    skip_ws();
    size_t n = std::strlen(w);
    if (s.compare(i, n, w) != 0) return false;
    i += n;
    return true;
  }
  bool boolean() {
    if (word("True")) return true;
    if (word("False")) return false;
    bad("expected True or False");
  }
  std::vector<int64_t> tuple() {
    expect('(');
    std::vector<int64_t> out;
    while (!eat(')')) {
      skip_ws();
      size_t start = i;
      while (i < s.size() && std::isdigit(static_cast<unsigned char>(s[i]))) ++i;
      if (i == start) bad("expected a dimension");
      if (i - start > 18) bad("dimension too large");
      out.push_back(std::stoll(s.substr(start, i - start)));
      if (i < s.size() && s[i] == 'L') ++i;  // written by numpy under Python 2
      if (!eat(',')) {
        expect(')');
        break;
      }
    }
    return out;
  }
};

}  // namespace

void write_npy_f32(const std::string& path, const float* data, const std::vector<int64_t>& shape) {
  std::optional<uint64_t> numel = element_count(shape);
  if (!numel) fail(path, ": invalid shape ", shape_str(shape), " for npy");
  if (*numel > 0 && data == nullptr) fail(path, ": data is null");

  std::string header =
      "{'descr': '<f4', 'fortran_order': False, 'shape': " + tuple_str(shape) + ", }";
  size_t total = kMagicLen + 2 + 2 + header.size() + 1;  // + '\n'
  header.append((64 - total % 64) % 64, ' ');
  header += '\n';
  if (header.size() > 0xffff) fail(path, ": npy header of ", header.size(), " bytes is too long");

  std::string prefix(kMagic, kMagicLen);
  prefix += '\x01';
  prefix += '\x00';
  prefix += char(header.size() & 0xff);
  prefix += char(header.size() >> 8);
  prefix += header;

  const std::string tmp = path + ".tmp-" + std::to_string(::getpid());
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail(path, ": cannot create ", tmp, ": ", std::strerror(errno));
  auto abandon = [&](const char* what) {
    int e = errno;
    if (fd >= 0) ::close(fd);
    ::unlink(tmp.c_str());
    fail(path, ": ", what, " of ", tmp, " failed: ", std::strerror(e));
  };
  auto write_all = [&](const void* p, size_t n) {
    const char* c = static_cast<const char*>(p);
    while (n > 0) {
      ssize_t w = ::write(fd, c, n);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) abandon("write");
      c += w;
      n -= size_t(w);
    }
  };
  write_all(prefix.data(), prefix.size());
  write_all(data, size_t(*numel) * sizeof(float));
  int rc = ::close(fd);
  fd = -1;
  if (rc != 0) abandon("close");
  if (::rename(tmp.c_str(), path.c_str()) != 0) abandon("rename");
}

NpyArray read_npy_f32(const std::string& path) {
  const std::string bytes = read_file(path);
  if (bytes.size() < kMagicLen + 4 || bytes.compare(0, kMagicLen, kMagic, kMagicLen) != 0)
    fail(path, ": not an npy file (missing \\x93NUMPY magic)");
  const int major = static_cast<unsigned char>(bytes[6]);
  const auto byte = [&](size_t k) { return uint64_t(static_cast<unsigned char>(bytes[k])); };
  size_t header_start, header_len;
  if (major == 1) {
    header_start = 10;
    header_len = size_t(byte(8) | byte(9) << 8);
  } else if (major == 2 || major == 3) {
    if (bytes.size() < 12) fail(path, ": truncated npy header");
    header_start = 12;
    header_len = size_t(byte(8) | byte(9) << 8 | byte(10) << 16 | byte(11) << 24);
  } else {
    fail(path, ": unsupported npy version ", major, ".", int(static_cast<unsigned char>(bytes[7])));
  }
  if (header_len > bytes.size() - header_start)
    fail(path, ": truncated npy header (", header_len, " bytes announced, ",
         bytes.size() - header_start, " present)");
  const std::string header = bytes.substr(header_start, header_len);

  HeaderParser p{header, path};
  std::optional<std::string> descr;
  std::optional<bool> fortran;
  std::optional<std::vector<int64_t>> shape;
  p.expect('{');
  while (!p.eat('}')) {
    std::string key = p.string();
    p.expect(':');
    if (key == "descr") {
      descr = p.string();
    } else if (key == "fortran_order") {
      fortran = p.boolean();
    } else if (key == "shape") {
      shape = p.tuple();
    } else {
      fail(path, ": unexpected key '", key, "' in npy header");
    }
    if (!p.eat(',')) {
      p.expect('}');
      break;
    }
  }
  if (!descr || !fortran || !shape)
    fail(path, ": npy header lacks ",
         !descr     ? "'descr'"
         : !fortran ? "'fortran_order'"
                    : "'shape'");
  if (*fortran) fail(path, ": Fortran-order arrays are not supported (save with C order)");
  size_t item;
  if (*descr == "<f4") {
    item = 4;
  } else if (*descr == "<f8") {
    item = 8;
  } else {
    fail(path, ": dtype '", *descr, "' is not supported (expected '<f4' or '<f8')");
  }

  std::optional<uint64_t> numel = element_count(*shape);
  if (!numel) fail(path, ": shape ", tuple_str(*shape), " is too large");
  const size_t data_start = header_start + header_len;
  const uint64_t need = *numel * item, have = bytes.size() - data_start;
  if (have < need)
    fail(path, ": truncated: shape ", tuple_str(*shape), " of '", *descr, "' needs ", need,
         " data bytes, file has ", have);
  if (have > need)
    fail(path, ": ", have - need, " unexpected bytes after the data of shape ", tuple_str(*shape));

  NpyArray out;
  out.shape = std::move(*shape);
  out.data.resize(size_t(*numel));
  const char* src = bytes.data() + data_start;
  if (item == 4) {
    if (need > 0) std::memcpy(out.data.data(), src, size_t(need));
  } else {
    for (size_t k = 0; k < out.data.size(); ++k) {
      double d;
      std::memcpy(&d, src + 8 * k, 8);
      out.data[k] = float(d);
    }
  }
  return out;
}

}  // namespace moestream
