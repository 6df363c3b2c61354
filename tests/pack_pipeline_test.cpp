// pack's pipeline: the source read ahead of the conversion (--read-io direct, buffered or mmap)
// and the converted experts written on their own thread, resident matrices quantized by blocks of
// rows. None of it may change a byte of the pack; a read that fails (a source truncated while
// packing) is one line naming the file and the tensor, not a SIGBUS or a hang; memory stays
// bounded by what is in flight.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <deque>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
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

// The files of `dir` leave the page cache (written out first), so that --read-io auto reads them
// from the disk.
void drop_page_cache(const std::string& dir) {
  for (const auto& e : fs::directory_iterator(dir)) {
    const int fd = ::open(e.path().c_str(), O_RDONLY | O_CLOEXEC);
    ASSERT_GE(fd, 0) << e.path();
    ::fdatasync(fd);
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
  }
}

// A qwen3_moe checkpoint in three shards whose expert weights span many pages (the fixtures'
// are under one page, so that only their first and last pages would be read): 2 layers of 4
// experts of 128 x 256 bf16 (64 KiB), norms of 512 bytes between them so that no tensor starts
// on a page, seeded random values.
std::string sharded_source() {
  const std::string dir = test::temp_dir("pipeline-sharded") + "/model";
  if (fs::exists(dir + "/config.json")) return dir;
  fs::create_directories(dir);
  json config = json::parse(test::read_file(test::fixture(kSource) + "/config.json"));
  const int64_t hidden = 256, inter = 128, experts = 4, vocab = 64;
  config["hidden_size"] = hidden;
  config["moe_intermediate_size"] = inter;
  config["num_local_experts"] = experts;
  config["vocab_size"] = vocab;
  std::ofstream(dir + "/config.json") << config.dump(1);
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 0.02f);
  std::deque<std::vector<uint16_t>> values;
  const auto tensor = [&](const std::string& name, std::vector<int64_t> shape) {
    auto& v = values.emplace_back(size_t(shape[0] * (shape.size() > 1 ? shape[1] : 1)));
    for (uint16_t& x : v) x = f32_to_bf16(shape.size() > 1 ? normal(rng) : 1.0f);
    return TensorToWrite{name, DType::BF16, shape, v.data()};
  };
  std::vector<std::vector<TensorToWrite>> shards(3);
  shards[0].push_back(tensor("model.embed_tokens.weight", {vocab, hidden}));
  for (int64_t l = 0; l < 2; ++l) {
    auto& shard = shards[size_t(l)];
    const std::string p = "model.layers." + std::to_string(l) + ".";
    shard.push_back(tensor(p + "input_layernorm.weight", {hidden}));
    shard.push_back(tensor(p + "mlp.gate.weight", {experts, hidden}));
    for (int64_t e = 0; e < experts; ++e) {
      const std::string q = p + "mlp.experts." + std::to_string(e) + ".";
      shard.push_back(tensor(q + "gate_proj.weight", {inter, hidden}));
      shard.push_back(tensor(q + "up_proj.weight", {inter, hidden}));
      shard.push_back(tensor(q + "down_proj.weight", {hidden, inter}));
      shard.push_back(tensor(q + "norm.weight", {hidden}));  // a resident tensor between experts
    }
  }
  shards[2].push_back(tensor("model.norm.weight", {hidden}));
  shards[2].push_back(tensor("lm_head.weight", {vocab, hidden}));
  json index = {{"weight_map", json::object()}};
  for (size_t i = 0; i < shards.size(); ++i) {
    const std::string name = "model-0000" + std::to_string(i + 1) + "-of-00003.safetensors";
    write_safetensors(dir + "/" + name, shards[i], {{"format", "pt"}});
    for (const TensorToWrite& t : shards[i]) index["weight_map"][t.name] = name;
  }
  std::ofstream(dir + "/model.safetensors.index.json") << index.dump(1);
  return dir;
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

