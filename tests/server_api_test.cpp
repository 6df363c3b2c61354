// The request fields clients send, honoured over real HTTP on the serve fixture: logit_bias and the
// presence / frequency penalties (checked against a greedy loop over the model's own logits),
// logprobs (log-softmax of those logits), n choices, json_schema and forced tool calls (constrained
// decoding makes even this random-weight model's output valid), count_tokens, the request log
// line, and a 400 naming every field the server does not honour.
#include <httplib.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>

#include "models/model.h"
#include "schema_check.h"
#include "served.h"
#include "test_util.h"
#include "text/tokenizer.h"

namespace moestream {
namespace {

using json = nlohmann::ordered_json;

const std::string& model_dir() {
  static const std::string dir = test::tiny_chat_copy("serve-api-model");
  return dir;
}

const json& ref() { return test::serve_ref(); }

class Served : public test::ServedServer {
 public:
  Served() : ServedServer(model_dir(), engine(), options()) {}

 private:
  static EngineOptions engine() {
    EngineOptions eo;
    eo.ctx = 1024;
    return eo;
  }
  static ServeOptions options() {
    ServeOptions so;
    so.max_body_bytes = 1 << 20;
    return so;
  }
};

json post(const Served& s, const std::string& path, const json& body, int expect_status = 200) {
  auto res = s.client().Post(path.c_str(), body.dump(), "application/json");
  EXPECT_TRUE(res) << path;
  if (!res) return {};
  EXPECT_EQ(res->status, expect_status) << res->body.substr(0, 2000);
  json j = json::parse(res->body, nullptr, false);
  EXPECT_FALSE(j.is_discarded()) << "not JSON: " << res->body;
  return j;
}

std::vector<json> sse(const std::string& body) {
  std::vector<json> out;
  size_t pos = 0;
  while ((pos = body.find("data: ", pos)) != std::string::npos) {
    const size_t end = body.find("\n\n", pos);
    const std::string d = body.substr(pos + 6, end - pos - 6);
    if (d != "[DONE]") out.push_back(json::parse(d));
    pos = end;
  }
  return out;
}

// The model itself, beside the server, for reference logits.
struct Reference {
  std::unique_ptr<Model> model = load_model(model_dir(), ModelOptions{});
  std::unique_ptr<Tokenizer> tok = Tokenizer::load(model_dir());

