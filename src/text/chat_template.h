// A model's chat template: the Jinja template of its tokenizer_config.json or chat_template.jinja,
// rendered like transformers' apply_chat_template(messages, tools=tools,
// add_generation_prompt=..., tokenize=False, **kwargs) renders it.
#pragma once

#include <ctime>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "text/jinja.h"

namespace moestream {

struct ChatTemplate {
  // Loads the template of a model directory as transformers does: chat_template.jinja when present
  // (transformers lets it override the config), else tokenizer_config.json "chat_template" (a
  // string, or a list of {name, template} where "default" is used, and "tool_use" when tools are
  // given). Special-token strings (bos_token, eos_token, unk_token, pad_token, ... in string or
  // {"content": ...} form) come from tokenizer_config.json. Throws moestream::Error naming the file
  // when absent or malformed.
  static ChatTemplate load(const std::string& model_dir);
  // `special_tokens`: a JSON object such as {"bos_token": "<s>", "eos_token": "</s>"}; null values
  // are left out (the template sees them undefined, as transformers does).
  static ChatTemplate from_source(std::string source, nlohmann::ordered_json special_tokens);

  // Renders like transformers apply_chat_template(messages, tools=tools, add_generation_prompt=...,
  // tokenize=False, **kwargs): the template variables are the special tokens, then messages, tools
  // (None when null), documents (None), add_generation_prompt, then kwargs (which override special
  // tokens). Template errors (raise_exception, syntax, type errors) throw moestream::Error
  // (jinja::TemplateError) with the template line.
  std::string render(const nlohmann::ordered_json& messages, const nlohmann::ordered_json& tools /* null or array */,
                     bool add_generation_prompt, const nlohmann::ordered_json& kwargs /* object, may be empty */) const;

  // Where the template came from (file path or "<source>"), for messages.
  std::string origin;
  // Special-token strings given to the template (nulls removed).
  nlohmann::ordered_json special_tokens = nlohmann::ordered_json::object();
  // When set, strftime_now() formats this time instead of the current one (tests).
  std::optional<std::time_t> fixed_time;
  const std::string& source() const { return source_; }

 private:
  std::string source_;
  std::optional<jinja::Template> default_, tool_use_;
};

}  // namespace moestream
