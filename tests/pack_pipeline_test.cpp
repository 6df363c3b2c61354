// pack's pipeline: the source read ahead of the conversion and the converted experts written on
// their own thread, resident matrices quantized by blocks of rows. None of it may change a byte
// of the pack; a read that fails (a source truncated while packing) is one line naming the file
// and the tensor, not a SIGBUS or a hang; memory stays bounded by what is in flight.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>

#include "core/error.h"
#include "core/quant.h"
#include "io/pack.h"
#include "io/pack_pipeline.h"
#include "io/safetensors.h"
#include "models/registry.h"
#include "test_util.h"

namespace moestream {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

// Untied (an lm_head to quantize), widths that are whole groups of 32.
const char* kSource = "models/qwen3moe_ppl";

std::map<std::string, std::string> tree(const std::string& dir) {
  std::map<std::string, std::string> files;
  for (const auto& e : fs::recursive_directory_iterator(dir))
    if (e.is_regular_file()) files[fs::relative(e.path(), dir).string()] = test::read_file(e.path().string());
  return files;
}

std::string pack_with(const std::string& src, const std::string& name, const std::string& flags) {
  const std::string out = test::temp_dir(name) + "/pack";
  const auto r = test::run_cli("pack " + src + " " + out + " " + flags);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  return out;
}

TEST(PackPipeline, ThreadsAndReadAheadDoNotChangeTheBytes) {
  // The sharded fixture (three files: the read-ahead crosses them) has widths of 48, no whole
  // groups: it is packed to bf16.
  for (const auto& [src, quant] : {std::pair{kSource, "--quant q4 --group-size 32 --quant-all"},
                                   {kSource, "--quant q2 --group-size 32 --clip-search"},
                                   {"models/qwen3moe_saved_sharded", "--quant bf16"}}) {
    const std::string dir = test::fixture(src), flags = quant;
    const auto serial = tree(pack_with(dir, "pipeline-serial", flags + " -t 1 --read-ahead 0"));
    for (const std::string run : {"-t 2 --read-ahead 1", "-t 3 --read-ahead 0", "-t 3 --read-ahead 5"})
      EXPECT_EQ(tree(pack_with(dir, "pipeline-run", flags + " " + run)), serial) << flags << " " << run;
  }
}

// --quant-all's resident matrices are quantized by blocks of rows on several threads: the bytes
// of quantize_affine over the whole matrix at once.
TEST(PackPipeline, ResidentMatricesQuantizedByRowsAreOneCallsBytes) {
  const std::string src = test::fixture(kSource);
  const std::string out = pack_with(src, "pipeline-rows", "--quant q4 --group-size 32 --quant-all -t 3");
  const WeightSet source = WeightSet::open_dir(src), packed = WeightSet::open_dir(out);
  const QuantFormat f = parse_quant_format("q4g32");
  for (const std::string name : {"model.embed_tokens.weight", "lm_head.weight", "model.layers.1.self_attn.q_proj.weight"}) {
    const TensorView& t = source.get(name);
    ASSERT_EQ(t.dtype, DType::BF16) << name;
    const int64_t rows = t.shape[0], cols = t.shape[1];
    ASSERT_GT(rows, 12) << name;  // more rows than the 3 threads' blocks
    std::vector<float> values(size_t(rows * cols));
    for (size_t i = 0; i < values.size(); ++i) values[i] = bf16_to_f32(t.as<uint16_t>()[i]);
    std::vector<uint32_t> words(size_t(rows * quant_words_per_row(f, cols)));
    std::vector<uint16_t> scales(size_t(rows * quant_groups_per_row(f, cols))), biases(scales.size());
    quantize_affine(values.data(), rows, cols, f, words.data(), scales.data(), biases.data(), {}, name);
    const std::string module = name.substr(0, name.size() - 7);
    const auto bytes = [](const TensorView& v) { return std::string(v.as<char>(), v.nbytes); };
    EXPECT_EQ(bytes(packed.get(name)), std::string(reinterpret_cast<const char*>(words.data()), words.size() * 4)) << name;
    EXPECT_EQ(bytes(packed.get(module + ".scales")), std::string(reinterpret_cast<const char*>(scales.data()), scales.size() * 2));
    EXPECT_EQ(bytes(packed.get(module + ".biases")), std::string(reinterpret_cast<const char*>(biases.data()), biases.size() * 2));
  }
}

TEST(PackPipeline, InterruptedAndResumedWithOtherThreadsIsTheSame) {
  const std::string src = test::temp_dir("pipeline-resume-src") + "/model";
  fs::copy(test::fixture(kSource), src, fs::copy_options::recursive);
  const std::string flags = "--quant q4 --group-size 32 --quant-all";
  const auto clean = tree(pack_with(src, "pipeline-resume-clean", flags + " -t 1 --read-ahead 0"));
  const std::string out = test::temp_dir("pipeline-resume") + "/pack";
  ::setenv("MOESTREAM_PACK_STOP_AFTER", "2", 1);  // the resident weights and layer 0's experts
  const auto stopped = test::run_cli("pack " + src + " " + out + " " + flags + " -t 3 --read-ahead 4");
  ::unsetenv("MOESTREAM_PACK_STOP_AFTER");
  EXPECT_EQ(stopped.exit_code, 1) << stopped.err;
  EXPECT_NE(stopped.err.find("stopping after 2 files"), std::string::npos) << stopped.err;
  const auto resumed = test::run_cli("pack " + src + " " + out + " " + flags + " -t 2 --read-ahead 1");
  ASSERT_EQ(resumed.exit_code, 0) << resumed.err;
  EXPECT_NE(resumed.err.find("kept 2 of 2 completed files"), std::string::npos) << resumed.err;
  EXPECT_EQ(tree(out), clean);
}

// A source file truncated after it was opened: the reads that find it short fail with one line
// naming the file and a tensor that was cut, for every read-ahead and thread count; no SIGBUS.
TEST(PackPipeline, SourceTruncatedWhilePackingIsNamed) {
  const Architecture& arch = find_architecture("qwen3_moe", "test");
  for (const auto& [threads, ahead] : {std::pair{1, 0}, {3, 2}}) {
    const std::string src = test::temp_dir("pipeline-truncated-src") + "/model";
    fs::remove_all(src);
    fs::copy(test::fixture(kSource), src, fs::copy_options::recursive);
    const std::string shard = src + "/model.safetensors";
    // Cut at the start of the largest tensor: it and every tensor whose pages reach past the new
    // end can no longer be read.
    uint64_t cut_at = 0;
    std::string last;
    std::set<std::string> cut;
    {
      const std::string bytes = test::read_file(shard);
      uint64_t n = 0;
      for (int i = 7; i >= 0; --i) n = (n << 8) | uint8_t(bytes[size_t(i)]);
      const json header = json::parse(bytes.substr(8, n));
      uint64_t largest = 0;
      for (const auto& [name, t] : header.items())
        if (name != "__metadata__" && t["data_offsets"][1].get<uint64_t>() - t["data_offsets"][0].get<uint64_t>() > largest) {
          largest = t["data_offsets"][1].get<uint64_t>() - t["data_offsets"][0].get<uint64_t>();
          cut_at = 8 + n + t["data_offsets"][0].get<uint64_t>();
          last = name;
        }
      ASSERT_GT(largest, 8192u) << last << ": too small to lose a whole page";
      for (const auto& [name, t] : header.items())
        if (name != "__metadata__" && 8 + n + t["data_offsets"][1].get<uint64_t>() > cut_at / 4096 * 4096 + 4096)
          cut.insert(name);
    }
    PackOptions options;
    options.quant = "q4";
    options.group_size = 32;
    options.threads = threads;
    options.read_ahead = ahead;
    options.progress = false;
    options.skip = arch.unused_tensors;
    options.opened = [&] { fs::resize_file(shard, cut_at); };
    const std::string out = test::temp_dir("pipeline-truncated") + "/pack";
    try {
      write_pack(src, out, arch.expert_tensors, options);
      ADD_FAILURE() << "packed a truncated source";
    } catch (const Error& e) {
      const std::string what = e.what();
      EXPECT_EQ(what.find('\n'), std::string::npos) << what;
      EXPECT_EQ(what.rfind(shard + ": tensor ", 0), 0u) << what;
      EXPECT_NE(what.find("the file ends before the tensor's bytes"), std::string::npos) << what;
      const size_t at = shard.size() + 9;
      EXPECT_EQ(cut.count(what.substr(at, what.find(':', at) - at)), 1u) << what;
    }
    EXPECT_FALSE(fs::exists(out));
  }
}

// ReadAhead alone: every byte read once, no more than the read-ahead (plus one chunk) in memory
// beyond the group in use, and a short file named.
TEST(PackPipeline, ReadAheadStaysWithinItsWindow) {
  const std::string path = test::temp_dir("pipeline-window") + "/data";
  const uint64_t mb = 1 << 20, group = 3 * mb;
  std::ofstream(path) << std::string(size_t(40 * mb), 'x');
  const auto file = MappedFile::open(path);
  std::vector<std::vector<packer::SourceRange>> groups;
  for (uint64_t at = 0; at + group <= file->size(); at += group)
    groups.push_back({{reinterpret_cast<const char*>(file->data()) + at, group, path, "t" + std::to_string(at / group)}});
  {
    packer::ReadAhead reads(groups, 2 * group, 3);
    for (size_t g = 0; g < groups.size(); ++g) {
      reads.wait(g);
      reads.release(g);
    }
    EXPECT_EQ(reads.read_bytes(), groups.size() * group);
    EXPECT_LE(reads.peak_in_flight(), group + 2 * group + 8 * mb);
  }
  fs::resize_file(path, 20 * mb + 100);  // groups 6.. lie past the end
  packer::ReadAhead reads(groups, 2 * group, 3);
  for (size_t g = 0; g < 6; ++g) reads.wait(g);
  try {
    reads.wait(6);
    ADD_FAILURE() << "read past the end";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()),
              path + ": tensor t6: the file ends before the tensor's bytes (was it truncated while packing?)");
  }
}

}  // namespace
}  // namespace moestream
