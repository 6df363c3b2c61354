// What the HTTP endpoints share: the served model, counters for /metrics, and strict reading of
// request fields (a wrong type or range is a 400 that names the field).
#pragma once

#include <atomic>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>

#include "server/generation.h"
#include "server/json_schema.h"

namespace httplib {
class Server;
struct Request;
struct Response;
}  // namespace httplib

namespace moestream {

using ojson = nlohmann::ordered_json;

// A client error: HTTP status (400 unless stated), the field at fault ("" if none), a message.
struct ApiError : std::runtime_error {
  ApiError(int status, std::string param, const std::string& message)
      : std::runtime_error(message), status(status), param(std::move(param)) {}
  int status;
  std::string param;
};

struct ServerContext {
  ServedModel& model;
  std::string api_key;
  bool log_requests = true;  // one line per request on stderr

  // /metrics counters
  std::mutex mu;
  std::map<std::pair<std::string, int>, int64_t> requests;  // (endpoint, status) -> count
  void count(const std::string& endpoint, int status) {
    std::lock_guard lock(mu);
    ++requests[{endpoint, status}];
  }
};

// Field readers for a JSON request body. Each throws ApiError(400, field, …) on a wrong type or a
// value out of range, and returns the fallback when the field is absent or null.
namespace field {
double number(const ojson& body, const std::string& key, double fallback, double lo, double hi);
int64_t integer(const ojson& body, const std::string& key, int64_t fallback, int64_t lo, int64_t hi);
bool boolean(const ojson& body, const std::string& key, bool fallback);
std::string string(const ojson& body, const std::string& key, const std::string& fallback);
std::vector<std::string> string_or_list(const ojson& body, const std::string& key, size_t max_items);
// A string member of an object inside the body; `path` names it in the error ("tools[0].type").
std::string member(const ojson& object, const std::string& key, const std::string& path, const std::string& fallback);
// One of `allowed` (strings).
std::string choice(const ojson& body, const std::string& key, std::initializer_list<const char*> allowed);
// An object whose values are all strings (OpenAI's and Anthropic's `metadata`).
void string_map(const ojson& body, const std::string& key);
// logit_bias: an object mapping token ids (as strings, below `vocab`) to numbers in [-100, 100].
std::vector<std::pair<int32_t, float>> logit_bias(const ojson& body, int64_t vocab);
// Refuses any member of `body` not in `known` (400 naming it): a field the server does not
// honour is an error, never silently ignored.
void known_only(const ojson& body, std::initializer_list<const char*> known, const std::string& where = "");
}  // namespace field

// A request's constraint on the output: response_format json_object / json_schema, or a forced
// tool call. 400 naming the field (and the schema keyword) when it cannot be enforced.
std::shared_ptr<const JsonGrammar> response_format_grammar(const ojson& body, bool& json_object);
// tool_choice "required" (name empty) or a named function: the grammar of one call to it in the
// model's markup. tools is the OpenAI-form list that goes to the template; `param` names the field.
std::shared_ptr<const JsonGrammar> forced_tool_call(const ServedModel& m, const ojson& tools, const std::string& name,
                                                    bool in_reasoning, const std::string& param);

// tool_choice "auto" with tools marked strict: the grammar a call the model opens must follow
// (nullptr when no tool is strict). 400 naming the schema keyword or the markup it cannot force.
std::shared_ptr<const JsonGrammar> strict_tool_calls(const ServedModel& m, const ojson& tools);

// Logprobs in OpenAI's chat form ({"content": [...], "refusal": null}) and legacy completions
// form ({"tokens", "token_logprobs", "top_logprobs", "text_offset"}); text_offset counts from
// `offset` bytes.
ojson chat_logprobs(const Tokenizer& tok, const std::vector<TokenLogprob>& lps);
ojson completion_logprobs(const Tokenizer& tok, const std::vector<TokenLogprob>& lps, size_t& offset);

// One line on stderr for a finished request: id, endpoint, status, tokens, time to first token,
// speed. r is null for requests that generated nothing (errors).
void log_request(ServerContext& ctx, const std::string& endpoint, const std::string& id, int status,
                 const std::vector<const GenerateResult*>& results, double seconds, const std::string& user = "");

// obj[key] when obj is an object holding a string there, else "" (to dispatch on a "type" member;
// any other value then falls through to the caller's error that names the field).
inline std::string string_member(const ojson& obj, const char* key) {
  if (!obj.is_object()) return "";
  auto it = obj.find(key);
  return it != obj.end() && it->is_string() ? it->get<std::string>() : "";
}

// Request JSON nests at most this deep (objects and arrays); deeper text is refused before it is
// parsed, so nothing recurses over it (templates, dumps, destructors).
constexpr int kMaxJsonDepth = 128;

// The nesting depth of JSON text (counting brackets outside strings; stops counting beyond
// kMaxJsonDepth + 1).
int json_depth(std::string_view text);

// Parses JSON text held in a string field (a tool call's arguments): nullopt when it is not JSON;
// ApiError when it nests too deep.
std::optional<ojson> parse_nested_json(const std::string& text, const std::string& param);

// Sampling parameters: the model's defaults overridden by the request's fields (OpenAI names,
// presence / frequency penalties and logit_bias included; temperature_max: 2 for OpenAI, 1 for
// Anthropic).
SamplingParams request_sampling(const ServedModel& m, const ojson& body, double temperature_max);

// max_tokens for a prompt of n tokens in a context of ctx: the request's value (checked against
// the context) or, when absent, `fallback` capped to what the context leaves. dropped: the
// messages a context shift left out, named in the error.
int resolve_max_tokens(int64_t ctx, int64_t prompt_tokens, std::optional<int64_t> requested,
                       const std::string& param, int64_t fallback, int dropped = 0);

// Parses a request body as a JSON object, or throws ApiError.
ojson parse_body(const std::string& body);

// Renders a chat prompt with the model's template; template errors are the client's (400).
std::string render_chat(const ServedModel& m, const ojson& messages, const ojson& tools,
                        const ojson& kwargs);

std::string random_id(const std::string& prefix);
int64_t unix_time();

void add_openai_routes(httplib::Server& server, ServerContext& ctx);
void add_anthropic_routes(httplib::Server& server, ServerContext& ctx);

}  // namespace moestream