  // Logits after the prompt, then after each of `more` tokens.
  std::vector<std::vector<float>> logits(const std::vector<int32_t>& prompt, const std::vector<int32_t>& more) {
    auto state = model->new_sequence(1024);
    std::vector<std::vector<float>> out;
    std::vector<float> l(size_t(model->info().vocab_size));
    model->forward(prompt, *state, l);
    out.push_back(l);
    for (int32_t t : more) {
      model->forward(std::span<const int32_t>(&t, 1), *state, l);
      out.push_back(l);
    }
    return out;
  }
  // Greedy ids with OpenAI's penalties and a bias applied to the logits.
  std::vector<int32_t> greedy(const std::vector<int32_t>& prompt, int n, float presence, float frequency,
                              const std::vector<std::pair<int32_t, float>>& bias = {}) {
    auto state = model->new_sequence(1024);
    std::vector<float> l(size_t(model->info().vocab_size));
    model->forward(prompt, *state, l);
    std::vector<int32_t> out;
    for (int i = 0; i < n; ++i) {
      for (size_t id = 0; id < l.size(); ++id) {
        const auto c = std::count(out.begin(), out.end(), int32_t(id));
        if (c) l[id] -= frequency * float(c) + presence;
      }
      for (const auto& [id, b] : bias) l[size_t(id)] += b;
      const int32_t next = int32_t(std::max_element(l.begin(), l.end()) - l.begin());
      out.push_back(next);
      model->forward(std::span<const int32_t>(&next, 1), *state, l);
    }
    return out;
  }
  // Greedy ids with the repetition penalty over the last `last_n` tokens of prompt + reply (-1 all).
  std::vector<int32_t> greedy_repeat(const std::vector<int32_t>& prompt, int n, float penalty, int last_n) {
    auto state = model->new_sequence(1024);
    std::vector<float> l(size_t(model->info().vocab_size));
    model->forward(prompt, *state, l);
    std::vector<int32_t> context = prompt, out;
    for (int i = 0; i < n; ++i) {
      const size_t from = last_n < 0 ? 0 : context.size() - std::min(context.size(), size_t(last_n));
      std::vector<char> seen(l.size(), 0);
      for (size_t k = from; k < context.size(); ++k) {
        const auto id = size_t(context[k]);
        if (seen[id]) continue;
        seen[id] = 1;
        l[id] = l[id] > 0 ? l[id] / penalty : l[id] * penalty;
      }
      const int32_t next = int32_t(std::max_element(l.begin(), l.end()) - l.begin());
      out.push_back(next);
      context.push_back(next);
      model->forward(std::span<const int32_t>(&next, 1), *state, l);
    }
    return out;
  }
};

std::vector<int32_t> ids(const json& j) { return j.get<std::vector<int32_t>>(); }

// Text as the server writes it (ids past the tokenizer's vocabulary stand for nothing).
std::string text_of(const Tokenizer& tok, const std::vector<int32_t>& ids) {
  StreamDecoder d(tok);
  std::string out;
  for (int32_t id : ids) out += d.push(id);
  return out + d.flush();
}

double log_softmax(const std::vector<float>& l, int32_t id) {
  const float mx = *std::max_element(l.begin(), l.end());
  double sum = 0;
  for (float x : l) sum += std::exp(double(x - mx));
  return double(l[size_t(id)] - mx) - std::log(sum);
}

json completion(const json& c, int max_tokens) {
  return {{"prompt", c["prompt_ids"]}, {"max_tokens", max_tokens}, {"temperature", 0}};
}

TEST(ServerApi, LogitBiasBansTheGreedyToken) {
  Served s;
  Reference ref_model;
  const json& c = ref()["cases"][0];
  const auto logits = ref_model.logits(ids(c["prompt_ids"]), {})[0];
  const int32_t best = c["greedy_ids"][0];
  ASSERT_EQ(int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin()), best);
  std::vector<float> rest = logits;
  rest[size_t(best)] = -1e30f;
  const int32_t second = int32_t(std::max_element(rest.begin(), rest.end()) - rest.begin());

