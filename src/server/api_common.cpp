#include <chrono>
#include <cmath>
#include <random>

#include "core/error.h"
#include "server/api.h"

namespace moestream {

namespace field {

namespace {
const ojson* get(const ojson& body, const std::string& key) {
  auto it = body.find(key);
  return it == body.end() || it->is_null() ? nullptr : &*it;
}
}  // namespace

double number(const ojson& body, const std::string& key, double fallback, double lo, double hi) {
  const ojson* v = get(body, key);
  if (!v) return fallback;
  if (!v->is_number()) throw ApiError(400, key, "'" + key + "' must be a number");
  const double x = v->get<double>();
  if (!(x >= lo && x <= hi))
    throw ApiError(400, key, "'" + key + "' must be between " + nlohmann::json(lo).dump() + " and " +
                                 nlohmann::json(hi).dump() + ", got " + v->dump());
  return x;
}

int64_t integer(const ojson& body, const std::string& key, int64_t fallback, int64_t lo, int64_t hi) {
  const ojson* v = get(body, key);
  if (!v) return fallback;
  if (!v->is_number_integer() && !(v->is_number_float() && std::floor(v->get<double>()) == v->get<double>()))
    throw ApiError(400, key, "'" + key + "' must be an integer");
  const double x = v->get<double>();
  if (!(x >= double(lo) && x <= double(hi)))
    throw ApiError(400, key, "'" + key + "' must be between " + std::to_string(lo) + " and " +
                                 std::to_string(hi) + ", got " + v->dump());
  return int64_t(x);
}

bool boolean(const ojson& body, const std::string& key, bool fallback) {
  const ojson* v = get(body, key);
  if (!v) return fallback;
  if (!v->is_boolean()) throw ApiError(400, key, "'" + key + "' must be true or false");
  return v->get<bool>();
}

std::string string(const ojson& body, const std::string& key, const std::string& fallback) {
  const ojson* v = get(body, key);
  if (!v) return fallback;
  if (!v->is_string()) throw ApiError(400, key, "'" + key + "' must be a string");
  return v->get<std::string>();
}

std::vector<std::string> string_or_list(const ojson& body, const std::string& key, size_t max_items) {
  const ojson* v = get(body, key);
  if (!v) return {};
  std::vector<std::string> out;
  if (v->is_string()) {
    out.push_back(v->get<std::string>());
  } else if (v->is_array()) {
    for (const auto& s : *v) {
      if (!s.is_string()) throw ApiError(400, key, "'" + key + "' must be a string or a list of strings");
      out.push_back(s.get<std::string>());
    }
  } else {
    throw ApiError(400, key, "'" + key + "' must be a string or a list of strings");
  }
  if (out.size() > max_items)
    throw ApiError(400, key, "'" + key + "' has " + std::to_string(out.size()) + " entries; at most " +
                                 std::to_string(max_items) + " are allowed");
  for (const auto& s : out)
    if (s.empty()) throw ApiError(400, key, "'" + key + "' contains an empty string");
  return out;
}

}  // namespace field

SamplingParams request_sampling(const ServedModel& m, const ojson& body, double temperature_max) {
  SamplingParams p = m.defaults;
  p.temperature = float(field::number(body, "temperature", p.temperature, 0.0, temperature_max));
  p.top_p = float(field::number(body, "top_p", p.top_p, 0.0, 1.0));
  if (p.top_p <= 0.0f) throw ApiError(400, "top_p", "'top_p' must be greater than 0");
  p.top_k = int(field::integer(body, "top_k", p.top_k, 0, 1 << 30));
  p.min_p = float(field::number(body, "min_p", p.min_p, 0.0, 1.0));
  p.repetition_penalty = float(field::number(body, "repetition_penalty", p.repetition_penalty, 1e-3, 100.0));
  p.seed = uint64_t(field::integer(body, "seed", 0, INT64_MIN, INT64_MAX));
  for (const char* k : {"presence_penalty", "frequency_penalty"})
    if (field::number(body, k, 0.0, -2.0, 2.0) != 0.0)
      throw ApiError(400, k, std::string("'") + k + "' is not supported (use repetition_penalty)");
  return p;
}

int resolve_max_tokens(const ServedModel& m, int64_t prompt_tokens, std::optional<int64_t> requested,
                       const std::string& param, int64_t fallback) {
  const int64_t ctx = m.engine->options().ctx;
  if (prompt_tokens >= ctx)
    throw ApiError(400, "messages", "the prompt has " + std::to_string(prompt_tokens) +
                                        " tokens; the context holds " + std::to_string(ctx) +
                                        " (the prompt and at least one generated token)");
  const int64_t room = ctx - prompt_tokens;
  if (requested) {
    if (*requested > room)
      throw ApiError(400, param, "'" + param + "' is " + std::to_string(*requested) + " but the context of " +
                                     std::to_string(ctx) + " tokens leaves " + std::to_string(room) +
                                     " after the prompt's " + std::to_string(prompt_tokens));
    return int(*requested);
  }
  return int(std::min(room, fallback));
}

ojson parse_body(const std::string& body) {
  ojson j = ojson::parse(body, nullptr, false);
  if (j.is_discarded()) throw ApiError(400, "", "the request body is not valid JSON");
  if (!j.is_object()) throw ApiError(400, "", "the request body must be a JSON object");
  return j;
}

std::string render_chat(const ServedModel& m, const ojson& messages, const ojson& tools, const ojson& kwargs) {
  if (!m.chat_template)
    throw ApiError(400, "messages", "model '" + m.id + "' has no chat template; use /v1/completions");
  try {
    return m.chat_template->render(messages, tools, true, kwargs);
  } catch (const Error& e) {
    throw ApiError(400, "messages", std::string("the chat template rejected the messages: ") + e.what());
  }
}

std::string random_id(const std::string& prefix) {
  static thread_local std::mt19937_64 rng{std::random_device{}()};
  static const char* digits = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
  std::string id = prefix;
  for (int i = 0; i < 24; ++i) id += digits[rng() % 62];
  return id;
}

int64_t unix_time() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace moestream
