// A damaged pack is an error naming what is damaged, never a different answer: checksums of the
// resident weights, the experts and the manifest (moestream verify and load), validation of every
// manifest field, paths kept inside the pack, and a source without weights refused.
#include <gtest/gtest.h>

#include <filesystem>
#include <functional>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/pack.h"
#include "io/pack_format.h"
#include "models/model.h"
#include "test_util.h"

namespace moestream {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

const char* kSource = "models/qwen3moe_gqa_tied";

// A fresh pack of the fixture (packed once, copied for each test).
std::string fresh_pack(const std::string& name) {
  static const std::string packed = [] {
    const std::string out = test::temp_dir("integrity-master") + "/pack";
    auto r = test::run_cli("pack " + test::fixture(kSource) + " " + out);
    EXPECT_EQ(r.exit_code, 0) << r.err;
    return out;
  }();
  const std::string dir = test::temp_dir("integrity-" + name) + "/pack";
  fs::copy(packed, dir, fs::copy_options::recursive);
  return dir;
}

// Byte offset of a tensor's data in a safetensors file.
uint64_t tensor_offset(const std::string& path, const std::string& tensor) {
  const std::string bytes = test::read_file(path);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | uint8_t(bytes[size_t(i)]);
  const json header = json::parse(bytes.substr(8, n));
  return 8 + n + header.at(tensor).at("data_offsets")[0].get<uint64_t>();
}

void flip_byte(const std::string& path, uint64_t at) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(std::streamoff(at));
  char c = 0;
  f.read(&c, 1);
  c = char(c ^ 0x10);
  f.seekp(std::streamoff(at));
  f.write(&c, 1);
  ASSERT_TRUE(f.good()) << path;
}

json read_manifest(const std::string& dir) { return json::parse(test::read_file(dir + "/" + kPackManifestName)); }

// Writes an edited manifest; `reseal` gives it a matching checksum so that the field checks,
// not the checksum, have to find the edit.
void write_manifest(const std::string& dir, json m, bool reseal = true) {
  if (reseal) m["manifest_xxh64"] = pack_format::hex64(pack_format::manifest_checksum(m));
  std::ofstream(dir + "/" + kPackManifestName) << m.dump(1) << "\n";
}

