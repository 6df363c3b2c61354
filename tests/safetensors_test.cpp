// Safetensors reading, validation, sharded directories and atomic writing.
#include "io/safetensors.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <initializer_list>

#include "core/error.h"
#include "test_util.h"

namespace moestream {
namespace {

namespace fs = std::filesystem;

class SafetensorsTest : public test::TempDirTest {
 protected:
  // A file with the given header text (not checked) and data section.
  std::string write_raw(const std::string& name, const std::string& header,
                        const std::string& data = "", std::optional<uint64_t> len = {}) {
    std::string p = path(name);
    std::ofstream out(p, std::ios::binary);
    uint64_t n = len ? *len : header.size();
    for (int i = 0; i < 8; ++i) out.put(char(n >> (8 * i)));
    out << header << data;
    return p;
  }
  std::string write_text(const std::string& name, const std::string& text) { return write(name, text); }
};

using test::error_of;
using test::expect_contains;

std::string bytes_of(const TensorView& t) {
  return std::string(static_cast<const char*>(t.data), t.nbytes);
}

TEST_F(SafetensorsTest, RoundTripSeveralDtypesAndShapes) {
  std::vector<float> f32 = {1, -2, 3.5f, 4, 5, 6};
  std::vector<uint16_t> bf16 = {0x3f80, 0xc000, 0x0000, 0x7f80};
  std::vector<int64_t> i64 = {-1, 2, 1LL << 40, 7};
  uint16_t f16_scalar = 0x3c00;
  std::vector<uint8_t> flags = {1, 0, 1};
  std::vector<TensorToWrite> tensors = {
      {"model.w", DType::F32, {2, 3}, f32.data()}, {"model.b", DType::BF16, {4}, bf16.data()},
      {"ids", DType::I64, {2, 2, 1}, i64.data()},  {"empty", DType::U8, {0, 5}, nullptr},
      {"scalar", DType::F16, {}, &f16_scalar},     {"mask", DType::BOOL, {3}, flags.data(), 3},
  };
  const std::string p = path("rt.safetensors");
  write_safetensors(p, tensors, {{"format", "pt"}});

  auto st = SafetensorsFile::open(p);
  ASSERT_EQ(st->tensors().size(), tensors.size());
  EXPECT_EQ(st->metadata().at("format"), "pt");
  for (const auto& w : tensors) {
    const TensorView& t = st->tensors().at(w.name);
    EXPECT_EQ(t.name, w.name);
    EXPECT_EQ(t.dtype, w.dtype) << w.name;
    EXPECT_EQ(t.shape, w.shape) << w.name;
    size_t n = size_t(t.numel()) * dtype_size(w.dtype);
    ASSERT_EQ(t.nbytes, n) << w.name;
    if (n) {
      EXPECT_EQ(bytes_of(t), std::string(static_cast<const char*>(w.data), n)) << w.name;
    }
  }
  EXPECT_EQ(st->tensors().at("scalar").numel(), 1);
  EXPECT_EQ(st->tensors().at("empty").numel(), 0);

  // Data section 8-byte aligned; tensors in the order given; no temp file left behind.
  std::ifstream in(p, std::ios::binary);
  uint8_t len[8];
  in.read(reinterpret_cast<char*>(len), 8);
  EXPECT_EQ(len[0] % 8, 0);
  std::string header(len[0] | len[1] << 8, '\0');
  in.read(header.data(), std::streamsize(header.size()));
  EXPECT_LT(header.find("\"model.w\""), header.find("\"model.b\""));
  EXPECT_LT(header.find("\"model.b\""), header.find("\"ids\""));
  EXPECT_EQ(std::distance(fs::directory_iterator(dir_), fs::directory_iterator()), 1);
}

TEST_F(SafetensorsTest, WriteRejectsWrongByteCountAndLeavesNothing) {
  std::vector<float> v(4);
  std::string msg = error_of([&] {
    write_safetensors(path("w.safetensors"), {{"t", DType::F32, {2, 3}, v.data(), 16}});
  });
  expect_contains(msg, {"w.safetensors", "'t'", "24", "16"});
  msg = error_of([&] {
    write_safetensors(path("w.safetensors"),
                      {{"a", DType::F32, {1}, v.data()}, {"a", DType::F32, {1}, v.data()}});
  });
  expect_contains(msg, {"w.safetensors", "'a'", "twice"});
  EXPECT_TRUE(fs::is_empty(dir_));

  msg = error_of([&] {
    write_safetensors(path("no/such/dir/x.safetensors"), {{"t", DType::F32, {1}, v.data()}});
  });
  expect_contains(msg, {"no/such/dir/x.safetensors"});
}

TEST_F(SafetensorsTest, WriteReplacesExistingFile) {
  float a = 1, b = 2;
  write_safetensors(path("x.safetensors"), {{"t", DType::F32, {1}, &a}});
  write_safetensors(path("x.safetensors"), {{"u", DType::F32, {1}, &b}});
  auto st = SafetensorsFile::open(path("x.safetensors"));
  ASSERT_EQ(st->tensors().count("u"), 1u);
  EXPECT_EQ(st->tensors().count("t"), 0u);
  EXPECT_EQ(*st->tensors().at("u").as<float>(), 2.0f);
}

TEST_F(SafetensorsTest, AcceptsPaddedHeaderAndZeroSizeInsideAnotherRange) {
  std::string p = write_raw("pad.safetensors",
                            R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                            R"("z":{"dtype":"F32","shape":[0,3],"data_offsets":[4,4]}}     )",
                            std::string(8, '\0'));
  auto st = SafetensorsFile::open(p);
  EXPECT_EQ(st->tensors().size(), 2u);
  EXPECT_TRUE(st->metadata().empty());
}

TEST_F(SafetensorsTest, RejectsShortFile) {
  std::string p = write_text("short.safetensors", "abc");
  expect_contains(error_of([&] { SafetensorsFile::open(p); }),
                  {"short.safetensors", "shorter than"});
  p = write_text("empty.safetensors", "");
  expect_contains(error_of([&] { SafetensorsFile::open(p); }), {"empty.safetensors", "0 bytes"});
}

TEST_F(SafetensorsTest, RejectsHeaderLengthTooLarge) {
  std::string p = write_raw("len.safetensors", "{}", "", 1000);
  expect_contains(error_of([&] { SafetensorsFile::open(p); }),
                  {"len.safetensors", "header length 1000 is too large"});
  p = write_raw("huge.safetensors", "{}", "", 1ull << 40);
  expect_contains(error_of([&] { SafetensorsFile::open(p); }),
                  {"huge.safetensors", "header length", "too large"});
}

TEST_F(SafetensorsTest, RejectsBadJsonAndNonObjectHeader) {
  std::string p = write_raw("json.safetensors", R"({"a": {"dtype": )");
  expect_contains(error_of([&] { SafetensorsFile::open(p); }),
                  {"json.safetensors", "not valid JSON"});
  p = write_raw("arr.safetensors", "[1, 2]");
  expect_contains(error_of([&] { SafetensorsFile::open(p); }),
                  {"arr.safetensors", "must be a JSON object", "array"});
}

TEST_F(SafetensorsTest, RejectsMalformedEntries) {
  struct Case {
    std::string header, data, expect;
  };
  const std::vector<Case> cases = {
      {R"({"t":{"shape":[1],"data_offsets":[0,4]}})", "1234", "missing 'dtype'"},
      {R"({"t":{"dtype":"F32","data_offsets":[0,4]}})", "1234", "missing 'shape'"},
      {R"({"t":{"dtype":"F32","shape":[1]}})", "1234", "missing 'data_offsets'"},
      {R"({"t":{"dtype":7,"shape":[1],"data_offsets":[0,4]}})", "1234", "'dtype' must be a string"},
      {R"({"t":{"dtype":"F32","shape":"1","data_offsets":[0,4]}})", "1234",
       "'shape' must be an array"},
      {R"({"t":{"dtype":"F32","shape":[1.5],"data_offsets":[0,4]}})", "1234", "must hold integers"},
      {R"({"t":{"dtype":"F32","shape":[1],"data_offsets":[0]}})", "1234", "'data_offsets' must be"},
      {R"({"t":{"dtype":"F12","shape":[1],"data_offsets":[0,4]}})", "1234", "unknown dtype 'F12'"},
      {R"({"t":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", "1234", "negative dimension"},
      {R"({"t":{"dtype":"F32","shape":[0],"data_offsets":[4,0]}})", "1234", "begin 4 > end 0"},
      {R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}})", "1234", "size mismatch"},
      {R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", "1234", "truncated"},
      {R"({"t":"x"})", "", "entry must be an object"},
      {R"({"__metadata__":{"k":1}})", "", "__metadata__ value for 'k' must be a string"},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    std::string name = "bad" + std::to_string(i) + ".safetensors";
    std::string p = write_raw(name, cases[i].header, cases[i].data);
    std::string msg = error_of([&] { SafetensorsFile::open(p); });
    expect_contains(msg, {name, cases[i].expect});
    if (cases[i].header.find("__metadata__") == std::string::npos)
      expect_contains(msg, {"tensor 't'"});
  }
}

TEST_F(SafetensorsTest, SizeMismatchNamesExpectedAndActualBytes) {
  std::string p =
      write_raw("sz.safetensors", R"({"w":{"dtype":"BF16","shape":[2,3],"data_offsets":[0,10]}})",
                std::string(10, '\0'));
  expect_contains(error_of([&] { SafetensorsFile::open(p); }),
                  {"sz.safetensors", "'w'", "needs 12 bytes", "hold 10"});
}

TEST_F(SafetensorsTest, RejectsOverlappingTensors) {
  std::string p = write_raw("ov.safetensors",
                            R"({"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]},)"
                            R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})",
                            std::string(12, '\0'));
  expect_contains(error_of([&] { SafetensorsFile::open(p); }),
                  {"ov.safetensors", "'a'", "'b'", "overlapping"});
}

