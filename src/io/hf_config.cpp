#include "io/hf_config.h"

#include <fcntl.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <limits>

#include "core/error.h"
#include "core/files.h"

namespace moestream {

using Json = nlohmann::json;  // plain `json` would name HfConfig::json() inside members

namespace {

// Field names that changed across transformers versions or differ between model families.
// Each row: the canonical name first, then the spellings accepted for it. A config giving two
// spellings of one field with different values is an error rather than a silent pick.
const std::vector<std::vector<std::string>> kAliases = {
    {"num_experts", "num_local_experts", "n_routed_experts"},
    {"num_experts_per_tok", "num_experts_per_token", "moe_topk"},
    {"torch_dtype", "dtype"},
    {"max_position_embeddings", "max_seq_len"},
    {"hidden_size", "d_model", "n_embd"},
    {"num_hidden_layers", "n_layer", "num_layers"},
    {"num_attention_heads", "n_head"},
    {"num_key_value_heads", "n_kv_heads"},
    {"rms_norm_eps", "layer_norm_epsilon"},
    {"intermediate_size", "ffn_dim"},
};

// The names to try for a field: the one asked for, then its aliases in table order.
std::vector<std::string> spellings(const std::string& field) {
  std::vector<std::string> out = {field};
  for (const auto& row : kAliases) {
    bool in_row = false;
    for (const auto& name : row) in_row |= name == field;
    if (!in_row) continue;
    for (const auto& name : row)
      if (name != field) out.push_back(name);
  }
  return out;
}

std::string describe(const Json& v) {
  if (v.is_number_float()) return "number " + v.dump();
  if (v.is_string()) return "string " + v.dump();
  return v.type_name();
}

// Conversions with messages "<path>: field '<name>' must be ..., found ...".
int64_t to_int(const Json& v, const std::string& path, const std::string& name) {
  if (v.is_number_unsigned()) {
    uint64_t u = v.get<uint64_t>();
    if (u <= uint64_t(std::numeric_limits<int64_t>::max())) return int64_t(u);
  } else if (v.is_number_integer()) {
    return v.get<int64_t>();
  } else if (v.is_number_float()) {
    double d = v.get<double>();
    // 2^63 is exactly representable; anything at or beyond it does not fit.
    if (std::isfinite(d) && d == std::floor(d) && d >= -9223372036854775808.0 &&
        d < 9223372036854775808.0)
      return int64_t(d);
  }
  fail(path, ": field '", name, "' must be an integer, found ", describe(v));
}

double to_double(const Json& v, const std::string& path, const std::string& name) {
  if (!v.is_number()) fail(path, ": field '", name, "' must be a number, found ", describe(v));
  return v.get<double>();
}

bool to_bool(const Json& v, const std::string& path, const std::string& name) {
  if (!v.is_boolean()) fail(path, ": field '", name, "' must be a boolean, found ", describe(v));
  return v.get<bool>();
}

std::string to_string(const Json& v, const std::string& path, const std::string& name) {
  if (!v.is_string()) fail(path, ": field '", name, "' must be a string, found ", describe(v));
  return v.get<std::string>();
}

// obj[key] when present and non-null.
const Json* member(const Json& obj, const std::string& key) {
  auto it = obj.find(key);
  return it == obj.end() || it->is_null() ? nullptr : &*it;
}

struct Found {
  std::string name;  // the spelling present in the file
  const Json* value = nullptr;
};

Found find_field(const Json& obj, const std::string& field, const std::string& path) {
  Found found;
  for (const std::string& name : spellings(field)) {
    const Json* v = member(obj, name);
    if (!v) continue;
    if (!found.value) {
      found = {name, v};
    } else if (*v != *found.value) {
      fail(path, ": fields '", found.name, "' (", found.value->dump(), ") and '", name, "' (",
           v->dump(), ") name the same setting with different values");
    }
  }
  return found;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// HfConfig

HfConfig::HfConfig(nlohmann::json json, std::string path)
    : json_(std::move(json)), path_(std::move(path)) {
  if (!json_.is_object()) fail(path_, ": must be a JSON object, found ", json_.type_name());
}

HfConfig HfConfig::load(const std::string& path) {
  std::string text = read_file(path);
  Json parsed;
  try {
    parsed = Json::parse(text);
  } catch (const Json::exception& e) {
    fail(path, ": not valid JSON: ", e.what());
  }
  return HfConfig(std::move(parsed), path);
}

HfConfig HfConfig::text() const {
  const Json* inner = member(json_, "text_config");
  if (!inner) return *this;
  if (!inner->is_object())
    fail(path_, ": field 'text_config' must be an object, found ", describe(*inner));
  Json merged = json_;
  merged.erase("text_config");
  for (const auto& [key, value] : inner->items()) merged[key] = value;
  return HfConfig(std::move(merged), path_ + " (text_config)");
}

const nlohmann::json* HfConfig::lookup(const std::string& field) const {
  return find_field(json_, field, path_).value;
}

bool HfConfig::has(const std::string& field) const {
  return lookup(field) != nullptr;
}

namespace {

// Resolves a required field or throws "<path>: missing field 'x' (also accepted: y, z)".
Found require(const Json& obj, const std::string& field, const std::string& path) {
  Found f = find_field(obj, field, path);
  if (f.value) return f;
  std::vector<std::string> names = spellings(field);
  std::string also;
  for (size_t i = 1; i < names.size(); ++i) also += (i > 1 ? ", " : "") + names[i];
  if (also.empty()) fail(path, ": missing field '", field, "'");
  fail(path, ": missing field '", field, "' (also accepted: ", also, ")");
}

}  // namespace

int64_t HfConfig::get_int(const std::string& field) const {
  Found f = require(json_, field, path_);
  return to_int(*f.value, path_, f.name);
}
double HfConfig::get_double(const std::string& field) const {
  Found f = require(json_, field, path_);
  return to_double(*f.value, path_, f.name);
}
bool HfConfig::get_bool(const std::string& field) const {
  Found f = require(json_, field, path_);
  return to_bool(*f.value, path_, f.name);
}
std::string HfConfig::get_string(const std::string& field) const {
  Found f = require(json_, field, path_);
  return to_string(*f.value, path_, f.name);
}

int64_t HfConfig::get_int(const std::string& field, int64_t dflt) const {
  Found f = find_field(json_, field, path_);
  return f.value ? to_int(*f.value, path_, f.name) : dflt;
}
double HfConfig::get_double(const std::string& field, double dflt) const {
  Found f = find_field(json_, field, path_);
  return f.value ? to_double(*f.value, path_, f.name) : dflt;
}
bool HfConfig::get_bool(const std::string& field, bool dflt) const {
  Found f = find_field(json_, field, path_);
  return f.value ? to_bool(*f.value, path_, f.name) : dflt;
}
std::string HfConfig::get_string(const std::string& field, const std::string& dflt) const {
  Found f = find_field(json_, field, path_);
  return f.value ? to_string(*f.value, path_, f.name) : dflt;
}

namespace {

int64_t in_range(int64_t v, int64_t lo, int64_t hi, const std::string& path, const std::string& name) {
  if (v < lo || v > hi) fail(path, ": field '", name, "' must be in [", lo, ", ", hi, "], found ", v);
  return v;
}

}  // namespace

int64_t HfConfig::get_int_in(const std::string& field, int64_t lo, int64_t hi) const {
  Found f = require(json_, field, path_);
  return in_range(to_int(*f.value, path_, f.name), lo, hi, path_, f.name);
}
int64_t HfConfig::get_int_in(const std::string& field, int64_t lo, int64_t hi, int64_t dflt) const {
  Found f = find_field(json_, field, path_);
  return f.value ? in_range(to_int(*f.value, path_, f.name), lo, hi, path_, f.name) : dflt;
}

std::string HfConfig::spelling(const std::string& field) const {
  Found f = find_field(json_, field, path_);
  return f.value ? f.name : field;
}

std::vector<int64_t> HfConfig::get_int_list(const std::string& field) const {
  Found f = find_field(json_, field, path_);
  if (!f.value) return {};
  if (!f.value->is_array()) return {to_int(*f.value, path_, f.name)};
  std::vector<int64_t> out;
  for (size_t i = 0; i < f.value->size(); ++i)
    out.push_back(to_int((*f.value)[i], path_, f.name + "[" + std::to_string(i) + "]"));
  return out;
}

std::vector<std::string> HfConfig::get_string_list(const std::string& field) const {
  Found f = find_field(json_, field, path_);
  if (!f.value) return {};
  if (!f.value->is_array()) return {to_string(*f.value, path_, f.name)};
  std::vector<std::string> out;
  for (size_t i = 0; i < f.value->size(); ++i)
    out.push_back(to_string((*f.value)[i], path_, f.name + "[" + std::to_string(i) + "]"));
  return out;
}

std::string HfConfig::model_type() const {
  return get_string("model_type");
}

std::string HfConfig::torch_dtype() const {
  return get_string("torch_dtype", "");
}

// ---------------------------------------------------------------------------------------------
// RoPE

namespace {

// rope_parameters nested per layer type: a non-empty object whose values are all objects.
bool is_per_layer_type(const Json& rp) {
  if (rp.empty()) return false;
  for (const auto& [key, value] : rp.items())
    if (!value.is_object()) return false;
  return true;
}

std::string key_list(const Json& obj) {
  std::string s;
  for (const auto& [key, value] : obj.items()) s += (s.empty() ? "" : ", ") + key;
  return s;
}

}  // namespace

RopeParams HfConfig::rope(const std::string& layer_type) const {
  // `params` is the object holding rope_type, factor, ...; `where` names it in messages.
  const Json* params = nullptr;
  std::string where;
  if (const Json* rp = member(json_, "rope_parameters")) {
    if (!rp->is_object())
      fail(path_, ": field 'rope_parameters' must be an object, found ", describe(*rp));
    if (is_per_layer_type(*rp)) {
      if (layer_type.empty())
        fail(path_, ": rope_parameters is given per layer type (", key_list(*rp),
             "); the caller must name a layer type");
      params = member(*rp, layer_type);
      if (!params)
        fail(path_, ": rope_parameters has no entry for layer type '", layer_type, "' (has ",
             key_list(*rp), ")");
      where = "rope_parameters." + layer_type;
    } else {
      params = rp;
      where = "rope_parameters";
    }
  } else if (const Json* rs = member(json_, "rope_scaling")) {
    if (!rs->is_object())
      fail(path_, ": field 'rope_scaling' must be an object or null, found ", describe(*rs));
    params = rs;
    where = "rope_scaling";
  }

  // A value from the rope object, else (for fields 4.x configs keep there) from the top level.
  auto field = [&](const std::string& key, bool top_level_too) -> Found {
    if (params)
      if (const Json* v = member(*params, key)) return {where + "." + key, v};
    if (top_level_too)
      if (const Json* v = member(json_, key)) return {key, v};
    return {};
  };

  RopeParams r;
  Found theta = field("rope_theta", true);
  if (!theta.value)
    fail(path_, ": missing field 'rope_theta'",
         params ? " (looked in " + where + " and at the top level)" : std::string());
  r.theta = to_double(*theta.value, path_, theta.name);
  if (!(r.theta > 0)) fail(path_, ": field '", theta.name, "' must be positive, found ", r.theta);

  Found type = field("rope_type", false);
  if (!type.value) type = field("type", false);
  if (type.value) {
    r.type = to_string(*type.value, path_, type.name);
  } else if (params) {
    // Without a type, scaling fields would be ignored silently; only a bare theta may omit it.
    for (const char* key :
         {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
          "mscale_all_dim", "attention_factor", "low_freq_factor", "high_freq_factor"})
      if (member(*params, key))
        fail(path_, ": ", where, " sets '", key, "' but has no 'rope_type' (or 'type')");
  }

  auto number = [&](const std::string& key, bool top_level_too, auto& out) {
    Found f = field(key, top_level_too);
    if (f.value) out = to_double(*f.value, path_, f.name);
  };
  number("factor", false, r.factor);
  number("original_max_position_embeddings", true, r.original_max_position);
  number("beta_fast", false, r.beta_fast);
  number("beta_slow", false, r.beta_slow);
  number("mscale", false, r.mscale);
  number("mscale_all_dim", false, r.mscale_all_dim);
  number("attention_factor", false, r.attention_factor);
  number("low_freq_factor", false, r.low_freq_factor);
  number("high_freq_factor", false, r.high_freq_factor);
  number("partial_rotary_factor", true, r.partial_rotary_factor);
  if (Found f = field("truncate", false); f.value) r.truncate = to_bool(*f.value, path_, f.name);

  if (!(r.factor > 0))
    fail(path_, ": field '", where, ".factor' must be positive, found ", r.factor);
  if (!(r.partial_rotary_factor > 0 && r.partial_rotary_factor <= 1))
    fail(path_, ": partial_rotary_factor must be in (0, 1], found ", r.partial_rotary_factor);
  return r;
}

// ---------------------------------------------------------------------------------------------
// generation_config.json

GenerationDefaults load_generation_defaults(const std::string& model_dir, const HfConfig& config) {
  GenerationDefaults g;
  auto add_eos = [&](const HfConfig& c) {
    for (int64_t id : c.get_int_list("eos_token_id")) {
      if (id < 0 || id > std::numeric_limits<int32_t>::max())
        fail(c.path(), ": eos_token_id ", id, " is not a valid token id");
      bool seen = false;
      for (int32_t e : g.eos_token_ids) seen |= e == id;
      if (!seen) g.eos_token_ids.push_back(int32_t(id));
    }
  };
  auto token_id = [](const HfConfig& c, const std::string& field) -> std::optional<int32_t> {
    if (!c.has(field)) return std::nullopt;
    int64_t id = c.get_int(field);
    if (id < 0 || id > std::numeric_limits<int32_t>::max())
      fail(c.path(), ": ", field, " ", id, " is not a valid token id");
    return int32_t(id);
  };

  const HfConfig text = config.text();  // multimodal checkpoints keep the ids in text_config
  add_eos(config);
  add_eos(text);
  g.bos_token_id = token_id(text, "bos_token_id");

  const std::filesystem::path gen_path =
      std::filesystem::path(model_dir) / "generation_config.json";
  std::error_code ec;
  if (!std::filesystem::exists(gen_path, ec)) return g;

  const HfConfig gen = HfConfig::load(gen_path.string());
  add_eos(gen);
  if (auto bos = token_id(gen, "bos_token_id")) g.bos_token_id = bos;
  auto opt_float = [&](const std::string& field, std::optional<float>& out) {
    if (gen.has(field)) out = float(gen.get_double(field));
  };
  opt_float("temperature", g.temperature);
  opt_float("top_p", g.top_p);
  opt_float("min_p", g.min_p);
  opt_float("repetition_penalty", g.repetition_penalty);
  if (gen.has("top_k")) {
    int64_t k = gen.get_int("top_k");
    if (k < 0 || k > std::numeric_limits<int>::max())
      fail(gen.path(), ": field 'top_k' must be a non-negative integer, found ", k);
    g.top_k = int(k);
  }
  if (gen.has("do_sample")) g.do_sample = gen.get_bool("do_sample");
  return g;
}

}  // namespace moestream
