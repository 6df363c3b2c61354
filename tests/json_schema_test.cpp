// Constrained decoding grammars: json_object's whitespace cap, JSON Schema compiled to a grammar
// (what it accepts and refuses, which keywords it rejects), and random walks through the grammar
// -- a stand-in for a model writing noise -- that always end in a value valid for the schema.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <random>

#include "server/json_schema.h"
#include "schema_check.h"

namespace moestream {
namespace {

using json = nlohmann::ordered_json;

bool accepts(const json& schema, const std::string& text, bool whole = true) {
  JsonMatcher m(schema_grammar(schema));
  return m.feed(std::string_view(text)) && (!whole || m.complete());
}

TEST(JsonConstraint, WhitespaceRunsAreCappedSoGreedyDecodingCannotLoop) {
  JsonPrefix p;
  EXPECT_TRUE(p.feed(std::string("{")));
  for (int i = 0; i < JsonMatcher::kMaxWhitespace; ++i) EXPECT_TRUE(p.feed((unsigned char)'\t')) << i;
  EXPECT_FALSE(JsonPrefix(p).feed((unsigned char)'\t'));  // the 17th: something else must come
  EXPECT_TRUE(p.feed(std::string("\"a\": \n  1}")));
  EXPECT_TRUE(p.complete());
}

TEST(JsonSchema, AcceptsValidAndRefusesInvalid) {
  const json schema = json::parse(R"({
    "type": "object",
    "properties": {
      "name": {"type": "string", "maxLength": 3},
      "age": {"type": "integer"},
      "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
      "ok": {"type": ["boolean", "null"]},
      "pos": {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}
    },
    "required": ["name", "age"],
    "additionalProperties": false})");
  EXPECT_TRUE(accepts(schema, R"({"name": "abc", "age": 3})"));
  EXPECT_TRUE(accepts(schema, R"({"age": -3, "name": "", "tags": ["b", "a"], "ok": null, "pos": {"x": -1.5e3}})"));
  EXPECT_TRUE(accepts(schema, R"({"name": "x", "age": 1, "ok": true})"));
  EXPECT_FALSE(accepts(schema, R"({"name": "abc"})"));               // age is required
  EXPECT_FALSE(accepts(schema, R"({"name": "abcd", "age": 1})"));     // maxLength
  EXPECT_FALSE(accepts(schema, R"({"name": "a", "age": 1.5})"));      // an integer
  EXPECT_FALSE(accepts(schema, R"({"name": "a", "age": 1, "x": 1})"));  // no other properties
  EXPECT_FALSE(accepts(schema, R"({"name": "a", "name": "b", "age": 1})"));  // each once
  EXPECT_FALSE(accepts(schema, R"({"name": "a", "age": 1, "tags": ["c"]})"));  // enum
  EXPECT_FALSE(accepts(schema, R"({"name": "a", "age": 1, "tags": ["a", "a", "a"]})"));  // maxItems
  EXPECT_FALSE(accepts(schema, R"({"name": "a", "age": 1, "ok": 1})"));
  EXPECT_FALSE(accepts(schema, R"({"name": "a", "age": 1, "pos": {}})"));  // x is required
  EXPECT_FALSE(accepts(schema, R"(["name"])"));
  // A prefix is not complete.
  EXPECT_TRUE(accepts(schema, R"({"name": "abc", "age": 3)", false));
  EXPECT_FALSE(accepts(schema, R"({"name": "abc", "age": 3)", true));
  // Enum values that are prefixes of each other, at the top level.
  EXPECT_TRUE(accepts(json{{"enum", {1, 12}}}, "1"));
  EXPECT_TRUE(accepts(json{{"enum", {1, 12}}}, "12"));
  EXPECT_FALSE(accepts(json{{"enum", {1, 12}}}, "13"));
  EXPECT_TRUE(accepts(json{{"const", {{"a", 1}}}}, R"({"a":1})"));
}

TEST(JsonSchema, UnsupportedKeywordsAreNamed) {
  auto where = [](const json& schema) {
    try {
      schema_grammar(schema);
    } catch (const SchemaError& e) {
      return e.where + ": " + e.what();
    }
    return std::string("accepted");
  };
  EXPECT_EQ(where(json::parse(R"({"type": "object", "properties": {"a": {"type": "string", "pattern": "x"}}})")),
            "properties.a.pattern: unsupported keyword 'pattern'");
  EXPECT_EQ(where(json::parse(R"({"anyOf": [{"type": "string"}]})")), "anyOf: unsupported keyword 'anyOf'");
  EXPECT_EQ(where(json::parse(R"({"type": "object", "properties": {"a": {}}, "required": ["b"]})")),
            "required: 'required' names \"b\", which is not in 'properties'");
  EXPECT_EQ(where(json::parse(R"({"type": "date"})")), "type: unknown type 'date'");
  EXPECT_EQ(where(json::parse(R"({"type": "array", "items": {"type": "string", "format": "email"}})")),
            "items.format: unsupported keyword 'format'");
}

// Feeds random characters the grammar allows (printable ASCII, newline, tab and an "é", as a model
// picks tokens) until the value is complete; returns the text.
std::string random_walk(const std::shared_ptr<const JsonGrammar>& g, uint64_t seed, int max_bytes) {
  std::mt19937_64 rng(seed);
  std::string alphabet = "\n\té";
  for (char c = ' '; c <= '~'; ++c) alphabet += c;
  JsonMatcher m(g);
  std::string text;
  while (int(text.size()) < max_bytes) {
    std::vector<std::string> ok;
    for (size_t i = 0; i < alphabet.size(); ++i) {
      const size_t n = (unsigned char)alphabet[i] >= 0xC0 ? 2 : 1;
      const std::string c = alphabet.substr(i, n);
      if ((unsigned char)alphabet[i] >= 0x80 && (unsigned char)alphabet[i] < 0xC0) continue;
      JsonMatcher t = m;
      if (t.feed(std::string_view(c))) ok.push_back(c);
    }
    // End as a model would now and then once it may; the caps force an end anyway.
    if (m.complete() && (ok.empty() || rng() % 4 == 0)) return text;
    if (ok.empty()) return text + "<stuck>";
    const std::string& c = ok[rng() % ok.size()];
    m.feed(std::string_view(c));
    text += c;
  }
  return text + "<too long>";
}

TEST(JsonSchema, RandomWalksEndInValidValues) {
  const json schema = json::parse(R"({
    "type": "object",
    "properties": {
      "id": {"type": "integer"},
      "score": {"type": "number"},
      "label": {"type": "string", "maxLength": 8},
      "kind": {"enum": ["x", "y", 3, null]},
      "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
      "child": {"type": "object", "properties": {"v": {"type": ["string", "null"], "maxLength": 4}},
                "required": ["v"], "additionalProperties": false},
      "free": {"type": "object", "additionalProperties": {"type": "integer"}}
    },
    "required": ["id", "label", "child"],
    "additionalProperties": false})");
  auto g = schema_grammar(schema);
  for (uint64_t seed = 1; seed <= 200; ++seed) {
    const std::string text = random_walk(g, seed, 200000);
    const json v = json::parse(text, nullptr, false);
    ASSERT_FALSE(v.is_discarded()) << "seed " << seed << ": " << text;
    EXPECT_EQ(test::schema_violation(schema, v), "") << "seed " << seed << ": " << text;
  }
  // json_object: any object, and still bounded.
  for (uint64_t seed = 1; seed <= 50; ++seed) {
    const std::string text = random_walk(JsonGrammar::any_object(), seed, 2000000);
    const json v = json::parse(text, nullptr, false);
    ASSERT_TRUE(v.is_object()) << "seed " << seed << ": " << text.substr(0, 300);
  }
}