TEST_F(SafetensorsTest, MissingFileNamesPath) {
  expect_contains(error_of([&] { SafetensorsFile::open(path("nope.safetensors")); }),
                  {"nope.safetensors", "open"});
}

// ---- WeightSet

TEST_F(SafetensorsTest, WeightSetSingleFile) {
  float x[2] = {1, 2};
  write_safetensors(path("model.safetensors"), {{"a.weight", DType::F32, {2}, x}});
  write_safetensors(path("other.safetensors"), {{"ignored", DType::F32, {2}, x}});
  WeightSet ws = WeightSet::open_dir(dir_);
  EXPECT_EQ(ws.names(), std::vector<std::string>{"a.weight"});
  EXPECT_EQ(ws.get("a.weight").as<float>()[1], 2.0f);
  EXPECT_EQ(ws.find("ignored"), nullptr);
  EXPECT_EQ(ws.origin(), dir_);
}

TEST_F(SafetensorsTest, WeightSetShardedWithIndex) {
  float x[2] = {1, 2}, y[3] = {3, 4, 5};
  write_safetensors(path("model-00001-of-00002.safetensors"),
                    {{"layers.0.w", DType::F32, {2}, x}, {"unindexed", DType::F32, {2}, x}});
  write_safetensors(path("model-00002-of-00002.safetensors"),
                    {{"layers.1.w", DType::F32, {3}, y}, {"norm", DType::F32, {2}, x}});
  write_text("model.safetensors.index.json", R"({"metadata": {"total_size": 28}, "weight_map": {
      "layers.0.w": "model-00001-of-00002.safetensors",
      "layers.1.w": "model-00002-of-00002.safetensors",
      "norm": "model-00002-of-00002.safetensors"}})");
  WeightSet ws = WeightSet::open_dir(dir_);
  EXPECT_EQ(ws.names(), (std::vector<std::string>{"layers.0.w", "layers.1.w", "norm"}));
  EXPECT_FALSE(ws.has("unindexed"));
  EXPECT_EQ(ws.get("layers.1.w").shape, std::vector<int64_t>{3});
  EXPECT_EQ(ws.get("layers.1.w").as<float>()[2], 5.0f);

  // Moving the set keeps its views valid.
  WeightSet moved = std::move(ws);
  EXPECT_EQ(moved.get("layers.0.w").as<float>()[0], 1.0f);
}

