// Tokenizer tests: conformance with Hugging Face `tokenizers` on the real Qwen3 tokenizer
// (reference ids made by tools/make_tokenizer_refs.py), round trips and streaming on the corpus,
// and small hand-made tokenizer.json files for each pipeline component.
#include "text/tokenizer.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "core/error.h"
#include "test_util.h"
#include "text/unicode.h"

namespace {

using moestream::Error;
using moestream::StreamDecoder;
using moestream::Tokenizer;
namespace test = moestream::test;
using nlohmann::json;
namespace fs = std::filesystem;

const fs::path kFixtures = fs::path(MOESTREAM_SOURCE_DIR) / "tests/fixtures/tokenizer";

json read_json(const fs::path& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot open " + path.string());
  return json::parse(in);
}

std::vector<std::string> read_corpus() {
  return read_json(kFixtures / "corpus.json").get<std::vector<std::string>>();
}

std::vector<std::string> pieces(const Tokenizer& tok, const std::vector<int32_t>& ids) {
  std::vector<std::string> out;
  for (int32_t id : ids) out.push_back(tok.piece(id));
  return out;
}

// Decodes ids one at a time; checks every chunk is whole UTF-8 when the full text is.
std::string stream_decode(const Tokenizer& tok, const std::vector<int32_t>& ids,
                          bool expect_valid_chunks) {
  StreamDecoder stream(tok);
  std::string all;
  for (int32_t id : ids) {
    std::string chunk = stream.push(id);
    if (expect_valid_chunks) {
      EXPECT_EQ(moestream::unicode::find_invalid_utf8(chunk), std::string::npos)
          << "chunk of " << chunk.size() << " bytes";
    }
    all += chunk;
  }
  return all + stream.flush();
}

// ---------------------------------------------------------------------------------------------
// The real Qwen3 tokenizer, loaded once for the suite.

class TokenizerQwen3 : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    const char* env = std::getenv("MOESTREAM_QWEN3_TOKENIZER");
    dir_ = env ? env : MOESTREAM_SOURCE_DIR "/.cache/tokenizer-qwen3";
    if (!fs::exists(fs::path(dir_) / "tokenizer.json")) return;
    auto start = std::chrono::steady_clock::now();
    tok_ = Tokenizer::load(dir_).release();
    load_seconds_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  static void TearDownTestSuite() {
    delete tok_;
    tok_ = nullptr;
  }
  void SetUp() override {
    if (!tok_)
      GTEST_FAIL() << "Qwen3 tokenizer not found at " << dir_
                   << "/tokenizer.json: run scripts/setup (or set MOESTREAM_QWEN3_TOKENIZER)";
  }
  static const Tokenizer& tok() { return *tok_; }

  static inline std::string dir_;
  static inline Tokenizer* tok_ = nullptr;
  static inline double load_seconds_ = 0;
};

TEST_F(TokenizerQwen3, LoadsQuickly) {
  std::cout << "[ info ] Qwen3 tokenizer load: " << load_seconds_ << " s\n";
  EXPECT_LT(load_seconds_, 2.0);
}

TEST_F(TokenizerQwen3, ReadsVocabAndConfig) {
  EXPECT_EQ(tok().vocab_size(), 151669);
  EXPECT_EQ(tok().token_id("<|endoftext|>"), 151643);
  EXPECT_EQ(tok().token_id("<|im_start|>"), 151644);
  EXPECT_EQ(tok().token_id("</think>"), 151668);
  EXPECT_EQ(tok().token_id("Hello"), 9707);
  EXPECT_EQ(tok().piece(9707), "Hello");
  EXPECT_EQ(tok().piece(151645), "<|im_end|>");
  EXPECT_TRUE(tok().is_special(151643));
  EXPECT_FALSE(tok().is_special(151667));  // <think> is an added token, not a special one
  EXPECT_FALSE(tok().is_special(9707));
  EXPECT_FALSE(tok().add_bos());
  EXPECT_EQ(tok().bos_id(), std::nullopt);
  EXPECT_EQ(tok().eos_id(), 151645);
  EXPECT_NE(tok().chat_template().find("<|im_start|>"), std::string::npos);
}

