#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <random>

#include "core/error.h"
#include "server/api.h"
#include "server/context_shift.h"
#include "server/requests.h"

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

std::string member(const ojson& object, const std::string& key, const std::string& path, const std::string& fallback) {
  const ojson* v = get(object, key);
  if (!v) return fallback;
  if (!v->is_string()) throw ApiError(400, path, "'" + path + "' must be a string");
  return v->get<std::string>();
}

std::string choice(const ojson& body, const std::string& key, std::initializer_list<const char*> allowed) {
  const ojson* v = get(body, key);
  if (!v) return "";
  std::string list;
  for (const char* a : allowed) {
    if (v->is_string() && v->get<std::string>() == a) return a;
    list += std::string(list.empty() ? "" : ", ") + a;
  }
  throw ApiError(400, key, "'" + key + "' must be one of " + list + "; got " + v->dump());
}

void string_map(const ojson& body, const std::string& key) {
  const ojson* v = get(body, key);
  if (!v) return;
  if (!v->is_object()) throw ApiError(400, key, "'" + key + "' must be an object of strings");
  for (const auto& [k, x] : v->items())
    if (!x.is_string()) throw ApiError(400, key + "." + k, "'" + key + "." + k + "' must be a string");
}

std::vector<std::pair<int32_t, float>> logit_bias(const ojson& body, int64_t vocab) {
  const ojson* v = get(body, "logit_bias");
  std::vector<std::pair<int32_t, float>> out;
  if (!v) return out;
  if (!v->is_object())
    throw ApiError(400, "logit_bias", "'logit_bias' must be an object mapping token ids to numbers");
  for (const auto& [k, x] : v->items()) {
    const bool digits = !k.empty() && k.size() <= 10 && k.find_first_not_of("0123456789") == std::string::npos;
    if (!digits || std::stoll(k) >= vocab)
      throw ApiError(400, "logit_bias", "'logit_bias' has key '" + k + "'; keys must be token ids in [0, " +
                                            std::to_string(vocab) + ")");
    if (!x.is_number() || !(x.get<double>() >= -100 && x.get<double>() <= 100))
      throw ApiError(400, "logit_bias", "'logit_bias' for token " + k + " must be a number between -100 and 100, got " + x.dump());
    out.emplace_back(int32_t(std::stoll(k)), float(x.get<double>()));
  }
  return out;
}

void known_only(const ojson& body, std::initializer_list<const char*> known, const std::string& where) {
  for (const auto& [k, v] : body.items()) {
    if (v.is_null()) continue;  // null is "not set": nothing to honour
    if (std::find_if(known.begin(), known.end(), [&](const char* n) { return k == n; }) != known.end()) continue;
    const std::string name = where.empty() ? k : where + "." + k;
    throw ApiError(400, name, "'" + name + "' is not supported by this server");
  }
}

}  // namespace field

int json_depth(std::string_view text) {
  int depth = 0, deepest = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') ++i;
      else if (c == '"') in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      deepest = std::max(deepest, ++depth);
      if (deepest > kMaxJsonDepth) return deepest;
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return deepest;
}

namespace {
ApiError too_deep(const std::string& what, const std::string& param) {
  return ApiError(400, param, what + " nests deeper than " + std::to_string(kMaxJsonDepth) +
                                  " levels of objects and arrays, the most this server accepts");
}
}  // namespace

std::optional<ojson> parse_nested_json(const std::string& text, const std::string& param) {
  if (json_depth(text) > kMaxJsonDepth) throw too_deep("'" + param + "'", param);
  ojson j = ojson::parse(text, nullptr, false);
  if (j.is_discarded()) return std::nullopt;
  return j;
}

