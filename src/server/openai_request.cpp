// /v1/chat/completions and /v1/completions request bodies -> validated requests (requests.h).
#include "core/error.h"
#include "server/requests.h"

namespace moestream {

ojson openai_error_body(const std::string& message, const std::string& type, const std::string& param, ojson code) {
  return {{"error", {{"message", message}, {"type", type},
                     {"param", param.empty() ? ojson(nullptr) : ojson(param)}, {"code", code}}}};
}

namespace {

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
  c.options.ignore_eos = field::boolean(body, "ignore_eos", false);
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

}  // namespace

ChatRequest parse_chat_request(const ServedModel& m, const ojson& body, int64_t ctx) {
  field::known_only(body, {"model", "messages", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                           "repeat_penalty", "repeat_last_n",
                           "seed", "presence_penalty", "frequency_penalty", "logit_bias", "stop", "stream",
                           "stream_options", "n", "logprobs", "top_logprobs", "response_format", "tools",
                           "tool_choice", "parallel_tool_calls", "chat_template_kwargs", "reasoning_effort",
                           "max_tokens", "max_completion_tokens", "user", "service_tier", "store", "metadata",
                           "modalities", "ignore_eos"});
  Common c = common_fields(m, body);
  ChatRequest r;
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

  std::string prompt = render_chat(m, messages, tools, kwargs);
  c.options.prompt = m.encode_chat(prompt);
  std::string param;
  const auto requested = requested_max_tokens(body, param);
  shift_to_fit(m, messages, {}, tools, kwargs, ctx, requested, prompt, c.options, r.shift);
  c.options.max_tokens = resolve_max_tokens(ctx, int64_t(c.options.prompt.size()), requested, param, INT32_MAX,
                                            r.shift.dropped_messages);
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
  r.options = std::move(c.options);
  r.stream = c.stream;
  r.include_usage = c.include_usage;
  r.logprobs = logprobs;
  r.n = c.n;
  r.user = std::move(c.user);
  r.prompt = std::move(prompt);
  return r;
}

CompletionRequest parse_completion_request(const ServedModel& m, const ojson& body, int64_t ctx) {
  field::known_only(body, {"model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "min_p",
                           "repetition_penalty", "repeat_penalty", "repeat_last_n", "seed", "presence_penalty",
                           "frequency_penalty", "logit_bias", "stop", "stream", "stream_options", "n", "best_of", "logprobs", "echo", "suffix",
                           "response_format", "user", "service_tier", "store", "metadata", "ignore_eos"});
  Common c = common_fields(m, body);
  if (!body.contains("prompt") || body["prompt"].is_null()) throw ApiError(400, "prompt", "'prompt' is required");
  const ojson& p = body["prompt"];
  // The output head's rows (the fuzz targets' ServedModel has only a tokenizer).
  const int64_t vocab = m.model ? m.model->info().vocab_size : m.tokenizer->vocab_size();
  if (p.is_string()) {
    c.options.prompt = m.encode_text(p.get<std::string>());
  } else if (p.is_array() && p.size() == 1 && p[0].is_string()) {
    c.options.prompt = m.encode_text(p[0].get<std::string>());
  } else if (p.is_array() && !p.empty() && p[0].is_number_integer()) {
    for (const auto& t : p) {
      if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() >= vocab)
        throw ApiError(400, "prompt", "'prompt' token ids must be integers in [0, " + std::to_string(vocab) + ")");
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
  c.options.logprobs = int(field::integer(body, "logprobs", -1, 0, 20));
  std::string param;
  const auto requested = requested_max_tokens(body, param);
  c.options.max_tokens = resolve_max_tokens(ctx, int64_t(c.options.prompt.size()), requested, param, 16);
  CompletionRequest r;
  r.options = std::move(c.options);
  r.stream = c.stream;
  r.include_usage = c.include_usage;
  r.n = c.n;
  r.user = std::move(c.user);
  return r;
}

}  // namespace moestream