TEST_F(SafetensorsTest, WeightSetIndexNamingMissingShard) {
  float x[1] = {1};
  write_safetensors(path("a.safetensors"), {{"t", DType::F32, {1}, x}});
  write_text("model.safetensors.index.json",
             R"({"weight_map": {"t": "a.safetensors", "u": "gone.safetensors"}})");
  expect_contains(error_of([&] { WeightSet::open_dir(dir_); }),
                  {"model.safetensors.index.json", "gone.safetensors", "'u'", "does not exist"});
}

TEST_F(SafetensorsTest, WeightSetIndexedTensorMissingFromShard) {
  float x[1] = {1};
  write_safetensors(path("a.safetensors"), {{"t", DType::F32, {1}, x}});
  write_text("model.safetensors.index.json",
             R"({"weight_map": {"t": "a.safetensors", "u": "a.safetensors"}})");
  expect_contains(error_of([&] { WeightSet::open_dir(dir_); }),
                  {"tensor 'u'", "a.safetensors", "does not contain"});
}

TEST_F(SafetensorsTest, WeightSetMalformedIndex) {
  write_text("model.safetensors.index.json", R"({"weight_map": [1]})");
  expect_contains(error_of([&] { WeightSet::open_dir(dir_); }),
                  {"model.safetensors.index.json", "'weight_map' must be an object"});
  write_text("model.safetensors.index.json", "{oops");
  expect_contains(error_of([&] { WeightSet::open_dir(dir_); }),
                  {"model.safetensors.index.json", "not valid JSON"});
}

