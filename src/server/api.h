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

#include "server/generation.h"

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
}  // namespace field

// Sampling parameters: the model's defaults overridden by the request's fields (OpenAI names;
// temperature_max: 2 for OpenAI, 1 for Anthropic).
SamplingParams request_sampling(const ServedModel& m, const ojson& body, double temperature_max);

// max_tokens for a prompt of n tokens: the request's value (checked against the context) or, when
// absent, `fallback` capped to what the context leaves.
int resolve_max_tokens(const ServedModel& m, int64_t prompt_tokens, std::optional<int64_t> requested,
                       const std::string& param, int64_t fallback);

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
