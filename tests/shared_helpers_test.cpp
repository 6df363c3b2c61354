// The helpers that src/ keeps one copy of: reading a file (core/files.h), encoding UTF-8
// (core/strings.h), and Python's %-formatting for the Jinja `%` operator and `format` filter.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include <cmath>

#include "core/dtype.h"
#include "core/files.h"
#include "core/strings.h"
#include "test_util.h"
#include "text/jinja.h"

namespace moestream {
namespace {

TEST(Files, ReadFileReturnsEveryByte) {
  const std::string path = test::unique_temp_dir("moestream_files_") + "/bytes";
  const std::string bytes("a\0b\xff\n", 5);
  std::ofstream(path, std::ios::binary) << bytes;
  EXPECT_EQ(read_file(path), bytes);
  ASSERT_TRUE(try_read_file(path).has_value());
  EXPECT_EQ(*try_read_file(path), bytes);
}

TEST(Files, ErrorsNameThePathAndTheReason) {
  const std::string dir = test::unique_temp_dir("moestream_files_");
  test::expect_contains(test::error_of([&] { read_file(dir + "/absent"); }),
                        {dir + "/absent: cannot open for reading: No such file or directory"});
  EXPECT_EQ(test::error_of([&] { read_file(dir + "/absent"); }).find("src/"), std::string::npos) << "no source path";
  test::expect_contains(test::error_of([&] { read_file(dir); }), {dir + ": cannot open for reading: Is a directory"});
  EXPECT_FALSE(try_read_file(dir + "/absent").has_value());
  EXPECT_FALSE(try_read_file(dir).has_value());
}

// MemAvailable as the kernel reports it, in bytes: a positive amount no larger than MemTotal.
TEST(Files, MemoryAvailableReadsProcMeminfo) {
  const std::string info = read_file("/proc/meminfo");
  const size_t at = info.find("MemTotal:");
  ASSERT_NE(at, std::string::npos);
  const double total = std::stod(info.substr(at + 9)) * 1024.0;
  const double available = memory_available();
  EXPECT_GT(available, 0.0);
  EXPECT_LE(available, total);
}

TEST(Strings, AppendUtf8EncodesOneToFourBytes) {
  std::string s;
  for (char32_t cp : {U'A', U'\u00e9', U'\u20ac', U'\U0001F600'}) append_utf8(s, cp);
  EXPECT_EQ(s, "A\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80");
}

std::string render(const std::string& src) {
  return jinja::Template::parse(src, "t").render(nlohmann::ordered_json::object());
}

// jinja2: the `%` operator is Python's str % (tuple or value), `format` is str % args; the filter
// also refuses arguments left over, as Python does.
TEST(PercentFormat, OperatorAndFilterFormatAlike) {
  EXPECT_EQ(render("{{ '%s-%d|%r|%i%%' % ('a', 3.7, 'q', 4) }}"), "a-3|'q'|4%");
  EXPECT_EQ(render("{{ '<%s>' % 'x' }}"), "<x>");
  EXPECT_EQ(render("{{ '%s-%d|%r|%i%%' | format('a', 3.7, 'q', 4) }}"), "a-3|'q'|4%");
  test::expect_contains(test::error_of([] { render("{{ '%s' | format('a', 'b') }}"); }), {"not all arguments converted"});
  test::expect_contains(test::error_of([] { render("{{ '%s %s' % ('a',) }}"); }), {"not enough arguments"});
  test::expect_contains(test::error_of([] { render("{{ '%s %s' | format('a') }}"); }), {"not enough arguments"});
  test::expect_contains(test::error_of([] { render("{{ '%x' % 3 }}"); }), {"unsupported format character"});
}

}  // namespace
}  // namespace moestream

// float -> f16 rounds to nearest even over the whole range, subnormals included: every f16 value
// comes back from its float unchanged, and a float halfway between two neighbours rounds to the
// even one. (The subnormal branch shifted 13 bits too far and returned 0 for them all.)
TEST(Float16, EveryValueRoundTripsAndHalfwayRoundsToEven) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    if ((h & 0x7c00u) == 0x7c00u && (h & 0x3ffu)) continue;  // NaN payloads
    EXPECT_EQ(moestream::f32_to_f16(moestream::f16_to_f32(uint16_t(h))), h) << std::hex << h;
  }
  const float tiny = std::ldexp(1.0f, -24);  // the smallest f16 subnormal
  EXPECT_EQ(moestream::f32_to_f16(tiny * 0.5f), 0u);          // halfway to 0: even (0)
  EXPECT_EQ(moestream::f32_to_f16(tiny * 1.5f), 2u);          // halfway 1..2: even (2)
  EXPECT_EQ(moestream::f32_to_f16(tiny * 2.5f), 2u);          // halfway 2..3: even (2)
  EXPECT_EQ(moestream::f32_to_f16(tiny * 0.75f), 1u);
  EXPECT_EQ(moestream::f32_to_f16(-tiny * 3.0f), 0x8003u);
}
