// Tokenizer::from_json, the in-memory half of Tokenizer::load (the tokenizer fuzz target builds
// its tokenizers with it, without writing files): the same tokenizer as load, and errors that
// name the files as load's do.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <optional>
#include <string>
#include <vector>

#include "test_util.h"
#include "text/tokenizer.h"

namespace {

using moestream::Tokenizer;
namespace test = moestream::test;

const std::string kModel = MOESTREAM_SOURCE_DIR "/tests/fixtures/models/qwen3moe_ppl";
const std::string kSentencePiece = MOESTREAM_SOURCE_DIR "/tests/fixtures/tokenizer/sentencepiece_bpe";

void expect_same_tokenizer(const std::string& dir, const std::optional<std::string>& config) {
  SCOPED_TRACE(dir);
  const auto loaded = Tokenizer::load(dir);
  const std::string tokenizer_json = test::read_file(dir + "/tokenizer.json");
  const auto built = Tokenizer::from_json(tokenizer_json, config, dir);
  EXPECT_EQ(built->vocab_size(), loaded->vocab_size());
  EXPECT_EQ(built->add_bos(), loaded->add_bos());
  EXPECT_EQ(built->bos_id(), loaded->bos_id());
  EXPECT_EQ(built->eos_id(), loaded->eos_id());
  EXPECT_EQ(built->chat_template(), loaded->chat_template());
  for (const std::string text : {"Hello world! 123", "<|im_start|>user\nhé 中文 🙂<|im_end|>",
                                 "  a  b\n\n\tc", "<s>[INST] x [/INST]", ""}) {
    const std::vector<int32_t> ids = loaded->encode(text);
    EXPECT_EQ(built->encode(text), ids) << text;
    EXPECT_EQ(built->decode(ids), loaded->decode(ids)) << text;
  }
  for (int32_t id = 0; id < loaded->vocab_size(); ++id) {
    EXPECT_EQ(built->piece(id), loaded->piece(id));
    EXPECT_EQ(built->is_special(id), loaded->is_special(id));
  }
}

TEST(TokenizerFromJson, SameTokenizerAsLoad) {
  expect_same_tokenizer(kModel, test::read_file(kModel + "/tokenizer_config.json"));
  expect_same_tokenizer(kSentencePiece, test::read_file(kSentencePiece + "/tokenizer_config.json"));
}

TEST(TokenizerFromJson, WithoutConfig) {
  const auto tok = Tokenizer::from_json(test::read_file(kModel + "/tokenizer.json"), std::nullopt, kModel);
  EXPECT_FALSE(tok->add_bos());
  EXPECT_FALSE(tok->eos_id().has_value());
  EXPECT_EQ(tok->chat_template(), "");
  EXPECT_EQ(tok->encode("Hello world"), Tokenizer::load(kModel)->encode("Hello world"));
}

TEST(TokenizerFromJson, ErrorsNameTheFiles) {
  test::expect_contains(test::error_of([] { Tokenizer::from_json("{\"model\": {", std::nullopt, "/models/x"); }),
                        {"/models/x/tokenizer.json", "malformed JSON"});
  const std::string tokenizer_json = test::read_file(kModel + "/tokenizer.json");
  test::expect_contains(test::error_of([&] { Tokenizer::from_json(tokenizer_json, "[1,", "/models/x"); }),
                        {"/models/x/tokenizer_config.json", "malformed JSON"});
  test::expect_contains(
      test::error_of([&] { Tokenizer::from_json(tokenizer_json, R"({"eos_token": "<nope>"})", "/models/x"); }),
      {"/models/x/tokenizer_config.json", "eos_token '<nope>' is not in the vocabulary"});
}

// The 10M-execution fuzz run's out-of-memory inputs: a vocab or added-token id near 2^31 sized an
// id-indexed table at gigabytes; ids above text_limits::kMaxTokenId are refused, naming the token.
TEST(TokenizerFromJson, HugeTokenIdsAreRefused) {
  const std::string tokenizer_json = test::read_file(kModel + "/tokenizer.json");
  nlohmann::json j = nlohmann::json::parse(tokenizer_json);
  nlohmann::json vocab_big = j, added_big = j;
  vocab_big["model"]["vocab"]["zzz"] = 2000000000;
  ASSERT_FALSE(added_big["added_tokens"].empty());
  added_big["added_tokens"][0]["id"] = 2000000000;
  test::expect_contains(test::error_of([&] { Tokenizer::from_json(vocab_big.dump(), std::nullopt, "/m"); }),
                        {"/m/tokenizer.json", "zzz", "2000000000", "largest supported"});
  test::expect_contains(test::error_of([&] { Tokenizer::from_json(added_big.dump(), std::nullopt, "/m"); }),
                        {"/m/tokenizer.json", "2000000000", "largest supported"});
  vocab_big["model"]["vocab"]["zzz"] = 300000;  // a large real vocabulary still loads
  EXPECT_GE(Tokenizer::from_json(vocab_big.dump(), std::nullopt, "/m")->vocab_size(), 300001);
}

}  // namespace
