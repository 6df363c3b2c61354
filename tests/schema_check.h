// A small JSON Schema validator for tests (the keywords the server's grammar supports), written
// independently of the grammar so the two check each other.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

namespace moestream::test {

// "" when `v` is valid for `schema`, else what is wrong (and where).
inline std::string schema_violation(const nlohmann::ordered_json& schema, const nlohmann::ordered_json& v,
                                    const std::string& at = "$") {
  using json = nlohmann::ordered_json;
  if (schema.is_boolean()) return schema.get<bool>() ? "" : at + ": false schema";
  if (schema.contains("const") && v != schema["const"]) return at + ": not the const";
  if (schema.contains("enum")) {
    bool found = false;
    for (const auto& e : schema["enum"]) found = found || e == v;
    if (!found) return at + ": not in enum";
  }
  if (schema.contains("type")) {
    const json types = schema["type"].is_array() ? schema["type"] : json::array({schema["type"]});
    bool ok = false;
    for (const auto& t : types) {
      const std::string s = t.get<std::string>();
      ok = ok || (s == "object" && v.is_object()) || (s == "array" && v.is_array()) ||
           (s == "string" && v.is_string()) || (s == "number" && v.is_number()) ||
           (s == "integer" && v.is_number_integer()) || (s == "boolean" && v.is_boolean()) ||
           (s == "null" && v.is_null());
    }
    if (!ok) return at + ": wrong type " + v.dump();
  }
  if (v.is_string()) {
    size_t chars = 0;
    for (unsigned char c : v.get<std::string>()) chars += (c & 0xC0) != 0x80;
    if (schema.contains("maxLength") && chars > schema["maxLength"].get<size_t>()) return at + ": too long";
    if (schema.contains("minLength") && chars < schema["minLength"].get<size_t>()) return at + ": too short";
  }
  if (v.is_array()) {
    if (schema.contains("maxItems") && v.size() > schema["maxItems"].get<size_t>()) return at + ": too many items";
    if (schema.contains("minItems") && v.size() < schema["minItems"].get<size_t>()) return at + ": too few items";
    if (schema.contains("items"))
      for (size_t i = 0; i < v.size(); ++i) {
        std::string e = schema_violation(schema["items"], v[i], at + "[" + std::to_string(i) + "]");
        if (!e.empty()) return e;
      }
  }
  if (v.is_object()) {
    const json props = schema.value("properties", json::object());
    for (const auto& r : schema.value("required", json::array()))
      if (!v.contains(r.get<std::string>())) return at + ": missing " + r.get<std::string>();
    for (const auto& [k, x] : v.items()) {
      std::string e;
      if (props.contains(k)) e = schema_violation(props[k], x, at + "." + k);
      else if (schema.contains("additionalProperties")) e = schema_violation(schema["additionalProperties"], x, at + "." + k);
      if (!e.empty()) return e;
    }
  }
  return "";
}

}  // namespace moestream::test