TEST_F(TokenizerQwen3, EncodesKnownIds) {
  EXPECT_EQ(tok().encode("Hello, world!"), (std::vector<int32_t>{9707, 11, 1879, 0}));
  EXPECT_EQ(tok().encode(""), std::vector<int32_t>{});
  EXPECT_EQ(tok().encode("<|im_start|>user\nhi<|im_end|>"),
            (std::vector<int32_t>{151644, 872, 198, 6023, 151645}));
}

TEST_F(TokenizerQwen3, MatchesHuggingFaceReference) {
  fs::path refs_path = kFixtures / "qwen3_refs.json";
  ASSERT_TRUE(fs::exists(refs_path))
      << "missing qwen3_refs.json: run tools/make_tokenizer_refs.py (see its docstring)";
  json refs = read_json(refs_path);
  ASSERT_TRUE(refs.contains("cases") && refs["cases"].is_array());
  EXPECT_EQ(refs["cases"].size(), read_corpus().size()) << "refs are older than corpus.json";
  for (const json& c : refs["cases"]) {
    std::string text = c["text"];
    auto want = c["ids"].get<std::vector<int32_t>>();
    auto ids = tok().encode(text);
    EXPECT_EQ(ids, want) << "text " << json(text).dump();
    EXPECT_EQ(tok().decode(want), c["decoded"].get<std::string>()) << "text " << json(text).dump();
  }
}

TEST_F(TokenizerQwen3, RoundTripsCorpus) {
  for (const std::string& text : read_corpus()) {
    std::string nfc = moestream::unicode::normalize(text, moestream::unicode::Form::NFC);
    EXPECT_EQ(tok().decode(tok().encode(text)), nfc) << "text " << json(text).dump();
  }
}

TEST_F(TokenizerQwen3, StreamDecoderYieldsWholeCharacters) {
  for (const std::string& text : read_corpus()) {
    auto ids = tok().encode(text);
    EXPECT_EQ(stream_decode(tok(), ids, true), tok().decode(ids)) << json(text).dump();
  }
  // A long stream exercises the window being cut back many times.
  std::string long_text;
  for (const std::string& text : read_corpus()) long_text += text + "\n";
  auto ids = tok().encode(long_text);
  EXPECT_EQ(stream_decode(tok(), ids, true), tok().decode(ids));
}

TEST_F(TokenizerQwen3, StreamDecoderHoldsBackSplitCharacter) {
  // Byte tokens for the three bytes of U+4E2D (中), one at a time.
  const auto& alphabet = moestream::unicode::byte_to_char();
  std::vector<int32_t> ids;
  for (unsigned char b : std::string("\xE4\xB8\xAD")) ids.push_back(*tok().token_id(alphabet[b]));
  StreamDecoder stream(tok());
  EXPECT_EQ(stream.push(ids[0]), "");
  EXPECT_EQ(stream.push(ids[1]), "");
  EXPECT_EQ(stream.push(ids[2]), "\xE4\xB8\xAD");
  EXPECT_EQ(stream.push(*tok().token_id("!")), "!");
  // An unfinished character at the end comes out as U+FFFD (transformers' decode), never as a
  // byte that is not UTF-8: a chat reply cut there must encode again in the next turn's prompt.
  EXPECT_EQ(stream.push(ids[0]), "");
  EXPECT_EQ(stream.push(ids[1]), "");
  EXPECT_EQ(stream.flush(), "\xEF\xBF\xBD");
  EXPECT_EQ(moestream::unicode::to_valid_utf8("a\xE4\xB8!\xFF\xC3"), "a\xEF\xBF\xBD!\xEF\xBF\xBD\xEF\xBF\xBD");
  EXPECT_EQ(moestream::unicode::to_valid_utf8("\xED\xA0\x80"), "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");  // a surrogate
  EXPECT_EQ(moestream::unicode::to_valid_utf8("ok \xE4\xB8\xAD"), "ok \xE4\xB8\xAD");
}

TEST_F(TokenizerQwen3, EncodesFromSeveralThreads) {
  auto corpus = read_corpus();
  std::vector<std::vector<int32_t>> expected;
  for (const auto& text : corpus) expected.push_back(tok().encode(text));
  std::atomic<int> mismatches{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&, t] {
      for (int round = 0; round < 3; ++round)
        for (size_t i = 0; i < corpus.size(); ++i) {
          size_t k = (i * 7 + static_cast<size_t>(t)) % corpus.size();
          if (tok().encode(corpus[k]) != expected[k]) ++mismatches;
        }
    });
  for (auto& th : threads) th.join();
  EXPECT_EQ(mismatches.load(), 0);
}