  json body = completion(c, 1);
  body["logit_bias"] = {{std::to_string(best), -100}};
  json r = post(s, "/v1/completions", body);
  EXPECT_EQ(r["choices"][0]["text"], text_of(*ref_model.tok, {second}));
  // +100 on a token makes it the choice; several tokens over a reply follow the reference loop.
  body["logit_bias"] = {{"9707", 100}};
  EXPECT_EQ(post(s, "/v1/completions", body)["choices"][0]["text"], text_of(*ref_model.tok, {9707}));
  body["max_tokens"] = 8;
  body["logit_bias"] = {{std::to_string(best), -100}, {"78623", 5.5}};
  EXPECT_EQ(post(s, "/v1/completions", body)["choices"][0]["text"],
            text_of(*ref_model.tok, ref_model.greedy(ids(c["prompt_ids"]), 8, 0, 0, {{best, -100}, {78623, 5.5f}})));
}

TEST(ServerApi, PresenceAndFrequencyPenaltiesFollowOpenAI) {
  Served s;
  Reference ref_model;
  const json& c = ref()["cases"][0];
  // The plain greedy reply repeats a token, so the penalties have something to change.
  const auto plain = ids(c["greedy_ids"]);
  ASSERT_NE(std::count(plain.begin(), plain.end(), 78623), 0);
  for (const auto& [presence, frequency] : std::vector<std::pair<float, float>>{{2, 0}, {0, 2}, {-1.5f, 1.25f}}) {
    SCOPED_TRACE(std::to_string(presence) + " " + std::to_string(frequency));
    json body = completion(c, 16);
    body["presence_penalty"] = presence;
    body["frequency_penalty"] = frequency;
    const auto expect = ref_model.greedy(ids(c["prompt_ids"]), 16, presence, frequency);
    EXPECT_EQ(post(s, "/v1/completions", body)["choices"][0]["text"], text_of(*ref_model.tok, expect));
    if (presence > 0) {
      EXPECT_NE(expect, plain);
    }
  }
}

// repetition_penalty looks at the whole context (transformers, vLLM); llama.cpp's repeat_penalty at
// its last repeat_last_n tokens, 64 unless given. Both against the reference loop; not both at once.
TEST(ServerApi, RepeatPenaltyFollowsLlamaCppsWindow) {
  Served s;
  Reference ref_model;
  const json& c = ref()["cases"][0];
  const auto prompt = ids(c["prompt_ids"]);
  struct Case {
    const char* name;
    int last_n;   // sent when >= -1
    int window;   // what the reference uses
  };
  std::vector<std::vector<int32_t>> replies;
  for (const Case& k : {Case{"repetition_penalty", -9, -1}, Case{"repeat_penalty", -9, 64},
                        Case{"repeat_penalty", 2, 2}, Case{"repeat_penalty", 0, 0}}) {
    SCOPED_TRACE(std::string(k.name) + " " + std::to_string(k.last_n));
    json body = completion(c, 12);
    body[k.name] = 3.0;
    if (k.last_n >= -1) body["repeat_last_n"] = k.last_n;
    const auto expect = ref_model.greedy_repeat(prompt, 12, 3.0f, k.window);
    EXPECT_EQ(post(s, "/v1/completions", body)["choices"][0]["text"], text_of(*ref_model.tok, expect));
    replies.push_back(expect);
  }
  const auto plain = ref_model.greedy_repeat(prompt, 12, 1.0f, -1);
  EXPECT_NE(replies[0], plain) << "the penalty changed nothing";
  EXPECT_EQ(replies[3], plain) << "repeat_last_n 0 looks at no token";
  json both = completion(c, 1);
  both["repetition_penalty"] = 1.1;
  both["repeat_penalty"] = 1.1;
  EXPECT_EQ(post(s, "/v1/completions", both, 400)["error"]["param"], "repeat_penalty");
  json bad = completion(c, 1);
  bad["repeat_last_n"] = -2;
  EXPECT_EQ(post(s, "/v1/completions", bad, 400)["error"]["param"], "repeat_last_n");
  const json msgs = {{{"role", "user"}, {"content", "hi"}}};
  post(s, "/v1/chat/completions", {{"messages", msgs}, {"max_tokens", 1}, {"repeat_penalty", 1.1}, {"repeat_last_n", 8}});
  post(s, "/v1/messages", {{"messages", msgs}, {"max_tokens", 1}, {"repeat_penalty", 1.1}});
}

TEST(ServerApi, LogprobsAreLogSoftmaxOfTheModelsLogits) {
  Served s;
  Reference ref_model;
  const json& c = ref()["cases"][0];
  const auto greedy = ids(c["greedy_ids"]);
  const auto logits = ref_model.logits(ids(c["prompt_ids"]), greedy);
  json body = {{"messages", c["messages"]}, {"temperature", 0}, {"max_tokens", 4}, {"logprobs", true}, {"top_logprobs", 3}};
  json r = post(s, "/v1/chat/completions", body);
  const json& content = r["choices"][0]["logprobs"]["content"];
  ASSERT_EQ(content.size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    SCOPED_TRACE(i);
    EXPECT_EQ(content[i]["token"], text_of(*ref_model.tok, {greedy[i]}));
    EXPECT_NEAR(content[i]["logprob"].get<double>(), log_softmax(logits[i], greedy[i]), 1e-4);
    const std::string t = content[i]["token"];
    const std::vector<unsigned char> bytes(t.begin(), t.end());
    EXPECT_EQ(content[i]["bytes"], json(std::vector<int>(bytes.begin(), bytes.end())));
    ASSERT_EQ(content[i]["top_logprobs"].size(), 3u);
    EXPECT_EQ(content[i]["top_logprobs"][0]["token"], content[i]["token"]);  // greedy: the best
    std::vector<float> sorted = logits[i];
    std::sort(sorted.begin(), sorted.end(), std::greater<>());
    for (size_t k = 0; k < 3; ++k) {
      const auto at = std::find(logits[i].begin(), logits[i].end(), sorted[k]) - logits[i].begin();
      EXPECT_NEAR(content[i]["top_logprobs"][k]["logprob"].get<double>(), log_softmax(logits[i], int32_t(at)), 1e-4);
    }
  }
  // Streamed: the same numbers, spread over the chunks.
  body["stream"] = true;
  auto res = s.client().Post("/v1/chat/completions", body.dump(), "application/json");
  ASSERT_TRUE(res);
  json streamed = json::array();
  for (const json& e : sse(res->body))
    for (const json& ch : e["choices"])
      if (!ch["logprobs"].is_null())
        for (const json& t : ch["logprobs"]["content"]) streamed.push_back(t);
  // The streamed request finds its prompt in the prefix cache and computes the rest in a shorter
  // batch, which the CPU's several-token kernels sum in another order (kernels.h): the same
  // tokens, the same numbers to rounding.
  ASSERT_EQ(streamed.size(), content.size());
  for (size_t i = 0; i < content.size(); ++i) {
    SCOPED_TRACE(i);
    EXPECT_EQ(streamed[i]["token"], content[i]["token"]);
    EXPECT_EQ(streamed[i]["bytes"], content[i]["bytes"]);
    EXPECT_NEAR(streamed[i]["logprob"].get<double>(), content[i]["logprob"].get<double>(), 1e-5);
    ASSERT_EQ(streamed[i]["top_logprobs"].size(), content[i]["top_logprobs"].size());
    for (size_t k = 0; k < content[i]["top_logprobs"].size(); ++k) {
      EXPECT_EQ(streamed[i]["top_logprobs"][k]["token"], content[i]["top_logprobs"][k]["token"]);
      EXPECT_NEAR(streamed[i]["top_logprobs"][k]["logprob"].get<double>(),
                  content[i]["top_logprobs"][k]["logprob"].get<double>(), 1e-5);
    }
  }
  // Legacy completions: logprobs: N.
  json cr = post(s, "/v1/completions", {{"prompt", c["prompt_ids"]}, {"max_tokens", 3}, {"temperature", 0}, {"logprobs", 2}});
  const json& lp = cr["choices"][0]["logprobs"];
  ASSERT_EQ(lp["tokens"].size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(lp["tokens"][i], content[i]["token"]);
    EXPECT_NEAR(lp["token_logprobs"][i].get<double>(), content[i]["logprob"].get<double>(), 1e-5);  // cached prefix
    EXPECT_EQ(lp["top_logprobs"][i].size(), 2u);
  }
  EXPECT_EQ(lp["text_offset"][1], lp["tokens"][0].get<std::string>().size());
  // Streamed completions: the same tokens and offsets, chunk by chunk.
  auto cs = s.client().Post("/v1/completions",
                            json{{"prompt", c["prompt_ids"]}, {"max_tokens", 3}, {"temperature", 0}, {"logprobs", 2},
                                 {"stream", true}}.dump(),
                            "application/json");
  ASSERT_TRUE(cs);
  json tokens = json::array(), offsets = json::array();
  for (const json& e : sse(cs->body))
    for (const json& ch : e["choices"])
      if (!ch["logprobs"].is_null())
        for (size_t i = 0; i < ch["logprobs"]["tokens"].size(); ++i) {
          tokens.push_back(ch["logprobs"]["tokens"][i]);
          offsets.push_back(ch["logprobs"]["text_offset"][i]);
        }
  EXPECT_EQ(tokens, lp["tokens"]);
  EXPECT_EQ(offsets, lp["text_offset"]);
  post(s, "/v1/chat/completions", {{"messages", c["messages"]}, {"top_logprobs", 2}}, 400);  // needs logprobs
}

TEST(ServerApi, NChoices) {
  Served s;
  const json& c = ref()["cases"][0];
  json body = {{"messages", c["messages"]}, {"temperature", 0}, {"max_tokens", 16}, {"n", 3}};
  json r = post(s, "/v1/chat/completions", body);
  ASSERT_EQ(r["choices"].size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(r["choices"][i]["index"], i);
    EXPECT_EQ(r["choices"][i]["message"]["content"], c["reply"]);  // greedy: all alike
  }
  EXPECT_EQ(r["usage"]["completion_tokens"], 48);
  EXPECT_EQ(r["usage"]["prompt_tokens"], c["prompt_ids"].size());
  // Sampled with a seed: the choices differ from each other and repeat exactly.
  body["temperature"] = 1.0;
  body["seed"] = 7;
  json a = post(s, "/v1/chat/completions", body), b = post(s, "/v1/chat/completions", body);
  EXPECT_EQ(a["choices"], b["choices"]);
  EXPECT_NE(a["choices"][0]["message"]["content"], a["choices"][1]["message"]["content"]);
  EXPECT_NE(a["choices"][1]["message"]["content"], a["choices"][2]["message"]["content"]);
  // Streamed: chunks carry their choice's index; each choice's text is whole.
  body["stream"] = true;
  auto res = s.client().Post("/v1/chat/completions", body.dump(), "application/json");
  ASSERT_TRUE(res);
  std::vector<std::string> text(3);
  std::vector<int> finished(3, 0);
  for (const json& e : sse(res->body))
    for (const json& ch : e["choices"]) {
      const size_t i = ch["index"];
      ASSERT_LT(i, 3u);
      if (ch["delta"].contains("content")) text[i] += ch["delta"]["content"].get<std::string>();
      if (!ch["finish_reason"].is_null()) ++finished[i];
    }
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(text[i], a["choices"][i]["message"]["content"]) << i;
    EXPECT_EQ(finished[i], 1) << i;
  }
  // Completions too.
  json cr = post(s, "/v1/completions", {{"prompt", c["prompt"]}, {"max_tokens", 4}, {"temperature", 0}, {"n", 2}});
  ASSERT_EQ(cr["choices"].size(), 2u);
  EXPECT_EQ(cr["choices"][1]["index"], 1);
  EXPECT_EQ(cr["choices"][0]["text"], cr["choices"][1]["text"]);
}

