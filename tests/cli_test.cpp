// The command line as a user of llama.cpp or Ollama meets it: familiar flags, one-line errors with
// "did you mean", model discovery (the Hugging Face cache, GGUF said plainly), the pack cache,
// bench repetitions, and a terminal chat that survives Ctrl-C and saves its conversation.
#include <gtest/gtest.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <thread>

#include <httplib.h>

#include "test_util.h"
#include "text/unicode.h"

namespace fs = std::filesystem;
using nlohmann::json;
using namespace moestream;

namespace {

// The tiny random-weight Qwen3-MoE chat model of the server tests, with the Qwen3 tokenizer.
const std::string& chat_model() {
  static const std::string dir = test::tiny_chat_copy("cli-chat-model");
  return dir;
}

std::string cache_env() { return "MOESTREAM_CACHE=" + test::temp_dir("cli-cache") + " "; }

test::CliResult cli(const std::string& args, const std::string& env = "") {
  // run_cli prefixes the binary; environment assignments go before it through `env`.
  if (env.empty()) return test::run_cli(args);
  const std::string err_path = test::temp_dir("cli-env") + "/stderr";
  test::CliResult r;
  FILE* p = popen(("env " + env + std::string(MOESTREAM_BINARY) + " " + args + " 2>" + err_path).c_str(), "r");
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) r.out.append(buf, n);
  const int status = pclose(p);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.err = test::read_file(err_path);
  return r;
}

size_t lines(const std::string& s) { return size_t(std::count(s.begin(), s.end(), '\n')); }

}  // namespace

TEST(Cli, LlamaCppFlagSpellingsMeanTheSame) {
  const std::string m = "-m " + chat_model() + " --tokens 1,2,3 -n 6 --ids --temp 0 ";
  const auto base = cli("run " + m + "--threads 1 --ctx 64 --seed 5");
  ASSERT_EQ(base.exit_code, 0) << base.err;
  for (const char* alias : {"-t 1 -c 64 -s 5", "--threads 1 --ctx-size 64 --seed 5", "-t 1 -c 64 -ngl 0 -s 5"}) {
    const auto r = cli("run " + m + alias);
    EXPECT_EQ(r.exit_code, 0) << alias << ": " << r.err;
    EXPECT_EQ(r.out, base.out) << alias;
  }
  // -ngl N > 0 asks for the GPU exactly as --device cuda does (on a machine without one: the same error).
  const auto ngl = cli("run " + m + "-ngl 99");
  const auto cuda = cli("run " + m + "--device cuda");
  EXPECT_EQ(ngl.exit_code, cuda.exit_code);
  EXPECT_EQ(ngl.err, cuda.err);
  // -np is serve's --parallel (checked before anything loads).
  const auto np = cli("serve -m " + chat_model() + " -np 0");
  EXPECT_NE(np.exit_code, 0);
  EXPECT_NE(np.err.find("--parallel"), std::string::npos) << np.err;
}

TEST(Cli, PromptFromFileEqualsPromptText) {
  const std::string file = test::temp_dir("cli-prompt") + "/prompt.txt";
  std::ofstream(file) << "The capital of France is";
  const std::string m = "-m " + chat_model() + " -n 5 --ids --temp 0 ";
  const auto text = cli("run " + m + "-p 'The capital of France is'");
  const auto from_file = cli("run " + m + "-f " + file);
  ASSERT_EQ(text.exit_code, 0) << text.err;
  ASSERT_EQ(from_file.exit_code, 0) << from_file.err;
  EXPECT_EQ(from_file.out, text.out);
  const auto both = cli("run " + m + "-f " + file + " -p x");
  EXPECT_NE(both.exit_code, 0);
  EXPECT_NE(both.err.find("exactly one of"), std::string::npos) << both.err;
}

TEST(Cli, MalformedValuesGiveOneShortLine) {
  for (const std::string& args : {"run -m " + chat_model() + " -p x --threads abc",
                                  "run -m " + chat_model() + " -p x --threads -3",
                                  "bench -m " + chat_model() + " -r 0"}) {
    const auto r = cli(args);
    EXPECT_NE(r.exit_code, 0) << args;
    EXPECT_EQ(lines(r.err), 1u) << args << ": " << r.err;
    EXPECT_LT(r.err.size(), 200u) << args << ": " << r.err;  // not CLI11's 300-digit range
    EXPECT_EQ(r.err.find("1.79769"), std::string::npos) << r.err;
  }
}

