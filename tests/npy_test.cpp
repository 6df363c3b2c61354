// .npy writing and reading, including headers laid out byte for byte as numpy writes them.
#include "io/npy.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <iterator>

#include "core/error.h"
#include "test_util.h"

namespace moestream {
namespace {

namespace fs = std::filesystem;

class NpyTest : public test::TempDirTest {
 protected:
  std::string read_bytes(const std::string& p) { return test::read_file(p); }

  // A version 1.0 file with the given dict, padded to 64 bytes the way numpy pads it.
  std::string write_v1(const std::string& name, std::string dict, const std::string& data) {
    size_t total = 10 + dict.size() + 1;
    dict.append((64 - total % 64) % 64, ' ');
    dict += '\n';
    std::string bytes = std::string("\x93NUMPY\x01\x00", 8);
    bytes += char(dict.size() & 0xff);
    bytes += char(dict.size() >> 8);
    bytes += dict + data;
    std::string p = path(name);
    std::ofstream(p, std::ios::binary) << bytes;
    return p;
  }

};

using test::error_of;
using test::expect_contains;

template <class T>
std::string raw(const std::vector<T>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
}

TEST_F(NpyTest, RoundTripShapes) {
  const std::vector<std::vector<int64_t>> shapes = {{2, 3}, {5}, {}, {0, 4}, {2, 1, 3}};
  for (const auto& shape : shapes) {
    size_t n = 1;
    for (int64_t d : shape) n *= size_t(d);
    std::vector<float> data(n);
    for (size_t i = 0; i < n; ++i) data[i] = float(i) * 0.5f - 1.25f;
    const std::string p = path("a.npy");
    write_npy_f32(p, data.data(), shape);
    NpyArray back = read_npy_f32(p);
    EXPECT_EQ(back.shape, shape);
    EXPECT_EQ(back.data, data);
  }
  EXPECT_EQ(std::distance(fs::directory_iterator(dir_), fs::directory_iterator()), 1);
}

TEST_F(NpyTest, WrittenHeaderMatchesNumpyLayout) {
  std::vector<float> data = {1, 2, 3};
  write_npy_f32(path("h.npy"), data.data(), {3});
  const std::string bytes = read_bytes(path("h.npy"));
  ASSERT_GE(bytes.size(), 10u);
  EXPECT_EQ(bytes.substr(0, 8), std::string("\x93NUMPY\x01\x00", 8));
  size_t hlen = size_t(uint8_t(bytes[8])) | size_t(uint8_t(bytes[9])) << 8;
  EXPECT_EQ((10 + hlen) % 64, 0u);
  const std::string header = bytes.substr(10, hlen);
  // numpy 1.x and 2.x write exactly this dict for a float32 vector of 3.
  EXPECT_EQ(header.rfind("{'descr': '<f4', 'fortran_order': False, 'shape': (3,), }", 0), 0u)
      << header;
  EXPECT_EQ(header.back(), '\n');
  EXPECT_EQ(bytes.size(), 10 + hlen + 12);
  EXPECT_EQ(bytes.substr(10 + hlen), raw(data));
}

TEST_F(NpyTest, ReadsHandWrittenF8AndV2Headers) {
  std::vector<double> d = {0.5, -1.0, 3.25, 1e-3};
  std::string p =
      write_v1("f8.npy", "{'descr': '<f8', 'fortran_order': False, 'shape': (2, 2), }", raw(d));
  NpyArray a = read_npy_f32(p);
  EXPECT_EQ(a.shape, (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(a.data, (std::vector<float>{0.5f, -1.0f, 3.25f, float(1e-3)}));

  // Version 2.0 (u32 header length), keys in another order, no trailing comma.
  std::string dict = "{\"shape\": (2,), \"fortran_order\": False, \"descr\": '<f4'}";
  dict.append((64 - (12 + dict.size() + 1) % 64) % 64, ' ');
  dict += '\n';
  std::vector<float> f = {7, 8};
  std::string bytes = std::string("\x93NUMPY\x02\x00", 8);
  for (int i = 0; i < 4; ++i) bytes += char(dict.size() >> (8 * i));
  bytes += dict + raw(f);
  std::ofstream(path("v2.npy"), std::ios::binary) << bytes;
  a = read_npy_f32(path("v2.npy"));
  EXPECT_EQ(a.shape, std::vector<int64_t>{2});
  EXPECT_EQ(a.data, f);
}

TEST_F(NpyTest, RejectsUnsupportedAndMalformedFiles) {
  std::vector<int32_t> ints = {1, 2};
  std::string p =
      write_v1("i4.npy", "{'descr': '<i4', 'fortran_order': False, 'shape': (2,), }", raw(ints));
  expect_contains(error_of([&] { read_npy_f32(p); }), {"i4.npy", "dtype '<i4' is not supported"});

  std::vector<float> f = {1, 2, 3, 4};
  p = write_v1("fo.npy", "{'descr': '<f4', 'fortran_order': True, 'shape': (2, 2), }", raw(f));
  expect_contains(error_of([&] { read_npy_f32(p); }), {"fo.npy", "Fortran"});

  p = write_v1("short.npy", "{'descr': '<f4', 'fortran_order': False, 'shape': (5,), }", raw(f));
  expect_contains(error_of([&] { read_npy_f32(p); }),
                  {"short.npy", "truncated", "needs 20", "has 16"});

  p = write_v1("long.npy", "{'descr': '<f4', 'fortran_order': False, 'shape': (3,), }", raw(f));
  expect_contains(error_of([&] { read_npy_f32(p); }), {"long.npy", "4 unexpected bytes"});

  p = write_v1("bad.npy", "{'descr': '<f4', 'fortran_order': False, 'shape': (2, x), }", raw(f));
  expect_contains(error_of([&] { read_npy_f32(p); }), {"bad.npy", "malformed npy header"});

  p = write_v1("nokey.npy", "{'descr': '<f4', 'shape': (4,), }", raw(f));
  expect_contains(error_of([&] { read_npy_f32(p); }), {"nokey.npy", "lacks 'fortran_order'"});

  std::ofstream(path("magic.npy"), std::ios::binary) << "PK\x03\x04 not numpy";
  expect_contains(error_of([&] { read_npy_f32(path("magic.npy")); }),
                  {"magic.npy", "not an npy file"});

  expect_contains(error_of([&] { read_npy_f32(path("absent.npy")); }), {"absent.npy"});
}

TEST_F(NpyTest, WriteErrorsNameThePath) {
  float x = 1;
  expect_contains(error_of([&] { write_npy_f32(path("neg.npy"), &x, {-1}); }),
                  {"neg.npy", "invalid shape"});
  expect_contains(error_of([&] { write_npy_f32(path("no/dir/x.npy"), &x, {1}); }),
                  {"no/dir/x.npy"});
  EXPECT_TRUE(fs::is_empty(dir_));
}

}  // namespace
}  // namespace moestream