const json& weather_schema() {
  static const json s = json::parse(R"({
    "type": "object",
    "properties": {
      "city": {"type": "string", "maxLength": 12},
      "days": {"type": "integer"},
      "temps": {"type": "array", "items": {"type": "number"}, "maxItems": 4},
      "unit": {"enum": ["c", "f"]},
      "alert": {"type": ["boolean", "null"]},
      "where": {"type": "object", "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                "required": ["lat", "lon"], "additionalProperties": false}
    },
    "required": ["city", "days", "where"],
    "additionalProperties": false})");
  return s;
}

TEST(ServerApi, JsonSchemaOutputIsValidEvenFromNoise) {
  Served s;
  const json& c = ref()["cases"][0];
  json body = {{"messages", c["messages"]}, {"max_tokens", 1000},
               {"response_format", {{"type", "json_schema"}, {"json_schema", {{"name", "w"}, {"schema", weather_schema()}}}}}};
  for (const json& sampling : {json{{"temperature", 0}}, json{{"temperature", 1}, {"seed", 1}, {"n", 3}}}) {
    json b = body;
    b.update(sampling);
    json r = post(s, "/v1/chat/completions", b);
    for (const json& ch : r["choices"]) {
      const std::string text = ch["message"]["content"];
      EXPECT_EQ(ch["finish_reason"], "stop") << text;
      const json v = json::parse(text, nullptr, false);
      ASSERT_FALSE(v.is_discarded()) << text;
      EXPECT_EQ(test::schema_violation(weather_schema(), v), "") << text;
    }
  }
  // A keyword the grammar cannot enforce is named, not ignored.
  json bad = body;
  bad["response_format"]["json_schema"]["schema"]["properties"]["city"]["pattern"] = "^[A-Z]";
  json e = post(s, "/v1/chat/completions", bad, 400);
  EXPECT_EQ(e["error"]["param"], "response_format.json_schema.schema.properties.city.pattern");
}

