// /v1/messages and /v1/messages/count_tokens request bodies -> validated requests (requests.h).
#include <cstdint>

#include "core/error.h"
#include "server/requests.h"

namespace moestream {

ojson anthropic_error_body(const std::string& type, const std::string& message) {
  return {{"type", "error"}, {"error", {{"type", type}, {"message", message}}}};
}

namespace {

std::string block_text(const ojson& content, const std::string& where) {
  if (content.is_string()) return content.get<std::string>();
  if (!content.is_array()) throw ApiError(400, where, "'" + where + "' must be a string or a list of blocks");
  std::string text;
  for (const auto& b : content) {
    if (string_member(b, "type") != "text" || !b.contains("text") || !b["text"].is_string())
      throw ApiError(400, where, "'" + where + "' may only hold text blocks here");
    text += b["text"].get<std::string>();
  }
  return text;
}

// Anthropic messages -> the OpenAI/transformers message list chat templates take; origin[i]: the
// request message out[i] came from (the system prompt: none, SIZE_MAX).
ojson template_messages(const ojson& body, std::vector<size_t>& origin) {
  ojson out = ojson::array();
  if (body.contains("system") && !body["system"].is_null())
    out.push_back({{"role", "system"}, {"content", block_text(body["system"], "system")}});
  if (!body.contains("messages") || !body["messages"].is_array() || body["messages"].empty())
    throw ApiError(400, "messages", "'messages' must be a non-empty list");
  const ojson& messages = body["messages"];
  for (size_t i = 0; i < messages.size(); ++i) {
    const ojson& m = messages[i];
    const std::string at = "messages[" + std::to_string(i) + "]";
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string())
      throw ApiError(400, at, "'" + at + "' must be an object with a 'role'");
    const std::string role = m["role"].get<std::string>();
    if (role != "user" && role != "assistant")
      throw ApiError(400, at + ".role", "'" + at + ".role' must be user or assistant");
    if (!m.contains("content")) throw ApiError(400, at + ".content", "'" + at + ".content' is required");
    const ojson& content = m["content"];
    origin.resize(out.size(), SIZE_MAX);  // what came before
    if (content.is_string()) {
      out.push_back({{"role", role}, {"content", content}});
      origin.push_back(i);
      continue;
    }
    if (!content.is_array()) throw ApiError(400, at + ".content", "'" + at + ".content' must be a string or a list of blocks");
    std::string text, thinking;
    ojson calls = ojson::array();
    for (size_t j = 0; j < content.size(); ++j) {
      const ojson& b = content[j];
      const std::string bat = at + ".content[" + std::to_string(j) + "]";
      const std::string type = string_member(b, "type");
      if (type == "text" && b.contains("text") && b["text"].is_string()) {
        text += b["text"].get<std::string>();
      } else if (type == "thinking" && role == "assistant") {
        thinking += field::member(b, "thinking", bat + ".thinking", "");
      } else if (type == "tool_use" && role == "assistant") {
        if (!b.contains("name") || !b["name"].is_string())
          throw ApiError(400, bat + ".name", "'" + bat + ".name' must be a string");
        const ojson input = b.value("input", ojson::object());
        if (!input.is_object()) throw ApiError(400, bat + ".input", "'" + bat + ".input' must be an object");
        calls.push_back({{"id", field::member(b, "id", bat + ".id", "")}, {"type", "function"},
                         {"function", {{"name", b["name"]}, {"arguments", input}}}});
      } else if (type == "tool_result" && role == "user") {
        if (!text.empty()) out.push_back({{"role", "user"}, {"content", text}}), text.clear();
        ojson result = b.value("content", ojson(""));
        out.push_back({{"role", "tool"}, {"tool_call_id", field::member(b, "tool_use_id", bat + ".tool_use_id", "")},
                       {"content", result.is_null() ? std::string() : block_text(result, bat + ".content")}});
      } else {
        throw ApiError(400, bat, "'" + bat + "': unsupported content block type '" + type + "'");
      }
    }
    if (role == "assistant") {
      ojson msg = {{"role", "assistant"}, {"content", text}};
      if (!thinking.empty()) msg["reasoning_content"] = thinking;
      if (!calls.empty()) msg["tool_calls"] = calls;
      out.push_back(std::move(msg));
    } else if (!text.empty()) {
      out.push_back({{"role", "user"}, {"content", text}});
    }
    origin.resize(out.size(), i);
  }
  return out;
}

ojson request_tools(const ojson& body) {
  if (!body.contains("tools") || body["tools"].is_null()) return nullptr;
  if (!body["tools"].is_array()) throw ApiError(400, "tools", "'tools' must be a list");
  ojson tools = ojson::array();
  for (size_t i = 0; i < body["tools"].size(); ++i) {
    const ojson& t = body["tools"][i];
    if (!t.is_object() || !t.contains("name") || !t["name"].is_string())
      throw ApiError(400, "tools[" + std::to_string(i) + "]", "each tool needs a 'name'");
    ojson fn = {{"name", t["name"]}};
    if (t.contains("description")) fn["description"] = t["description"];
    fn["parameters"] = t.value("input_schema", ojson{{"type", "object"}, {"properties", ojson::object()}});
    tools.push_back({{"type", "function"}, {"function", fn}});
  }
  return tools.empty() ? ojson(nullptr) : tools;
}

// The prompt of a messages body (also what count_tokens counts); sets the tool fields of o (and,
// when generating, the grammar of a forced call, and the context shift that leaves room for
// `max_tokens`).
std::string messages_prompt(const ServedModel& m, const ojson& body, GenerateOptions& o, int64_t ctx = 0,
                            std::optional<int64_t> max_tokens = std::nullopt, ShiftNote* shift = nullptr) {
  const bool generating = shift != nullptr;
  std::vector<size_t> origin;
  ojson messages = template_messages(body, origin);
  ojson tools = request_tools(body);
  bool parse_tools = !tools.is_null();
  std::string forced;  // "any" or the tool's name
  bool single_call = false;
  if (body.contains("tool_choice") && !body["tool_choice"].is_null()) {
    const ojson& tc = body["tool_choice"];
    const std::string type = string_member(tc, "type");
    if (type != "auto" && type != "any" && type != "tool" && type != "none")
      throw ApiError(400, "tool_choice", "'tool_choice' must be an object with a 'type' of auto, any, tool or none");
    field::known_only(tc, {"type", "name", "disable_parallel_tool_use"}, "tool_choice");
    single_call = field::boolean(tc, "disable_parallel_tool_use", false);
    if (type == "none") tools = nullptr, parse_tools = false;
    if (type == "any") forced = "any";
    if (type == "tool") {
      forced = field::member(tc, "name", "tool_choice.name", "");
      if (forced.empty()) throw ApiError(400, "tool_choice.name", "'tool_choice.name' is required with type tool");
    }
  }
  ojson kwargs = ojson::object();
  if (body.contains("thinking") && !body["thinking"].is_null()) {
    const ojson& th = body["thinking"];
    const std::string type = string_member(th, "type");
    if (type != "enabled" && type != "disabled")
      throw ApiError(400, "thinking", "'thinking' must be an object with a 'type' of enabled or disabled");
    field::known_only(th, {"type", "budget_tokens"}, "thinking");
    // The budget is advisory in Anthropic's API too; the model's template decides how to think.
    field::integer(th, "budget_tokens", 0, 0, INT32_MAX);
    kwargs["enable_thinking"] = type == "enabled";
  }
  std::string prompt = render_chat(m, messages, tools, kwargs);
  o.prompt = m.encode_chat(prompt);
  if (generating) shift_to_fit(m, messages, origin, tools, kwargs, ctx, max_tokens, prompt, o, *shift);
  o.chat = true;
  o.parse_tools = parse_tools;
  o.in_reasoning = prompt_opens_reasoning(prompt);
  o.single_tool_call = parse_tools && (single_call || !forced.empty());
  if (!forced.empty() && generating)
    o.grammar = forced_tool_call(m, tools, forced == "any" ? "" : forced, o.in_reasoning, "tool_choice");
  return prompt;
}

}  // namespace