// `moestream profile` counts each token's chosen experts on the CPU backend (the default even on a
// GPU machine); the CUDA tier routes on the device, so a profile asked of it is refused in one
// line rather than written from the few uses its store sees.
TEST(Cli, ProfileCountsEveryTokensExpertsOnTheCpu) {
  const std::string dir = test::temp_dir("cli-profile");
  std::ofstream(dir + "/text.txt") << "The quick brown fox jumps over the lazy dog, again and again.";
  const auto r = cli("profile -m " + chat_model() + " -f " + dir + "/text.txt -o " + dir + "/p.json -t 2", cache_env());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const json p = json::parse(test::read_file(dir + "/p.json"));
  const int64_t tokens = p["tokens"].get<int64_t>();
  const json cfg = json::parse(test::read_file(chat_model() + "/config.json"));
  const int64_t k = cfg["num_experts_per_tok"].get<int64_t>();
  ASSERT_GT(tokens, 5);
  for (const auto& layer : p["counts"]) {
    int64_t sum = 0;
    for (const auto& c : layer) sum += c.get<int64_t>();
    EXPECT_EQ(sum, tokens * k);  // one count per token and chosen expert
  }
  const auto gpu = cli("profile -m " + chat_model() + " -f " + dir + "/text.txt -o " + dir + "/q.json --device cuda",
                       cache_env());
  EXPECT_NE(gpu.exit_code, 0);
  EXPECT_EQ(lines(gpu.err), 1u) << gpu.err;
  EXPECT_NE(gpu.err.find("--device cpu"), std::string::npos) << gpu.err;
  EXPECT_FALSE(fs::exists(dir + "/q.json"));
}

TEST(Cli, NearMissesGetDidYouMean) {
  auto r = cli("run -m " + chat_model() + " -p x --ctx-siz 64");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("did you mean --ctx-size?"), std::string::npos) << r.err;
  EXPECT_EQ(lines(r.err), 1u) << r.err;
  r = cli("rn -m " + chat_model());
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("did you mean run?"), std::string::npos) << r.err;
  r = cli("run -m " + chat_model() + " -p x --temperature 0");  // llama.cpp's spelling of --temp
  EXPECT_NE(r.err.find("did you mean --temp?"), std::string::npos) << r.err;
}

TEST(Cli, RunRefusesToGoPastTheTrainedContextUnlessAsked) {
  // The fixture was trained (configured) for 4096 positions.
  const std::string m = "-m " + chat_model() + " --tokens 1,2,3 --ids --temp 0 ";
  auto r = cli("run " + m + "-n 4094");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("max_position_embeddings"), std::string::npos) << r.err;
  r = cli("run " + m + "-n 8 -c 8");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("more than -c 8"), std::string::npos) << r.err;
  r = cli("run " + m + "-n 2 -c 5000");
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find("warning: -c 5000 is past the 4096 positions"), std::string::npos) << r.err;
}