TEST(ServerApi, JsonObjectCannotLoopOnWhitespace) {
  // Greedy decoding used to write tabs until the length limit when whitespace was the model's
  // favourite (made so here by a bias on the tab and newline tokens).
  Served s;
  const auto tok = Tokenizer::load(model_dir());
  json bias = json::object();
  for (const char* ws : {"\t", "\n"}) {
    const auto id = tok->encode(ws);
    ASSERT_EQ(id.size(), 1u);
    bias[std::to_string(id[0])] = 100;
  }
  for (const json& c : ref()["cases"]) {
    json body = {{"messages", c["messages"]}, {"temperature", 0}, {"max_tokens", 60}, {"logit_bias", bias},
                 {"response_format", {{"type", "json_object"}}}};
    json r = post(s, "/v1/chat/completions", body);
    const std::string text = r["choices"][0]["message"]["content"];
    EXPECT_EQ(text.find(std::string(JsonMatcher::kMaxWhitespace + 1, '\t')), std::string::npos) << text;
    size_t run = 0, longest = 0;
    for (char ch : text) longest = std::max(longest, run = std::isspace((unsigned char)ch) ? run + 1 : 0);
    EXPECT_LE(longest, size_t(JsonMatcher::kMaxWhitespace)) << text;
    // It made progress: an object with a key begun, and what there is, is a JSON prefix.
    EXPECT_NE(text.find("{"), std::string::npos) << text;
    EXPECT_NE(text.find('"'), std::string::npos) << text;
    JsonPrefix p;
    EXPECT_TRUE(p.feed(text)) << text;
  }
}

