// Typed field access for tokenizer.json components. A missing or mistyped field is an Error
// naming the file, the component and the field, never a silent default (defaults are explicit).
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "core/error.h"
#include "text/tokenizer_regex.h"

namespace moestream::tok {

using nlohmann::json;

// "tokenizer.json: pre_tokenizer Split" style prefix for messages.
struct Where {
  std::string file;
  std::string component;
  std::string str() const { return file + ": " + component; }
};

inline const json& require(const json& obj, std::string_view key, const Where& where) {
  auto it = obj.find(key);
  if (it == obj.end()) fail(where.str(), ": missing field '", key, "'");
  return *it;
}

inline std::string get_string(const json& obj, std::string_view key, const Where& where) {
  const json& v = require(obj, key, where);
  if (!v.is_string()) fail(where.str(), ": field '", key, "' must be a string");
  return v.get<std::string>();
}

inline std::string get_string(const json& obj, std::string_view key, const Where& where,
                              std::string_view fallback) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return std::string(fallback);
  if (!it->is_string()) fail(where.str(), ": field '", key, "' must be a string");
  return it->get<std::string>();
}

inline bool get_bool(const json& obj, std::string_view key, const Where& where, bool fallback) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return fallback;
  if (!it->is_boolean()) fail(where.str(), ": field '", key, "' must be true or false");
  return it->get<bool>();
}

inline int64_t get_int(const json& obj, std::string_view key, const Where& where,
                       int64_t fallback) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return fallback;
  if (!it->is_number_integer()) fail(where.str(), ": field '", key, "' must be an integer");
  return it->get<int64_t>();
}

// The "type" of a component object, e.g. "NFC" or "Split".
inline std::string type_of(const json& spec, const Where& where) {
  if (!spec.is_object()) fail(where.str(), ": expected an object");
  return get_string(spec, "type", where);
}

// A Split/Replace pattern: {"String": literal} or {"Regex": oniguruma-style pattern}.
inline Regex get_pattern(const json& obj, std::string_view key, const Where& where) {
  const json& p = require(obj, key, where);
  if (p.is_object() && p.size() == 1) {
    if (auto it = p.find("String"); it != p.end() && it->is_string())
      return Regex::literal(it->get<std::string>(), where.str());
    if (auto it = p.find("Regex"); it != p.end() && it->is_string())
      return Regex::pattern(it->get<std::string>(), where.str());
  }
  fail(where.str(), ": field '", key, "' must be {\"String\": ...} or {\"Regex\": ...}");
}

}  // namespace moestream::tok