TEST_F(TokenizerQwen3, RejectsInvalidInput) {
  test::expect_contains(test::error_of([&] { tok().encode("ok\xFF"); }), {"UTF-8"});
  test::expect_contains(test::error_of([&] { tok().decode({1, 999999}); }), {"999999"});
}

TEST_F(TokenizerQwen3, EncodeThroughput) {
  std::string text;
  for (const std::string& t : read_corpus()) text += t + "\n";
  while (text.size() < (1u << 20)) text += text;
  auto start = std::chrono::steady_clock::now();
  size_t count = tok().encode(text).size();
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::cout << "[ info ] encode: " << text.size() / seconds / 1e6 << " MB/s, "
            << count / seconds / 1e6 << " Mtok/s (" << text.size() << " bytes)\n";
  EXPECT_GT(count, 0u);
}

// ---------------------------------------------------------------------------------------------
// Hand-made tokenizers.

// A directory with a tokenizer.json (and tokenizer_config.json when given), removed at the end.
class TempDir {
 public:
  explicit TempDir(const json& tokenizer, const json& config = nullptr) {
    static std::atomic<int> counter{0};
    path_ = fs::temp_directory_path() /
            ("moestream_tok_" + std::to_string(getpid()) + "_" + std::to_string(counter++));
    fs::create_directories(path_);
    if (!tokenizer.is_null()) std::ofstream(path_ / "tokenizer.json") << tokenizer.dump(1);
    if (!config.is_null()) std::ofstream(path_ / "tokenizer_config.json") << config.dump(1);
  }
  ~TempDir() { fs::remove_all(path_); }
  std::string str() const { return path_.string(); }
  fs::path path() const { return path_; }

 private:
  fs::path path_;
};

// A BPE tokenizer.json over `vocab` (ids in order) with `merges`, no other stages.
json toy_tokenizer(const std::vector<std::string>& vocab,
                   const std::vector<std::pair<std::string, std::string>>& merges) {
  json v = json::object();
  for (size_t i = 0; i < vocab.size(); ++i) v[vocab[i]] = i;
  json m = json::array();
  for (const auto& [a, b] : merges) m.push_back({a, b});
  return {{"version", "1.0"},
          {"added_tokens", json::array()},
          {"normalizer", nullptr},
          {"pre_tokenizer", nullptr},
          {"post_processor", nullptr},
          {"decoder", nullptr},
          {"model",
           {{"type", "BPE"},
            {"vocab", v},
            {"merges", m},
            {"unk_token", nullptr},
            {"ignore_merges", false}}}};
}

std::unique_ptr<Tokenizer> load(const json& tokenizer) {
  TempDir dir(tokenizer);
  return Tokenizer::load(dir.str());
}

TEST(TokenizerBpe, MergesByRank) {
  // The same pairs in two orders: the lower rank merges first.
  auto bc_first = load(toy_tokenizer({"a", "b", "c", "ab", "bc"}, {{"b", "c"}, {"a", "b"}}));
  EXPECT_EQ(pieces(*bc_first, bc_first->encode("abc")), (std::vector<std::string>{"a", "bc"}));
  auto ab_first = load(toy_tokenizer({"a", "b", "c", "ab", "bc"}, {{"a", "b"}, {"b", "c"}}));
  EXPECT_EQ(pieces(*ab_first, ab_first->encode("abc")), (std::vector<std::string>{"ab", "c"}));
}

TEST(TokenizerBpe, EqualRanksMergeLeftmostFirst) {
  auto tok = load(toy_tokenizer({"a", "aa", "aaaa"}, {{"a", "a"}, {"aa", "aa"}}));
  EXPECT_EQ(pieces(*tok, tok->encode("aaa")), (std::vector<std::string>{"aa", "a"}));
  EXPECT_EQ(pieces(*tok, tok->encode("aaaaa")), (std::vector<std::string>{"aaaa", "a"}));
}

