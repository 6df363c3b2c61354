// The Jinja interpreter (src/text/jinja*.cpp): lexer, parser, and rendering. Input: a template,
// then optionally a NUL and its variables as a JSON object; without them (or when they are not a
// JSON object) it renders with a chat conversation like the server's.
#include <cstdint>

#include "fuzz_util.h"
#include "text/jinja.h"
#include "text/limits.h"

using namespace moestream;

namespace {

const nlohmann::ordered_json& default_variables() {
  static const nlohmann::ordered_json vars = nlohmann::ordered_json::parse(R"({
    "bos_token": "<s>", "eos_token": "</s>",
    "messages": [
      {"role": "system", "content": "You are helpful."},
      {"role": "user", "content": "What is 2+2? Use the tool."},
      {"role": "assistant", "content": "", "reasoning_content": "Add them.",
       "tool_calls": [{"type": "function", "id": "call_1", "function": {"name": "add", "arguments": {"a": 2, "b": 2}}}]},
      {"role": "tool", "tool_call_id": "call_1", "name": "add", "content": "4"},
      {"role": "assistant", "content": "<think>\nok\n</think>\n\n4"}
    ],
    "tools": [{"type": "function", "function": {"name": "add", "description": "Adds.",
      "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "number"}}, "required": ["a"]}}}],
    "documents": null, "add_generation_prompt": true, "enable_thinking": false
  })");
  return vars;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto parts = fuzz::split_input(data, size, 2);
  nlohmann::ordered_json parsed;
  if (parts.size() > 1) parsed = nlohmann::ordered_json::parse(parts[1], nullptr, false);
  const nlohmann::ordered_json& vars = parsed.is_object() ? parsed : default_variables();
  jinja::RenderOptions options;
  options.now = 1700000000;  // strftime_now: the same output for the same input
  // An eighth of the product's budgets (text_limits): the same checks stop a render, but at this
  // build's speed (-O1, coverage) a render that builds the whole 128 MB takes ~5 s, which
  // libFuzzer reports as a slow unit and which holds a process for that long.
  options.max_steps = text_limits::kMaxRenderSteps / 8;
  options.max_bytes = text_limits::kMaxRenderBytes / 8;
  MOESTREAM_FUZZ_GUARD(Error, {
    const jinja::Template t = jinja::Template::parse(parts[0], "fuzz");
    (void)t.render(vars, options);
  });
  return 0;
}
