// JSON Schema -> JsonGrammar, for response_format json_schema and forced tool calls. Supported:
// type (one or a list), properties, required, additionalProperties (true, false, or a schema for
// an object without properties), items, minItems / maxItems, minLength / maxLength, enum, const,
// and the annotations (title, description, default, examples, $schema, $id). Any other keyword is
// refused with SchemaError naming it: a constraint the output would not honour is never silently
// dropped.
#pragma once

#include <memory>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>

#include "server/json_constraint.h"

namespace moestream {

struct SchemaError : std::runtime_error {
  SchemaError(const std::string& message, std::string where)
      : std::runtime_error(message), where(std::move(where)) {}
  std::string where;  // JSON-pointer-like path inside the schema ("properties.name.pattern")
};

// The node for `schema`, added to g. Throws SchemaError.
int add_schema(JsonGrammar& g, const nlohmann::ordered_json& schema);

std::shared_ptr<const JsonGrammar> schema_grammar(const nlohmann::ordered_json& schema);

// A tool call in Qwen3's (Hermes') markup, one of `tools` (OpenAI form: [{"type": "function",
// "function": {"name", "parameters"}}]), all when `only` is empty:
//   PREFIX{"name": "NAME", "arguments": ARGS}\n</tool_call>
// where PREFIX is "<tool_call>\n" for a whole call. ARGS follow the tool's parameters schema, or
// are any JSON object when the schema uses a keyword the grammar does not support.
std::shared_ptr<const JsonGrammar> tool_call_grammar(const nlohmann::ordered_json& tools, const std::string& only,
                                                      const std::string& prefix = "<tool_call>\n");

}  // namespace moestream
