#include "server/json_schema.h"

#include <set>

namespace moestream {

namespace {

using ojson = nlohmann::ordered_json;
using Kind = JsonGrammar::Kind;

constexpr int kMaxSchemaDepth = 16;        // schemas nest at most this deep
constexpr int64_t kMaxLength = 1 << 20;    // the largest maxLength / maxItems taken as given

const std::set<std::string>& supported() {
  static const std::set<std::string> s = {"type", "properties", "required", "additionalProperties", "items",
                                          "minItems", "maxItems", "minLength", "maxLength", "enum", "const",
                                          "title", "description", "default", "examples", "$schema", "$id"};
  return s;
}

std::string join(const std::string& path, const std::string& key) { return path.empty() ? key : path + "." + key; }

uint32_t bound(const ojson& s, const char* key, uint32_t fallback, const std::string& path) {
  if (!s.contains(key)) return fallback;
  const ojson& v = s[key];
  if (!v.is_number_integer() || v.get<int64_t>() < 0)
    throw SchemaError(std::string("'") + key + "' must be a non-negative integer", join(path, key));
  return uint32_t(std::min<int64_t>(v.get<int64_t>(), kMaxLength));
}

int add(JsonGrammar& g, const ojson& s, const std::string& path, int depth);

int add_type(JsonGrammar& g, const ojson& s, const std::string& type, const std::string& path, int depth) {
  JsonGrammar::Node n;
  if (type == "string") {
    n.kind = Kind::string;
    n.min = bound(s, "minLength", 0, path);
    n.max = bound(s, "maxLength", JsonGrammar::kMaxString, path);
    if (n.min > n.max) throw SchemaError("'minLength' is larger than 'maxLength'", join(path, "minLength"));
  } else if (type == "number" || type == "integer") {
    n.kind = type == "number" ? Kind::number : Kind::integer;
  } else if (type == "boolean") {
    return JsonGrammar::kBoolean;
  } else if (type == "null") {
    return JsonGrammar::kNull;
  } else if (type == "array") {
    n.kind = Kind::array;
    if (s.contains("items") && s["items"].is_array())
      throw SchemaError("tuple 'items' (a list of schemas) is not supported", join(path, "items"));
    n.child = s.contains("items") ? add(g, s["items"], join(path, "items"), depth + 1) : int(JsonGrammar::kAny);
    n.min = bound(s, "minItems", 0, path);
    n.max = bound(s, "maxItems", std::max(n.min, JsonGrammar::kMaxItems), path);
    if (n.min > n.max) throw SchemaError("'minItems' is larger than 'maxItems'", join(path, "minItems"));
  } else if (type == "object") {
    const ojson props = s.value("properties", ojson::object());
    if (!props.is_object()) throw SchemaError("'properties' must be an object", join(path, "properties"));
    const ojson extra = s.value("additionalProperties", ojson(true));
    if (!extra.is_boolean() && !extra.is_object())
      throw SchemaError("'additionalProperties' must be a boolean or a schema", join(path, "additionalProperties"));
    if (props.empty() && !(extra.is_boolean() && !extra.get<bool>())) {
      n.kind = Kind::map;  // a free-form object (a dictionary when additionalProperties is a schema)
      n.child = extra.is_object() ? add(g, extra, join(path, "additionalProperties"), depth + 1) : int(JsonGrammar::kAny);
    } else {
      if (props.size() > JsonGrammar::kMaxProperties)
        throw SchemaError("an object may declare at most 64 properties", join(path, "properties"));
      n.kind = Kind::object;
      for (const auto& [name, sub] : props.items()) {
        const std::string quoted = ojson(name).dump();
        n.props.push_back({quoted.substr(1, quoted.size() - 2), add(g, sub, join(join(path, "properties"), name), depth + 1)});
      }
    }
    if (s.contains("required")) {
      const ojson& req = s["required"];
      if (!req.is_array()) throw SchemaError("'required' must be a list of property names", join(path, "required"));
      for (const auto& r : req) {
        const auto it = r.is_string() ? props.find(r.get<std::string>()) : props.end();
        if (it == props.end())
          throw SchemaError("'required' names " + r.dump() + ", which is not in 'properties'", join(path, "required"));
        n.required |= uint64_t(1) << size_t(std::distance(props.begin(), it));
      }
    }
  } else {
    throw SchemaError("unknown type '" + type + "'", join(path, "type"));
  }
  return g.add(std::move(n));
}

int add(JsonGrammar& g, const ojson& s, const std::string& path, int depth) {
  if (depth > kMaxSchemaDepth) throw SchemaError("the schema nests deeper than 16 levels", path);
  if (s.is_boolean()) {
    if (s.get<bool>()) return JsonGrammar::kAny;
    throw SchemaError("the schema 'false' allows no value", path);
  }
  if (!s.is_object()) throw SchemaError("a schema must be an object", path);
  for (const auto& [key, _] : s.items())
    if (!supported().count(key)) throw SchemaError("unsupported keyword '" + key + "'", join(path, key));
  if (s.contains("enum") || s.contains("const")) {
    JsonGrammar::Node n;
    n.kind = Kind::literals;
    if (s.contains("const")) {
      n.texts.push_back(s["const"].dump());
    } else {
      const ojson& e = s["enum"];
      if (!e.is_array() || e.empty() || e.size() > JsonGrammar::kMaxLiterals)
        throw SchemaError("'enum' must be a list of 1 to 64 values", join(path, "enum"));
      for (const auto& v : e) n.texts.push_back(v.dump());
    }
    return g.add(std::move(n));
  }
  if (!s.contains("type")) {
    if (s.contains("properties")) return add_type(g, s, "object", path, depth);
    if (s.contains("items")) return add_type(g, s, "array", path, depth);
    return JsonGrammar::kAny;
  }
  const ojson& type = s["type"];
  if (type.is_string()) return add_type(g, s, type.get<std::string>(), path, depth);
  if (!type.is_array() || type.empty()) throw SchemaError("'type' must be a string or a list of strings", join(path, "type"));
  std::set<std::string> names;
  for (const auto& t : type) {
    if (!t.is_string()) throw SchemaError("'type' must be a string or a list of strings", join(path, "type"));
    names.insert(t.get<std::string>());
  }
  if (names.count("number")) names.erase("integer");  // both start with a digit; number covers both
  JsonGrammar::Node choice;
  choice.kind = Kind::choice;
  for (const std::string& t : names) choice.alts.push_back(add_type(g, s, t, path, depth));
  return choice.alts.size() == 1 ? choice.alts[0] : g.add(std::move(choice));
}

}  // namespace

int add_schema(JsonGrammar& g, const ojson& schema) { return add(g, schema, "", 0); }

std::shared_ptr<const JsonGrammar> schema_grammar(const ojson& schema) {
  auto g = std::make_shared<JsonGrammar>();
  g->root = add_schema(*g, schema);
  return g;
}

std::shared_ptr<const JsonGrammar> tool_call_grammar(const ojson& tools, const std::string& only, const std::string& prefix) {
  auto g = std::make_shared<JsonGrammar>();
  JsonGrammar::Node call;
  call.kind = Kind::call;
  call.tail = "}\n</tool_call>";
  for (const auto& t : tools) {
    const ojson& fn = t["function"];
    const std::string name = fn["name"].get<std::string>();
    if (!only.empty() && name != only) continue;
    int args = JsonGrammar::kAnyObject;
    if (fn.contains("parameters") && fn["parameters"].is_object()) {
      JsonGrammar trial = *g;
      try {
        const int node = add_schema(trial, fn["parameters"]);
        // The arguments are an object: a schema of another type keeps the free-form object.
        const Kind k = trial.nodes[size_t(node)].kind;
        if (k == Kind::object || k == Kind::map) {
          *g = std::move(trial);
          args = node;
        }
      } catch (const SchemaError&) {
        // Not enforceable: the arguments are any JSON object (the call itself is still forced).
      }
    }
    call.texts.push_back(prefix + "{\"name\": " + ojson(name).dump() + ", \"arguments\": ");
    call.alts.push_back(args);
    if (call.texts.size() == JsonGrammar::kMaxLiterals) break;
  }
  g->root = g->add(std::move(call));
  return g;
}

}  // namespace moestream
