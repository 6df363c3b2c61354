// OpenAI-compatible endpoints: /v1/chat/completions and /v1/completions, plain and streamed
// (server-sent events ending with "data: [DONE]").
#include <httplib.h>

#include <chrono>
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
  const int status = res.status == -1 ? 200 : res.status;  // httplib sets 200 after the handler
  ctx.count(endpoint, status);
  if (status != 200) log_request(ctx, endpoint, "", status, {}, 0);  // successes log their own line
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

constexpr int kMaxChoices = 8;  // n

struct Common {
  GenerateOptions options;
  bool stream = false, include_usage = false;
  int n = 1;
  std::string user;
};

// The fields /v1/chat/completions and /v1/completions share.
Common common_fields(const ServedModel& m, const ojson& body) {
  Common c;
  c.options.sampling = request_sampling(m, body, 2.0);
  c.options.stop = field::string_or_list(body, "stop", 16);
  c.stream = field::boolean(body, "stream", false);
  if (body.contains("stream_options") && !body["stream_options"].is_null()) {
    if (!body["stream_options"].is_object()) throw ApiError(400, "stream_options", "'stream_options' must be an object");
    field::known_only(body["stream_options"], {"include_usage"}, "stream_options");
    c.include_usage = field::boolean(body["stream_options"], "include_usage", false);
  }
  c.n = int(field::integer(body, "n", 1, 1, kMaxChoices));
  c.options.grammar = response_format_grammar(body, c.options.json_object);
  const std::string model = field::string(body, "model", m.id);
  (void)model;  // one model is served; any name addresses it
  c.user = field::string(body, "user", "");  // shown in the request's log line
  field::string(body, "service_tier", "");    // one tier here
  if (field::boolean(body, "store", false))
    throw ApiError(400, "store", "'store': true is not supported (this server keeps no completions)");
  field::string_map(body, "metadata");
  if (body.contains("modalities") && !body["modalities"].is_null() && body["modalities"] != ojson::array({"text"}))
    throw ApiError(400, "modalities", "'modalities' must be [\"text\"]: this server writes text only");
  return c;
}