TEST_F(SafetensorsTest, WeightSetAllFilesAndDuplicates) {
  float x[1] = {1};
  write_safetensors(path("b.safetensors"), {{"t2", DType::F32, {1}, x}});
  write_safetensors(path("a.safetensors"), {{"t1", DType::F32, {1}, x}});
  WeightSet ws = WeightSet::open_dir(dir_);
  EXPECT_EQ(ws.names(), (std::vector<std::string>{"t1", "t2"}));

  write_safetensors(path("c.safetensors"), {{"t1", DType::F32, {1}, x}});
  expect_contains(error_of([&] { WeightSet::open_dir(dir_); }),
                  {"tensor 't1'", "a.safetensors", "c.safetensors"});
  expect_contains(error_of([&] {
                    WeightSet::open_files({path("a.safetensors"), path("c.safetensors")});
                  }),
                  {"tensor 't1'", "appears in both"});
}

TEST_F(SafetensorsTest, WeightSetEmptyDirAndMissingDir) {
  expect_contains(error_of([&] { WeightSet::open_dir(dir_); }), {dir_, "no *.safetensors"});
  expect_contains(error_of([&] { WeightSet::open_dir(path("missing")); }),
                  {"missing", "not a directory"});
}

TEST_F(SafetensorsTest, WeightSetGetMissingSuggestsNames) {
  float x[1] = {1};
  write_safetensors(path("model.safetensors"),
                    {{"model.layers.0.mlp.gate.weight", DType::F32, {1}, x},
                     {"model.layers.0.mlp.up.weight", DType::F32, {1}, x},
                     {"lm_head.weight", DType::F32, {1}, x}});
  WeightSet ws = WeightSet::open_dir(dir_);
  std::string msg = error_of([&] { ws.get("model.layers.0.mlp.down.weight"); });
  expect_contains(msg,
                  {"tensor 'model.layers.0.mlp.down.weight' not found in " + dir_, "did you mean",
                   "model.layers.0.mlp.gate.weight", "model.layers.0.mlp.up.weight"});
  EXPECT_EQ(msg.find("lm_head"), std::string::npos);
  msg = error_of([&] { ws.get("zzz"); });
  EXPECT_EQ(msg.find("did you mean"), std::string::npos) << msg;
}

TEST_F(SafetensorsTest, WeightSetIndexShardOutsideTheDirectoryIsRefused) {
  // The shard exists next to the directory, so only the path check can refuse it.
  float x[1] = {1};
  fs::create_directories(path("model"));
  write_safetensors(path("outside.safetensors"), {{"t", DType::F32, {1}, x}});
  const std::string model = path("model");
  for (const std::string& shard : std::vector<std::string>{"../outside.safetensors", path("outside.safetensors"), "sub/../../outside.safetensors"}) {
    std::ofstream(model + "/model.safetensors.index.json") << R"({"weight_map": {"t": ")" + shard + R"("}})";
    expect_contains(error_of([&] { WeightSet::open_dir(model); }),
                    {"model.safetensors.index.json", "'t'", shard, "outside"});
  }
}

}  // namespace
}  // namespace moestream
