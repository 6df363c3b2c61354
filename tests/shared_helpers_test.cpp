// The helpers that src/ keeps one copy of: reading a file (core/files.h), encoding UTF-8
// (core/strings.h), and Python's %-formatting for the Jinja `%` operator and `format` filter.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

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