TEST(TokenizerBpe, AcceptsBothMergeSpellings) {
  json spec = toy_tokenizer({"a", "b", "ab"}, {});
  spec["model"]["merges"] = json::array({"a b"});
  auto tok = load(spec);
  EXPECT_EQ(pieces(*tok, tok->encode("abab")), (std::vector<std::string>{"ab", "ab"}));
}

TEST(TokenizerBpe, DropsUnknownCharactersWithoutUnkToken) {
  auto tok = load(toy_tokenizer({"a", "b"}, {}));
  EXPECT_EQ(pieces(*tok, tok->encode("axb")), (std::vector<std::string>{"a", "b"}));
}

TEST(TokenizerBpe, IgnoreMergesTakesWholeWords) {
  json spec = toy_tokenizer({"a", "b", "c", "bc", "abc"}, {{"b", "c"}});
  auto merged = load(spec);
  EXPECT_EQ(pieces(*merged, merged->encode("abc")), (std::vector<std::string>{"a", "bc"}));
  spec["model"]["ignore_merges"] = true;
  auto whole = load(spec);
  EXPECT_EQ(pieces(*whole, whole->encode("abc")), (std::vector<std::string>{"abc"}));
}

TEST(TokenizerByteLevel, RegexSplitAndPrefixSpace) {
  // All 256 byte characters, then merged tokens; merges that would cross a GPT-2 regex
  // boundary ("i Ġ", "Ġ Ġ") must never apply.
  const auto& alphabet = moestream::unicode::byte_to_char();
  std::vector<std::string> vocab(alphabet.begin(), alphabet.end());
  for (const char* t : {"Ġh", "Ġhi", "Ġt", "he", "Ġthe", "re", "Ġthere", "ĠĠ", "iĠ"})
    vocab.push_back(t);
  json spec = toy_tokenizer(vocab, {{"Ġ", "h"},
                                    {"Ġh", "i"},
                                    {"Ġ", "t"},
                                    {"h", "e"},
                                    {"Ġt", "he"},
                                    {"r", "e"},
                                    {"Ġthe", "re"},
                                    {"Ġ", "Ġ"},
                                    {"i", "Ġ"}});
  spec["pre_tokenizer"] = {{"type", "ByteLevel"},
                           {"add_prefix_space", true},
                           {"trim_offsets", true},
                           {"use_regex", true}};
  spec["decoder"] = {{"type", "ByteLevel"}};
  auto tok = load(spec);
  auto ids = tok->encode("hi  there");
  EXPECT_EQ(pieces(*tok, ids), (std::vector<std::string>{"Ġhi", "Ġ", "Ġthere"}));
  EXPECT_EQ(tok->decode(ids), " hi  there");  // the added prefix space stays, as in HF
  EXPECT_EQ(pieces(*tok, tok->encode("it's")), (std::vector<std::string>{"Ġ", "i", "t", "'", "s"}));

  spec["pre_tokenizer"]["add_prefix_space"] = false;
  spec["pre_tokenizer"]["use_regex"] = false;
  auto plain = load(spec);
  EXPECT_EQ(pieces(*plain, plain->encode("hi  there")),
            (std::vector<std::string>{"h", "iĠ", "Ġthere"}));
  EXPECT_EQ(plain->decode(plain->encode("h\xC3\xA9\n")), "h\xC3\xA9\n");
}

// Splits "the-final--countdown" on "-" and returns the pieces (whole pieces are vocab entries
// and ignore_merges maps each to one id).
std::vector<std::string> split_pieces(const std::string& behavior, bool invert, bool regex) {
  std::vector<std::string> vocab = {
      "t", "h", "e", "f",   "i",     "n",         "a",    "l",      "c",      "o",          "u",
      "d", "w", "-", "the", "final", "countdown", "the-", "final-", "-final", "-countdown", "--"};
  json spec = toy_tokenizer(vocab, {});
  spec["model"]["ignore_merges"] = true;
  json pattern = regex ? json{{"Regex", "-"}} : json{{"String", "-"}};
  spec["pre_tokenizer"] = {
      {"type", "Split"}, {"pattern", pattern}, {"behavior", behavior}, {"invert", invert}};
  auto tok = load(spec);
  return pieces(*tok, tok->encode("the-final--countdown"));
}

