// Context shift (server/context_shift.h): a conversation that outgrows --ctx loses its oldest
// turns after the system prompt, the answer says how many, and the reply equals that of a lone
// request holding the shifted conversation; a latest turn that cannot fit is a 400 naming --ctx.
#include <httplib.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "served.h"
#include "server/context_shift.h"
#include "test_util.h"

namespace moestream {
namespace {

using json = nlohmann::ordered_json;

constexpr int64_t kCtx = 160;

const std::string& model_dir() {
  static const std::string dir = test::tiny_chat_copy("serve-shift-model");
  return dir;
}

class Served : public test::ServedServer {
 public:
  Served() : ServedServer(model_dir(), engine(), ServeOptions{}) {}

 private:
  static EngineOptions engine() {
    EngineOptions eo;
    eo.ctx = kCtx;
    return eo;
  }
};

struct Reply {
  int status = 0;
  std::string shift_header;
  json body;
};

Reply post(const Served& s, const std::string& path, const json& body) {
  auto res = s.client().Post(path.c_str(), body.dump(), "application/json");
  EXPECT_TRUE(res) << path;
  if (!res) return {};
  Reply r{res->status, res->get_header_value("Moestream-Context-Shift"), json::parse(res->body, nullptr, false)};
  EXPECT_FALSE(r.body.is_discarded()) << res->body;
  return r;
}

// A system prompt, `exchanges` user/assistant pairs of about 20 tokens each, and a last question.
json conversation(int exchanges) {
  json m = json::array({{{"role", "system"}, {"content", "You are a terse assistant."}}});
  for (int i = 0; i < exchanges; ++i) {
    m.push_back({{"role", "user"}, {"content", "Question " + std::to_string(i) + ": what is the colour of the sky today?"}});
    m.push_back({{"role", "assistant"}, {"content", "Answer " + std::to_string(i) + ": it is blue, as usual, thank you."}});
  }
  m.push_back({{"role", "user"}, {"content", "And what about the sea?"}});
  return m;
}

json chat(const json& messages, int max_tokens = 16) {
  return {{"messages", messages}, {"temperature", 0}, {"max_tokens", max_tokens}};
}

// messages without [first, first + n)
json without(const json& messages, size_t first, size_t n) {
  json out = json::array();
  for (size_t i = 0; i < messages.size(); ++i)
    if (i < first || i >= first + n) out.push_back(messages[i]);
  return out;
}

TEST(ServerShift, ChatDropsTheOldestTurnsAndRepliesAsToTheShiftedConversation) {
  Served s;
  const json messages = conversation(8);
  const Reply shifted = post(s, "/v1/chat/completions", chat(messages));
  ASSERT_EQ(shifted.status, 200) << shifted.body.dump();
  const int dropped = shifted.body["context_shift"]["dropped_messages"].get<int>();
  EXPECT_GT(dropped, 0);
  EXPECT_EQ(dropped % 2, 0);  // whole exchanges
  EXPECT_EQ(shifted.shift_header, std::to_string(dropped));
  EXPECT_EQ(shifted.body["context_shift"]["ctx"], kCtx);
  const int64_t prompt_tokens = shifted.body["usage"]["prompt_tokens"].get<int64_t>();
  EXPECT_LE(prompt_tokens + 16, kCtx);

  // The same conversation without those messages, sent alone: no shift, the same prompt (the
  // system prompt in it) and the same greedy reply.
  const Reply lone = post(s, "/v1/chat/completions", chat(without(messages, 1, size_t(dropped))));
  ASSERT_EQ(lone.status, 200) << lone.body.dump();
  EXPECT_FALSE(lone.body.contains("context_shift"));
  EXPECT_EQ(lone.shift_header, "");
  EXPECT_EQ(lone.body["usage"]["prompt_tokens"], prompt_tokens);
  EXPECT_EQ(lone.body["choices"][0]["message"]["content"], shifted.body["choices"][0]["message"]["content"]);
  EXPECT_EQ(lone.body["usage"]["completion_tokens"], shifted.body["usage"]["completion_tokens"]);

  // Without the system prompt the prompt is shorter: the shifted one kept it.
  const Reply no_system = post(s, "/v1/chat/completions", chat(without(messages, 0, size_t(dropped) + 1)));
  ASSERT_EQ(no_system.status, 200);
  EXPECT_LT(no_system.body["usage"]["prompt_tokens"].get<int64_t>(), prompt_tokens);

  // The fewest: one exchange fewer dropped does not fit.
  const Reply fewer = post(s, "/v1/chat/completions", chat(without(messages, 1, size_t(dropped) - 2)));
  ASSERT_EQ(fewer.status, 200);
  EXPECT_EQ(fewer.body["context_shift"]["dropped_messages"], 2);
}

TEST(ServerShift, StreamedChatSaysSoInTheHeaderAndEveryChunk) {
  Served s;
  json body = chat(conversation(8));
  body["stream"] = true;
  auto res = s.client().Post("/v1/chat/completions", body.dump(), "application/json");
  ASSERT_TRUE(res);
  ASSERT_EQ(res->status, 200) << res->body;
  const std::string dropped = res->get_header_value("Moestream-Context-Shift");
  ASSERT_NE(dropped, "");
  size_t chunks = 0;
  for (size_t pos = 0; (pos = res->body.find("data: {", pos)) != std::string::npos; ++pos, ++chunks) {
    const json e = json::parse(res->body.substr(pos + 6, res->body.find("\n\n", pos) - pos - 6));
    EXPECT_EQ(e["context_shift"]["dropped_messages"], std::stoi(dropped));
  }
  EXPECT_GT(chunks, 2u);
}

TEST(ServerShift, WithoutMaxTokensTheReplyGetsAQuarterOfTheContext) {
  Served s;
  json body = chat(conversation(8));
  body.erase("max_tokens");
  const Reply r = post(s, "/v1/chat/completions", body);
  ASSERT_EQ(r.status, 200) << r.body.dump();
  ASSERT_TRUE(r.body.contains("context_shift"));
  EXPECT_LE(r.body["usage"]["prompt_tokens"].get<int64_t>() + shift_reply_room(kCtx), kCtx);
}

TEST(ServerShift, ALatestTurnThatCannotFitIs400NamingTheContext) {
  Served s;
  std::string long_text;
  for (int i = 0; i < 60; ++i) long_text += "many words here ";
  json messages = conversation(2);
  messages.back()["content"] = long_text;
  const Reply r = post(s, "/v1/chat/completions", chat(messages));
  EXPECT_EQ(r.status, 400);
  const std::string message = r.body["error"]["message"];
  EXPECT_NE(message.find("--ctx"), std::string::npos) << message;
  EXPECT_NE(message.find("after leaving out the 4 oldest messages"), std::string::npos) << message;
  // max_tokens that the context cannot hold even for a short conversation: 400 naming it.
  const Reply big = post(s, "/v1/chat/completions", chat(conversation(1), int(kCtx)));
  EXPECT_EQ(big.status, 400);
  EXPECT_EQ(big.body["error"]["param"], "max_tokens");
  EXPECT_NE(big.body["error"]["message"].get<std::string>().find("--ctx"), std::string::npos);
  // Anthropic's answer too.
  json a = {{"max_tokens", 16}, {"messages", json::array({{{"role", "user"}, {"content", long_text}}})}};
  const Reply ra = post(s, "/v1/messages", a);
  EXPECT_EQ(ra.status, 400);
  EXPECT_NE(ra.body["error"]["message"].get<std::string>().find("--ctx"), std::string::npos);
}

// Anthropic: the system field stays, a tool_use and its tool_result go together, and the reply
// equals that of the shifted conversation sent alone.
TEST(ServerShift, AnthropicMessagesKeepToolCallsWithTheirResults) {
  Served s;
  json messages = json::array();
  for (int i = 0; i < 5; ++i) {
    messages.push_back({{"role", "user"}, {"content", "Weather in city " + std::to_string(i) + ", please?"}});
    messages.push_back({{"role", "assistant"}, {"content", json::array({
        {{"type", "text"}, {"text", "Checking."}},
        {{"type", "tool_use"}, {"id", "toolu_" + std::to_string(i)}, {"name", "get_weather"}, {"input", {{"city", "c"}}}}})}});
    messages.push_back({{"role", "user"}, {"content", json::array({
        {{"type", "tool_result"}, {"tool_use_id", "toolu_" + std::to_string(i)}, {"content", "sunny and warm"}}})}});
    messages.push_back({{"role", "assistant"}, {"content", "It is sunny."}});
  }
  messages.push_back({{"role", "user"}, {"content", "Thanks! And tomorrow?"}});
  const json tools = json::array({{{"name", "get_weather"}, {"description", "Weather."},
                                   {"input_schema", {{"type", "object"}, {"properties", {{"city", {{"type", "string"}}}}}}}}});
  auto body = [&](const json& m) {
    return json{{"max_tokens", 16}, {"temperature", 0}, {"system", "Be brief."}, {"tools", tools}, {"messages", m}};
  };
  const Reply shifted = post(s, "/v1/messages", body(messages));
  ASSERT_EQ(shifted.status, 200) << shifted.body.dump();
  const int dropped = shifted.body["context_shift"]["dropped_messages"].get<int>();
  EXPECT_GT(dropped, 0);
  EXPECT_EQ(dropped % 4, 0) << dropped;  // whole exchanges: question, call, result, answer
  EXPECT_EQ(shifted.shift_header, std::to_string(dropped));
  const Reply lone = post(s, "/v1/messages", body(without(messages, 0, size_t(dropped))));
  ASSERT_EQ(lone.status, 200) << lone.body.dump();
  EXPECT_FALSE(lone.body.contains("context_shift"));
  auto prompt_tokens = [](const json& usage) { return usage["input_tokens"].get<int64_t>() + usage["cache_read_input_tokens"].get<int64_t>(); };
  EXPECT_EQ(prompt_tokens(lone.body["usage"]), prompt_tokens(shifted.body["usage"]));
  EXPECT_EQ(lone.body["usage"]["output_tokens"], shifted.body["usage"]["output_tokens"]);
  EXPECT_EQ(lone.body["content"], shifted.body["content"]);

  // Streamed: the header, and message_start's message.
  json streamed = body(messages);
  streamed["stream"] = true;
  auto res = s.client().Post("/v1/messages", streamed.dump(), "application/json");
  ASSERT_TRUE(res);
  ASSERT_EQ(res->status, 200) << res->body;
  EXPECT_EQ(res->get_header_value("Moestream-Context-Shift"), std::to_string(dropped));
  const size_t start = res->body.find("data: ", res->body.find("event: message_start"));
  ASSERT_NE(start, std::string::npos) << res->body;
  const json e = json::parse(res->body.substr(start + 6, res->body.find("\n\n", start) - start - 6));
  EXPECT_EQ(e["message"]["context_shift"]["dropped_messages"], dropped);
}

TEST(ContextShift, ExchangesAfterTheSystemPromptTheLastOneKept) {
  const json m = json::parse(R"([
    {"role": "system", "content": "s"},
    {"role": "assistant", "content": "greeting"},
    {"role": "user", "content": "u1"},
    {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {}}}]},
    {"role": "tool", "content": "r1"},
    {"role": "assistant", "content": "a1"},
    {"role": "user", "content": "u2"},
    {"role": "assistant", "content": "a2"},
    {"role": "user", "content": "u3"},
    {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {}}}]},
    {"role": "tool", "content": "r3"}
  ])");
  ContextShift shift(m);
  ASSERT_EQ(shift.droppable(), 3);  // the greeting, u1's exchange, u2's exchange
  auto contents = [](const json& kept) {
    std::string s;
    for (const auto& x : kept) s += x["content"].get<std::string>() + ",";
    return s;
  };
  EXPECT_EQ(contents(shift.kept(0)), "s,greeting,u1,,r1,a1,u2,a2,u3,,r3,");
  EXPECT_EQ(contents(shift.kept(1)), "s,u1,,r1,a1,u2,a2,u3,,r3,");
  EXPECT_EQ(contents(shift.kept(2)), "s,u2,a2,u3,,r3,");
  EXPECT_EQ(contents(shift.kept(3)), "s,u3,,r3,");
  EXPECT_EQ(shift.dropped_messages(2), 5);
  // Request messages that became several: the count is of the request's.
  ContextShift grouped(m, {0, 1, 2, 3, 3, 4, 5, 6, 7, 8, 9});
  EXPECT_EQ(grouped.dropped_messages(2), 4);
  // A tool result carried by a user request message does not start an exchange.
  const json anthropic = json::parse(R"([
    {"role": "user", "content": "q"}, {"role": "assistant", "content": "c"},
    {"role": "tool", "content": "r"}, {"role": "user", "content": "and"}, {"role": "user", "content": "next"}])");
  ContextShift a(anthropic, {0, 1, 2, 2, 3});
  ASSERT_EQ(a.droppable(), 1);
  EXPECT_EQ(contents(a.kept(1)), "next,");
  EXPECT_EQ(ContextShift(json::array({{{"role", "system"}, {"content", "s"}}, {{"role", "user"}, {"content", "u"}}})).droppable(), 0);
}

TEST(ContextShift, FewestToDropIsTheFirstThatFits) {
  for (int n = 0; n <= 9; ++n)
    for (int first = 0; first <= n + 1; ++first) {
      int calls = 0;
      const int k = fewest_to_drop(n, [&](int k) { ++calls; return k >= first; });
      EXPECT_EQ(k, std::min(first, n)) << n << " " << first;
      EXPECT_LE(calls, 6);
    }
}

}  // namespace
}  // namespace moestream