TEST(JsonSchema, ToolCallGrammarForcesTheMarkup) {
  const json tools = json::parse(R"([
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
      "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object",
      "properties": {"zone": {"type": "string", "pattern": "^[A-Z]"}}}}}])");
  auto all = tool_call_grammar(tools, "");
  auto ok = [](std::shared_ptr<const JsonGrammar> g, const std::string& text) {
    JsonMatcher m(g);
    return m.feed(std::string_view(text)) && m.complete();
  };
  EXPECT_TRUE(ok(all, "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>"));
  EXPECT_FALSE(ok(all, "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {}}\n</tool_call>"));  // city
  // get_time's schema uses 'pattern': its arguments are any object.
  EXPECT_TRUE(ok(all, "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"any\": [1]}}\n</tool_call>"));
  EXPECT_FALSE(ok(all, "Sure! <tool_call>"));
  auto named = tool_call_grammar(tools, "get_time", "</think>\n\n<tool_call>\n");
  EXPECT_FALSE(ok(named, "</think>\n\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"P\"}}\n</tool_call>"));
  EXPECT_TRUE(ok(named, "</think>\n\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>"));
  for (uint64_t seed = 1; seed <= 50; ++seed) {
    const std::string text = random_walk(all, seed, 100000);
    ASSERT_EQ(text.rfind("<tool_call>\n{\"name\": \"get_", 0), 0u) << text;
    ASSERT_GE(text.size(), 13u);
    ASSERT_EQ(text.substr(text.size() - 13), "\n</tool_call>") << text;
    const json call = json::parse(text.substr(12, text.size() - 25), nullptr, false);
    ASSERT_TRUE(call.is_object()) << text;
    EXPECT_TRUE(call["arguments"].is_object()) << text;
    if (call["name"] == "get_weather") {
      EXPECT_TRUE(call["arguments"]["city"].is_string()) << text;
    }
  }
}

