// OpenAI-compatible endpoints: /v1/chat/completions and /v1/completions, plain and streamed
// (server-sent events ending with "data: [DONE]").
#include <httplib.h>

#include <functional>

#include "core/error.h"
#include "server/api.h"

namespace moestream {

namespace {

ojson error_body(const std::string& message, const std::string& type, const std::string& param, ojson code) {
  return {{"error", {{"message", message}, {"type", type},
                     {"param", param.empty() ? ojson(nullptr) : ojson(param)}, {"code", code}}}};
}

// Runs a handler, turning every failure into an OpenAI-style JSON error.
template <typename F>
void guarded(ServerContext& ctx, const std::string& endpoint, const httplib::Request& req,
             httplib::Response& res, F&& handle) {
  try {
    handle(req, res);
  } catch (const ApiError& e) {
    res.status = e.status;
    res.set_content(error_body(e.what(), "invalid_request_error", e.param, nullptr).dump(), "application/json");
  } catch (const nlohmann::json::exception&) {
    // A field read without its own check met a value of another type: still the client's error.
    res.status = 400;
    res.set_content(error_body("a field of the request has the wrong type", "invalid_request_error", "", nullptr).dump(),
                    "application/json");
  } catch (const QueueFull& e) {
    res.status = 503;
    res.set_header("Retry-After", "1");
    res.set_content(error_body(e.what(), "server_overloaded", "", 503).dump(), "application/json");
  } catch (const std::exception& e) {
    res.status = 500;
    res.set_content(error_body(e.what(), "server_error", "", 500).dump(), "application/json");
  }
  ctx.count(endpoint, res.status == -1 ? 200 : res.status);  // httplib sets 200 after the handler
}

std::string text_of_content(const ojson& content, const std::string& where) {
  if (content.is_null()) return "";
  if (content.is_string()) return content.get<std::string>();
  if (content.is_array()) {
    std::string text;
    for (const auto& part : content) {
      if (string_member(part, "type") != "text" || !part.contains("text") || !part["text"].is_string())
        throw ApiError(400, where, "'" + where + "': only text content parts are supported");
      text += part["text"].get<std::string>();
    }
    return text;
  }
  throw ApiError(400, where, "'" + where + "' must be a string or a list of text parts");
}

ojson parse_arguments(const ojson& args, const std::string& where) {
  if (args.is_object()) return args;
  if (args.is_string()) {
    std::optional<ojson> parsed = parse_nested_json(args.get<std::string>(), where);
    if (parsed && parsed->is_object()) return *parsed;
  }
  throw ApiError(400, where, "'" + where + "' must be a JSON object (or a string holding one)");
}

// The request's messages in the form chat templates expect (transformers' convention: text
// content, tool-call arguments as objects, "developer" as "system").
ojson template_messages(const ojson& body) {
  if (!body.contains("messages") || !body["messages"].is_array() || body["messages"].empty())
    throw ApiError(400, "messages", "'messages' must be a non-empty list");
  ojson out = ojson::array();
  const ojson& messages = body["messages"];
  for (size_t i = 0; i < messages.size(); ++i) {
    const ojson& m = messages[i];
    const std::string at = "messages[" + std::to_string(i) + "]";
    if (!m.is_object()) throw ApiError(400, at, "'" + at + "' must be an object");
    if (!m.contains("role") || !m["role"].is_string()) throw ApiError(400, at + ".role", "'" + at + ".role' must be a string");
    std::string role = m["role"].get<std::string>();
    if (role == "developer") role = "system";
    if (role != "system" && role != "user" && role != "assistant" && role != "tool")
      throw ApiError(400, at + ".role", "'" + at + ".role' must be system, developer, user, assistant or tool; got '" + role + "'");
    ojson msg = {{"role", role}, {"content", text_of_content(m.value("content", ojson()), at + ".content")}};
    if (m.contains("reasoning_content") && m["reasoning_content"].is_string())
      msg["reasoning_content"] = m["reasoning_content"];
    if (role == "assistant" && m.contains("tool_calls") && !m["tool_calls"].is_null()) {
      if (!m["tool_calls"].is_array()) throw ApiError(400, at + ".tool_calls", "'" + at + ".tool_calls' must be a list");
      ojson calls = ojson::array();
      for (size_t j = 0; j < m["tool_calls"].size(); ++j) {
        const ojson& c = m["tool_calls"][j];
        const std::string cat = at + ".tool_calls[" + std::to_string(j) + "]";
        if (!c.is_object() || !c.contains("function") || !c["function"].is_object() ||
            !c["function"].contains("name") || !c["function"]["name"].is_string())
          throw ApiError(400, cat, "'" + cat + "' must be {\"type\": \"function\", \"function\": {\"name\", \"arguments\"}}");
        ojson call = {{"type", "function"},
                      {"function", {{"name", c["function"]["name"]},
                                    {"arguments", parse_arguments(c["function"].value("arguments", ojson::object()),
                                                                  cat + ".function.arguments")}}}};
        if (c.contains("id")) call["id"] = c["id"];
        calls.push_back(std::move(call));
      }
      msg["tool_calls"] = std::move(calls);
    }
    if (role == "tool") {
      for (const char* k : {"tool_call_id", "name"})
        if (m.contains(k) && m[k].is_string()) msg[k] = m[k];
    }
    out.push_back(std::move(msg));
  }
  return out;
}

ojson request_tools(const ojson& body) {
  if (!body.contains("tools") || body["tools"].is_null()) return nullptr;
  const ojson& tools = body["tools"];
  if (!tools.is_array()) throw ApiError(400, "tools", "'tools' must be a list");
  for (size_t i = 0; i < tools.size(); ++i) {
    const ojson& t = tools[i];
    if (string_member(t, "type") != "function" || !t.contains("function") ||
        !t["function"].is_object() || !t["function"].contains("name") || !t["function"]["name"].is_string())
      throw ApiError(400, "tools[" + std::to_string(i) + "]",
                     "'tools[" + std::to_string(i) + "]' must be {\"type\": \"function\", \"function\": {\"name\", …}}");
  }
  return tools.empty() ? ojson(nullptr) : tools;
}

ojson tool_calls_json(const std::vector<ToolCall>& calls, size_t first_index, bool with_index) {
  ojson out = ojson::array();
  for (size_t i = 0; i < calls.size(); ++i) {
    ojson c = {{"id", calls[i].id}, {"type", "function"},
               {"function", {{"name", calls[i].name}, {"arguments", calls[i].arguments}}}};
    if (with_index) c["index"] = first_index + i;
    out.push_back(std::move(c));
  }
  return out;
}

ojson usage_json(const GenerateResult& r) {
  return {{"prompt_tokens", r.prompt_tokens}, {"completion_tokens", r.completion_tokens},
          {"total_tokens", r.prompt_tokens + r.completion_tokens},
          {"prompt_tokens_details", {{"cached_tokens", r.cached_tokens}}}};
}

bool is_blank(const std::string& s) { return s.find_first_not_of(" \t\r\n") == std::string::npos; }

struct Common {
  GenerateOptions options;
  bool stream = false, include_usage = false;
};

// The fields /v1/chat/completions and /v1/completions share.
Common common_fields(const ServedModel& m, const ojson& body) {
  Common c;
  c.options.sampling = request_sampling(m, body, 2.0);
  c.options.stop = field::string_or_list(body, "stop", 16);
  c.stream = field::boolean(body, "stream", false);
  if (body.contains("stream_options") && !body["stream_options"].is_null()) {
    if (!body["stream_options"].is_object()) throw ApiError(400, "stream_options", "'stream_options' must be an object");
    c.include_usage = field::boolean(body["stream_options"], "include_usage", false);
  }
  if (field::integer(body, "n", 1, 1, 1) != 1) throw ApiError(400, "n", "only n = 1 is supported");
  if (field::boolean(body, "logprobs", false)) throw ApiError(400, "logprobs", "'logprobs' is not supported");
  if (body.contains("response_format") && !body["response_format"].is_null()) {
    const ojson& rf = body["response_format"];
    const std::string type = string_member(rf, "type");
    if (type == "json_object" || type == "json_schema") c.options.json_object = true;
    else if (type != "text")
      throw ApiError(400, "response_format", "'response_format.type' must be text, json_object or json_schema");
  }
  const std::string model = field::string(body, "model", m.id);
  (void)model;  // one model is served; any name addresses it
  // Fields that change nothing here, checked so that a wrong type is an error, not ignored.
  field::logit_bias(body);
  if (field::integer(body, "top_logprobs", 0, 0, 20) > 0)
    throw ApiError(400, "top_logprobs", "'top_logprobs' is not supported");
  field::string(body, "user", "");
  field::string(body, "service_tier", "");
  field::boolean(body, "parallel_tool_calls", true);
  field::boolean(body, "store", false);
  field::string_map(body, "metadata");
  return c;
}

std::optional<int64_t> requested_max_tokens(const ojson& body, std::string& param) {
  for (const char* k : {"max_completion_tokens", "max_tokens"}) {
    const int64_t v = field::integer(body, k, -1, 1, INT32_MAX);
    if (v > 0) {
      param = k;
      return v;
    }
  }
  param = "max_tokens";
  return std::nullopt;
}

void write_event(httplib::DataSink& sink, const ojson& j) {
  const std::string s = "data: " + j.dump(-1, ' ', false, ojson::error_handler_t::replace) + "\n\n";
  sink.write(s.data(), s.size());
}

// Streams a generation as server-sent events. Each event is `envelope` (id, object, created, model)
// with "choices": first_choice (if any), then the choices pieces() makes of each piece of output,
// then last() of the result; then the usage event when asked for, and "data: [DONE]".
void stream_events(httplib::Response& res, std::shared_ptr<Generation> gen, ojson envelope, bool include_usage,
                   ojson first_choice, std::function<ojson(const ParsedOutput&)> pieces,
                   std::function<ojson(const GenerateResult&)> last) {
  res.set_header("Cache-Control", "no-cache");
  res.set_chunked_content_provider("text/event-stream", [=](size_t, httplib::DataSink& sink) {
    auto event = [&](ojson choices) {
      ojson e = envelope;
      e["choices"] = std::move(choices);
      write_event(sink, e);
    };
    try {
      if (!first_choice.is_null()) event(ojson::array({first_choice}));
      GenerateResult r = gen->run(
          [&](const ParsedOutput& piece) {
            for (ojson& c : pieces(piece)) event(ojson::array({std::move(c)}));
            return sink.is_writable();
          },
          [&] { return sink.is_writable(); });
      if (r.finish_reason == "cancelled") return false;
      event(ojson::array({last(r)}));
      if (include_usage) {
        ojson e = envelope;
        e["choices"] = ojson::array();
        e["usage"] = usage_json(r);
        write_event(sink, e);
      }
    } catch (const std::exception& e) {
      write_event(sink, error_body(e.what(), "server_error", "", 500));
    }
    const std::string done = "data: [DONE]\n\n";
    sink.write(done.data(), done.size());
    sink.done();
    return true;
  });
}

void chat_completions(ServerContext& ctx, const httplib::Request& req, httplib::Response& res) {
  ServedModel& m = ctx.model;
  const ojson body = parse_body(req.body);
  Common c = common_fields(m, body);
  ojson messages = template_messages(body);
  ojson tools = request_tools(body);
  bool parse_tools = !tools.is_null();
  if (body.contains("tool_choice") && !body["tool_choice"].is_null()) {
    const ojson& tc = body["tool_choice"];
    if (tc.is_string()) {
      const std::string s = tc.get<std::string>();
      if (s != "none" && s != "auto" && s != "required")
        throw ApiError(400, "tool_choice", "'tool_choice' must be none, auto, required or a function");
      if (s == "none") tools = nullptr, parse_tools = false;
    } else if (!tc.is_object()) {
      throw ApiError(400, "tool_choice", "'tool_choice' must be a string or an object");
    }
  }
  ojson kwargs = ojson::object();
  if (body.contains("chat_template_kwargs") && !body["chat_template_kwargs"].is_null()) {
    if (!body["chat_template_kwargs"].is_object())
      throw ApiError(400, "chat_template_kwargs", "'chat_template_kwargs' must be an object");
    kwargs = body["chat_template_kwargs"];
  }
  const std::string effort = field::choice(body, "reasoning_effort", {"none", "minimal", "low", "medium", "high"});
  if (!effort.empty()) kwargs["reasoning_effort"] = effort;

  const std::string prompt = render_chat(m, messages, tools, kwargs);
  c.options.prompt = m.encode_chat(prompt);
  std::string param;
  const auto requested = requested_max_tokens(body, param);
  c.options.max_tokens = resolve_max_tokens(m, int64_t(c.options.prompt.size()), requested, param, INT32_MAX);
  c.options.chat = true;
  c.options.parse_tools = parse_tools;
  c.options.in_reasoning = prompt_opens_reasoning(prompt);

  auto gen = std::make_shared<Generation>(m, c.options);
  const std::string id = random_id("chatcmpl-");
  const int64_t created = unix_time();
  const std::string model_id = m.id;

  if (!c.stream) {
    GenerateResult r = gen->run(nullptr);
    ojson message = {{"role", "assistant"}};
    const bool calls = !r.output.tool_calls.empty();
    message["content"] = calls && is_blank(r.output.content) ? ojson(nullptr) : ojson(r.output.content);
    if (!r.output.reasoning.empty()) message["reasoning_content"] = r.output.reasoning;
    if (calls) message["tool_calls"] = tool_calls_json(r.output.tool_calls, 0, false);
    ojson out = {{"id", id}, {"object", "chat.completion"}, {"created", created}, {"model", model_id},
                 {"choices", ojson::array({{{"index", 0}, {"message", message}, {"logprobs", nullptr},
                                            {"finish_reason", r.finish_reason}}})},
                 {"usage", usage_json(r)}};
    res.set_content(out.dump(-1, ' ', false, ojson::error_handler_t::replace), "application/json");
    return;
  }

  auto choice = [](ojson delta, ojson finish) {
    return ojson{{"index", 0}, {"delta", std::move(delta)}, {"logprobs", nullptr}, {"finish_reason", std::move(finish)}};
  };
  auto n_calls = std::make_shared<size_t>(0);
  stream_events(
      res, gen, {{"id", id}, {"object", "chat.completion.chunk"}, {"created", created}, {"model", model_id}},
      c.include_usage, choice({{"role", "assistant"}, {"content", ""}}, nullptr),
      [=](const ParsedOutput& piece) {
        ojson out = ojson::array();
        if (!piece.reasoning.empty()) out.push_back(choice({{"reasoning_content", piece.reasoning}}, nullptr));
        if (!piece.content.empty()) out.push_back(choice({{"content", piece.content}}, nullptr));
        if (!piece.tool_calls.empty()) {
          out.push_back(choice({{"tool_calls", tool_calls_json(piece.tool_calls, *n_calls, true)}}, nullptr));
          *n_calls += piece.tool_calls.size();
        }
        return out;
      },
      [=](const GenerateResult& r) { return choice(ojson::object(), r.finish_reason); });
}

void completions(ServerContext& ctx, const httplib::Request& req, httplib::Response& res) {
  ServedModel& m = ctx.model;
  const ojson body = parse_body(req.body);
  Common c = common_fields(m, body);
  if (!body.contains("prompt") || body["prompt"].is_null()) throw ApiError(400, "prompt", "'prompt' is required");
  const ojson& p = body["prompt"];
  if (p.is_string()) {
    c.options.prompt = m.encode_text(p.get<std::string>());
  } else if (p.is_array() && p.size() == 1 && p[0].is_string()) {
    c.options.prompt = m.encode_text(p[0].get<std::string>());
  } else if (p.is_array() && !p.empty() && p[0].is_number_integer()) {
    for (const auto& t : p) {
      if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() >= m.model->info().vocab_size)
        throw ApiError(400, "prompt", "'prompt' token ids must be integers in [0, " +
                                          std::to_string(m.model->info().vocab_size) + ")");
      c.options.prompt.push_back(int32_t(t.get<int64_t>()));
    }
  } else {
    throw ApiError(400, "prompt", "'prompt' must be a string, a list of one string, or a list of token ids");
  }
  if (c.options.prompt.empty()) throw ApiError(400, "prompt", "'prompt' is empty");
  if (field::boolean(body, "echo", false)) throw ApiError(400, "echo", "'echo' is not supported");
  if (body.contains("suffix") && !body["suffix"].is_null()) throw ApiError(400, "suffix", "'suffix' is not supported");
  std::string param;
  const auto requested = requested_max_tokens(body, param);
  c.options.max_tokens = resolve_max_tokens(m, int64_t(c.options.prompt.size()), requested, param, 16);