TEST(TokenizerSplit, Behaviors) {
  using V = std::vector<std::string>;
  EXPECT_EQ(split_pieces("Removed", false, false), (V{"the", "final", "countdown"}));
  EXPECT_EQ(split_pieces("Isolated", false, true), (V{"the", "-", "final", "-", "-", "countdown"}));
  EXPECT_EQ(split_pieces("MergedWithPrevious", false, false),
            (V{"the-", "final-", "-", "countdown"}));
  EXPECT_EQ(split_pieces("MergedWithNext", false, true), (V{"the", "-final", "-", "-countdown"}));
  EXPECT_EQ(split_pieces("Contiguous", false, false), (V{"the", "-", "final", "--", "countdown"}));
  // invert: the pattern marks what to keep, so Removed drops the words.
  EXPECT_EQ(split_pieces("Removed", true, false), (V{"-", "-", "-"}));
  EXPECT_EQ(split_pieces("Isolated", true, false), (V{"the", "-", "final", "-", "-", "countdown"}));
}

TEST(TokenizerSplit, QwenPatternKeepsNewlinesAndSpaces) {
  json spec = toy_tokenizer({"a", "b", " ", "\n", "a ", " a", " b", "\n\n", "  ", "a\n"}, {});
  spec["model"]["ignore_merges"] = true;
  spec["pre_tokenizer"] = {
      {"type", "Split"},
      {"pattern",
       {{"Regex",
         R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)"}}},
      {"behavior", "Isolated"},
      {"invert", false}};
  auto tok = load(spec);
  EXPECT_EQ(pieces(*tok, tok->encode("a  b\n\na")),
            (std::vector<std::string>{"a", " ", " b", "\n\n", "a"}));
}

TEST(TokenizerAddedTokens, StripAndSingleWord) {
  json spec = toy_tokenizer({"hello", " world", "world", "a", "b", " ", " concat ", "."}, {});
  spec["model"]["ignore_merges"] = true;
  auto added = [](int id, const char* content, bool lstrip, bool rstrip, bool single_word) {
    return json{{"id", id},         {"content", content}, {"single_word", single_word},
                {"lstrip", lstrip}, {"rstrip", rstrip},   {"normalized", false},
                {"special", true}};
  };
  spec["added_tokens"] = {added(100, "<mask>", true, false, false),
                          added(101, "[SEP]", false, true, false),
                          added(102, "cat", false, false, true)};
  auto tok = load(spec);
  // lstrip: the space before <mask> belongs to it.
  EXPECT_EQ(tok->encode("hello <mask> world"), (std::vector<int32_t>{0, 100, 1}));
  // rstrip: the spaces after [SEP] belong to it.
  EXPECT_EQ(tok->encode("a[SEP]   b"), (std::vector<int32_t>{3, 101, 4}));
  // single_word: "cat" inside "concat" is not the token.
  auto ids = tok->encode("cat concat cat.");
  EXPECT_EQ(pieces(*tok, ids), (std::vector<std::string>{"cat", " concat ", "cat", "."}));
  EXPECT_EQ(tok->vocab_size(), 103);
}

TEST(TokenizerAddedTokens, LongestMatchWins) {
  json spec = toy_tokenizer({"x"}, {});
  auto added = [](int id, const char* content) {
    return json{{"id", id},        {"content", content},  {"single_word", false}, {"lstrip", false},
                {"rstrip", false}, {"normalized", false}, {"special", false}};
  };
  spec["added_tokens"] = {added(10, "<a>"), added(11, "<a><b>"), added(12, "<b>")};
  auto tok = load(spec);
  EXPECT_EQ(tok->encode("x<a><b><b>x<a>"), (std::vector<int32_t>{0, 11, 12, 0, 10}));
  EXPECT_FALSE(tok->is_special(10));
}

TEST(TokenizerAddedTokens, NormalizedTokensMatchNormalizedText) {
  json spec = toy_tokenizer({"x", " "}, {});
  spec["normalizer"] = {{"type", "Lowercase"}};
  spec["added_tokens"] = {{{"id", 5},
                           {"content", "HeLLo"},
                           {"single_word", false},
                           {"lstrip", false},
                           {"rstrip", false},
                           {"normalized", true},
                           {"special", false}}};
  auto tok = load(spec);
  EXPECT_EQ(tok->encode("X HELLO x"), (std::vector<int32_t>{0, 1, 5, 1, 0}));
}

TEST(TokenizerNormalizers, UnicodeForms) {
  json spec = toy_tokenizer({}, {});
  spec["model"]["vocab"] = {{"\xC3\xA9", 0}, {"e", 1}, {"\xCC\x81", 2}, {"f", 3}, {"i", 4}};
  spec["normalizer"] = {{"type", "NFC"}};
  EXPECT_EQ(load(spec)->encode("e\xCC\x81"), std::vector<int32_t>{0});
  spec["normalizer"] = {{"type", "NFD"}};
  EXPECT_EQ(load(spec)->encode("\xC3\xA9"), (std::vector<int32_t>{1, 2}));
  spec["normalizer"] = {{"type", "NFKC"}};
  EXPECT_EQ(load(spec)->encode("\xEF\xAC\x81"), (std::vector<int32_t>{3, 4}));  // the fi ligature
  spec["normalizer"] = {{"type", "Sequence"},
                        {"normalizers", {{{"type", "NFKD"}}, {{"type", "Lowercase"}}}}};
  EXPECT_EQ(load(spec)->encode("\xC3\x89"), (std::vector<int32_t>{1, 2}));  // É
}

// ---------------------------------------------------------------------------------------------
// A SentencePiece-style BPE (Mistral/Llama 2 layout): Prepend + Replace normalizers,
// byte_fallback, and the Replace/ByteFallback/Fuse/Strip decoder chain.

const fs::path kSentencePiece = kFixtures / "sentencepiece_bpe";

TEST(TokenizerSentencePiece, EncodesWithByteFallback) {
  auto tok = Tokenizer::load(kSentencePiece.string());
  EXPECT_EQ(tok->encode("Hello world"), (std::vector<int32_t>{22, 27}));
  EXPECT_EQ(tok->encode("Hello\n"), (std::vector<int32_t>{22, 3}));
  EXPECT_EQ(tok->encode("\xC3\xA9"), (std::vector<int32_t>{10, 4, 5}));  // é as two bytes
  EXPECT_EQ(tok->encode("\xF0\x9F\x98\x80"), (std::vector<int32_t>{10, 6, 7, 8, 9}));
  // ü's second byte has no <0xBC> token, so it is unknown; fuse_unk joins the run.
  EXPECT_EQ(tok->encode("\xC3\xBC\xC3\xBC"), (std::vector<int32_t>{10, 0}));
  EXPECT_EQ(tok->encode("<s>Hello"), (std::vector<int32_t>{1, 22}));
}

TEST(TokenizerSentencePiece, Decodes) {
  auto tok = Tokenizer::load(kSentencePiece.string());
  for (const char* text : {"Hello world", "Hello\n", "\xC3\xA9", "\xF0\x9F\x98\x80 Hello"})
    EXPECT_EQ(tok->decode(tok->encode(text)), text);
  EXPECT_EQ(tok->decode({1, 22}), "<s> Hello");  // added tokens pass through the decoder
  std::vector<int32_t> ids = {10, 6, 7, 8, 9, 22, 27};
  EXPECT_EQ(stream_decode(*tok, ids, true), "\xF0\x9F\x98\x80 Hello world");
  StreamDecoder stream(*tok);
  EXPECT_EQ(stream.push(22), "Hello");
  EXPECT_EQ(stream.push(27), " world");
}

TEST(TokenizerSentencePiece, ReadsConfig) {
  auto tok = Tokenizer::load(kSentencePiece.string());
  EXPECT_TRUE(tok->add_bos());
  EXPECT_EQ(tok->bos_id(), 1);
  EXPECT_EQ(tok->eos_id(), 2);
  EXPECT_EQ(tok->chat_template().rfind("{{ bos_token }}{% for", 0), 0u);  // "default" entry

  json config = read_json(kSentencePiece / "tokenizer_config.json");
  TempDir dir(read_json(kSentencePiece / "tokenizer.json"), config);
  std::ofstream(dir.path() / "chat_template.jinja") << "from the jinja file";
  EXPECT_EQ(Tokenizer::load(dir.str())->chat_template(), "from the jinja file");
}

TEST(TokenizerSentencePiece, MetaspacePreTokenizer) {
  json spec = read_json(kSentencePiece / "tokenizer.json");
  spec["normalizer"] = nullptr;
  spec["decoder"] = {{"type", "Metaspace"}, {"replacement", "▁"}, {"prepend_scheme", "always"}};
  // A top-ranked "o ▁" merge shows whether words were split before the model.
  spec["model"]["vocab"]["o▁"] = 28;
  spec["model"]["merges"].insert(spec["model"]["merges"].begin(), "o ▁");
  auto pre = [&](const char* scheme, bool split) {
    spec["pre_tokenizer"] = {
        {"type", "Metaspace"}, {"replacement", "▁"}, {"prepend_scheme", scheme}, {"split", split}};
    return load(spec);
  };
  auto split = pre("always", true);
  EXPECT_EQ(split->encode("Hello world"), (std::vector<int32_t>{22, 27}));
  EXPECT_EQ(split->decode({22, 27}), "Hello world");
  EXPECT_EQ(split->encode("<s>Hello"), (std::vector<int32_t>{1, 22}));
  auto whole = pre("always", false);
  EXPECT_EQ(pieces(*whole, whole->encode("Hello world")),
            (std::vector<std::string>{"▁Hell", "o▁", "w", "or", "ld"}));
  auto first = pre("first", true);
  EXPECT_EQ(first->encode("Hello"), std::vector<int32_t>{22});
  EXPECT_EQ(pieces(*first, first->encode("<s>Hello")),
            (std::vector<std::string>{"<s>", "H", "ell", "o"}));
}

// ---------------------------------------------------------------------------------------------
// Errors name the file and the component.

void expect_load_error(const std::string& dir, std::vector<std::string> parts) {
  SCOPED_TRACE(dir);
  test::expect_contains(test::error_of([&] { Tokenizer::load(dir); }), parts);
}

TEST(TokenizerErrors, MissingFile) {
  expect_load_error("/nonexistent/moestream", {"/nonexistent/moestream/tokenizer.json"});
}

TEST(TokenizerErrors, MalformedJson) {
  TempDir dir(nullptr);
  std::ofstream(dir.path() / "tokenizer.json") << "{\"model\": {\"vocab\": {\"a\": 0,}}";
  expect_load_error(dir.str(), {dir.str() + "/tokenizer.json", "malformed JSON"});
}

TEST(TokenizerErrors, UnknownComponentTypes) {
  for (const char* stage : {"normalizer", "pre_tokenizer", "decoder"}) {
    json spec = toy_tokenizer({"a"}, {});
    spec[stage] = {{"type", "NoSuchThing"}};
    TempDir dir(spec);
    expect_load_error(dir.str(), {dir.str() + "/tokenizer.json", stage, "NoSuchThing"});
  }
  json spec = toy_tokenizer({"a"}, {});
  spec["model"]["type"] = "Unigram";
  TempDir dir(spec);
  expect_load_error(dir.str(), {dir.str() + "/tokenizer.json", "model", "Unigram"});
}

TEST(TokenizerErrors, BadFields) {
  json spec = toy_tokenizer({"a", "b"}, {{"a", "c"}});
  TempDir bad_merge(spec);
  expect_load_error(bad_merge.str(), {"merge 0", "'c'"});

  spec = toy_tokenizer({"a"}, {});
  spec["pre_tokenizer"] = {
      {"type", "Split"}, {"pattern", {{"Regex", "(unclosed"}}}, {"behavior", "Isolated"}};
  TempDir bad_regex(spec);
  expect_load_error(bad_regex.str(), {"pre_tokenizer Split", "(unclosed"});

  spec = toy_tokenizer({"a"}, {});
  spec["model"]["vocab"]["b"] = "one";
  TempDir bad_id(spec);
  expect_load_error(bad_id.str(), {"tokenizer.json", "model.vocab", "token id"});

  spec = toy_tokenizer({"a", "b", "ab"}, {});
  spec["model"]["merges"] = json::array({json::array({"a", "b", "c"})});
  TempDir long_merge(spec);
  expect_load_error(long_merge.str(), {"tokenizer.json", "model.merges", "more than two"});

  TempDir bad_config(toy_tokenizer({"a"}, {}), json{{"eos_token", "</s>"}});
  expect_load_error(bad_config.str(), {"tokenizer_config.json", "eos_token", "</s>"});
}

}  // namespace