SamplingParams request_sampling(const ServedModel& m, const ojson& body, double temperature_max) {
  SamplingParams p = m.defaults;
  p.temperature = float(field::number(body, "temperature", p.temperature, 0.0, temperature_max));
  p.top_p = float(field::number(body, "top_p", p.top_p, 0.0, 1.0));
  if (p.top_p <= 0.0f) throw ApiError(400, "top_p", "'top_p' must be greater than 0");
  p.top_k = int(field::integer(body, "top_k", p.top_k, 0, 1 << 30));
  p.min_p = float(field::number(body, "min_p", p.min_p, 0.0, 1.0));
  p.repetition_penalty = float(field::number(body, "repetition_penalty", p.repetition_penalty, 1e-3, 100.0));
  // llama.cpp's name for it, with llama.cpp's window: the last repeat_last_n tokens, 64 unless given
  const bool llama_named = body.contains("repeat_penalty") && !body["repeat_penalty"].is_null();
  if (llama_named) {
    if (body.contains("repetition_penalty") && !body["repetition_penalty"].is_null())
      throw ApiError(400, "repeat_penalty", "give 'repetition_penalty' or 'repeat_penalty', not both");
    p.repetition_penalty = float(field::number(body, "repeat_penalty", p.repetition_penalty, 1e-3, 100.0));
  }
  p.repeat_last_n = int(field::integer(body, "repeat_last_n", llama_named ? 64 : p.repeat_last_n, -1, INT32_MAX));
  p.seed = uint64_t(field::integer(body, "seed", 0, INT64_MIN, INT64_MAX));
  p.presence_penalty = float(field::number(body, "presence_penalty", 0.0, -2.0, 2.0));
  p.frequency_penalty = float(field::number(body, "frequency_penalty", 0.0, -2.0, 2.0));
  // The output head's rows (the fuzz targets' ServedModel has only a tokenizer).
  const int64_t vocab = m.model ? m.model->info().vocab_size : m.tokenizer ? m.tokenizer->vocab_size() : INT32_MAX;
  p.logit_bias = field::logit_bias(body, vocab);
  return p;
}

int resolve_max_tokens(int64_t ctx, int64_t prompt_tokens, std::optional<int64_t> requested,
                       const std::string& param, int64_t fallback, int dropped) {
  const std::string shifted =
      dropped > 0 ? " (after leaving out the " + std::to_string(dropped) + " oldest messages)" : "";
  if (prompt_tokens >= ctx)
    throw ApiError(400, "messages", "the prompt has " + std::to_string(prompt_tokens) + " tokens" + shifted +
                                        "; the context (--ctx) holds " + std::to_string(ctx) +
                                        " (the prompt and at least one generated token)");
  const int64_t room = ctx - prompt_tokens;
  if (requested) {
    if (*requested > room)
      throw ApiError(400, param, "'" + param + "' is " + std::to_string(*requested) + " but the context (--ctx) of " +
                                     std::to_string(ctx) + " tokens leaves " + std::to_string(room) +
                                     " after the prompt's " + std::to_string(prompt_tokens) + shifted);
    return int(*requested);
  }
  return int(std::min(room, fallback));
}

ojson parse_body(const std::string& body) {
  if (json_depth(body) > kMaxJsonDepth) throw too_deep("the request body", "");
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

void shift_to_fit(const ServedModel& m, const ojson& messages, const std::vector<size_t>& origin, const ojson& tools,
                  const ojson& kwargs, int64_t ctx, std::optional<int64_t> requested, std::string& prompt,
                  GenerateOptions& o, ShiftNote& shift) {
  shift = ShiftNote{0, ctx};
  const int64_t reply = requested ? *requested : shift_reply_room(ctx);
  if (int64_t(o.prompt.size()) + reply <= ctx) return;
  ContextShift turns(messages, origin);
  if (turns.droppable() == 0) return;
  // Each try's rendering, kept for the one chosen.
  std::map<int, std::pair<std::string, std::vector<int32_t>>> tried;
  const int k = fewest_to_drop(turns.droppable(), [&](int k) {
    if (k == 0) return false;  // known not to fit
    std::string text = render_chat(m, turns.kept(k), tools, kwargs);
    std::vector<int32_t> ids = m.encode_chat(text);
    const bool fits = int64_t(ids.size()) + reply <= ctx;
    tried[k] = {std::move(text), std::move(ids)};
    return fits;
  });
  auto it = tried.find(k);
  if (it == tried.end()) {  // never tried: every smaller k failed and k == droppable() untested
    std::string text = render_chat(m, turns.kept(k), tools, kwargs);
    it = tried.emplace(k, std::make_pair(text, m.encode_chat(text))).first;
  }
  shift.dropped_messages = turns.dropped_messages(k);
  o.prompt = std::move(it->second.second);
  prompt = std::move(it->second.first);
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