TEST(JsonSchema, AfterATextTheGrammarFollows) {
  // A prompt that opened a reasoning block: the reply closes it, then the value.
  auto g = JsonGrammar::after("</think>\n\n", schema_grammar(json{{"type", "integer"}}));
  JsonMatcher m(g);
  EXPECT_FALSE(JsonMatcher(m).feed(std::string_view("12")));
  EXPECT_TRUE(m.feed(std::string_view("</think>\n\n")));
  EXPECT_FALSE(m.complete());
  EXPECT_TRUE(m.feed(std::string_view("-12")));
  EXPECT_TRUE(m.complete());  // a number may end here, inside the call with nothing after it
  EXPECT_FALSE(JsonMatcher(m).feed(std::string_view(" ")));
  JsonMatcher o(JsonGrammar::after("</think>\n\n", JsonGrammar::any_object()));
  EXPECT_TRUE(o.feed(std::string_view("</think>\n\n{\"a\": [1]}")));
  EXPECT_TRUE(o.complete());
  EXPECT_FALSE(JsonMatcher(o).feed(std::string_view("x")));
}

TEST(JsonSchema, TriggeredConstraintIsFreeUntilACallOpens) {
  const json tools = json::parse(R"([{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
      "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": false}}}])");
  auto vocab = std::make_shared<TokenBytes>();
  vocab->bytes = {"hi ", "<tool_call>", "\n{\"name\": \"f\", \"arguments\": ", "{\"a\": ", "7", "}",
                  "}\n</tool_call>", "<tool_call>\nzz", "<tool_", "call>", "", "\"x\""};
  vocab->eos = {10};
  TriggeredConstraint c(vocab, "<tool_call>", tool_call_grammar(tools, "", "\n"));
  auto allowed = [&] {
    std::vector<float> logits(vocab->bytes.size(), 1.0f);
    c.mask(logits);
    std::string ids;
    for (size_t i = 0; i < logits.size(); ++i)
      if (logits[i] > -1e30f) ids += char(i < 10 ? '0' + i : 'a' + (i - 10));
    return ids;
  };
  EXPECT_EQ(allowed(), "012345689ab");  // free text: all but a call opened wrongly (7)
  c.accept(0);
  c.accept(8);  // "<tool_"
  EXPECT_EQ(allowed(), "012345689ab");  // "call>" completes the trigger with nothing after it: fine
  c.accept(9);
  EXPECT_TRUE(c.inside());
  EXPECT_EQ(allowed(), "2");
  for (int t : {2, 3, 4}) c.accept(t);
  EXPECT_EQ(allowed(), "45");  // more digits, or close the arguments
  c.accept(5);
  EXPECT_EQ(allowed(), "56");  // the rest of the call's markup
  c.accept(6);
  EXPECT_FALSE(c.inside());  // free again, the end of sequence included
  EXPECT_EQ(allowed(), "012345689ab");
}

}  // namespace
}  // namespace moestream
