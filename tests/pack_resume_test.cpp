// moestream pack after an interruption: the files an interrupted run completed are verified and
// kept, the rest written, and the result is the bytes of a pack that ran through; leftovers that
// cannot be resumed are reported and removed. MOESTREAM_PACK_STOP_AFTER=N makes the packer exit
// after N completed files as a kill would (nothing cleaned up).
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>

#include "io/pack.h"
#include "test_util.h"

namespace moestream {
namespace {

namespace fs = std::filesystem;

// The fixture's 3 MoE layers: weights.safetensors and 3 expert files.
std::string source_copy(const std::string& name) {
  const std::string src = test::temp_dir(name) + "/model";
  fs::copy(test::fixture("models/qwen3moe_gqa_tied"), src, fs::copy_options::recursive);
  return src;
}

test::CliResult pack_cli(const std::string& args, int stop_after = 0) {
  if (stop_after > 0) ::setenv("MOESTREAM_PACK_STOP_AFTER", std::to_string(stop_after).c_str(), 1);
  test::CliResult r = test::run_cli("pack " + args);
  ::unsetenv("MOESTREAM_PACK_STOP_AFTER");
  return r;
}

// Every file under `dir` by relative path, with its bytes.
std::map<std::string, std::string> tree(const std::string& dir) {
  std::map<std::string, std::string> files;
  for (const auto& e : fs::recursive_directory_iterator(dir))
    if (e.is_regular_file()) files[fs::relative(e.path(), dir).string()] = test::read_file(e.path().string());
  return files;
}

// The temporary directories next to `out` (its parent's entries other than out itself).
std::vector<std::string> leftovers(const std::string& out) {
  std::vector<std::string> found;
  for (const auto& e : fs::directory_iterator(fs::path(out).parent_path()))
    if (e.path() != fs::path(out)) found.push_back(e.path().string());
  return found;
}

// A pack stopped part way, as a kill would: returns its temporary directory.
std::string interrupted(const std::string& src, const std::string& out, const std::string& flags, int files) {
  const auto r = pack_cli(src + " " + out + " " + flags, files);
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_NE(r.err.find("stopping after " + std::to_string(files) + " files"), std::string::npos) << r.err;
  EXPECT_FALSE(fs::exists(out));
  const std::vector<std::string> left = leftovers(out);
  EXPECT_EQ(left.size(), 1u);
  return left.empty() ? "" : left[0];
}

std::string clean_pack(const std::string& src, const std::string& name, const std::string& flags) {
  const std::string out = test::temp_dir(name) + "/pack";
  const auto r = pack_cli(src + " " + out + " " + flags);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  return out;
}

TEST(PackResume, ContinuesAndWritesTheSameBytes) {
  const std::string src = source_copy("resume-src");
  const std::string flags = "--quant q4 --group-size 32 --quant-all -t 2";
  const std::string clean = clean_pack(src, "resume-clean", flags);
  const std::string out = test::temp_dir("resume-out") + "/pack";
  // Stopped after the resident weights and the first layer's experts.
  const std::string tmp = interrupted(src, out, flags, 2);
  EXPECT_TRUE(fs::exists(tmp + "/weights.safetensors"));
  EXPECT_TRUE(fs::exists(tmp + "/experts/layer-0.bin"));
  const auto r = pack_cli(src + " " + out + " " + flags);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find("pack: resuming " + tmp + ", left by process"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("kept 2 of 2 completed files"), std::string::npos) << r.err;
  EXPECT_EQ(tree(out), tree(clean));
  EXPECT_TRUE(leftovers(out).empty());
  // Interrupted again after it resumed (one more file), then once more with nothing left but the
  // manifest: still the same bytes. OUT is relative here (the temporaries are found beside it).
  const std::string dir2 = test::temp_dir("resume-twice"), out2 = dir2 + "/pack";
  const auto in_dir = [&](const std::string& stop) {
    const std::string err = test::temp_dir("resume-twice-err") + "/stderr";
    const std::string cmd = "cd " + dir2 + " && MOESTREAM_PACK_STOP_AFTER=" + stop + " " + MOESTREAM_BINARY + " pack " +
                            src + " pack " + flags + " 2>" + err;
    const int status = std::system(cmd.c_str());
    return test::CliResult{WIFEXITED(status) ? WEXITSTATUS(status) : -1, "", test::read_file(err)};
  };
  EXPECT_EQ(in_dir("1").exit_code, 1);
  EXPECT_EQ(in_dir("1").exit_code, 1);
  EXPECT_EQ(in_dir("2").exit_code, 1);
  EXPECT_EQ(leftovers(out2).size(), 1u);
  const auto last = in_dir("");
  ASSERT_EQ(last.exit_code, 0) << last.err;
  EXPECT_NE(last.err.find("kept 4 of 4 completed files"), std::string::npos) << last.err;
  EXPECT_EQ(tree(out2), tree(clean));
  EXPECT_TRUE(leftovers(out2).empty());
}

// GPTQ calibrates again for the layers left (its scratch pack is not resumed): the same bytes.
TEST(PackResume, GptqPackResumes) {
  const std::string src = test::fixture("models/qwen3moe_ppl");
  const std::string flags = "--quant q3 --group-size 32 --gptq " + src + "/text.txt";
  const std::string clean = clean_pack(src, "gptq-clean", flags);
  const std::string out = test::temp_dir("gptq-out") + "/pack";
  interrupted(src, out, flags, 2);
  const auto r = pack_cli(src + " " + out + " " + flags);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find("kept 2 of 2 completed files"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("gptq: calibrated"), std::string::npos) << r.err;
  EXPECT_EQ(tree(out), tree(clean));
  EXPECT_TRUE(leftovers(out).empty());
}

TEST(PackResume, CorruptedKeptFilesAreWrittenAgain) {
  const std::string src = source_copy("corrupt-src");
  const std::string clean = clean_pack(src, "corrupt-clean", "--quant q8 --group-size 32");
  const std::string out = test::temp_dir("corrupt-out") + "/pack";
  const std::string tmp = interrupted(src, out, "--quant q8 --group-size 32", 3);
  {  // one byte of layer 1's second expert, and one of the resident weights' data
    std::fstream f(tmp + "/experts/layer-1.bin", std::ios::in | std::ios::out | std::ios::binary);
    const PackManifest m = PackManifest::load(clean);
    f.seekp(std::streamoff(m.expert(1, 1).offset + 100));
    f.put('\x5a');
    std::fstream w(tmp + "/weights.safetensors", std::ios::in | std::ios::out | std::ios::binary | std::ios::ate);
    w.seekp(-3, std::ios::end);
    w.put('\x01');
  }
  const auto r = pack_cli(src + " " + out + " --quant q8 --group-size 32");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find("kept 1 of 3 completed files"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("weights.safetensors does not match its checksums: written again"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("experts/layer-1.bin: expert 1 does not match its checksum: written again"), std::string::npos)
      << r.err;
  EXPECT_EQ(tree(out), tree(clean));
  // A kept file cut short is written again too.
  const std::string out2 = test::temp_dir("corrupt-short") + "/pack";
  const std::string tmp2 = interrupted(src, out2, "--quant q8 --group-size 32", 2);
  fs::resize_file(tmp2 + "/experts/layer-0.bin", fs::file_size(tmp2 + "/experts/layer-0.bin") - 4096);
  const auto r2 = pack_cli(src + " " + out2 + " --quant q8 --group-size 32");
  ASSERT_EQ(r2.exit_code, 0) << r2.err;
  EXPECT_NE(r2.err.find("kept 1 of 2"), std::string::npos) << r2.err;
  EXPECT_NE(r2.err.find("experts/layer-0.bin: shorter than the journal says"), std::string::npos) << r2.err;
  EXPECT_EQ(tree(out2), tree(clean));
}

TEST(PackResume, OtherOptionsOrAChangedSourceStartOver) {
  const std::string src = source_copy("options-src");
  const std::string out = test::temp_dir("options-out") + "/pack";
  const std::string tmp = interrupted(src, out, "--quant q4 --group-size 32", 2);
  const auto r = pack_cli(src + " " + out + " --quant q8 --group-size 32");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find("pack: removed " + tmp + " ("), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("MB), an unfinished pack left by process"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("it was packed with other options (--quant q4, now q8)"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("resuming"), std::string::npos) << r.err;
  EXPECT_EQ(tree(out), tree(clean_pack(src, "options-clean", "--quant q8 --group-size 32")));
  EXPECT_TRUE(leftovers(out).empty());

  const std::string out2 = test::temp_dir("source-out") + "/pack";
  const std::string tmp2 = interrupted(src, out2, "--quant q8 --group-size 32", 2);
  std::ofstream(src + "/generation_config.json", std::ios::app) << "\n";
  const auto r2 = pack_cli(src + " " + out2 + " --quant q8 --group-size 32");
  ASSERT_EQ(r2.exit_code, 0) << r2.err;
  EXPECT_NE(r2.err.find("pack: removed " + tmp2), std::string::npos) << r2.err;
  EXPECT_NE(r2.err.find(": its source changed"), std::string::npos) << r2.err;
  EXPECT_EQ(r2.err.find("resuming"), std::string::npos) << r2.err;
}

TEST(PackResume, StaleTemporariesAreReportedAndRemoved) {
  const std::string src = source_copy("stale-src");
  const std::string dir = test::temp_dir("stale");
  const std::string out = dir + "/pack";
  // A temporary without a journal (an older moestream's, or killed as it started), a GPTQ
  // calibration scratch pack, one of another destination, and one whose writer still runs.
  const std::vector<std::string> names = {"pack.tmp-999999999", "pack.calib.tmp-999999998", "other.tmp-999999997",
                                          "pack.tmp-" + std::to_string(getpid())};
  for (const std::string& name : names) {
    fs::create_directories(dir + "/" + name + "/experts");
    std::ofstream(dir + "/" + name + "/experts/layer-0.bin") << std::string(2'500'000, 'x');
  }
  const auto r = pack_cli(src + " " + out);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find("pack: removed " + dir + "/pack.tmp-999999999 (2.5 MB), an unfinished pack left by process "
                       "999999999: it has no journal to resume from"),
            std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("pack: removed " + dir + "/pack.calib.tmp-999999998 (2.5 MB)"), std::string::npos) << r.err;
  EXPECT_FALSE(fs::exists(dir + "/pack.tmp-999999999"));
  EXPECT_FALSE(fs::exists(dir + "/pack.calib.tmp-999999998"));
  EXPECT_TRUE(fs::exists(dir + "/other.tmp-999999997"));
  EXPECT_TRUE(fs::exists(dir + "/pack.tmp-" + std::to_string(getpid())));
  EXPECT_EQ(r.err.find("other.tmp"), std::string::npos) << r.err;
}

// OUT/ is OUT: its temporary directory lies beside it (it was made inside it, and the rename
// into place failed).
TEST(PackResume, OutputWithATrailingSlash) {
  const std::string dir = test::temp_dir("slash");
  const auto r = pack_cli(test::fixture("models/qwen3moe_gqa_tied") + " " + dir + "/pack/");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(is_pack_dir(dir + "/pack"));
  EXPECT_TRUE(leftovers(dir + "/pack").empty());
}

// The pack a model directory gets on first use (ensure_pack) resumes the same way.
TEST(PackResume, AutoPackResumes) {
  const std::string src = source_copy("auto-src");
  const std::string cache = test::temp_dir("auto-cache");
  const char* was = std::getenv("MOESTREAM_CACHE");
  const std::string before = was ? was : "";
  ::setenv("MOESTREAM_CACHE", cache.c_str(), 1);
  ::setenv("MOESTREAM_PACK_STOP_AFTER", "2", 1);
  const auto stopped = test::run_cli("run -m " + src + " --tokens 1 -n 1 --ids");
  ::unsetenv("MOESTREAM_PACK_STOP_AFTER");
  EXPECT_EQ(stopped.exit_code, 1) << stopped.err;
  const auto r = test::run_cli("run -m " + src + " --tokens 1 -n 1 --ids");
  if (was)
    ::setenv("MOESTREAM_CACHE", before.c_str(), 1);
  else
    ::unsetenv("MOESTREAM_CACHE");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find("kept 2 of 2 completed files"), std::string::npos) << r.err;
  size_t packs = 0;
  for (const auto& e : fs::directory_iterator(cache + "/packs")) {
    ++packs;
    EXPECT_TRUE(is_pack_dir(e.path().string())) << e.path();
    EXPECT_TRUE(verify_pack(e.path().string()).problems.empty()) << e.path();
  }
  EXPECT_EQ(packs, 1u);
}

}  // namespace
}  // namespace moestream