TEST(ServerApi, ToolChoiceForcesACall) {
  Served s;
  const json& c = ref()["cases"][3];
  ASSERT_FALSE(c["tools"].is_null());
  const json params = c["tools"][0]["function"]["parameters"];
  for (const json& choice : {json("required"), json{{"type", "function"}, {"function", {{"name", "get_weather"}}}}}) {
    for (const json& sampling : {json{{"temperature", 0}}, json{{"temperature", 1}, {"seed", 3}}}) {
      json body = {{"messages", c["messages"]}, {"tools", c["tools"]}, {"tool_choice", choice}, {"max_tokens", 600}};
      body.update(sampling);
      json r = post(s, "/v1/chat/completions", body);
      const json& ch = r["choices"][0];
      ASSERT_EQ(ch["finish_reason"], "tool_calls") << r.dump();
      ASSERT_EQ(ch["message"]["tool_calls"].size(), 1u);
      const json& fn = ch["message"]["tool_calls"][0]["function"];
      EXPECT_EQ(fn["name"], "get_weather");
      const json args = json::parse(fn["arguments"].get<std::string>());
      EXPECT_EQ(test::schema_violation(params, args), "") << args.dump();
    }
  }
  // Streamed as well.
  json body = {{"messages", c["messages"]}, {"tools", c["tools"]}, {"tool_choice", "required"}, {"max_tokens", 600},
               {"temperature", 0}, {"stream", true}};
  auto res = s.client().Post("/v1/chat/completions", body.dump(), "application/json");
  ASSERT_TRUE(res);
  int calls = 0;
  std::string finish;
  for (const json& e : sse(res->body))
    for (const json& ch : e["choices"]) {
      if (ch["delta"].contains("tool_calls")) calls += int(ch["delta"]["tool_calls"].size());
      if (!ch["finish_reason"].is_null()) finish = ch["finish_reason"];
    }
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(finish, "tool_calls");
  // Anthropic: tool_choice any and tool.
  json tools = json::array({{{"name", "get_weather"}, {"input_schema", params}}});
  for (const json& choice : {json{{"type", "any"}}, json{{"type", "tool"}, {"name", "get_weather"}}}) {
    json a = post(s, "/v1/messages", {{"max_tokens", 600}, {"temperature", 0}, {"tools", tools}, {"tool_choice", choice},
                                      {"messages", {{{"role", "user"}, {"content", "Weather in Paris?"}}}}});
    EXPECT_EQ(a["stop_reason"], "tool_use") << a.dump();
    ASSERT_FALSE(a["content"].empty());
    const json& block = a["content"].back();
    EXPECT_EQ(block["type"], "tool_use");
    EXPECT_EQ(block["name"], "get_weather");
    EXPECT_EQ(test::schema_violation(params, block["input"]), "") << block.dump();
  }
  // Errors name the field.
  json e = post(s, "/v1/chat/completions", {{"messages", c["messages"]}, {"tool_choice", "required"}}, 400);
  EXPECT_EQ(e["error"]["param"], "tool_choice");
  e = post(s, "/v1/chat/completions",
           {{"messages", c["messages"]}, {"tools", c["tools"]},
            {"tool_choice", {{"type", "function"}, {"function", {{"name", "nope"}}}}}},
           400);
  EXPECT_EQ(e["error"]["param"], "tool_choice");
}

