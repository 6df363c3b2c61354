// A Jinja interpreter for chat templates, written for moestream. It renders the way transformers'
// apply_chat_template renders with jinja2: an ImmutableSandboxedEnvironment with trim_blocks,
// lstrip_blocks and the loopcontrols extension (break/continue), transformers' tojson filter
// (json.dumps(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)) and the globals
// raise_exception(msg) and strftime_now(fmt).
//
// Values follow Python: {{ x }} prints str(x) (True, None, {'a': 1}, floats as repr), string
// indices and lengths count code points, undefined names and attributes are jinja2's Undefined
// (prints "", false, iterates empty, raises when used in arithmetic or indexed). Template variables
// come as JSON; objects keep their key order (nlohmann::ordered_json), as Python dicts from
// json.loads do, so tojson writes keys in the order they were given.
//
// Supported: if/elif/else, for (loop.index/index0/revindex/revindex0/first/last/length/previtem/
// nextitem/cycle, for-else, for-if filter, break/continue), set (names, tuples, ns.attr, block set
// with filters), namespace(), macro (defaults, caller, varargs, kwargs), call blocks, filter blocks,
// with, raw, comments, whitespace control, jinja2's builtin filters and tests that chat templates
// use, and the methods of str, dict and list. Not supported: include/import/extends/blocks,
// recursive loops.
//
// A Template is parsed once and is immutable: render() may run on several threads at once.
#pragma once

#include <ctime>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>

#include "core/error.h"

namespace moestream::jinja {

struct Program;

// Syntax and render errors. what() is "NAME line N: Type: message" (just "NAME line N: message" for
// raise_exception, whose type is TemplateError); type() is the Python exception class jinja2 would
// raise (TemplateSyntaxError, TemplateError, UndefinedError, TypeError, ...).
class TemplateError : public Error {
 public:
  TemplateError(const std::string& what, std::string type, std::string message, int line)
      : Error(what), type_(std::move(type)), message_(std::move(message)), line_(line) {}
  const std::string& type() const { return type_; }
  const std::string& message() const { return message_; }
  int line() const { return line_; }

 private:
  std::string type_, message_;
  int line_;
};

struct RenderOptions {
  // The time strftime_now() formats (local time); unset: the current time.
  std::optional<std::time_t> now;
  // Evaluation steps before the render fails (text_limits::kMaxRenderSteps; tests lower it).
  int64_t max_steps = 0;  // 0: the limit
  // Bytes the render may build (text_limits::kMaxRenderBytes; tests lower it).
  uint64_t max_bytes = 0;  // 0: the limit
};

class Template {
 public:
  // Parses `source`; `name` names the template in error messages. Throws TemplateError.
  static Template parse(std::string_view source, std::string name = "template");
  // Renders with `variables` (a JSON object: name -> value). Throws TemplateError.
  std::string render(const nlohmann::ordered_json& variables, const RenderOptions& options = {}) const;
  const std::string& name() const;

 private:
  std::shared_ptr<const Program> program_;
};

}  // namespace moestream::jinja