TEST(Cli, GgufAndMissingModelsAreNamedPlainly) {
  const std::string dir = test::temp_dir("cli-gguf");
  std::ofstream(dir + "/model.gguf", std::ios::binary) << "GGUF\x03\x00\x00\x00 rest of a gguf file";
  auto r = cli("run -m " + dir + "/model.gguf -p x");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_EQ(lines(r.err), 1u) << r.err;
  EXPECT_NE(r.err.find("a GGUF file"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("Hugging Face"), std::string::npos) << r.err;
  r = cli("run -m " + dir + "/nothing-here -p x");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("no such model directory"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find(".cpp"), std::string::npos) << r.err;  // no source paths
}

// A Hugging Face hub cache as huggingface_hub lays it out: blobs, a snapshot of symlinks to
// them, and refs/main naming the snapshot.
std::string make_hub_cache(const std::string& repo_folder) {
  const std::string hub = test::temp_dir("cli-hub");
  const fs::path repo = fs::path(hub) / repo_folder;
  const std::string commit = "0123456789abcdef0123456789abcdef01234567";
  fs::create_directories(repo / "blobs");
  fs::create_directories(repo / "snapshots" / commit);
  fs::create_directories(repo / "refs");
  std::ofstream(repo / "refs" / "main") << commit;
  int i = 0;
  for (const auto& e : fs::directory_iterator(chat_model())) {
    const fs::path blob = repo / "blobs" / ("blob" + std::to_string(i++));
    fs::copy_file(e.path(), blob);
    fs::create_symlink(fs::path("../../blobs") / blob.filename(), repo / "snapshots" / commit / e.path().filename());
  }
  return hub;
}

TEST(Cli, RepoIdsResolveInTheHuggingFaceCache) {
  const std::string hub = make_hub_cache("models--tiny-org--tiny-chat");
  const std::string cache = test::temp_dir("cli-hub-cache");
  const std::string env = "HF_HUB_CACHE=" + hub + " MOESTREAM_CACHE=" + cache + " ";
  const auto direct = cli("run -m " + chat_model() + " --tokens 1,2,3 -n 4 --ids --temp 0");
  const auto by_id = cli("run -m tiny-org/tiny-chat --tokens 1,2,3 -n 4 --ids --temp 0", env);
  ASSERT_EQ(by_id.exit_code, 0) << by_id.err;
  EXPECT_EQ(by_id.out, direct.out);
  // The pack is named after the model, not the snapshot's commit hash.
  size_t named = 0;
  for (const auto& e : fs::directory_iterator(cache + "/packs"))
    named += e.path().filename().string().rfind("tiny-org--tiny-chat-", 0) == 0;
  EXPECT_EQ(named, 1u);
  const auto missing = cli("run -m tiny-org/other --tokens 1 -n 1", env);
  EXPECT_EQ(missing.exit_code, 1);
  EXPECT_NE(missing.err.find("not in the Hugging Face cache"), std::string::npos) << missing.err;
  // list shows it, with its family, precision and that a pack now exists.
  const auto list = cli("list", env);
  ASSERT_EQ(list.exit_code, 0) << list.err;
  EXPECT_NE(list.out.find("tiny-org/tiny-chat"), std::string::npos) << list.out;
  EXPECT_NE(list.out.find("qwen3_moe"), std::string::npos) << list.out;
  size_t row = list.out.find("tiny-org/tiny-chat");
  EXPECT_NE(list.out.substr(row, list.out.find('\n', row) - row).find(" yes "), std::string::npos) << list.out;
}

// Auto-pack says what it does, with progress also when stderr is not a terminal, and clears away
// the temporary directory an interrupted earlier pack left.
TEST(Cli, AutoPackTellsAndCleansUpAfterAnInterruptedOne) {
  const std::string cache = test::temp_dir("cli-autopack");
  fs::create_directories(cache + "/packs/chat-0123.tmp-999999999/experts");
  std::ofstream(cache + "/packs/chat-0123.tmp-999999999/weights.safetensors") << "partial";
  const auto r = cli("run -m " + chat_model() + " --tokens 1 -n 1 --ids", "MOESTREAM_CACHE=" + cache + " ");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_FALSE(fs::exists(cache + "/packs/chat-0123.tmp-999999999"));
  EXPECT_NE(r.err.find("removed " + cache + "/packs/chat-0123.tmp-999999999, an unfinished pack"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("moestream: packing " + chat_model()), std::string::npos) << r.err;
  // The last progress line (stderr is a file here): 100%, and no rate made of tiny numbers.
  const size_t last = r.err.rfind("packing: 100.0%");
  ASSERT_NE(last, std::string::npos) << r.err;
  const std::string line = r.err.substr(last, r.err.find('\n', last) - last);
  const size_t mb = line.find(" MB/s");
  ASSERT_NE(mb, std::string::npos) << line;
  const std::string rate = line.substr(line.rfind(' ', mb - 1) + 1, mb - line.rfind(' ', mb - 1) - 1);
  EXPECT_TRUE(rate == "---" || std::stod(rate) < 1e5) << line;
  // The second run reuses the pack and says nothing about packing.
  const auto again = cli("run -m " + chat_model() + " --tokens 1 -n 1 --ids", "MOESTREAM_CACHE=" + cache + " ");
  EXPECT_EQ(again.err.find("packing"), std::string::npos) << again.err;
}

TEST(Cli, CachePruneRemovesAbandonedAndOrphanedPacks) {
  const std::string cache = test::temp_dir("cli-prune");
  const std::string env = "MOESTREAM_CACHE=" + cache + " ";
  // An auto-pack of a copy of the model, whose source then disappears.
  const std::string src = test::temp_dir("cli-prune-src") + "/model";
  fs::copy(chat_model(), src);
  ASSERT_EQ(cli("run -m " + src + " --tokens 1 -n 1 --ids", env).exit_code, 0);
  // A live pack of the real fixture copy, and an unfinished one whose writer is gone.
  ASSERT_EQ(cli("run -m " + chat_model() + " --tokens 1 -n 1 --ids", env).exit_code, 0);
  fs::create_directories(cache + "/packs/x-0000.tmp-999999999");
  std::ofstream(cache + "/packs/x-0000.tmp-999999999/weights.safetensors") << "partial";
  fs::remove_all(src);
  const auto listed = cli("cache list", env);
  EXPECT_NE(listed.out.find("(gone)"), std::string::npos) << listed.out;
  EXPECT_NE(listed.out.find("abandoned"), std::string::npos) << listed.out;
  const auto dry = cli("cache prune --dry-run", env);
  EXPECT_NE(dry.out.find("would remove"), std::string::npos) << dry.out;
  EXPECT_TRUE(fs::exists(cache + "/packs/x-0000.tmp-999999999"));
  const auto pruned = cli("cache prune", env);
  ASSERT_EQ(pruned.exit_code, 0) << pruned.err;
  size_t left = 0;
  for (const auto& e : fs::directory_iterator(cache + "/packs")) left += e.is_directory();
  EXPECT_EQ(left, 1u) << pruned.out;  // the pack of the model that still exists
  EXPECT_FALSE(fs::exists(cache + "/packs/x-0000.tmp-999999999"));
}

TEST(Cli, BenchRepetitionsReportMeanAndSpread) {
  const auto r = cli("bench -m " + chat_model() + " -p 8 -n 4 -r 3 --raw-read-mb 1 --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const json j = json::parse(r.out);
  ASSERT_EQ(j["tg"]["samples"].size(), 3u);
  ASSERT_EQ(j["pp"]["samples"].size(), 3u);
  double mean = 0;
  for (double x : j["tg"]["samples"]) mean += x / 3;
  EXPECT_NEAR(j["tg"]["tok_per_s"].get<double>(), mean, 1e-6 * mean);
  EXPECT_GE(j["tg"]["tok_per_s_sd"].get<double>(), 0.0);
  const auto table = cli("bench -m " + chat_model() + " -p 8 -n 4 -r 2 --raw-read-mb 1");
  ASSERT_EQ(table.exit_code, 0) << table.err;
  for (const char* column : {"| model", "size", "params", "backend", "threads", "test", "t/s", "hit rate", "±"})
    EXPECT_NE(table.out.find(column), std::string::npos) << column << "\n" << table.out;
}

TEST(Cli, PerplexityGivesErrorEstimatesAndKlPercentiles) {
  const std::string dir = test::fixture("models/qwen3moe_ppl");
  const std::string kl = test::temp_dir("cli-ppl") + "/base.kl";
  const std::string env = cache_env();
  const auto r = cli("perplexity -m " + dir + " -f " + dir + "/text.txt -c 32 --chunks 2 --kl-save " + kl, env);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("ppl = "), std::string::npos);
  EXPECT_NE(r.out.find(" +/- "), std::string::npos) << r.out;
  // Against itself with int8 activations: a small, non-zero KL with its spread.
  const auto q = cli("perplexity -m " + dir + " -f " + dir + "/text.txt -c 32 --chunks 2 --int8-activations --kl-base " + kl, env);
  ASSERT_EQ(q.exit_code, 0) << q.err;
  EXPECT_NE(q.out.find("kl divergence (base || this run) = "), std::string::npos) << q.out;
  EXPECT_NE(q.out.find("kl percentiles: median "), std::string::npos) << q.out;
  EXPECT_NE(q.out.find("99.9% "), std::string::npos) << q.out;
  EXPECT_NE(q.out.find("top-1 agreement = "), std::string::npos) << q.out;
}

// Runs `moestream chat` with a pipe as its terminal, and Ctrl-C sent by the test.
class ChatProcess {
 public:
  explicit ChatProcess(std::vector<std::string> args) {
    int in[2], out[2];
    EXPECT_EQ(pipe(in), 0);
    EXPECT_EQ(pipe(out), 0);
    err_path_ = test::temp_dir("cli-chat") + "/stderr";
    pid_ = fork();
    if (pid_ == 0) {
      dup2(in[0], 0);
      dup2(out[1], 1);
      close(in[1]);
      close(out[0]);
      const int err = open(err_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      dup2(err, 2);
      args.insert(args.begin(), {MOESTREAM_BINARY, "chat"});
      std::vector<char*> argv;
      for (auto& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      execv(MOESTREAM_BINARY, argv.data());
      _exit(127);
    }
    close(in[0]);
    close(out[1]);
    to_ = in[1];
    from_ = out[0];
  }
  ~ChatProcess() {
    if (pid_ > 0 && !waited_) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
    close(to_);
    close(from_);
  }
  void send(const std::string& text) { ASSERT_EQ(write(to_, text.data(), text.size()), ssize_t(text.size())); }
  // Reads stdout until it holds `n` bytes more than before.
  std::string read_some(size_t n) {
    std::string got;
    char buf[4096];
    while (got.size() < n) {
      const ssize_t k = read(from_, buf, sizeof buf);
      if (k <= 0) break;
      got.append(buf, size_t(k));
    }
    return got;
  }
  void interrupt() { kill(pid_, SIGINT); }
  int wait() {
    close(to_);
    int status = 0;
    waitpid(pid_, &status, 0);
    waited_ = true;
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }
  std::string err() const { return test::read_file(err_path_); }

 private:
  pid_t pid_ = -1;
  int to_ = -1, from_ = -1;
  bool waited_ = false;
  std::string err_path_;
};

// A copy of the chat model whose tokenizer spells token `id` as the single byte 0xE4 (the first
// byte of a three-byte character): a reply that stops right after it is cut inside a character.
std::string model_with_cut_token(int32_t id, const std::string& name) {
  const std::string dir = test::temp_dir(name);
  fs::remove(dir);
  fs::copy(chat_model(), dir);
  json tok = json::parse(test::read_file(dir + "/tokenizer.json"));
  auto& vocab = tok["model"]["vocab"];
  const std::string byte_e4 = "\xC3\xA4";  // the GPT-2 byte-level alphabet's character for 0xE4
  std::string spelled;
  for (auto it = vocab.begin(); it != vocab.end(); ++it)
    if (it.value().get<int32_t>() == id) spelled = it.key();
  EXPECT_FALSE(spelled.empty()) << id;
  const int32_t e4 = vocab[byte_e4].get<int32_t>();
  vocab[byte_e4] = id;
  vocab[spelled] = e4;
  std::ofstream(dir + "/tokenizer.json") << tok.dump();
  return dir;
}

int32_t first_greedy_id(const std::string& args) {
  const auto r = cli("run -m " + chat_model() + " " + args + " -n 1 --ids --temp 0");
  EXPECT_EQ(r.exit_code, 0) << r.err;
  return std::stoi(r.out);
}

TEST(Cli, RunReplyCutInsideACharacterEndsInReplacementCharacter) {
  const std::string dir = model_with_cut_token(first_greedy_id("-p Bonjour"), "cli-cut-run");
  const auto r = cli("run -m " + dir + " -p Bonjour -n 1 --temp 0");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, "\xEF\xBF\xBD\n");  // U+FFFD, as transformers decodes b"\xe4"
}

TEST(Cli, ChatReplyCutInsideACharacterKeepsTheConversation) {
  // The chat's first reply token: the rendered prompt, tokenized, run for one token.
  const std::string tmp = test::temp_dir("cli-cut-chat");
  std::ofstream(tmp + "/messages.json") << R"([{"role": "user", "content": "Hello"}])";
  const auto rendered = cli("template -m " + chat_model() + " --messages " + tmp + "/messages.json");
  ASSERT_EQ(rendered.exit_code, 0) << rendered.err;
  std::ofstream(tmp + "/prompt.txt") << rendered.out;
  const auto ids = cli("tokenize -m " + chat_model() + " --file " + tmp + "/prompt.txt");
  ASSERT_EQ(ids.exit_code, 0) << ids.err;
  std::string list;
  for (int32_t id : json::parse(ids.out)) list += (list.empty() ? "" : ",") + std::to_string(id);
  const std::string dir = model_with_cut_token(first_greedy_id("--tokens " + list), "cli-cut-chat-model");
  ChatProcess chat({"-m", dir, "-n", "1", "--temp", "0"});
  chat.send("Hello\nAgain\n/save " + tmp + "/conv.json\n/quit\n");
  EXPECT_EQ(chat.wait(), 0) << chat.err();
  const json conv = json::parse(test::read_file(tmp + "/conv.json"));
  ASSERT_EQ(conv["messages"].size(), 4u) << chat.err();  // the second turn encoded the first reply
  EXPECT_EQ(conv["messages"][1]["content"], "\xEF\xBF\xBD");
}

// A conversation that outgrows --ctx: the next message leaves out the oldest exchange, and a reply
// that reaches the end of the context leaves out older turns, is prefilled again and goes on,
// both noted on stderr; a message that cannot fit is a one-line error and the chat goes on.
TEST(Cli, ChatShiftsTheContextInsteadOfStopping) {
  const std::string tmp = test::temp_dir("cli-chat-shift");
  ChatProcess chat({"-m", chat_model(), "--ctx", "96", "-n", "20", "--temp", "0"});
  std::string long_message;
  for (int i = 0; i < 80; ++i) long_message += "many words ";
  chat.send("Hello\n/set max_tokens 100\nAgain\n/set max_tokens 8\nThird\n" + long_message + "\n/save " + tmp +
            "/conv.json\n/quit\n");
  EXPECT_EQ(chat.wait(), 0) << chat.err();
  const std::string err = chat.err();
  // "Again" fits beside the first exchange, its reply of up to 100 tokens does not: the first
  // exchange goes, the reply goes on, then stops at the end of the context with nothing left.
  EXPECT_NE(err.find("(context: left out the 2 oldest messages to continue the reply within --ctx 96)"), std::string::npos) << err;
  EXPECT_NE(err.find("the reply reached the end of the context, --ctx 96"), std::string::npos) << err;
  // "Third" does not fit beside that exchange with room for its reply: the exchange goes first.
  EXPECT_NE(err.find("(context: left out the 2 oldest messages to fit --ctx 96)"), std::string::npos) << err;
  // The long message cannot fit at all: an error, and the conversation stays as it was.
  EXPECT_NE(err.find("the message does not fit: the prompt has "), std::string::npos) << err;
  EXPECT_NE(err.find("the context (--ctx) holds 96"), std::string::npos) << err;
  const json conv = json::parse(test::read_file(tmp + "/conv.json"));
  ASSERT_EQ(conv["messages"].size(), 2u) << conv.dump();
  EXPECT_EQ(conv["messages"][0]["content"], "Third");
  // The reply spans more tokens than the context left it at first.
  const size_t at = err.find("[", err.find("--ctx 96, with no older"));
  ASSERT_NE(at, std::string::npos) << err;
  EXPECT_GT(std::atoi(err.c_str() + at + 1), 96 - 39) << err;
}

// The server's streamed reply (server-sent events) cut inside a character: every event is valid
// UTF-8 JSON and the text ends in U+FFFD, as the plain reply does.
TEST(Cli, StreamedReplyCutInsideACharacterIsValidUtf8) {
  const std::string tmp = test::temp_dir("cli-cut-sse");
  std::ofstream(tmp + "/messages.json") << R"([{"role": "user", "content": "Hello"}])";
  const auto rendered = cli("template -m " + chat_model() + " --messages " + tmp + "/messages.json");
  std::ofstream(tmp + "/prompt.txt") << rendered.out;
  const auto ids = cli("tokenize -m " + chat_model() + " --file " + tmp + "/prompt.txt");
  std::string list;
  for (int32_t id : json::parse(ids.out)) list += (list.empty() ? "" : ",") + std::to_string(id);
  const std::string dir = model_with_cut_token(first_greedy_id("--tokens " + list), "cli-cut-sse-model");
  const std::string err = tmp + "/serve.err";
  const pid_t pid = fork();
  if (pid == 0) {
    const int fd = open(err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(fd, 2);
    execl(MOESTREAM_BINARY, MOESTREAM_BINARY, "serve", "-m", dir.c_str(), "--port", "0", "--name", "tiny", nullptr);
    _exit(127);
  }
  int port = 0;
  for (int i = 0; i < 600 && !port; ++i) {
    const std::string log = test::read_file(err);
    if (const size_t at = log.find("http://127.0.0.1:"); at != std::string::npos) port = std::atoi(log.c_str() + at + 17);
    else std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_GT(port, 0) << test::read_file(err);
  httplib::Client client("127.0.0.1", port);
  const json body = {{"model", "tiny"}, {"messages", {{{"role", "user"}, {"content", "Hello"}}}},
                     {"max_tokens", 1}, {"temperature", 0}, {"stream", true}};
  auto streamed = client.Post("/v1/chat/completions", body.dump(), "application/json");
  auto plain = client.Post("/v1/chat/completions", json({{"model", "tiny"}, {"messages", body["messages"]},
                                                         {"max_tokens", 1}, {"temperature", 0}}).dump(), "application/json");
  kill(pid, SIGTERM);
  waitpid(pid, nullptr, 0);
  ASSERT_TRUE(streamed && plain);
  ASSERT_EQ(streamed->status, 200) << streamed->body;
  EXPECT_EQ(unicode::find_invalid_utf8(streamed->body), std::string::npos);
  std::string text;
  for (size_t at = streamed->body.find("data: {"); at != std::string::npos; at = streamed->body.find("data: {", at + 1)) {
    const json ev = json::parse(streamed->body.substr(at + 6, streamed->body.find('\n', at) - at - 6));
    if (!ev["choices"].empty()) text += ev["choices"][0]["delta"].value("content", "");
  }
  EXPECT_EQ(text, "\xEF\xBF\xBD");
  EXPECT_EQ(json::parse(plain->body)["choices"][0]["message"]["content"], "\xEF\xBF\xBD");
}

TEST(Cli, ChatCommandsSaveAndLoadTheConversation) {
  const std::string dir = test::temp_dir("cli-chat-save");
  ChatProcess chat({"-m", chat_model(), "-n", "8", "--temp", "0"});
  chat.send("/set temp 0\n/bogus\nHello there\n/set top_k -5\n/save " + dir + "/conv.json\n/quit\n");
  EXPECT_EQ(chat.wait(), 0);
  const std::string err = chat.err();
  EXPECT_NE(err.find("unknown command /bogus"), std::string::npos) << err;
  const json conv = json::parse(test::read_file(dir + "/conv.json"));
  ASSERT_EQ(conv["messages"].size(), 2u) << conv.dump();  // /bogus was not sent
  EXPECT_EQ(conv["messages"][0]["content"], "Hello there");
  EXPECT_EQ(conv["messages"][1]["role"], "assistant");
  EXPECT_FALSE(fs::exists(dir + "/conv.json.tmp"));
  // /load continues it: the next reply sees both earlier messages (it saves four).
  ChatProcess again({"-m", chat_model(), "-n", "4", "--temp", "0"});
  again.send("/load " + dir + "/conv.json\nAnd then?\n/save " + dir + "/conv2.json\n/quit\n");
  EXPECT_EQ(again.wait(), 0);
  EXPECT_EQ(json::parse(test::read_file(dir + "/conv2.json"))["messages"].size(), 4u) << again.err();
}

TEST(Cli, CtrlCStopsTheReplyAndTheChatGoesOn) {
  const std::string dir = test::temp_dir("cli-chat-int");
  ChatProcess chat({"-m", chat_model(), "-n", "3000", "-c", "4096", "--temp", "0"});
  chat.send("Write a very long story\n");
  ASSERT_FALSE(chat.read_some(16).empty());  // the reply is streaming
  chat.interrupt();
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  chat.send("/save " + dir + "/conv.json\n");
  for (int i = 0; i < 100 && !fs::exists(dir + "/conv.json"); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  // Twice at the prompt leaves.
  chat.interrupt();
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  chat.interrupt();
  const int code = chat.wait();
  EXPECT_EQ(code, 0) << chat.err();
  EXPECT_NE(chat.err().find("stopped;"), std::string::npos) << chat.err();
  ASSERT_TRUE(fs::exists(dir + "/conv.json")) << chat.err();
  const json conv = json::parse(test::read_file(dir + "/conv.json"));
  ASSERT_EQ(conv["messages"].size(), 2u);  // the stopped reply is kept
  EXPECT_FALSE(conv["messages"][1]["content"].get<std::string>().empty());
}