TEST(ServerApi, StrictToolsConstrainTheCallsTheModelChoosesToMake) {
  Served s;
  const json& c = ref()["cases"][3];
  json tools = c["tools"];
  tools[0]["function"]["strict"] = true;
  tools[0]["function"]["parameters"]["properties"]["city"]["maxLength"] = 24;  // keeps noise short
  const json params = tools[0]["function"]["parameters"];
  const auto tok = Tokenizer::load(model_dir());
  const auto open = tok->encode("<tool_call>");
  ASSERT_EQ(open.size(), 1u);
  // tool_choice auto: the model decides; a bias makes it open a call, and the grammar makes the
  // call well-formed from there, whatever the noise.
  for (int seed = 1; seed <= 2; ++seed) {
    json body = {{"messages", c["messages"]}, {"tools", tools}, {"max_tokens", 600}, {"temperature", 1}, {"seed", seed},
                 {"logit_bias", {{std::to_string(open[0]), 100}}}, {"parallel_tool_calls", false}};
    json r = post(s, "/v1/chat/completions", body);
    const json& ch = r["choices"][0];
    ASSERT_EQ(ch["finish_reason"], "tool_calls") << r.dump();
    ASSERT_EQ(ch["message"]["tool_calls"].size(), 1u) << r.dump();
    const json& fn = ch["message"]["tool_calls"][0]["function"];
    EXPECT_EQ(fn["name"], "get_weather");
    EXPECT_EQ(test::schema_violation(params, json::parse(fn["arguments"].get<std::string>())), "") << fn.dump();
  }
  // Without a bias this model writes text: nothing is forced.
  json plain = post(s, "/v1/chat/completions", {{"messages", c["messages"]}, {"tools", tools}, {"max_tokens", 16},
                                               {"temperature", 0}});
  EXPECT_EQ(plain["choices"][0]["finish_reason"], "length");
  EXPECT_FALSE(plain["choices"][0]["message"].contains("tool_calls"));
  EXPECT_EQ(plain["usage"]["completion_tokens"], 16);
  // A strict tool whose schema cannot be enforced is refused, naming the keyword.
  tools[0]["function"]["parameters"]["properties"]["city"]["format"] = "city";
  json e = post(s, "/v1/chat/completions", {{"messages", c["messages"]}, {"tools", tools}}, 400);
  EXPECT_EQ(e["error"]["param"], "tools[0].function.parameters.properties.city.format");
}

TEST(ServerApi, CountTokensEqualsThePromptsTokens) {
  Served s;
  for (const json& c : ref()["cases"]) {
    if (!c["tools"].is_null()) continue;
    json body = {{"model", "tiny"}, {"messages", json::array()}};
    for (const json& m : c["messages"]) {
      if (m["role"] == "system") body["system"] = m["content"];
      else body["messages"].push_back(m);
    }
    EXPECT_EQ(post(s, "/v1/messages/count_tokens", body)["input_tokens"], c["prompt_ids"].size()) << c["name"];
  }
  json e = post(s, "/v1/messages/count_tokens", {{"messages", {{{"role", "user"}, {"content", "x"}}}}, {"max_tokens", 3}}, 400);
  EXPECT_NE(e["error"]["message"].get<std::string>().find("max_tokens"), std::string::npos);
}