// Each way of reading the source gives the bytes of the old mapped read on one thread, on a source
// in three shards whose tensors span many pages and start and end inside pages, for several
// thread counts, read-aheads and reads in flight; --quant keep writes the experts from the source's
// memory as it was read.
TEST(PackPipeline, ReadIoDoesNotChangeTheBytes) {
  const std::string src = sharded_source();
  for (const std::string quant : {"--quant q4 --group-size 32 --quant-all", "--quant keep"}) {
    const auto mapped =
        tree(pack_with(src, "pipeline-mapped", quant + " -t 1 --read-ahead 0 --read-io mmap --read-threads 1"));
    for (const std::string run : {"--read-io direct -t 1 --read-ahead 0 --read-threads 1",
                                  "--read-io direct -t 2 --read-ahead 1",
                                  "--read-io direct -t 3 --read-ahead 5 --read-threads 3",
                                  "--read-io auto -t 3 --read-ahead 1 --read-threads 2",
                                  "--read-io buffered -t 2 --read-ahead 2 --read-threads 16",
                                  "--read-io mmap -t 3 --read-ahead 2 --read-threads 8"})
      EXPECT_EQ(tree(pack_with(src, "pipeline-read-io", quant + " " + run)), mapped) << quant << " " << run;
    // The default, auto, with the source gone from the page cache once it is open (a small file's
    // first read, the header's, brings all of it in): read with O_DIRECT.
    const Architecture& arch = find_architecture("qwen3_moe", "test");
    PackOptions options;
    options.quant = quant == "--quant keep" ? "keep" : "q4";
    options.group_size = 32;
    options.quant_all = quant != "--quant keep";
    options.threads = 2;
    options.progress = false;
    options.skip = arch.unused_tensors;
    options.opened = [&] { drop_page_cache(src); };
    const std::string out = test::temp_dir("pipeline-read-io-cold") + "/pack";
    fs::remove_all(out);
    write_pack(src, out, arch.expert_tensors, options);
    EXPECT_EQ(tree(out), mapped) << quant << ", auto, cold";
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
// naming the file and a tensor that was cut, for every way of reading, read-ahead and thread
// count, on one file and on the second of three shards; no SIGBUS.
TEST(PackPipeline, SourceTruncatedWhilePackingIsNamed) {
  const Architecture& arch = find_architecture("qwen3_moe", "test");
  const std::pair<std::string, std::string> sources[] = {{test::fixture(kSource), "model.safetensors"},
                                                         {sharded_source(), "model-00002-of-00003.safetensors"}};
  for (const auto& [source, shard_name] : sources)
    for (const std::string io : {"auto", "direct", "buffered", "mmap"})
      for (const auto& [threads, ahead] : {std::pair{1, 0}, {3, 2}}) {
        SCOPED_TRACE(shard_name + " --read-io " + io + " -t " + std::to_string(threads) + " --read-ahead " +
                     std::to_string(ahead));
        const std::string src = test::temp_dir("pipeline-truncated-src") + "/model";
        fs::remove_all(src);
        fs::copy(source, src, fs::copy_options::recursive);
        const std::string shard = src + "/" + shard_name;
        // Cut at the start of the largest tensor: it and every tensor whose pages reach past the
        // new end can no longer be read.
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
        options.read_io = io;
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
          EXPECT_NE(what.find(": the file ends before the tensor's bytes (was it truncated while packing?)"),
                    std::string::npos)
              << what;
          const size_t at = shard.size() + 9;
          EXPECT_EQ(cut.count(what.substr(at, what.find(':', at) - at)), 1u) << what;
        }
        EXPECT_FALSE(fs::exists(out));
      }
}

// ReadAhead alone, each way of reading: every byte read once and where the file has it (ranges
// that start and end inside pages, so that neighbours share their first and last pages), no more
// than the read-ahead (plus one chunk) in memory beyond the group in use, the file's bytes back in
// the mapping after release and after the reader is gone, and a short file named.
TEST(PackPipeline, ReadAheadStaysWithinItsWindow) {
  const std::string path = test::temp_dir("pipeline-window") + "/data";
  const uint64_t mb = 1 << 20, group = 3 * mb + 1000;
  std::string bytes(size_t(40 * mb), '\0');
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = char(i % 251);
  for (const packer::SourceIo io :
       {packer::SourceIo::Auto, packer::SourceIo::Direct, packer::SourceIo::Buffered, packer::SourceIo::Mapped}) {
    SCOPED_TRACE(int(io));
    std::ofstream(path, std::ios::binary) << bytes;
    drop_page_cache(fs::path(path).parent_path().string());
    if (io == packer::SourceIo::Auto) {  // the first 10 MB (and its readahead) cached and mapped, the rest read
      std::string head(size_t(10 * mb), '\0');
      std::ifstream(path, std::ios::binary).read(head.data(), std::streamsize(head.size()));
    }
    const auto file = MappedFile::open(path);
    const char* data = reinterpret_cast<const char*>(file->data());
    std::vector<std::vector<packer::SourceRange>> groups;
    for (uint64_t at = 100; at + group <= file->size(); at += group)
      groups.push_back({{data + at, group, file.get(), "t" + std::to_string(groups.size())}});
    {
      packer::ReadAhead reads(groups, {2 * group, 3, io});
      for (size_t g = 0; g < groups.size(); ++g) {
        reads.wait(g);
        EXPECT_EQ(std::string(groups[g][0].data, group), bytes.substr(size_t(groups[g][0].data - data), group)) << g;
        reads.release(g);
        EXPECT_EQ(groups[g][0].data[group / 2], bytes[size_t(groups[g][0].data - data + group / 2)]) << g;
      }
      EXPECT_GE(reads.read_bytes(), groups.size() * group);
      EXPECT_LE(reads.read_bytes(), groups.size() * (group + 2 * 4096));
      EXPECT_LE(reads.peak_in_flight(), group + 2 * group + 8 * mb + 2 * 4096);
    }
    {
      packer::ReadAhead reads(groups, {2 * group, 3, io});
      reads.wait(0);  // the rest read ahead, never released
    }
    EXPECT_EQ(std::string(data, bytes.size()), bytes);
    fs::resize_file(path, 20 * mb + 100);  // groups 6.. lie past the end
    packer::ReadAhead reads(groups, {2 * group, 3, io});
    for (size_t g = 0; g < 6; ++g) reads.wait(g);
    try {
      reads.wait(6);
      ADD_FAILURE() << "read past the end";
    } catch (const Error& e) {
      EXPECT_EQ(std::string(e.what()),
                path + ": tensor t6: the file ends before the tensor's bytes (was it truncated while packing?)");
    }
  }
}

}  // namespace
}  // namespace moestream
