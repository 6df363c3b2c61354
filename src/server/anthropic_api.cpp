// Anthropic-compatible /v1/messages: text, thinking and tool_use content blocks, plain and
// streamed (message_start, content_block_start/delta/stop, message_delta, message_stop).
#include <httplib.h>

#include <chrono>

#include "core/error.h"
#include "server/api.h"

namespace moestream {

namespace {

ojson error_body(const std::string& type, const std::string& message) {
  return {{"type", "error"}, {"error", {{"type", type}, {"message", message}}}};
}

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

// Anthropic messages -> the OpenAI/transformers message list chat templates take.
ojson template_messages(const ojson& body) {
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
    if (content.is_string()) {
      out.push_back({{"role", role}, {"content", content}});
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

std::string stop_reason(const GenerateResult& r) {
  if (r.finish_reason == "tool_calls") return "tool_use";
  if (!r.stop_sequence.empty()) return "stop_sequence";
  if (r.finish_reason == "length") return "max_tokens";
  return "end_turn";
}

ojson tool_use_block(const ToolCall& c) {
  ojson input = json_depth(c.arguments) > kMaxJsonDepth ? ojson() : ojson::parse(c.arguments, nullptr, false);
  if (input.is_discarded()) input = ojson::object();
  return {{"type", "tool_use"}, {"id", "toolu_" + c.id.substr(5)}, {"name", c.name}, {"input", input}};
}

double since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void write_event(httplib::DataSink& sink, const std::string& name, const ojson& data) {
  const std::string s = "event: " + name + "\ndata: " + data.dump(-1, ' ', false, ojson::error_handler_t::replace) + "\n\n";
  sink.write(s.data(), s.size());
}

// The prompt of a messages body (also what count_tokens counts); sets the tool fields of o (and,
// when generating, the grammar of a forced call).
std::string messages_prompt(ServedModel& m, const ojson& body, GenerateOptions& o, bool generating = true) {
  ojson messages = template_messages(body);
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
  const std::string prompt = render_chat(m, messages, tools, kwargs);
  o.prompt = m.encode_chat(prompt);
  o.chat = true;
  o.parse_tools = parse_tools;
  o.in_reasoning = prompt_opens_reasoning(prompt);
  o.single_tool_call = parse_tools && (single_call || !forced.empty());
  if (!forced.empty() && generating)
    o.grammar = forced_tool_call(m, tools, forced == "any" ? "" : forced, o.in_reasoning, "tool_choice");
  return prompt;
}

void count_tokens(ServerContext& ctx, const httplib::Request& req, httplib::Response& res) {
  const auto t0 = std::chrono::steady_clock::now();
  ServedModel& m = ctx.model;
  const ojson body = parse_body(req.body);
  field::known_only(body, {"model", "messages", "system", "tools", "tool_choice", "thinking"});
  field::string(body, "model", m.id);
  GenerateOptions o;
  messages_prompt(m, body, o, false);
  res.set_content(ojson{{"input_tokens", o.prompt.size()}}.dump(), "application/json");
  GenerateResult counted;
  counted.prompt_tokens = int64_t(o.prompt.size());
  log_request(ctx, "/v1/messages/count_tokens", "", 200, {&counted}, since(t0));
}

void messages(ServerContext& ctx, const httplib::Request& req, httplib::Response& res) {
  const auto t0 = std::chrono::steady_clock::now();
  ServedModel& m = ctx.model;
  const ojson body = parse_body(req.body);
  // Anthropic's fields, and the OpenAI-named sampling extensions request_sampling reads.
  field::known_only(body, {"model", "messages", "system", "max_tokens", "stop_sequences", "stream", "temperature",
                           "top_p", "top_k", "tools", "tool_choice", "thinking", "metadata", "service_tier",
                           "min_p", "repetition_penalty", "seed", "presence_penalty", "frequency_penalty",
                           "logit_bias"});
  if (!body.contains("max_tokens")) throw ApiError(400, "max_tokens", "'max_tokens' is required");
  const int64_t max_tokens = field::integer(body, "max_tokens", 0, 1, INT32_MAX);
  GenerateOptions o;
  o.sampling = request_sampling(m, body, 1.0);
  o.stop = field::string_or_list(body, "stop_sequences", 16);
  const bool stream = field::boolean(body, "stream", false);
  field::string(body, "model", m.id);
  field::string_map(body, "metadata");
  field::string(body, "service_tier", "");
  messages_prompt(m, body, o);
  o.max_tokens = resolve_max_tokens(m, int64_t(o.prompt.size()), max_tokens, "max_tokens", max_tokens);

  auto gen = std::make_shared<Generation>(m, o);
  const std::string id = random_id("msg_");
  const std::string model_id = m.id;
  const int64_t prompt_tokens = int64_t(o.prompt.size());

  if (!stream) {
    GenerateResult r = gen->run(nullptr);
    ojson content = ojson::array();
    if (!r.output.reasoning.empty())
      content.push_back({{"type", "thinking"}, {"thinking", r.output.reasoning}, {"signature", ""}});
    if (!r.output.content.empty() && !(r.output.tool_calls.size() && r.output.content.find_first_not_of(" \t\r\n") == std::string::npos))
      content.push_back({{"type", "text"}, {"text", r.output.content}});
    for (const ToolCall& c : r.output.tool_calls) content.push_back(tool_use_block(c));
    ojson out = {{"id", id}, {"type", "message"}, {"role", "assistant"}, {"model", model_id},
                 {"content", content}, {"stop_reason", stop_reason(r)},
                 {"stop_sequence", r.stop_sequence.empty() ? ojson(nullptr) : ojson(r.stop_sequence)},
                 {"usage", {{"input_tokens", r.prompt_tokens - r.cached_tokens},
                            {"cache_read_input_tokens", r.cached_tokens},
                            {"output_tokens", r.completion_tokens}}}};
    res.set_content(out.dump(-1, ' ', false, ojson::error_handler_t::replace), "application/json");
    log_request(ctx, "/v1/messages", id, 200, {&r}, since(t0));
    return;
  }

  res.set_header("Cache-Control", "no-cache");
  ServerContext* context = &ctx;
  res.set_chunked_content_provider("text/event-stream", [=](size_t, httplib::DataSink& sink) {
    try {
      write_event(sink, "message_start",
                  {{"type", "message_start"},
                   {"message", {{"id", id}, {"type", "message"}, {"role", "assistant"}, {"model", model_id},
                                {"content", ojson::array()}, {"stop_reason", nullptr}, {"stop_sequence", nullptr},
                                {"usage", {{"input_tokens", prompt_tokens}, {"output_tokens", 0}}}}}});
      int index = -1;
      std::string open;  // type of the open block: "", "text" or "thinking"
      auto close = [&] {
        if (open.empty()) return;
        write_event(sink, "content_block_stop", {{"type", "content_block_stop"}, {"index", index}});
        open.clear();
      };
      auto delta = [&](const std::string& type, const std::string& text) {
        if (open != type) {
          close();
          open = type;
          ojson block = type == "text" ? ojson{{"type", "text"}, {"text", ""}}
                                       : ojson{{"type", "thinking"}, {"thinking", ""}};
          write_event(sink, "content_block_start", {{"type", "content_block_start"}, {"index", ++index}, {"content_block", block}});
        }
        ojson d = type == "text" ? ojson{{"type", "text_delta"}, {"text", text}}
                                 : ojson{{"type", "thinking_delta"}, {"thinking", text}};
        write_event(sink, "content_block_delta", {{"type", "content_block_delta"}, {"index", index}, {"delta", d}});
      };
      GenerateResult r = gen->run(
          [&](const ParsedOutput& piece) {
            if (!piece.reasoning.empty()) delta("thinking", piece.reasoning);
            if (!piece.content.empty()) delta("text", piece.content);
            for (const ToolCall& c : piece.tool_calls) {
              close();
              ojson block = tool_use_block(c);
              const std::string args = block["input"].dump();
              block["input"] = ojson::object();
              write_event(sink, "content_block_start", {{"type", "content_block_start"}, {"index", ++index}, {"content_block", block}});
              write_event(sink, "content_block_delta", {{"type", "content_block_delta"}, {"index", index},
                                                        {"delta", {{"type", "input_json_delta"}, {"partial_json", args}}}});
              write_event(sink, "content_block_stop", {{"type", "content_block_stop"}, {"index", index}});
            }
            return sink.is_writable();
          },
          [&] { return sink.is_writable(); });
      if (r.finish_reason == "cancelled") {
        log_request(*context, "/v1/messages", id, 499, {&r}, since(t0));
        return false;
      }
      close();
      write_event(sink, "message_delta",
                  {{"type", "message_delta"},
                   {"delta", {{"stop_reason", stop_reason(r)},
                              {"stop_sequence", r.stop_sequence.empty() ? ojson(nullptr) : ojson(r.stop_sequence)}}},
                   {"usage", {{"output_tokens", r.completion_tokens}}}});
      write_event(sink, "message_stop", {{"type", "message_stop"}});
      log_request(*context, "/v1/messages", id, 200, {&r}, since(t0));
    } catch (const std::exception& e) {
      write_event(sink, "error", error_body("api_error", e.what()));
      log_request(*context, "/v1/messages", id, 500, {}, since(t0));
    }
    sink.done();
    return true;
  });
}

// Runs a handler, turning every failure into an Anthropic-style JSON error.
template <typename F>
void guarded(ServerContext& ctx, const std::string& endpoint, const httplib::Request& req, httplib::Response& res,
             F&& handle) {
  try {
    handle(ctx, req, res);
  } catch (const ApiError& e) {
    res.status = e.status;
    res.set_content(error_body(e.status == 401 ? "authentication_error" : "invalid_request_error", e.what()).dump(),
                    "application/json");
  } catch (const nlohmann::json::exception&) {
    // A field read without its own check met a value of another type: still the client's error.
    res.status = 400;
    res.set_content(error_body("invalid_request_error", "a field of the request has the wrong type").dump(),
                    "application/json");
  } catch (const QueueFull& e) {
    res.status = 503;
    res.set_header("Retry-After", "1");
    res.set_content(error_body("overloaded_error", e.what()).dump(), "application/json");
  } catch (const std::exception& e) {
    res.status = 500;
    res.set_content(error_body("api_error", e.what()).dump(), "application/json");
  }
  const int status = res.status == -1 ? 200 : res.status;  // httplib sets 200 after the handler
  ctx.count(endpoint, status);
  if (status != 200) log_request(ctx, endpoint, "", status, {}, 0);  // successes log their own line
}

}  // namespace

void add_anthropic_routes(httplib::Server& svr, ServerContext& ctx) {
  svr.Post("/v1/messages", [&ctx](const httplib::Request& req, httplib::Response& res) {
    guarded(ctx, "/v1/messages", req, res, messages);
  });
  svr.Post("/v1/messages/count_tokens", [&ctx](const httplib::Request& req, httplib::Response& res) {
    guarded(ctx, "/v1/messages/count_tokens", req, res, count_tokens);
  });
}

}  // namespace moestream
