// Loading a model's chat template and rendering conversations with it.
#include "text/chat_template.h"

#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/error.h"
#include "text/limits.h"
#include "core/files.h"

namespace moestream {

namespace {

using nlohmann::ordered_json;

bool read_text(const std::string& path, std::string& out) {
  std::optional<std::string> text = try_read_file(path);
  if (text) out = std::move(*text);
  return bool(text);
}

// transformers' SPECIAL_TOKENS_ATTRIBUTES; values are strings or AddedToken dicts ({"content": ...}).
ordered_json special_tokens_of(const ordered_json& config, const std::string& path) {
  static const char* const kNames[] = {"bos_token", "eos_token", "unk_token", "sep_token",
                                       "pad_token", "cls_token", "mask_token"};
  ordered_json out = ordered_json::object();
  auto text_of = [&](const ordered_json& v, const std::string& key) -> ordered_json {
    if (v.is_string() || v.is_null()) return v;
    if (v.is_object() && v.contains("content") && v["content"].is_string()) return v["content"];
    fail(path, ": ", key, " must be a string or {\"content\": string}");
  };
  for (const char* name : kNames) {
    if (!config.contains(name)) continue;
    ordered_json t = text_of(config[name], name);
    if (!t.is_null()) out[name] = t;
  }
  if (config.contains("additional_special_tokens") && config["additional_special_tokens"].is_array()) {
    ordered_json list = ordered_json::array();
    for (const auto& v : config["additional_special_tokens"]) {
      ordered_json t = text_of(v, "additional_special_tokens");
      if (!t.is_null()) list.push_back(t);
    }
    if (!list.empty()) out["additional_special_tokens"] = list;
  }
  return out;
}

jinja::Template compile(const std::string& source, const std::string& origin) {
  return jinja::Template::parse(source, origin);
}

}  // namespace

ChatTemplate ChatTemplate::from_source(std::string source, ordered_json special_tokens) {
  ChatTemplate t;
  t.origin = "chat template";
  if (special_tokens.is_object()) {
    for (auto it = special_tokens.begin(); it != special_tokens.end(); ++it)
      if (!it.value().is_null()) t.special_tokens[it.key()] = it.value();
  } else if (!special_tokens.is_null()) {
    throw Error("chat template: special tokens must be a JSON object");
  }
  t.default_ = compile(source, t.origin);
  t.source_ = std::move(source);
  return t;
}

ChatTemplate ChatTemplate::load(const std::string& model_dir) {
  namespace fs = std::filesystem;
  const std::string config_path = (fs::path(model_dir) / "tokenizer_config.json").string();
  const std::string jinja_path = (fs::path(model_dir) / "chat_template.jinja").string();
  ordered_json config = ordered_json::object();
  std::string text;
  bool have_config = read_text(config_path, text);
  if (have_config) {
    try {
      config = ordered_json::parse(text);
    } catch (const std::exception& e) {
      fail(config_path, ": not valid JSON: ", e.what());
    }
    if (!config.is_object()) fail(config_path, ": expected a JSON object");
  }
  ChatTemplate t;
  t.special_tokens = special_tokens_of(config, config_path);
  std::string jinja_source;
  if (read_text(jinja_path, jinja_source)) {
    t.origin = jinja_path;
    t.default_ = compile(jinja_source, jinja_path);
    t.source_ = std::move(jinja_source);
    return t;
  }
  if (!have_config) fail(model_dir, ": no tokenizer_config.json or chat_template.jinja (", config_path, ")");
  if (!config.contains("chat_template") || config["chat_template"].is_null())
    fail(config_path, ": no \"chat_template\" (and no chat_template.jinja next to it)");
  const ordered_json& ct = config["chat_template"];
  t.origin = config_path;
  if (ct.is_string()) {
    t.source_ = ct.get<std::string>();
    t.default_ = compile(t.source_, config_path);
    return t;
  }
  if (!ct.is_array()) fail(config_path, ": \"chat_template\" must be a string or a list of {name, template}");
  for (const auto& item : ct) {
    if (!item.is_object() || !item.contains("name") || !item["name"].is_string() || !item.contains("template") ||
        !item["template"].is_string())
      fail(config_path, ": \"chat_template\" list entries must be {\"name\": string, \"template\": string}");
    const std::string name = item["name"].get<std::string>();
    const std::string src = item["template"].get<std::string>();
    if (name == "default") {
      t.default_ = compile(src, config_path + " (default)");
      t.source_ = src;
    } else if (name == "tool_use") {
      t.tool_use_ = compile(src, config_path + " (tool_use)");
    }
  }
  if (!t.default_ && !t.tool_use_)
    fail(config_path, ": \"chat_template\" list has neither a \"default\" nor a \"tool_use\" template");
  return t;
}

std::string ChatTemplate::render(const ordered_json& messages, const ordered_json& tools, bool add_generation_prompt,
                                 const ordered_json& kwargs) const {
  const jinja::Template* tpl = nullptr;
  if (!tools.is_null() && tool_use_) tpl = &*tool_use_;
  else if (default_) tpl = &*default_;
  if (!tpl) fail(origin, ": this model has multiple chat templates and no \"default\" one");
  if (!messages.is_array()) throw Error("chat template: messages must be a JSON array");
  if (!tools.is_null() && !tools.is_array()) throw Error("chat template: tools must be null or a JSON array");
  if (!kwargs.is_null() && !kwargs.is_object()) throw Error("chat template: kwargs must be a JSON object");
  // Before the copies below: copying JSON recurses, as does turning it into template values.
  check_json_depth(messages, "messages");
  check_json_depth(tools, "tools");
  check_json_depth(kwargs, "chat_template_kwargs");
  ordered_json vars = special_tokens;
  vars["messages"] = messages;
  vars["tools"] = tools;
  vars["documents"] = nullptr;
  vars["add_generation_prompt"] = add_generation_prompt;
  if (kwargs.is_object())
    for (auto it = kwargs.begin(); it != kwargs.end(); ++it) vars[it.key()] = it.value();
  jinja::RenderOptions options;
  options.now = fixed_time;
  return tpl->render(vars, options);
}

}  // namespace moestream