  auto gen = std::make_shared<Generation>(m, c.options);
  const std::string id = random_id("cmpl-");
  const int64_t created = unix_time();
  const std::string model_id = m.id;
  auto choice = [](const std::string& text, ojson finish) {  // a list of one choice
    return ojson::array({{{"text", text}, {"index", 0}, {"logprobs", nullptr}, {"finish_reason", std::move(finish)}}});
  };
  if (!c.stream) {
    GenerateResult r = gen->run(nullptr);
    ojson out = {{"id", id}, {"object", "text_completion"}, {"created", created}, {"model", model_id},
                 {"choices", choice(r.output.content, r.finish_reason)}, {"usage", usage_json(r)}};
    res.set_content(out.dump(-1, ' ', false, ojson::error_handler_t::replace), "application/json");
    return;
  }
  stream_events(
      res, gen, {{"id", id}, {"object", "text_completion"}, {"created", created}, {"model", model_id}},
      c.include_usage, nullptr,
      [=](const ParsedOutput& piece) { return choice(piece.content, nullptr); },
      [=](const GenerateResult& r) { return choice("", r.finish_reason)[0]; });
}

}  // namespace

void add_openai_routes(httplib::Server& svr, ServerContext& ctx) {
  svr.Post("/v1/chat/completions", [&ctx](const httplib::Request& req, httplib::Response& res) {
    guarded(ctx, "/v1/chat/completions", req, res,
            [&](const httplib::Request& q, httplib::Response& r) { chat_completions(ctx, q, r); });
  });
  svr.Post("/v1/completions", [&ctx](const httplib::Request& req, httplib::Response& res) {
    guarded(ctx, "/v1/completions", req, res,
            [&](const httplib::Request& q, httplib::Response& r) { completions(ctx, q, r); });
  });
}

}  // namespace moestream