std::string load_error(const std::string& dir) {
  try {
    PackManifest::load(dir);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

std::string model_load_error(const std::string& dir) {
  try {
    load_model(dir, ModelOptions());
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

bool has(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

TEST(PackIntegrity, VerifyOfAGoodPackCountsEverything) {
  const std::string dir = fresh_pack("good");
  auto r = test::run_cli("verify " + dir);
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_TRUE(has(r.out, "ok")) << r.out;
  const PackManifest m = PackManifest::load(dir);
  size_t experts = 0;
  for (const auto& layer : m.layers) experts += layer.size();
  EXPECT_TRUE(has(r.out, std::to_string(experts) + " experts")) << r.out;
  EXPECT_TRUE(has(r.out, std::to_string(m.weight_checksums.size()) + " tensors")) << r.out;
}

TEST(PackIntegrity, FlippedByteInTheEmbeddingIsNamedNeverUsed) {
  for (const std::string tensor : {"model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight"}) {
    const std::string dir = fresh_pack("flip-" + tensor);
    const std::string weights = dir + "/weights.safetensors";
    flip_byte(weights, tensor_offset(weights, tensor) + 100);
    auto r = test::run_cli("verify " + dir);
    EXPECT_NE(r.exit_code, 0) << tensor;
    EXPECT_TRUE(has(r.out, tensor) && has(r.out, "checksum")) << r.out;
    const std::string err = model_load_error(dir);
    EXPECT_TRUE(has(err, tensor) && has(err, "checksum")) << err;
    auto logits = test::run_cli("logits --model " + dir + " --tokens 1,2,3 -o " + dir + "/out.npy");
    EXPECT_NE(logits.exit_code, 0);
    EXPECT_TRUE(has(logits.err, tensor)) << logits.err;
    EXPECT_FALSE(fs::exists(dir + "/out.npy"));
  }
}

TEST(PackIntegrity, FlippedByteInAnExpertIsNamedByVerify) {
  const std::string dir = fresh_pack("flip-expert");
  const PackManifest m = PackManifest::load(dir);
  const PackedExpert& e = m.expert(1, 2);
  flip_byte(dir + "/" + m.expert_files[size_t(e.file)], e.offset + 10);
  auto r = test::run_cli("verify " + dir);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_TRUE(has(r.out, "layer 1 expert 2")) << r.out;
  EXPECT_FALSE(has(r.out, "layer 1 expert 3")) << r.out;
}

TEST(PackIntegrity, EditedManifestFailsItsChecksum) {
  const std::string dir = fresh_pack("manifest-sum");
  json m = read_manifest(dir);
  m["layers"][0][0]["tensors"][0]["dtype"] = "F16";
  write_manifest(dir, m, /*reseal=*/false);
  const std::string err = load_error(dir);
  EXPECT_TRUE(has(err, kPackManifestName) && has(err, "checksum")) << err;
  auto r = test::run_cli("verify " + dir);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_TRUE(has(r.out, "checksum")) << r.out;
}

TEST(PackIntegrity, EveryManifestFieldIsChecked) {
  const std::string dir = fresh_pack("fields");
  const json good = read_manifest(dir);
  struct Edit {
    const char* name;
    std::function<void(json&)> apply;
    std::vector<std::string> message;  // parts the error must hold
  };
  const std::vector<Edit> edits = {
      {"misaligned tensor offset", [](json& m) { m["layers"][0][0]["tensors"][1]["offset"] = m["layers"][0][0]["tensors"][1]["offset"].get<uint64_t>() + 2; },
       {"layer 0 expert 0", "up", "offset"}},
      {"misaligned expert offset", [](json& m) { m["layers"][0][1]["offset"] = 4096 + 64; }, {"layer 0 expert 1", "offset"}},
      {"dtype BF16 -> F16", [](json& m) { m["layers"][0][0]["tensors"][0]["dtype"] = "F16"; }, {"layer 0 expert 0", "format"}},
      {"unknown format", [](json& m) { m["layers"][0][0]["format"] = "q9g7"; }, {"layer 0 expert 0", "q9g7"}},
      {"negative offset", [](json& m) { m["layers"][0][1]["offset"] = -4096; }, {"layer 0 expert 1", "offset"}},
      {"overflowing offset", [](json& m) { m["layers"][0][1]["offset"] = 18446744073709547520ull; }, {"layer 0 expert 1", "offset"}},
      {"huge size", [](json& m) { m["layers"][0][1]["size"] = 9223372036854775808ull; }, {"layer 0 expert 1", "size"}},
      {"negative tensor size", [](json& m) { m["layers"][0][0]["tensors"][2]["nbytes"] = -64; }, {"layer 0 expert 0", "nbytes"}},
      {"negative dimension", [](json& m) { m["layers"][0][0]["tensors"][0]["shape"][0] = -2; }, {"layer 0 expert 0", "shape"}},
      {"file index", [](json& m) { m["layers"][0][0]["file"] = 99; }, {"layer 0 expert 0", "file"}},
      {"n_experts", [](json& m) { m["n_experts"] = -1; }, {"n_experts"}},
      {"expert file outside", [](json& m) { m["expert_files"][0] = "../layer-0.bin"; }, {"expert_files", "../layer-0.bin"}},
      {"absolute expert file", [](json& m) { m["expert_files"][0] = "/etc/passwd"; }, {"expert_files", "/etc/passwd"}},
      {"weights outside", [](json& m) { m["weights"] = "experts/../../weights.safetensors"; }, {"weights", ".."}},
      {"weights checksum missing", [](json& m) { m["weights_xxh3"].erase("model.norm.weight"); }, {"model.norm.weight"}},
  };
  for (const Edit& edit : edits) {
    json m = good;
    edit.apply(m);
    write_manifest(dir, m);
    const std::string err = load_error(dir);
    EXPECT_TRUE(has(err, kPackManifestName)) << edit.name << ": " << err;
    for (const std::string& part : edit.message) EXPECT_TRUE(has(err, part)) << edit.name << ": " << err;
    EXPECT_EQ(err.find('\n'), std::string::npos) << edit.name << ": " << err;
    auto r = test::run_cli("verify " + dir);
    EXPECT_NE(r.exit_code, 0) << edit.name;
  }
  write_manifest(dir, good, false);
  EXPECT_EQ(load_error(dir), "");
}

TEST(PackIntegrity, DamagedWeightsHeaderIsAnError) {
  const std::string dir = fresh_pack("weights-header");
  const std::string path = dir + "/weights.safetensors";
  std::string bytes = test::read_file(path);
  const size_t at = bytes.find("\"BF16\"");
  ASSERT_NE(at, std::string::npos);
  bytes.replace(at, 6, "\"F16\" ");
  std::ofstream(path, std::ios::binary) << bytes;
  const std::string err = model_load_error(dir);
  EXPECT_TRUE(has(err, "weights.safetensors") && has(err, "checksum")) << err;
  EXPECT_NE(test::run_cli("verify " + dir).exit_code, 0);
}

TEST(PackIntegrity, PackWithoutChecksumsIsAcceptedWithAWarningAndFailsVerify) {
  const std::string dir = fresh_pack("old");
  json m = read_manifest(dir);
  m.erase("manifest_xxh64");
  m.erase("weights_xxh3");
  m.erase("weights_header_xxh64");
  m["version"] = 1;
  write_manifest(dir, m, false);
  EXPECT_EQ(load_error(dir), "");
  auto r = test::run_cli("verify " + dir);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_TRUE(has(r.out, "re-pack")) << r.out;
}

TEST(PackIntegrity, EmptySourceDirectoryIsRefused) {
  const std::string src = test::temp_dir("pack-empty") + "/model";
  fs::create_directories(src);
  fs::copy_file(test::fixture(kSource) + "/config.json", src + "/config.json");
  const std::string out = test::temp_dir("pack-empty-out") + "/pack";
  auto r = test::run_cli("pack " + src + " " + out);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_TRUE(has(r.err, src)) << r.err;
  EXPECT_FALSE(fs::exists(out));
  // A safetensors file holding no tensors is no better.
  std::ofstream(src + "/model.safetensors", std::ios::binary) << std::string("\x08\0\0\0\0\0\0\0{}      ", 16);
  r = test::run_cli("pack " + src + " " + out);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_TRUE(has(r.err, src) && has(r.err, "no weights")) << r.err;
  EXPECT_FALSE(fs::exists(out));
}

}  // namespace
}  // namespace moestream