TEST(ServerApi, UnhonouredFieldsAre400NamingThem) {
  Served s;
  const json msgs = {{{"role", "user"}, {"content", "hi"}}};
  struct Case {
    std::string path;
    json body;
    std::string param;
  };
  const std::vector<Case> cases = {
      {"/v1/chat/completions", {{"messages", msgs}, {"functions", json::array()}}, "functions"},
      {"/v1/chat/completions", {{"messages", msgs}, {"audio", json::object()}}, "audio"},
      {"/v1/chat/completions", {{"messages", msgs}, {"stream_options", {{"include_obfuscation", true}}}}, "stream_options.include_obfuscation"},
      {"/v1/chat/completions", {{"messages", msgs}, {"response_format", {{"type", "json_object"}, {"x", 1}}}}, "response_format.x"},
      {"/v1/chat/completions", {{"messages", msgs}, {"modalities", {"text", "audio"}}}, "modalities"},
      {"/v1/completions", {{"prompt", "hi"}, {"best_of", 3}}, "best_of"},
      {"/v1/completions", {{"prompt", "hi"}, {"echo", true}}, "echo"},
      {"/v1/completions", {{"prompt", "hi"}, {"guided_json", json::object()}}, "guided_json"},
      {"/v1/completions", {{"prompt", "hi"}, {"ignore_eos", "yes"}}, "ignore_eos"},
  };
  for (const Case& c : cases) {
    json r = post(s, c.path, c.body, 400);
    EXPECT_EQ(r["error"]["param"], c.param) << r.dump();
  }
  // null is "not set"; text is the one modality; ignore_eos (vLLM's, llama.cpp's) is honoured
  // (EngineTest.IgnoreEosGeneratesPastTheEndOfSequenceId).
  post(s, "/v1/chat/completions", {{"messages", msgs}, {"max_tokens", 1}, {"functions", nullptr}, {"modalities", {"text"}}});
  json ok = post(s, "/v1/completions", {{"prompt", "hi"}, {"max_tokens", 3}, {"temperature", 0}, {"ignore_eos", true}});
  EXPECT_EQ(ok["usage"]["completion_tokens"], 3) << ok.dump();
  EXPECT_EQ(ok["choices"][0]["finish_reason"], "length") << ok.dump();
  json a = post(s, "/v1/messages", {{"max_tokens", 2}, {"messages", msgs}, {"mcp_servers", json::array()}}, 400);
  EXPECT_NE(a["error"]["message"].get<std::string>().find("'mcp_servers'"), std::string::npos) << a.dump();
}

TEST(ServerApi, OneLogLinePerRequestAndBatchSizeInHealthAndMetrics) {
  Served s;
  const json& c = ref()["cases"][0];
  testing::internal::CaptureStderr();
  post(s, "/v1/chat/completions", {{"messages", c["messages"]}, {"temperature", 0}, {"max_tokens", 16}, {"user", "u1"}});
  post(s, "/v1/chat/completions", {{"messages", "x"}}, 400);
  const std::string err = testing::internal::GetCapturedStderr();
  for (const std::string part : {"moestream: request chatcmpl-", " /v1/chat/completions status=200 prompt_tokens=14",
                                 "cached_tokens=0 completion_tokens=16 ttft_s=", " tok_per_s=", " time_s=", "user=\"u1\"",
                                 "moestream: request - /v1/chat/completions status=400"})
    EXPECT_NE(err.find(part), std::string::npos) << part << "\n" << err;
  EXPECT_EQ(std::count(err.begin(), err.end(), '\n'), 2) << err;
  auto health = s.client().Get("/health");
  ASSERT_TRUE(health);
  const json h = json::parse(health->body);
  EXPECT_EQ(h["active_requests"], 0);
  EXPECT_EQ(h["batch_size"], 0);
  EXPECT_EQ(h["queued"], 0);
  auto metrics = s.client().Get("/metrics");
  ASSERT_TRUE(metrics);
  for (const char* m : {"moestream_batch_size 0", "moestream_requests_queued 0", "moestream_requests_active 0"})
    EXPECT_NE(metrics->body.find(m), std::string::npos) << m;
}

}  // namespace
}  // namespace moestream