MessagesRequest parse_messages_request(const ServedModel& m, const ojson& body, int64_t ctx) {
  // Anthropic's fields, and the OpenAI-named sampling extensions request_sampling reads.
  field::known_only(body, {"model", "messages", "system", "max_tokens", "stop_sequences", "stream", "temperature",
                           "top_p", "top_k", "tools", "tool_choice", "thinking", "metadata", "service_tier",
                           "min_p", "repetition_penalty", "repeat_penalty", "repeat_last_n", "seed",
                           "presence_penalty", "frequency_penalty", "logit_bias"});
  if (!body.contains("max_tokens")) throw ApiError(400, "max_tokens", "'max_tokens' is required");
  const int64_t max_tokens = field::integer(body, "max_tokens", 0, 1, INT32_MAX);
  MessagesRequest r;
  GenerateOptions& o = r.options;
  o.sampling = request_sampling(m, body, 1.0);
  o.stop = field::string_or_list(body, "stop_sequences", 16);
  r.stream = field::boolean(body, "stream", false);
  field::string(body, "model", m.id);
  field::string_map(body, "metadata");
  field::string(body, "service_tier", "");
  r.prompt = messages_prompt(m, body, o, ctx, max_tokens, &r.shift);
  o.max_tokens = resolve_max_tokens(ctx, int64_t(o.prompt.size()), max_tokens, "max_tokens", max_tokens,
                                    r.shift.dropped_messages);
  return r;
}

int64_t parse_count_tokens_request(const ServedModel& m, const ojson& body) {
  field::known_only(body, {"model", "messages", "system", "tools", "tool_choice", "thinking"});
  field::string(body, "model", m.id);
  GenerateOptions o;
  messages_prompt(m, body, o);
  return int64_t(o.prompt.size());
}

}  // namespace moestream
