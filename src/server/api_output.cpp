// What the endpoints share about the output: constraints from response_format and tool_choice,
// logprobs in OpenAI's two forms, and the per-request log line.
#include <cstdio>
#include <sstream>

#include "server/api.h"

namespace moestream {

std::shared_ptr<const JsonGrammar> response_format_grammar(const ojson& body, bool& json_object) {
  json_object = false;
  if (!body.contains("response_format") || body["response_format"].is_null()) return nullptr;
  const ojson& rf = body["response_format"];
  const std::string type = string_member(rf, "type");
  if (type == "text") {
    field::known_only(rf, {"type"}, "response_format");
    return nullptr;
  }
  if (type == "json_object") {
    field::known_only(rf, {"type"}, "response_format");
    json_object = true;
    return nullptr;
  }
  if (type != "json_schema")
    throw ApiError(400, "response_format", "'response_format.type' must be text, json_object or json_schema");
  field::known_only(rf, {"type", "json_schema"}, "response_format");
  const std::string at = "response_format.json_schema";
  if (!rf.contains("json_schema") || !rf["json_schema"].is_object())
    throw ApiError(400, at, "'" + at + "' must be an object with a 'schema'");
  const ojson& js = rf["json_schema"];
  field::known_only(js, {"name", "description", "schema", "strict"}, at);
  field::member(js, "name", at + ".name", "");
  field::member(js, "description", at + ".description", "");
  field::boolean(js, "strict", false);  // the schema is always enforced
  if (!js.contains("schema") || js["schema"].is_null()) return JsonGrammar::any_object();
  try {
    return schema_grammar(js["schema"]);
  } catch (const SchemaError& e) {
    const std::string where = at + ".schema" + (e.where.empty() ? "" : "." + e.where);
    throw ApiError(400, where, "'" + where + "': " + e.what() + " (this server enforces type, properties, required, "
                               "additionalProperties, items, minItems, maxItems, minLength, maxLength, enum and const)");
  }
}

namespace {
// Tools marked strict: true must have schemas the grammar enforces.
bool check_strict_tools(const ojson& tools) {
  bool any = false;
  for (size_t i = 0; i < tools.size(); ++i) {
    const ojson& fn = tools[i]["function"];
    if (!fn.contains("strict") || !fn["strict"].is_boolean() || !fn["strict"].get<bool>()) continue;
    any = true;
    const std::string at = "tools[" + std::to_string(i) + "].function.parameters";
    try {
      schema_grammar(fn.value("parameters", ojson::object()));
    } catch (const SchemaError& e) {
      const std::string where = at + (e.where.empty() ? "" : "." + e.where);
      throw ApiError(400, where, "'" + where + "': " + e.what() + " (a strict tool's schema is enforced, and this keyword cannot be)");
    }
  }
  return any;
}

// The grammar writes Qwen3's (Hermes') JSON markup; other families' markup is not forced yet.
void check_markup(const ServedModel& m, const std::string& param) {
  const std::string& source = m.chat_template ? m.chat_template->source() : std::string();
  if (m.syntax != OutputSyntax::tagged || source.find("<tool_call>") == std::string::npos ||
      source.find("<function=") != std::string::npos)
    throw ApiError(400, param, "'" + param + "': forcing tool calls is supported for models with Qwen3's "
                               "<tool_call>{\"name\", \"arguments\"}</tool_call> markup only");
}
}  // namespace

std::shared_ptr<const JsonGrammar> forced_tool_call(const ServedModel& m, const ojson& tools, const std::string& name,
                                                    bool in_reasoning, const std::string& param) {
  if (tools.is_null() || tools.empty())
    throw ApiError(400, param, "'" + param + "' asks for a tool call but the request has no tools");
  if (!name.empty()) {
    bool found = false;
    for (const auto& t : tools) found = found || t["function"]["name"] == name;
    if (!found) throw ApiError(400, param, "'" + param + "' names '" + name + "', which is not among the tools");
  }
  check_strict_tools(tools);
  check_markup(m, param);
  return tool_call_grammar(tools, name, std::string(in_reasoning ? "</think>\n\n" : "") + "<tool_call>\n");
}

std::shared_ptr<const JsonGrammar> strict_tool_calls(const ServedModel& m, const ojson& tools) {
  if (tools.is_null() || !check_strict_tools(tools)) return nullptr;
  check_markup(m, "tools");
  return tool_call_grammar(tools, "", "\n");
}

namespace {
// A token's text; an id past the tokenizer's vocabulary (an output head with spare rows) has none.
std::string token_text(const Tokenizer& tok, int32_t id) {
  return id >= 0 && id < tok.vocab_size() ? tok.decode({id}) : std::string();
}

ojson byte_list(const std::string& s) {
  ojson b = ojson::array();
  for (unsigned char c : s) b.push_back(int(c));
  return b;
}
}  // namespace

ojson chat_logprobs(const Tokenizer& tok, const std::vector<TokenLogprob>& lps) {
  ojson content = ojson::array();
  for (const TokenLogprob& l : lps) {
    const std::string text = token_text(tok, l.token);
    ojson top = ojson::array();
    for (const auto& [id, lp] : l.top) {
      const std::string t = token_text(tok, id);
      top.push_back({{"token", t}, {"logprob", lp}, {"bytes", byte_list(t)}});
    }
    content.push_back({{"token", text}, {"logprob", l.logprob}, {"bytes", byte_list(text)}, {"top_logprobs", top}});
  }
  return {{"content", content}, {"refusal", nullptr}};
}

ojson completion_logprobs(const Tokenizer& tok, const std::vector<TokenLogprob>& lps, size_t& offset) {
  ojson tokens = ojson::array(), token_lps = ojson::array(), tops = ojson::array(), offsets = ojson::array();
  for (const TokenLogprob& l : lps) {
    const std::string text = token_text(tok, l.token);
    tokens.push_back(text);
    token_lps.push_back(l.logprob);
    ojson top = ojson::object();
    for (const auto& [id, lp] : l.top) top[token_text(tok, id)] = lp;
    tops.push_back(top);
    offsets.push_back(offset);
    offset += text.size();
  }
  return {{"tokens", tokens}, {"token_logprobs", token_lps}, {"top_logprobs", tops}, {"text_offset", offsets}};
}

void log_request(ServerContext& ctx, const std::string& endpoint, const std::string& id, int status,
                 const std::vector<const GenerateResult*>& results, double seconds, const std::string& user) {
  if (!ctx.log_requests) return;
  int64_t prompt = 0, cached = 0, completion = 0;
  double ttft = 0;
  for (const GenerateResult* r : results) {
    prompt = std::max(prompt, r->prompt_tokens);
    cached = std::max(cached, r->cached_tokens);
    completion += r->completion_tokens;
    if (ttft == 0 || (r->first_token_seconds > 0 && r->first_token_seconds < ttft)) ttft = r->first_token_seconds;
  }
  const double decoding = seconds - ttft;
  std::ostringstream o;
  o.setf(std::ios::fixed);
  o.precision(3);
  o << "moestream: request " << (id.empty() ? "-" : id) << ' ' << endpoint << " status=" << status
    << " prompt_tokens=" << prompt << " cached_tokens=" << cached << " completion_tokens=" << completion;
  if (results.size() > 1) o << " choices=" << results.size();
  o << " ttft_s=" << ttft;
  o.precision(1);
  o << " tok_per_s=" << (completion > 1 && decoding > 0 ? double(completion - 1) / decoding : 0.0);
  o.precision(3);
  o << " time_s=" << seconds;
  if (!user.empty()) o << " user=" << ojson(user).dump();
  o << '\n';
  const std::string line = o.str();
  std::fwrite(line.data(), 1, line.size(), stderr);
}

}  // namespace moestream
