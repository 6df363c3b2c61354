// Splitting generated text into answer, reasoning and tool calls, for each family's convention,
// whole and streamed in pieces of every size; and the JSON-object constraint.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "server/json_constraint.h"
#include "server/output_parser.h"

namespace moestream {
namespace {

// Feeds `text` in pieces of `step` bytes and returns everything the parser produced.
ParsedOutput parse(OutputSyntax syntax, const std::string& text, size_t step, bool in_reasoning = false,
                   bool tools = true) {
  OutputParser p(syntax, in_reasoning, tools);
  ParsedOutput all;
  for (size_t i = 0; i < text.size(); i += step) all.append(p.push(std::string_view(text).substr(i, step)));
  all.append(p.finish());
  return all;
}

struct Expect {
  std::string content, reasoning;
  std::vector<std::pair<std::string, nlohmann::json>> calls;  // name, arguments
};

void check(OutputSyntax syntax, const std::string& text, const Expect& e, bool in_reasoning = false) {
  for (size_t step : {size_t(1), size_t(2), size_t(3), size_t(7), text.size()}) {
    ParsedOutput out = parse(syntax, text, step, in_reasoning);
    EXPECT_EQ(out.content, e.content) << "step " << step;
    EXPECT_EQ(out.reasoning, e.reasoning) << "step " << step;
    ASSERT_EQ(out.tool_calls.size(), e.calls.size()) << "step " << step;
    for (size_t i = 0; i < e.calls.size(); ++i) {
      EXPECT_EQ(out.tool_calls[i].name, e.calls[i].first);
      EXPECT_EQ(nlohmann::json::parse(out.tool_calls[i].arguments), e.calls[i].second);
      EXPECT_EQ(out.tool_calls[i].id.rfind("call_", 0), 0u);
    }
  }
}

TEST(OutputParser, QwenThinkingAndJsonToolCalls) {
  check(OutputSyntax::tagged,
        "<think>\nThe user wants weather.\n</think>\n\nLet me check.\n<tool_call>\n"
        "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 2}}\n</tool_call>\n"
        "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>",
        {"Let me check.\n\n", "The user wants weather.",
         {{"get_weather", {{"city", "Paris"}, {"days", 2}}}, {"get_time", nlohmann::json::object()}}});
}

TEST(OutputParser, ReasoningOpenedByThePrompt) {
  check(OutputSyntax::tagged, "step one</think>answer", {"answer", "step one", {}}, true);
}

TEST(OutputParser, TextThatOnlyLooksLikeMarkupStaysText) {
  check(OutputSyntax::tagged, "a < b and <thin ice>; <tool_call> unfinished",
        {"a < b and <thin ice>; <tool_call> unfinished", "", {}});
  check(OutputSyntax::tagged, "x <tool_call>not json</tool_call> y",
        {"x <tool_call>not json</tool_call> y", "", {}});
}

TEST(OutputParser, ToolMarkupIsTextWhenNoToolsWereGiven) {
  ParsedOutput out = parse(OutputSyntax::tagged, "<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>", 3,
                           false, false);
  EXPECT_TRUE(out.tool_calls.empty());
  EXPECT_EQ(out.content, "<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>");
}

TEST(OutputParser, QwenCoderXmlToolCall) {
  check(OutputSyntax::tagged,
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
        {"", "", {{"get_weather", {{"city", "New York"}, {"days", 3}}}}});
}

TEST(OutputParser, GlmToolCall) {
  check(OutputSyntax::tagged,
        "<think>hm</think>ok<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
        "<arg_key>units</arg_key>\n<arg_value>[\"c\"]</arg_value>\n</tool_call>",
        {"ok", "hm", {{"get_weather", {{"city", "Paris"}, {"units", {"c"}}}}}});
}

TEST(OutputParser, DeepSeekV3AndV31ToolCalls) {
  check(OutputSyntax::deepseek,
        "Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
        "{\"city\": \"Paris\"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        {"Sure.", "", {{"get_weather", {{"city", "Paris"}}}}});
  check(OutputSyntax::deepseek,
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": \"Oslo\"}"
        "<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        {"", "", {{"get_weather", {{"city", "Oslo"}}}, {"get_time", nlohmann::json::object()}}});
}

TEST(OutputParser, KimiToolCalls) {
  check(OutputSyntax::deepseek,
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
        "{\"city\": \"Rome\"}<|tool_call_end|><|tool_calls_section_end|>",
        {"", "", {{"get_weather", {{"city", "Rome"}}}}});
}

TEST(OutputParser, MistralToolCalls) {
  check(OutputSyntax::mistral, "[TOOL_CALLS] [{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Lyon\"}}]",
        {"", "", {{"get_weather", {{"city", "Lyon"}}}}});
  check(OutputSyntax::mistral, "[TOOL_CALLS]get_weather[ARGS]{\"city\": \"Nice\"}",
        {"", "", {{"get_weather", {{"city", "Nice"}}}}});
}

TEST(OutputParser, GptOssHarmonyChannels) {
  check(OutputSyntax::harmony,
        "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
        "to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\"}",
        {"", "Need the weather.", {{"get_weather", {{"city", "Paris"}}}}});
  check(OutputSyntax::harmony,
        "<|channel|>analysis<|message|>Simple.<|end|><|start|>assistant<|channel|>final<|message|>Hello there!",
        {"Hello there!", "Simple.", {}});
}

bool accepts(const std::string& text) {
  JsonPrefix p;
  return p.feed(text);
}

TEST(JsonConstraint, AcceptsPrefixesOfObjectsOnly) {
  EXPECT_TRUE(accepts("{"));
  EXPECT_TRUE(accepts(" {\"a\": [1, -2.5e+3, true, null, \"x\\u00e9\\n\"], \"b\": {}}"));
  EXPECT_TRUE(accepts("{\"a\": 1"));
  EXPECT_FALSE(accepts("["));        // the top level must be an object
  EXPECT_FALSE(accepts("{a"));       // keys are strings
  EXPECT_FALSE(accepts("{\"a\" 1"));  // a colon is missing
  EXPECT_FALSE(accepts("{\"a\": 01"));
  EXPECT_FALSE(accepts("{\"a\": tru }"));
  EXPECT_FALSE(accepts("{\"a\": 1,}"));
  EXPECT_FALSE(accepts("{\"a\": \"\x01\"}"));
  EXPECT_FALSE(accepts("{} x"));  // nothing but space after the object
  JsonPrefix p;
  EXPECT_TRUE(p.feed(std::string("{\"k\": [1, 2]")));
  EXPECT_FALSE(p.complete());
  EXPECT_TRUE(p.feed(std::string("}")));
  EXPECT_TRUE(p.complete());
}

TEST(JsonConstraint, MasksTokensAndEndsWhenComplete) {
  auto vocab = std::make_shared<TokenBytes>();
  vocab->bytes = {"{", "}", "\"a\"", ":", "1", "x", "", " "};  // id 6: a special token
  vocab->eos = {6};
  JsonObjectConstraint c(vocab);
  auto allowed = [&] {
    std::vector<float> logits(8, 1.0f);
    c.mask(logits);
    std::string ids;
    for (size_t i = 0; i < logits.size(); ++i)
      if (logits[i] > -1e30f) ids += char('0' + i);
    return ids;
  };
  EXPECT_EQ(allowed(), "07");
  c.accept(0);
  EXPECT_EQ(allowed(), "127");
  for (int t : {2, 3, 4}) c.accept(t);
  EXPECT_EQ(allowed(), "147");  // } ends it, 1 continues the number, space
  c.accept(1);
  EXPECT_EQ(allowed(), "6");  // complete: only end of sequence
}

}  // namespace
}  // namespace moestream