// The n generations of a request, queued at once (the engine runs them side by side). Choice i
// samples with its own seed derived from the request's, so sampled choices differ and a seeded
// request repeats exactly; greedy choices are identical.
std::vector<std::shared_ptr<Generation>> start_choices(ServedModel& m, const GenerateOptions& o, int n) {
  std::vector<std::shared_ptr<Generation>> gens;
  for (int i = 0; i < n; ++i) {
    GenerateOptions oi = o;
    oi.sampling.seed = o.sampling.seed + uint64_t(i) * 0x9E3779B97F4A7C15ull;
    gens.push_back(std::make_shared<Generation>(m, oi));
  }
  return gens;
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

ojson usage_json(const std::vector<GenerateResult>& rs) {
  GenerateResult sum = rs.at(0);
  for (size_t i = 1; i < rs.size(); ++i) sum.completion_tokens += rs[i].completion_tokens;
  return usage_json(sum);
}

std::vector<const GenerateResult*> pointers(const std::vector<GenerateResult>& rs) {
  std::vector<const GenerateResult*> out;
  for (const auto& r : rs) out.push_back(&r);
  return out;
}

double since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

struct StreamSpec {
  ojson envelope;                                                    // id, object, created, model
  std::function<ojson(size_t)> first;                                // a choice opening choice i, or null
  std::function<ojson(size_t, Generation&, const ParsedOutput&)> pieces;  // choices for a piece
  std::function<ojson(size_t, Generation&, const GenerateResult&)> last;  // choice i's closing choice
};

// Streams the choices' generations, one after another, as server-sent events: each event is the
// envelope with "choices" holding one choice (its "index" tells them apart); then the usage event
// when asked for, and "data: [DONE]". Logs the request when it ends.
void stream_events(ServerContext& ctx, const std::string& endpoint, httplib::Response& res,
                   std::vector<std::shared_ptr<Generation>> gens, bool include_usage, StreamSpec spec,
                   std::string user, std::chrono::steady_clock::time_point t0) {
  res.set_header("Cache-Control", "no-cache");
  ServerContext* context = &ctx;
  res.set_chunked_content_provider("text/event-stream", [=](size_t, httplib::DataSink& sink) {
    const std::string id = spec.envelope["id"];
    auto event = [&](ojson choice) {
      ojson e = spec.envelope;
      e["choices"] = ojson::array({std::move(choice)});
      write_event(sink, e);
    };
    std::vector<GenerateResult> results;
    try {
      for (size_t i = 0; i < gens.size(); ++i) {
        ojson first = spec.first ? spec.first(i) : ojson();
        if (!first.is_null()) event(std::move(first));
        Generation& gen = *gens[i];
        GenerateResult r = gen.run(
            [&](const ParsedOutput& piece) {
              for (ojson& c : spec.pieces(i, gen, piece)) event(std::move(c));
              return sink.is_writable();
            },
            [&] { return sink.is_writable(); });
        if (r.finish_reason == "cancelled") {
          results.push_back(std::move(r));
          log_request(*context, endpoint, id, 499, pointers(results), since(t0), user);
          return false;
        }
        event(spec.last(i, gen, r));
        results.push_back(std::move(r));
      }
      if (include_usage) {
        ojson e = spec.envelope;
        e["choices"] = ojson::array();
        e["usage"] = usage_json(results);
        write_event(sink, e);
      }
      log_request(*context, endpoint, id, 200, pointers(results), since(t0), user);
    } catch (const std::exception& e) {
      write_event(sink, error_body(e.what(), "server_error", "", 500));
      log_request(*context, endpoint, id, 500, pointers(results), since(t0), user);
    }
    const std::string done = "data: [DONE]\n\n";
    sink.write(done.data(), done.size());
    sink.done();
    return true;
  });
}

void chat_completions(ServerContext& ctx, const httplib::Request& req, httplib::Response& res) {
  const auto t0 = std::chrono::steady_clock::now();
  ServedModel& m = ctx.model;
  const ojson body = parse_body(req.body);
  field::known_only(body, {"model", "messages", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                           "seed", "presence_penalty", "frequency_penalty", "logit_bias", "stop", "stream",
                           "stream_options", "n", "logprobs", "top_logprobs", "response_format", "tools",
                           "tool_choice", "parallel_tool_calls", "chat_template_kwargs", "reasoning_effort",
                           "max_tokens", "max_completion_tokens", "user", "service_tier", "store", "metadata",
                           "modalities"});
  Common c = common_fields(m, body);
  const bool logprobs = field::boolean(body, "logprobs", false);
  const int64_t top_logprobs = field::integer(body, "top_logprobs", -1, 0, 20);
  if (top_logprobs >= 0 && !logprobs)
    throw ApiError(400, "top_logprobs", "'top_logprobs' needs 'logprobs': true");
  c.options.logprobs = logprobs ? int(std::max<int64_t>(top_logprobs, 0)) : -1;
  ojson messages = template_messages(body);
  ojson tools = request_tools(body);
  bool parse_tools = !tools.is_null();
  std::string forced;  // "required", or the function's name
  if (body.contains("tool_choice") && !body["tool_choice"].is_null()) {
    const ojson& tc = body["tool_choice"];
    if (tc.is_string()) {
      const std::string s = tc.get<std::string>();
      if (s != "none" && s != "auto" && s != "required")
        throw ApiError(400, "tool_choice", "'tool_choice' must be none, auto, required or a function");
      if (s == "none") tools = nullptr, parse_tools = false;
      if (s == "required") forced = s;
    } else if (tc.is_object()) {
      if (string_member(tc, "type") != "function" || !tc.contains("function") || !tc["function"].is_object())
        throw ApiError(400, "tool_choice", "'tool_choice' must be {\"type\": \"function\", \"function\": {\"name\": …}}");
      forced = field::member(tc["function"], "name", "tool_choice.function.name", "");
      if (forced.empty()) throw ApiError(400, "tool_choice.function.name", "'tool_choice.function.name' is required");
    } else {
      throw ApiError(400, "tool_choice", "'tool_choice' must be a string or an object");
    }
  }
  const bool parallel_calls = field::boolean(body, "parallel_tool_calls", true);
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
  // A forced call is one call; otherwise parallel_tool_calls false ends the reply after its first.
  c.options.single_tool_call = parse_tools && (!parallel_calls || !forced.empty());
  if (!forced.empty()) {
    if (c.options.grammar || c.options.json_object)
      throw ApiError(400, "tool_choice", "'tool_choice' cannot force a tool call together with a JSON response_format");
    c.options.grammar = forced_tool_call(m, tools, forced == "required" ? "" : forced, c.options.in_reasoning, "tool_choice");
  } else if (parse_tools) {
    // Strict tools: a call the model chooses to make has arguments that follow the schema.
    auto strict = strict_tool_calls(m, tools);
    if (strict && (c.options.grammar || c.options.json_object))
      throw ApiError(400, "tools", "strict tools cannot be combined with a JSON response_format");
    c.options.tool_call_grammar = strict;
  }
  if (c.options.in_reasoning && forced.empty() && (c.options.grammar || c.options.json_object)) {
    // The template opened a reasoning block: close it first, so the JSON is the answer.
    c.options.grammar = JsonGrammar::after("</think>\n\n", c.options.grammar ? c.options.grammar : JsonGrammar::any_object());
    c.options.json_object = false;
  }

  auto gens = start_choices(m, c.options, c.n);
  const std::string id = random_id("chatcmpl-");
  const int64_t created = unix_time();
  const std::string model_id = m.id;
  const Tokenizer* tok = m.tokenizer.get();

  if (!c.stream) {
    std::vector<GenerateResult> results;
    ojson choices = ojson::array();
    for (size_t i = 0; i < gens.size(); ++i) {
      GenerateResult r = gens[i]->run(nullptr);
      ojson message = {{"role", "assistant"}};
      const bool calls = !r.output.tool_calls.empty();
      message["content"] = calls && is_blank(r.output.content) ? ojson(nullptr) : ojson(r.output.content);
      if (!r.output.reasoning.empty()) message["reasoning_content"] = r.output.reasoning;
      if (calls) message["tool_calls"] = tool_calls_json(r.output.tool_calls, 0, false);
      choices.push_back({{"index", i}, {"message", message},
                         {"logprobs", logprobs ? chat_logprobs(*tok, r.logprobs) : ojson(nullptr)},
                         {"finish_reason", r.finish_reason}});
      results.push_back(std::move(r));
    }
    ojson out = {{"id", id}, {"object", "chat.completion"}, {"created", created}, {"model", model_id},
                 {"choices", choices}, {"usage", usage_json(results)}};
    res.set_content(out.dump(-1, ' ', false, ojson::error_handler_t::replace), "application/json");
    log_request(ctx, "/v1/chat/completions", id, 200, pointers(results), since(t0), c.user);
    return;
  }

  auto choice = [](size_t i, ojson delta, ojson finish, ojson lp) {
    return ojson{{"index", i}, {"delta", std::move(delta)}, {"logprobs", std::move(lp)}, {"finish_reason", std::move(finish)}};
  };
  auto lp_of = [logprobs, tok](Generation& gen) {
    if (!logprobs) return ojson(nullptr);
    std::vector<TokenLogprob> lps = gen.take_logprobs();
    return lps.empty() ? ojson(nullptr) : chat_logprobs(*tok, lps);
  };
  auto n_calls = std::make_shared<std::vector<size_t>>(gens.size(), 0);
  StreamSpec spec;
  spec.envelope = {{"id", id}, {"object", "chat.completion.chunk"}, {"created", created}, {"model", model_id}};
  spec.first = [=](size_t i) { return choice(i, {{"role", "assistant"}, {"content", ""}}, nullptr, nullptr); };
  spec.pieces = [=](size_t i, Generation& gen, const ParsedOutput& piece) {
    ojson out = ojson::array();
    if (!piece.reasoning.empty()) out.push_back(choice(i, {{"reasoning_content", piece.reasoning}}, nullptr, nullptr));
    if (!piece.content.empty()) out.push_back(choice(i, {{"content", piece.content}}, nullptr, nullptr));
    if (!piece.tool_calls.empty()) {
      out.push_back(choice(i, {{"tool_calls", tool_calls_json(piece.tool_calls, (*n_calls)[i], true)}}, nullptr, nullptr));
      (*n_calls)[i] += piece.tool_calls.size();
    }
    if (!out.empty()) out[0]["logprobs"] = lp_of(gen);  // the tokens of this piece
    return out;
  };
  spec.last = [=](size_t i, Generation& gen, const GenerateResult& r) {
    return choice(i, ojson::object(), r.finish_reason, lp_of(gen));
  };
  stream_events(ctx, "/v1/chat/completions", res, std::move(gens), c.include_usage, std::move(spec), c.user, t0);
}

void completions(ServerContext& ctx, const httplib::Request& req, httplib::Response& res) {
  const auto t0 = std::chrono::steady_clock::now();
  ServedModel& m = ctx.model;
  const ojson body = parse_body(req.body);
  field::known_only(body, {"model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "min_p",
                           "repetition_penalty", "seed", "presence_penalty", "frequency_penalty", "logit_bias",
                           "stop", "stream", "stream_options", "n", "best_of", "logprobs", "echo", "suffix",
                           "response_format", "user", "service_tier", "store", "metadata"});
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
  if (!field::string(body, "suffix", "").empty()) throw ApiError(400, "suffix", "'suffix' is not supported");
  if (field::integer(body, "best_of", c.n, 1, kMaxChoices) != c.n)
    throw ApiError(400, "best_of", "'best_of' must equal 'n' (choices are not ranked here)");
  const int64_t logprobs = field::integer(body, "logprobs", -1, 0, 20);
  c.options.logprobs = int(logprobs);
  std::string param;
  const auto requested = requested_max_tokens(body, param);
  c.options.max_tokens = resolve_max_tokens(m, int64_t(c.options.prompt.size()), requested, param, 16);

  auto gens = start_choices(m, c.options, c.n);
  const std::string id = random_id("cmpl-");
  const int64_t created = unix_time();
  const std::string model_id = m.id;
  const Tokenizer* tok = m.tokenizer.get();
  auto choice = [](size_t i, const std::string& text, ojson finish, ojson lp) {
    return ojson{{"text", text}, {"index", i}, {"logprobs", std::move(lp)}, {"finish_reason", std::move(finish)}};
  };
  if (!c.stream) {
    std::vector<GenerateResult> results;
    ojson choices = ojson::array();
    for (size_t i = 0; i < gens.size(); ++i) {
      GenerateResult r = gens[i]->run(nullptr);
      size_t offset = 0;
      choices.push_back(choice(i, r.output.content, r.finish_reason,
                               logprobs >= 0 ? completion_logprobs(*tok, r.logprobs, offset) : ojson(nullptr)));
      results.push_back(std::move(r));
    }
    ojson out = {{"id", id}, {"object", "text_completion"}, {"created", created}, {"model", model_id},
                 {"choices", choices}, {"usage", usage_json(results)}};
    res.set_content(out.dump(-1, ' ', false, ojson::error_handler_t::replace), "application/json");
    log_request(ctx, "/v1/completions", id, 200, pointers(results), since(t0), c.user);
    return;
  }
  auto offsets = std::make_shared<std::vector<size_t>>(gens.size(), 0);
  auto lp_of = [=](size_t i, Generation& gen) {
    if (logprobs < 0) return ojson(nullptr);
    std::vector<TokenLogprob> lps = gen.take_logprobs();
    return lps.empty() ? ojson(nullptr) : completion_logprobs(*tok, lps, (*offsets)[i]);
  };
  StreamSpec spec;
  spec.envelope = {{"id", id}, {"object", "text_completion"}, {"created", created}, {"model", model_id}};
  spec.pieces = [=](size_t i, Generation& gen, const ParsedOutput& piece) {
    return ojson::array({choice(i, piece.content, nullptr, lp_of(i, gen))});
  };
  spec.last = [=](size_t i, Generation& gen, const GenerateResult& r) { return choice(i, "", r.finish_reason, lp_of(i, gen)); };
  stream_events(ctx, "/v1/completions", res, std::move(gens), c.include_usage, std::move(spec), c.user, t0);
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
