// Anthropic-compatible /v1/messages: text, thinking and tool_use content blocks, plain and
// streamed (message_start, content_block_start/delta/stop, message_delta, message_stop).
#include <httplib.h>

#include <chrono>

#include "core/error.h"
#include "server/api.h"
#include "server/requests.h"

namespace moestream {

namespace {

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

void count_tokens(ServerContext& ctx, const httplib::Request& req, httplib::Response& res) {
  const auto t0 = std::chrono::steady_clock::now();
  ServedModel& m = ctx.model;
  const ojson body = parse_body(req.body);
  const int64_t tokens = parse_count_tokens_request(m, body);
  res.set_content(ojson{{"input_tokens", tokens}}.dump(), "application/json");
  GenerateResult counted;
  counted.prompt_tokens = tokens;
  log_request(ctx, "/v1/messages/count_tokens", "", 200, {&counted}, since(t0));
}

void messages(ServerContext& ctx, const httplib::Request& req, httplib::Response& res) {
  const auto t0 = std::chrono::steady_clock::now();
  ServedModel& m = ctx.model;
  const ojson body = parse_body(req.body);
  MessagesRequest q = parse_messages_request(m, body, m.engine->options().ctx);
  const GenerateOptions& o = q.options;
  const bool stream = q.stream;
  if (q.shift.dropped_messages > 0) res.set_header(kShiftHeader, std::to_string(q.shift.dropped_messages));
  auto gen = std::make_shared<Generation>(m, o);
  const std::string id = random_id("msg_");
  const std::string model_id = m.id;
  const int64_t prompt_tokens = int64_t(o.prompt.size());
  const ojson shift = q.shift.dropped_messages > 0 ? q.shift.json() : ojson();

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
    if (!shift.is_null()) out["context_shift"] = shift;
    res.set_content(out.dump(-1, ' ', false, ojson::error_handler_t::replace), "application/json");
    log_request(ctx, "/v1/messages", id, 200, {&r}, since(t0));
    return;
  }

  res.set_header("Cache-Control", "no-cache");
  ServerContext* context = &ctx;
  res.set_chunked_content_provider("text/event-stream", [=](size_t, httplib::DataSink& sink) {
    try {
      ojson message = {{"id", id}, {"type", "message"}, {"role", "assistant"}, {"model", model_id},
                       {"content", ojson::array()}, {"stop_reason", nullptr}, {"stop_sequence", nullptr},
                       {"usage", {{"input_tokens", prompt_tokens}, {"output_tokens", 0}}}};
      if (!shift.is_null()) message["context_shift"] = shift;
      write_event(sink, "message_start", {{"type", "message_start"}, {"message", std::move(message)}});
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
      write_event(sink, "error", anthropic_error_body("api_error", e.what()));
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
    res.set_content(anthropic_error_body(e.status == 401 ? "authentication_error" : "invalid_request_error", e.what()).dump(),
                    "application/json");
  } catch (const nlohmann::json::exception&) {
    // A field read without its own check met a value of another type: still the client's error.
    res.status = 400;
    res.set_content(anthropic_error_body("invalid_request_error", "a field of the request has the wrong type").dump(),
                    "application/json");
  } catch (const QueueFull& e) {
    res.status = 503;
    res.set_header("Retry-After", "1");
    res.set_content(anthropic_error_body("overloaded_error", e.what()).dump(), "application/json");
  } catch (const std::exception& e) {
    res.status = 500;
    res.set_content(anthropic_error_body("api_error", e.what()).dump(), "application/json");
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
